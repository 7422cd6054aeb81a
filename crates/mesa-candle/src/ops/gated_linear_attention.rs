//! Gated (decayed) causal linear attention with grouped heads (issue 41) as one candle op over
//! `q`, `k`, `v`, the log-decay `a` and an optional initial state.
//!
//! The calls into `mesa_kernels::gated_linear_attention` go through [`gla_forward`] and
//! [`gla_backward`] only (tensors outside any graph, any float type), so a change of that API
//! touches those two functions; sequence-parallel code reuses them.
use candle_core::{DType, Shape, Tensor};
use mesa_kernels::gated_linear_attention::{
    self, BackwardArgs, Decay, ForwardArgs, GatedConfig, GatedGrads, GatedSaved,
};

use super::linear_attention::{FeatureKind, LinearAttention};
use super::{check_dtypes, check_rank, tensor_result};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, KernelFloat, Output, View};
use crate::error::{Error, KernelResult};

/// Gated causal linear attention (issue 41):
///
/// ```text
/// S_t = exp(a_t)·S_{t−1} + φ(k_t) v'_tᵀ,   o_t = φ(q_t)ᵀ S_t  [ / g(φ(q_t)ᵀ z_t) ],   a_t ≤ 0
/// ```
///
/// with `v' = [v | 1]` and `z` the state's last column when normalised (`g(x) = x + ε·sign(x)`),
/// RetNet (Sun et al. 2023, §2.1, eq. 4: a fixed decay per head), Mamba-2's SSD (Dao & Gu 2024,
/// §3: a scalar decay per step and head) and gated linear attention with a scalar gate (Yang et
/// al. 2024, §4). `a_t = −∞` resets the state (a document boundary). `φ` is the identity (`map =
/// None`, as RetNet, Mamba-2 and GLA use `q`, `k` directly) or one of [`FeatureKind`]'s maps.
///
/// Shapes: `q: [B, H, L, M]`, `k: [B, H_kv, L, M]`, `v: [B, H_kv, L, D]` with `H_kv` dividing
/// `H` — query head `h` reads KV head `⌊h/(H/H_kv)⌋`, without copies — and the output
/// `[B, H, L, D]`. The decay `a` is f32, `[B, H_kv, L]` (per step) or `[H_kv]` (per head; the kind
/// follows from its rank), natural-log units, every value `≤ 0` or `−∞`. States are f32
/// `[B, H_kv, M', W]`, `M'` the feature map's width (`M` for the identity), `W = D + 1` when
/// normalised (the last column `z`), else `D`.
///
/// Dtypes: `q`, `k`, `v` one of f32, f16, bf16 (any strides). With the identity map the
/// kernels run in the inputs' dtype: f16 and bf16 on tensor cores (split bf16 pairs, f32
/// state and sums; [`mesa_kernels::gated_linear_attention`]), their gradients written in that
/// dtype, and a normalised backward reads the output as rounded to it. With a feature map the
/// op computes in f32 (16-bit inputs cast first, the output rounded once). f64 inputs are
/// computed in f32 (`a` and the state may then be f64), as [`crate::ops`] describes. The
/// gradients reach `q`, `k`, `v`, `a` and the initial state.
///
/// Forward: `φ` (the feature-map kernel), then the gated kernel, which keeps its final state
/// (and the `B·H·L` f32 denominators when normalised). Backward: the gated kernel's exact
/// gradients, then `φ`'s backward with `φ(q)`, `φ(k)` recomputed; a normalised op with 16-bit
/// inputs and a feature map reruns the f32 forward first (its backward needs the f32 output). The op's arguments
/// in candle's graph are `q`, a copy of `k` and `v` packed together (candle's custom ops
/// take at most three arguments), and `a` packed with the initial state.
#[derive(Debug, Clone)]
pub struct GatedLinearAttention {
    config: GatedConfig,
    /// `φ` as the ungated op's feature maps (causal); `None`: the identity.
    features: Option<LinearAttention>,
}

/// The decay's kind, from its rank.
fn decay_of<'a, 'b>(a: &'a mesa_kernels::TensorRef<'b, f32>) -> Decay<'a, 'b> {
    if a.shape().len() == 1 {
        Decay::PerHead(a)
    } else {
        Decay::PerStep(a)
    }
}

impl GatedLinearAttention {
    /// Attention with `config` (normalisation, ε, chunk) and feature map `map` (`None`: the
    /// identity).
    #[must_use]
    pub fn new(config: GatedConfig, map: Option<FeatureKind>) -> Self {
        let features = map.map(|m| {
            let la = mesa_kernels::linear_attention::LinearAttentionConfig::causal();
            LinearAttention::new(la, m)
        });
        GatedLinearAttention { config, features }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &GatedConfig {
        &self.config
    }

    /// `q: [B, H, L, M]`, `k: [B, H_kv, L, M]`, `v: [B, H_kv, L, D]`, `a: [B, H_kv, L]` or
    /// `[H_kv]` → `[B, H, L, D]`, from a zero state.
    ///
    /// # Errors
    /// As [`GatedLinearAttention::forward_with_state`].
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, a: &Tensor) -> candle_core::Result<Tensor> {
        self.run(q, k, v, a, None, false).map(|(y, _)| y)
    }

    /// The output `[B, H, L, D]` (`q`'s dtype) and the final state `[B, H_kv, M', W]` (f32; f64
    /// for f64 inputs), from `initial` (`[B, H_kv, M', W]`, f32; `None`: zero). Both results
    /// carry gradients: a loss of the final state (the next segment's initial state) reaches
    /// `q`, `k`, `v`, `a` and `initial`. The final state is copied out of the kernel's buffer
    /// (on CUDA through the host: one synchronisation).
    ///
    /// # Errors
    /// [`Error::Rank`] (`q`, `k`, `v` not of rank 4, `a` not of rank 3 or 1, `initial` not of
    /// rank 4), [`Error::Shape`] (disagreeing `B`, `L`, `M`; `a` or `initial` of another
    /// shape), [`Error::InvalidArgument`] (`H_kv` not dividing `H`; a decay value NaN or
    /// `> 0` — checked on the host: on CUDA one synchronisation), [`Error::DTypeMismatch`]
    /// (`q`, `k`, `v` not of one dtype; `a` or `initial` not f32), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the kernels' errors (chunk, ε) as [`Error::Kernel`].
    pub fn forward_with_state(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        a: &Tensor,
        initial: Option<&Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (y, s) = self.run(q, k, v, a, initial, true)?;
        let s = s.ok_or(Error::StateConsumed { op: "gated linear attention" })?;
        Ok((y, s))
    }

    fn run(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        a: &Tensor,
        initial: Option<&Tensor>,
        with_state: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "gated linear attention";
        check_dtypes(OP, &[(q, "queries [B, H, L, M]"), (k, "keys [B, H_kv, L, M]"), (v, "values [B, H_kv, L, D]")])?;
        let dtype = q.dtype();
        let side_dtype = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => DType::F32,
            DType::F64 => {
                let f = |t: &Tensor| if t.dtype() == DType::F64 { t.to_dtype(DType::F32) } else { Ok(t.clone()) };
                let init = initial.map(f).transpose()?;
                let (y, s) = self.run(&f(q)?, &f(k)?, &f(v)?, &f(a)?, init.as_ref(), with_state)?;
                return Ok((y.to_dtype(DType::F64)?, s.map(|s| s.to_dtype(DType::F64)).transpose()?));
            }
            other => return Err(Error::UnsupportedDType { op: OP, dtype: other }.into()),
        };
        for (t, what) in [(a, "log-decay a [B, H_kv, L] or [H_kv]")]
            .into_iter()
            .chain(initial.map(|s| (s, "initial state [B, H_kv, M', W]")))
        {
            if t.dtype() != side_dtype {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    what: what.into(),
                    of: "the op (f32 decay and states)".into(),
                    expected: side_dtype,
                    got: t.dtype(),
                }
                .into());
            }
        }
        let GatedShape { b, h, hkv, l, m, d } = gated_shape("gated linear attention", q, k, v, a)?;
        check_decay_values(a)?;
        let mut all = vec![q, k, v, a];
        all.extend(initial);
        let kernels = common_device(OP, &all)?;
        // identity map, 16-bit: the kernels in the inputs' dtype (tensor cores); else f32
        let compute = self.compute_dtype(dtype);
        let (phi_q, phi_k) = if compute == DType::F32 {
            self.features(&kernels, &f32_of(q)?, &f32_of(k)?)?
        } else {
            (q.detach(), k.detach())
        };
        let vc = v.detach().to_dtype(compute)?;
        let width = d + usize::from(self.config.normalize);
        let state_shape = [b, hkv, phi_k.dim(3)?, width];
        if let Some(s) = initial {
            check_rank("gated linear attention initial state [B, H_kv, M', W]", s, 4, false)?;
            if s.dims() != state_shape {
                let what = "initial state [B, H_kv, M', W]".into();
                return Err(Error::Shape { what, expected: state_shape.to_vec(), got: s.dims().to_vec() }.into());
            }
        }
        let (af, initf) = (a.detach().contiguous()?, initial.map(|s| s.detach().contiguous()).transpose()?);
        let (out, saved) = dispatch_float!(compute, OP, T => {
            let (o, s) = gla_forward::<T>(&kernels, &self.config, [&phi_q, &phi_k, &vc], &af, initf.as_ref())?;
            Ok::<_, candle_core::Error>((o.into_tensor()?, s))
        })?;
        // the op's arguments: q, k and v packed, a and the initial state packed (module docs)
        let n_k = k.elem_count();
        let kv = Tensor::cat(&[k.flatten_all()?, v.flatten_all()?], 0)?;
        let side = match initial {
            Some(s) => Tensor::cat(&[a.flatten_all()?, s.flatten_all()?], 0)?,
            None => a.flatten_all()?,
        };
        let grad = GatedGrad {
            op: self.clone(),
            saved,
            kernels,
            dims: Dims { q: [b, h, l, m], kv: [b, hkv, l], n_k, d, a: a.dims().to_vec(), state: state_shape },
            has_initial: initial.is_some(),
            with_state,
        };
        if !with_state {
            let y = attach(&[q, &kv, &side], tensor_result(&out.to_dtype(dtype)?)?, grad)?;
            return Ok((y, None));
        }
        let fin = final_state_tensor(&grad.saved, state_shape, q.device())?;
        let n_out = out.elem_count();
        // (a 16-bit output is exact in f32: the cast back below gives it unchanged)
        let packed = Tensor::cat(&[out.to_dtype(DType::F32)?.flatten_all()?, fin.flatten_all()?], 0)?;
        let packed = attach(&[q, &kv, &side], tensor_result(&packed)?, grad)?;
        let y = packed.narrow(0, 0, n_out)?.reshape((b, h, l, d))?.to_dtype(dtype)?;
        let s = packed.narrow(0, n_out, fin.elem_count())?.reshape(state_shape.to_vec())?;
        Ok((y, Some(s)))
    }

    /// The dtype the kernels run in for inputs of `dtype` (f32, f16 or bf16): the inputs' own
    /// for the identity map (16-bit inputs on tensor cores), f32 with a feature map (whose
    /// kernels the op runs in f32).
    fn compute_dtype(&self, dtype: DType) -> DType {
        if self.features.is_none() {
            dtype
        } else {
            DType::F32
        }
    }

    /// `φ(q)`, `φ(k)` (f32, outside any graph): the inputs themselves (any dtype) for the identity.
    fn features(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        match &self.features {
            None => Ok((q.clone(), k.clone())),
            Some(la) => la.features_detached::<f32>(kernels, q, k),
        }
    }

    /// `dx` from `dφ(x)` (the identity: `dφ` itself).
    fn features_backward(
        &self,
        kernels: &mesa_kernels::Device,
        x: &Tensor,
        phi: &Tensor,
        dphi: Tensor,
        query: bool,
    ) -> candle_core::Result<Tensor> {
        match &self.features {
            None => Ok(dphi),
            Some(la) => la.features_backward::<f32>(kernels, x, phi, &dphi, query),
        }
    }
}
/// Sizes of gated attention's inputs (`q: [B, H, L, M]`, `k: [B, H_kv, L, M]`,
/// `v: [B, H_kv, L, D]`, `a: [B, H_kv, L]` or `[H_kv]`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatedShape {
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) hkv: usize,
    pub(crate) l: usize,
    pub(crate) m: usize,
    pub(crate) d: usize,
}

/// Checks the ranks, the grouping (`H_kv` divides `H`) and the shapes of `q, k, v` and of the
/// log-decay `a` (per step or per head); `op` names the caller in rank errors.
///
/// # Errors
/// [`Error::Rank`], [`Error::Shape`], [`Error::InvalidArgument`] (a grouping that does not divide).
pub(crate) fn gated_shape(op: &str, q: &Tensor, k: &Tensor, v: &Tensor, a: &Tensor) -> candle_core::Result<GatedShape> {
    check_rank(&format!("{op} queries [B, H, L, M]"), q, 4, false)?;
    check_rank(&format!("{op} keys [B, H_kv, L, M]"), k, 4, false)?;
    check_rank(&format!("{op} values [B, H_kv, L, D]"), v, 4, false)?;
    let (b, h, l, m) = q.dims4()?;
    let hkv = k.dim(1)?;
    if hkv == 0 || h % hkv != 0 {
        return Err(Error::InvalidArgument {
            name: "keys [B, H_kv, L, M]",
            why: format!("H_kv = {hkv} KV heads must divide the H = {h} query heads"),
        }
        .into());
    }
    if k.dims() != [b, hkv, l, m] {
        return Err(Error::Shape { what: "keys".into(), expected: vec![b, hkv, l, m], got: k.dims().to_vec() }.into());
    }
    let d = v.dim(3)?;
    if v.dims() != [b, hkv, l, d] {
        return Err(Error::Shape { what: "values".into(), expected: vec![b, hkv, l, d], got: v.dims().to_vec() }.into());
    }
    match a.rank() {
        3 if a.dims() != [b, hkv, l] => {
            let what = "log-decay a per step [B, H_kv, L]".into();
            return Err(Error::Shape { what, expected: vec![b, hkv, l], got: a.dims().to_vec() }.into());
        }
        1 if a.dims() != [hkv] => {
            let what = "log-decay a per head [H_kv]".into();
            return Err(Error::Shape { what, expected: vec![hkv], got: a.dims().to_vec() }.into());
        }
        1 | 3 => {}
        _ => check_rank(&format!("{op} log-decay a [B, H_kv, L] or [H_kv]"), a, 3, false)?,
    }
    Ok(GatedShape { b, h, hkv, l, m, d })
}

/// A decay value NaN or `> 0` is [`Error::InvalidArgument`] (the kernel uses any value as
/// given); `−∞` is a reset. Read on the host: `B·H_kv·L` or `H_kv` values.
fn check_decay_values(a: &Tensor) -> candle_core::Result<()> {
    let values = a.detach().flatten_all()?.to_vec1::<f32>()?;
    match values.iter().position(|x| x.is_nan() || *x > 0.0) {
        None => Ok(()),
        Some(i) => Err(Error::InvalidArgument {
            name: "log-decay a",
            why: format!("element {i} is {}: a log-decay must be ≤ 0 (−∞ resets the state)", values[i]),
        }
        .into()),
    }
}

/// `t` detached, as f32 (a cast for 16-bit, else the same storage).
fn f32_of(t: &Tensor) -> candle_core::Result<Tensor> {
    t.detach().to_dtype(DType::F32)
}

/// The saved final state as a candle tensor of `shape` (`[B, H_kv, M, W]`) f32 on `device`
/// (a copy through the host).
pub(crate) fn final_state_tensor(
    saved: &GatedSaved,
    shape: [usize; 4],
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    Tensor::from_vec(saved.final_state().k()?, shape.to_vec(), device)
}

/// The gated kernel's forward on tensors outside any graph: `qkv = [q, k, v]` (the feature
/// maps applied, `T`), `a` f32 contiguous `[B, H_kv, L]` or `[H_kv]`, `initial` f32 contiguous
/// `[B, H_kv, M, W]` (`None`: zero). The output (not yet a tensor) and the saved state (thin
/// wrapper over `mesa_kernels::gated_linear_attention::forward`).
pub(crate) fn gla_forward<T: KernelFloat>(
    kernels: &mesa_kernels::Device,
    config: &GatedConfig,
    qkv: [&Tensor; 3],
    a: &Tensor,
    initial: Option<&Tensor>,
) -> candle_core::Result<(Output<T>, GatedSaved)> {
    let [q, k, v] = qkv;
    let (b, h, l, _) = q.dims4()?;
    let mut out = Output::<T>::zeros(q.device(), kernels, &Shape::from((b, h, l, v.dim(3)?)))?;
    let saved = {
        let (qv, kv, vv, av) = (View::of(q)?, View::of(k)?, View::of(v)?, View::of(a)?);
        let (qr, kr, vr, ar) =
            (qv.tensor_ref::<T>()?, kv.tensor_ref::<T>()?, vv.tensor_ref::<T>()?, av.tensor_ref::<f32>()?);
        let s0 = initial.map(View::of).transpose()?;
        let s0 = s0.as_ref().map(View::tensor_ref::<f32>).transpose()?;
        let mut o = out.tensor_mut()?;
        let args = ForwardArgs { q: &qr, k: &kr, v: &vr, decay: decay_of(&ar), initial: s0.as_ref(), out: &mut o };
        gated_linear_attention::forward(kernels, config, args).k()?
    };
    Ok((out, saved))
}

/// The gradients of [`gla_forward`]: `[dq, dk, dv]` (`T`; `dk`, `dv` summed over each group),
/// `da` (f32, shaped as `a`) and the initial state's (f32 `[B, H_kv, M, W]`; `None` unless
/// `want_initial`).
#[derive(Debug)]
pub(crate) struct GlaGrads {
    pub dqkv: [Tensor; 3],
    pub da: Tensor,
    pub d_initial: Option<Tensor>,
}

/// The gated kernel's backward on tensors outside any graph: the forward's `qkv`, `a`,
/// `initial` and `saved`, its output `out` (needed when normalised), the output's gradient
/// `dout` and the final state's `d_final` (f32 contiguous; `None`: zero); `config` the forward's (thin wrapper over
/// `mesa_kernels::gated_linear_attention::backward`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gla_backward<T: KernelFloat>(
    kernels: &mesa_kernels::Device,
    config: &GatedConfig,
    saved: &GatedSaved,
    qkv: [&Tensor; 3],
    a: &Tensor,
    initial: Option<&Tensor>,
    out: Option<&Tensor>,
    dout: &Tensor,
    d_final: Option<&Tensor>,
    want_initial: bool,
) -> candle_core::Result<GlaGrads> {
    let [q, k, v] = qkv;
    let dev = q.device();
    let mut dq = Output::<T>::zeros(dev, kernels, q.shape())?;
    let mut dk = Output::<T>::zeros(dev, kernels, k.shape())?;
    let mut dv = Output::<T>::zeros(dev, kernels, v.shape())?;
    let mut da = Output::<f32>::zeros(dev, kernels, a.shape())?;
    let dims = saved.dims();
    let width = dims.dim + usize::from(config.normalize);
    let sshape = Shape::from((dims.batch, dims.kv_heads, dims.feat, width));
    let mut d_init = if want_initial { Some(Output::<f32>::zeros(dev, kernels, &sshape)?) } else { None };
    {
        let (qv, kv, vv, av, gv) = (View::of(q)?, View::of(k)?, View::of(v)?, View::of(a)?, View::of(dout)?);
        let (qr, kr, vr) = (qv.tensor_ref::<T>()?, kv.tensor_ref::<T>()?, vv.tensor_ref::<T>()?);
        let (ar, gr) = (av.tensor_ref::<f32>()?, gv.tensor_ref::<T>()?);
        let ov = out.map(View::of).transpose()?;
        let or = ov.as_ref().map(View::tensor_ref::<T>).transpose()?;
        let s0 = initial.map(View::of).transpose()?;
        let s0 = s0.as_ref().map(View::tensor_ref::<f32>).transpose()?;
        let df = d_final.map(View::of).transpose()?;
        let df = df.as_ref().map(View::tensor_ref::<f32>).transpose()?;
        let (mut dqm, mut dkm, mut dvm, mut dam) =
            (dq.tensor_mut()?, dk.tensor_mut()?, dv.tensor_mut()?, da.tensor_mut()?);
        let mut dim = d_init.as_mut().map(Output::tensor_mut).transpose()?;
        let grads = GatedGrads { dq: &mut dqm, dk: &mut dkm, dv: &mut dvm, d_decay: &mut dam, d_initial: dim.as_mut() };
        let args = BackwardArgs {
            q: &qr,
            k: &kr,
            v: &vr,
            decay: decay_of(&ar),
            initial: s0.as_ref(),
            out: or.as_ref(),
            dout: &gr,
            d_final: df.as_ref(),
            grads,
        };
        gated_linear_attention::backward(kernels, saved, args).k()?;
    }
    Ok(GlaGrads {
        dqkv: [dq.into_tensor()?, dk.into_tensor()?, dv.into_tensor()?],
        da: da.into_tensor()?,
        d_initial: d_init.map(Output::into_tensor).transpose()?,
    })
}

/// Shapes to unpack the op's packed arguments and result.
#[derive(Debug, Clone)]
struct Dims {
    q: [usize; 4],
    /// `[B, H_kv, L]`
    kv: [usize; 3],
    /// Elements of `k` (its share of the packed `k`, `v`).
    n_k: usize,
    d: usize,
    a: Vec<usize>,
    state: [usize; 4],
}

struct GatedGrad {
    op: GatedLinearAttention,
    saved: GatedSaved,
    kernels: mesa_kernels::Device,
    dims: Dims,
    has_initial: bool,
    with_state: bool,
}

impl Backward for GatedGrad {
    fn name(&self) -> &'static str {
        "mesa-gated-linear-attention"
    }
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Dims { q: qd, kv: [b, hkv, l], n_k, d, a: ad, state } = self.dims.clone();
        let m = qd[3];
        let dtype = args[0].dtype();
        let compute = self.op.compute_dtype(dtype);
        let cast = |t: &Tensor| t.detach().to_dtype(compute);
        let q = cast(args[0])?;
        let kv = cast(args[1])?;
        let k = kv.narrow(0, 0, n_k)?.reshape((b, hkv, l, m))?;
        let v = kv.narrow(0, n_k, b * hkv * l * d)?.reshape((b, hkv, l, d))?;
        let side = args[2].detach();
        let n_a: usize = ad.iter().product();
        let a = side.narrow(0, 0, n_a)?.reshape(ad.clone())?;
        let n_s: usize = state.iter().product();
        let initial = if self.has_initial { Some(side.narrow(0, n_a, n_s)?.reshape(state.to_vec())?) } else { None };
        let n_out: usize = qd[0] * qd[1] * qd[2] * d;
        // the output as the forward's kernels wrote it (a 16-bit one exactly, in f32 or its own
        // dtype), or `None` where only its rounding to a 16-bit dtype is kept
        let (dout, d_final, res_out) = if self.with_state {
            let g = grad.to_dtype(DType::F32)?;
            let dout = cast(&g.narrow(0, 0, n_out)?.reshape((qd[0], qd[1], qd[2], d))?)?;
            let df = g.narrow(0, n_out, n_s)?.reshape(state.to_vec())?.contiguous()?;
            let o = res.narrow(0, 0, n_out)?.reshape((qd[0], qd[1], qd[2], d))?;
            (dout, Some(df), Some(cast(&o)?))
        } else {
            let o = (dtype == compute).then(|| res.detach());
            (cast(grad)?, None, o)
        };
        let (phi_q, phi_k) = self.op.features(&self.kernels, &q, &k)?;
        let rerun;
        let (saved, out) = match (self.op.config.normalize, res_out) {
            (true, None) => {
                // 16-bit with a feature map, normalised: the f32 output again (the rounded
                // `res` is not it)
                let (o, s) =
                    gla_forward::<f32>(&self.kernels, &self.op.config, [&phi_q, &phi_k, &v], &a, initial.as_ref())?;
                rerun = s;
                (&rerun, Some(o.into_tensor()?))
            }
            (true, Some(o)) => (&self.saved, Some(o)),
            (false, _) => (&self.saved, None),
        };
        let g = dispatch_float!(compute, "gated linear attention backward", T => gla_backward::<T>(
            &self.kernels,
            &self.op.config,
            saved,
            [&phi_q, &phi_k, &v],
            &a,
            initial.as_ref(),
            out.as_ref(),
            &dout,
            d_final.as_ref(),
            self.has_initial,
        ))?;
        let [dphi_q, dphi_k, dv] = g.dqkv;
        let dq = self.op.features_backward(&self.kernels, &q, &phi_q, dphi_q, true)?;
        let dk = self.op.features_backward(&self.kernels, &k, &phi_k, dphi_k, false)?;
        let dkv = Tensor::cat(&[dk.flatten_all()?, dv.flatten_all()?], 0)?.to_dtype(dtype)?;
        let dside = match g.d_initial {
            Some(di) => Tensor::cat(&[g.da.flatten_all()?, di.flatten_all()?], 0)?,
            None => g.da.flatten_all()?,
        };
        Ok(vec![Some(dq.to_dtype(dtype)?), Some(dkv), Some(dside)])
    }
}
