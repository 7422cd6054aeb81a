//! Transformer encoder block on compressed activations (issue 3, item 5).
//!
//! One post-LN BERT layer of all-MiniLM-L6-v2 (hidden 384, 12 heads × 32, FFN 1536, GELU erf,
//! LayerNorm eps 1e-12) on a real batch of 4 × 128 tokens (`fixtures/minilm_block.safetensors`,
//! `scripts/capture_block_fixture.py`), forward and backward:
//!
//! ```text
//! Q,K,V = X·Wᵀ + b        S = Q·Kᵀ/√32 + mask     P = softmax(S)       Ctx = P·V
//! R1 = Ctx·Woᵀ + bo + X   H = LN1(R1)             U = H·W1ᵀ + b1       G = gelu(U)
//! R2 = G·W2ᵀ + b2 + H     Out = LN2(R2)           loss = Σ r ⊙ Out  (r fixed, see `upstream_gradient`)
//! ```
//!
//! The softmax, GELU and LayerNorms run on the mesa-kernels device (fused kernels); the
//! matmuls are a plain host reference (f32 data, f64 accumulation per dot product, threads),
//! not our kernels. The forward is computed once (it is exact whatever is saved); each run
//! then keeps the activations backward needs in its own way and runs the backward from them:
//!
//! * `f32`: everything full precision (the reference gradients);
//! * `N-bit`: every saved activation as N-bit codes — matmul inputs X, Q, K, V, Ctx, H, G via
//!   quantize-on-save (head-wise / 12 channel groups), P via the fused softmax (codes of the
//!   output only, fixed range, square-root companded: the default `SoftmaxCodes::Sqrt`), U via the fused GELU, x̂ of both LayerNorms via the fused
//!   LayerNorm (+ f32 mean and rstd); the backward reads the codes (GELU, softmax, LayerNorm
//!   kernels) or their decoded values (host matmuls);
//! * `N-bit shared`: as `N-bit`, but the inputs of FC1 and FC2 are not saved again: FC1's
//!   input H = x̂1·γ1 + β1 is rebuilt from LN1's saved x̂1 codes, FC2's input G = gelu(Û) from
//!   the GELU's saved codes ("a tensor consumed by two ops is saved once").
//!
//! Each quantizer sees one batch, so its parameters are the batch's exact statistics (the
//! running estimate's clamping of later batches is measured by the tensor section).
use std::error::Error;
use std::path::Path;

use mesa_kernels::fused::{
    self, gelu, gelu_backward, gelu_backward_plain, gelu_forward, layer_norm_backward, layer_norm_backward_plain,
    layer_norm_forward, softmax, softmax_backward, softmax_backward_plain, softmax_forward, GeluBackwardPlain,
    LayerNormBackward, LayerNormBackwardPlain, LayerNormForward, LayerNormGrads, SoftmaxBackwardPlain, SoftmaxInput,
};
use mesa_kernels::{
    Buffer, Device, GeluForm, Layout, QuantConfig, Quantizer, SavedActivation, SavedLayerNorm, SoftmaxSave, Storage,
    TensorMut, TensorRef,
};
use safetensors::SafeTensors;
use serde_json::{json, Value};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// The block fixture in the source tree.
pub const BLOCK_FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/minilm_block.safetensors");

/// The block fixture: `$MESA_FIXTURE_DIR/minilm_block.safetensors` when that variable is set
/// (the GPU bundle sets it), else [`BLOCK_FIXTURE`].
#[must_use]
pub fn block_fixture() -> std::path::PathBuf {
    std::env::var_os("MESA_FIXTURE_DIR")
        .map(|d| std::path::PathBuf::from(d).join("minilm_block.safetensors"))
        .unwrap_or_else(|| std::path::PathBuf::from(BLOCK_FIXTURE))
}

const B: usize = 4;
const N: usize = 128;
const C: usize = 384;
const HEADS: usize = 12;
const D: usize = 32;
const F: usize = 1536;
const T: usize = B * N;
const LN_EPS: f32 = 1e-12;
/// Seed of the fixed random projection `r` of the loss.
const LOSS_SEED: u64 = 0x6d65_7361_626c_6f63;

/// The parameters of the layer, f32 (from f16), PyTorch layout `[out, in]`.
pub struct Params {
    wq: Vec<f32>,
    bq: Vec<f32>,
    wk: Vec<f32>,
    bk: Vec<f32>,
    wv: Vec<f32>,
    bv: Vec<f32>,
    wo: Vec<f32>,
    bo: Vec<f32>,
    ln1_weight: Vec<f32>,
    ln1_bias: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
    ln2_weight: Vec<f32>,
    ln2_bias: Vec<f32>,
}

/// The fixture: block input, key mask, parameters and a slice of the expected output.
pub struct BlockFixture {
    /// `[B, N, C]`.
    pub input: Vec<f32>,
    /// `[B, N]`, 1 = token, 0 = padding.
    pub key_mask: Vec<f32>,
    params: Params,
    /// The block output of sequence 0, first 32 tokens, `[32, C]` (numpy float32).
    pub output_seq0: Vec<f32>,
}

fn tensor(st: &SafeTensors, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = st.tensor(&format!("block.{name}")).map_err(|e| format!("block.{name}: {e}"))?;
    if t.dtype() != safetensors::Dtype::F16 {
        return Err(format!("block.{name}: expected f16").into());
    }
    let v: Vec<f32> = t.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
    if v.len() != len {
        return Err(format!("block.{name}: {} values, expected {len}", v.len()).into());
    }
    Ok(v)
}

/// Loads the block fixture.
///
/// # Errors
/// A missing or malformed file.
pub fn load(path: &Path) -> Result<BlockFixture> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let p = |name: &str, len: usize| tensor(&st, name, len);
    Ok(BlockFixture {
        input: p("input", T * C)?,
        key_mask: p("key_mask", T)?,
        output_seq0: p("output_seq0", 32 * C)?,
        params: Params {
            wq: p("wq", C * C)?,
            bq: p("bq", C)?,
            wk: p("wk", C * C)?,
            bk: p("bk", C)?,
            wv: p("wv", C * C)?,
            bv: p("bv", C)?,
            wo: p("wo", C * C)?,
            bo: p("bo", C)?,
            ln1_weight: p("ln1_weight", C)?,
            ln1_bias: p("ln1_bias", C)?,
            w1: p("w1", F * C)?,
            b1: p("b1", F)?,
            w2: p("w2", C * F)?,
            b2: p("b2", C)?,
            ln2_weight: p("ln2_weight", C)?,
            ln2_bias: p("ln2_bias", C)?,
        },
    })
}

// ---------------------------------------------------------------------------------------
// Host reference matmul: C[m, n] = Σ_k A[m, k] · B[n, k] (A·Bᵀ), f64 accumulation.

fn matmul_nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return c;
    }
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(m);
    let rows = m.div_ceil(threads);
    std::thread::scope(|s| {
        for (ci, chunk) in c.chunks_mut(rows * n).enumerate() {
            s.spawn(move || {
                for (r, out) in chunk.chunks_mut(n).enumerate() {
                    let ar = &a[(ci * rows + r) * k..(ci * rows + r + 1) * k];
                    for (j, o) in out.iter_mut().enumerate() {
                        let br = &b[j * k..(j + 1) * k];
                        let mut acc = [0f64; 4];
                        let (ac, at) = ar.split_at(k - k % 4);
                        let (bc, bt) = br.split_at(k - k % 4);
                        for (x, y) in ac.chunks_exact(4).zip(bc.chunks_exact(4)) {
                            for l in 0..4 {
                                acc[l] += f64::from(x[l]) * f64::from(y[l]);
                            }
                        }
                        let tail: f64 = at.iter().zip(bt).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
                        *o = (acc[0] + acc[1] + acc[2] + acc[3] + tail) as f32;
                    }
                }
            });
        }
    });
    c
}

fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; a.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = a[r * cols + c];
        }
    }
    t
}

/// `x·Wᵀ + b` for x `[rows, in]`, W `[out, in]`.
fn linear(x: &[f32], w: &[f32], b: &[f32], rows: usize, inp: usize, out: usize) -> Vec<f32> {
    let mut y = matmul_nt(x, w, rows, inp, out);
    for r in 0..rows {
        for o in 0..out {
            y[r * out + o] += b[o];
        }
    }
    y
}

/// Weight and bias gradients of `y = x·Wᵀ + b` and the input gradient `dy·W`.
fn linear_backward(dy: &[f32], x: &[f32], w: &[f32], rows: usize, inp: usize, out: usize) -> [Vec<f32>; 3] {
    let dyt = transpose(dy, rows, out);
    let dw = matmul_nt(&dyt, &transpose(x, rows, inp), out, rows, inp);
    let db: Vec<f32> =
        (0..out).map(|o| dyt[o * rows..(o + 1) * rows].iter().map(|&v| f64::from(v)).sum::<f64>() as f32).collect();
    let dx = matmul_nt(dy, &transpose(w, out, inp), rows, out, inp);
    [dw, db, dx]
}

/// Head `h` of batch `b` of a `[T, C]` tensor as `[N, D]`.
fn head(x: &[f32], b: usize, h: usize) -> Vec<f32> {
    let mut o = Vec::with_capacity(N * D);
    for i in 0..N {
        o.extend_from_slice(&x[(b * N + i) * C + h * D..(b * N + i) * C + (h + 1) * D]);
    }
    o
}

fn put_head(x: &mut [f32], b: usize, h: usize, v: &[f32]) {
    for i in 0..N {
        x[(b * N + i) * C + h * D..(b * N + i) * C + (h + 1) * D].copy_from_slice(&v[i * D..(i + 1) * D]);
    }
}

fn probs(p: &[f32], b: usize, h: usize) -> &[f32] {
    &p[(b * HEADS + h) * N * N..(b * HEADS + h + 1) * N * N]
}

// ---------------------------------------------------------------------------------------
// Forward (exact, once).

/// Everything the forward computes (host copies, f32).
pub struct Forward {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    p: Vec<f32>,
    ctx: Vec<f32>,
    r1: Vec<f32>,
    h: Vec<f32>,
    u: Vec<f32>,
    g: Vec<f32>,
    r2: Vec<f32>,
    /// The block output `[T, C]`.
    pub out: Vec<f32>,
    mean1: Vec<f32>,
    rstd1: Vec<f32>,
    mean2: Vec<f32>,
    rstd2: Vec<f32>,
}

fn additive_mask(fix: &BlockFixture) -> Vec<f32> {
    fix.key_mask.iter().map(|&m| if m > 0.5 { 0.0 } else { f32::NEG_INFINITY }).collect()
}

fn mask_layout() -> Layout {
    // [B, 1, 1, N] broadcast over heads and queries of [B, H, N, N]
    Layout::strided(&[B, HEADS, N, N], &[N, 0, 0, 1], 0).unwrap_or_else(|_| Layout::contiguous(&[B, HEADS, N, N]))
}

fn ln_full(device: &Device, x: &[f32], w: &[f32], b: &[f32]) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let l = Layout::contiguous(&[T, C]);
    let xb = device.upload(x)?;
    let (wb, bb) = (device.upload(w)?, device.upload(b)?);
    let mut y = device.alloc_zeros::<f32>(T * C)?;
    // a throwaway quantizer: the full-precision run only needs y, mean and rstd
    let mut q = Quantizer::new(device, QuantConfig::per_tensor())?;
    let saved = layer_norm_forward(
        device,
        &mut q,
        &LayerNormForward {
            x: &TensorRef::new(&xb, &l)?,
            weight: Some(&vref(&wb)?),
            bias: Some(&vref(&bb)?),
            eps: LN_EPS,
        },
        &mut TensorMut::new(&mut y, &l)?,
    )?;
    Ok((y.to_vec()?, saved.mean().to_vec()?, saved.rstd().to_vec()?))
}

/// The exact forward: host matmuls, device softmax / GELU / LayerNorm.
///
/// # Errors
/// Kernel errors.
pub fn forward(device: &Device, fix: &BlockFixture) -> Result<Forward> {
    let pr = &fix.params;
    let x = &fix.input;
    let q = linear(x, &pr.wq, &pr.bq, T, C, C);
    let k = linear(x, &pr.wk, &pr.bk, T, C, C);
    let v = linear(x, &pr.wv, &pr.bv, T, C, C);
    let scale = 1.0 / (D as f32).sqrt();
    let mut s = vec![0f32; B * HEADS * N * N];
    for b in 0..B {
        for h in 0..HEADS {
            let sc = matmul_nt(&head(&q, b, h), &head(&k, b, h), N, D, N);
            let dst = &mut s[(b * HEADS + h) * N * N..(b * HEADS + h + 1) * N * N];
            for (o, v) in dst.iter_mut().zip(sc) {
                *o = v * scale;
            }
        }
    }
    let ls = Layout::contiguous(&[B, HEADS, N, N]);
    let sb = device.upload(&s)?;
    let mb = device.upload(&additive_mask(fix))?;
    let ml = mask_layout();
    let mut pb = device.alloc_zeros::<f32>(s.len())?;
    softmax(
        device,
        &SoftmaxInput { x: &TensorRef::new(&sb, &ls)?, mask: Some(&TensorRef::new(&mb, &ml)?) },
        &mut TensorMut::new(&mut pb, &ls)?,
    )?;
    let p = pb.to_vec()?;
    let mut ctx = vec![0f32; T * C];
    for b in 0..B {
        for h in 0..HEADS {
            let c = matmul_nt(probs(&p, b, h), &transpose(&head(&v, b, h), N, D), N, N, D);
            put_head(&mut ctx, b, h, &c);
        }
    }
    let mut r1 = linear(&ctx, &pr.wo, &pr.bo, T, C, C);
    for (r, xv) in r1.iter_mut().zip(x) {
        *r += xv;
    }
    let (h, mean1, rstd1) = ln_full(device, &r1, &pr.ln1_weight, &pr.ln1_bias)?;
    let u = linear(&h, &pr.w1, &pr.b1, T, C, F);
    let lu = Layout::contiguous(&[T, F]);
    let ub = device.upload(&u)?;
    let mut gb = device.alloc_zeros::<f32>(T * F)?;
    gelu(device, GeluForm::Erf, &TensorRef::new(&ub, &lu)?, &mut TensorMut::new(&mut gb, &lu)?)?;
    let g = gb.to_vec()?;
    let mut r2 = linear(&g, &pr.w2, &pr.b2, T, F, C);
    for (r, hv) in r2.iter_mut().zip(&h) {
        *r += hv;
    }
    let (out, mean2, rstd2) = ln_full(device, &r2, &pr.ln2_weight, &pr.ln2_bias)?;
    Ok(Forward { q, k, v, s, p, ctx, r1, h, u, g, r2, out, mean1, rstd1, mean2, rstd2 })
}

// ---------------------------------------------------------------------------------------
// What a run keeps for backward.

/// How a run keeps its saved activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Full precision (f32).
    Full,
    /// Every saved activation as `bits`-bit codes; `shared`: FC1/FC2 inputs rebuilt from the
    /// LayerNorm / GELU codes instead of saved again.
    Compressed {
        /// 8, 4 or 2.
        bits: u32,
        /// Rebuild FC1's and FC2's inputs from LN1's and GELU's codes.
        shared: bool,
    },
}

impl Mode {
    /// Display name.
    #[must_use]
    pub fn name(&self) -> String {
        match self {
            Mode::Full => "f32".into(),
            Mode::Compressed { bits, shared: false } => format!("{bits}-bit"),
            Mode::Compressed { bits, shared: true } => format!("{bits}-bit shared"),
        }
    }
}

enum Kept {
    Full(Vec<f32>),
    Codes(Box<SavedActivation>),
}

enum KeptLn {
    /// The LayerNorm input and its f32 mean and rstd (what a framework keeps).
    Full {
        input: Vec<f32>,
        mean: Vec<f32>,
        rstd: Vec<f32>,
    },
    Codes(Box<SavedLayerNorm>),
}

/// What one run keeps for backward.
pub struct Saved {
    x: Kept,
    q: Kept,
    k: Kept,
    v: Kept,
    p: Kept,
    ctx: Kept,
    ln1: KeptLn,
    h: Option<Kept>,
    u: Kept,
    g: Option<Kept>,
    ln2: KeptLn,
}

impl Kept {
    fn bytes(&self) -> usize {
        match self {
            Kept::Full(v) => v.len() * 4,
            Kept::Codes(s) => s.size_in_bytes(),
        }
    }
    fn numel(&self) -> usize {
        match self {
            Kept::Full(v) => v.len(),
            Kept::Codes(s) => s.numel(),
        }
    }
    fn values(&self, device: &Device) -> Result<Vec<f32>> {
        match self {
            Kept::Full(v) => Ok(v.clone()),
            Kept::Codes(s) => decode(device, s),
        }
    }
}

impl KeptLn {
    fn bytes(&self) -> usize {
        match self {
            KeptLn::Full { input, mean, rstd } => (input.len() + mean.len() + rstd.len()) * 4,
            KeptLn::Codes(s) => s.size_in_bytes(),
        }
    }
    /// x̂ values (decoded, or recomputed from the saved input) and rstd.
    fn xhat(&self, device: &Device) -> Result<(Vec<f32>, Vec<f32>)> {
        match self {
            KeptLn::Full { input, mean, rstd } => {
                let xh = input.iter().enumerate().map(|(i, &x)| (x - mean[i / C]) * rstd[i / C]).collect();
                Ok((xh, rstd.clone()))
            }
            KeptLn::Codes(s) => Ok((decode(device, s.xhat())?, s.rstd().to_vec()?)),
        }
    }
}

fn decode(device: &Device, s: &SavedActivation) -> Result<Vec<f32>> {
    let mut out = device.alloc_zeros::<f32>(s.numel())?;
    s.dequantize(device, &mut TensorMut::contiguous(&mut out, s.shape())?)?;
    Ok(out.to_vec()?)
}

fn quantize(device: &Device, config: QuantConfig, data: &[f32], shape: &[usize]) -> Result<Kept> {
    let mut q = Quantizer::new(device, config)?;
    Ok(Kept::Codes(Box::new(q.quantize(&TensorRef::contiguous(&device.upload(data)?, shape)?)?)))
}

/// A whole buffer as a vector (LayerNorm parameters, rstd).
fn vref<T: Storage>(b: &Buffer<T>) -> mesa_kernels::Result<TensorRef<'_, T>> {
    TensorRef::contiguous(b, &[b.len()])
}

/// A whole buffer as an output vector (dweight, dbias).
fn vmut<T: Storage>(b: &mut Buffer<T>) -> mesa_kernels::Result<TensorMut<'_, T>> {
    let n = b.len();
    TensorMut::contiguous(b, &[n])
}

fn save(device: &Device, fix: &BlockFixture, fwd: &Forward, mode: Mode) -> Result<Saved> {
    let (bits, shared) = match mode {
        Mode::Full => {
            return Ok(Saved {
                x: Kept::Full(fix.input.clone()),
                q: Kept::Full(fwd.q.clone()),
                k: Kept::Full(fwd.k.clone()),
                v: Kept::Full(fwd.v.clone()),
                p: Kept::Full(fwd.p.clone()),
                ctx: Kept::Full(fwd.ctx.clone()),
                ln1: KeptLn::Full { input: fwd.r1.clone(), mean: fwd.mean1.clone(), rstd: fwd.rstd1.clone() },
                h: Some(Kept::Full(fwd.h.clone())),
                u: Kept::Full(fwd.u.clone()),
                g: Some(Kept::Full(fwd.g.clone())),
                ln2: KeptLn::Full { input: fwd.r2.clone(), mean: fwd.mean2.clone(), rstd: fwd.rstd2.clone() },
            })
        }
        Mode::Compressed { bits, shared } => (bits, shared),
    };
    let channels = QuantConfig { bits, ..fused::channel_groups(1, HEADS) };
    let heads = QuantConfig { bits, ..QuantConfig::per_head(2) };
    let pr = &fix.params;
    // matmul inputs: quantize-on-save (X once for the three projections)
    let x = quantize(device, channels, &fix.input, &[T, C])?;
    let q = quantize(device, heads, &fwd.q, &[B, N, HEADS, D])?;
    let k = quantize(device, heads, &fwd.k, &[B, N, HEADS, D])?;
    let v = quantize(device, heads, &fwd.v, &[B, N, HEADS, D])?;
    let ctx = quantize(device, channels, &fwd.ctx, &[T, C])?;
    // softmax: fused, codes of P only (also P·V's saved input)
    let ls = Layout::contiguous(&[B, HEADS, N, N]);
    let (sb, mb) = (device.upload(&fwd.s)?, device.upload(&additive_mask(fix))?);
    let ml = mask_layout();
    let mut pb = device.alloc_zeros::<f32>(fwd.p.len())?;
    let save_p = SoftmaxSave { bits, ..SoftmaxSave::per_head(1) };
    let p = softmax_forward(
        device,
        &save_p,
        &SoftmaxInput { x: &TensorRef::new(&sb, &ls)?, mask: Some(&TensorRef::new(&mb, &ml)?) },
        &mut TensorMut::new(&mut pb, &ls)?,
    )?;
    check_same("softmax output", &pb.to_vec()?, &fwd.p)?;
    // LayerNorms and GELU: fused
    let ln = |input: &[f32], w: &[f32], b: &[f32], expect: &[f32]| -> Result<SavedLayerNorm> {
        let l = Layout::contiguous(&[T, C]);
        let (xb, wb, bb) = (device.upload(input)?, device.upload(w)?, device.upload(b)?);
        let mut y = device.alloc_zeros::<f32>(T * C)?;
        let mut quant = Quantizer::new(device, channels)?;
        let s = layer_norm_forward(
            device,
            &mut quant,
            &LayerNormForward {
                x: &TensorRef::new(&xb, &l)?,
                weight: Some(&vref(&wb)?),
                bias: Some(&vref(&bb)?),
                eps: LN_EPS,
            },
            &mut TensorMut::new(&mut y, &l)?,
        )?;
        check_same("LayerNorm output", &y.to_vec()?, expect)?;
        Ok(s)
    };
    let ln1 = KeptLn::Codes(Box::new(ln(&fwd.r1, &pr.ln1_weight, &pr.ln1_bias, &fwd.h)?));
    let ln2 = KeptLn::Codes(Box::new(ln(&fwd.r2, &pr.ln2_weight, &pr.ln2_bias, &fwd.out)?));
    let lu = Layout::contiguous(&[T, F]);
    let ub = device.upload(&fwd.u)?;
    let mut gb = device.alloc_zeros::<f32>(T * F)?;
    let mut gq = Quantizer::new(device, channels)?;
    let u = Kept::Codes(Box::new(gelu_forward(
        device,
        &mut gq,
        GeluForm::Erf,
        &TensorRef::new(&ub, &lu)?,
        &mut TensorMut::new(&mut gb, &lu)?,
    )?));
    check_same("GELU output", &gb.to_vec()?, &fwd.g)?;
    let (h, g) = if shared {
        (None, None)
    } else {
        (Some(quantize(device, channels, &fwd.h, &[T, C])?), Some(quantize(device, channels, &fwd.g, &[T, F])?))
    };
    Ok(Saved { x, q, k, v, p: Kept::Codes(Box::new(p)), ctx, ln1, h, u, g, ln2 })
}

fn check_same(what: &str, a: &[f32], b: &[f32]) -> Result<()> {
    if a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits()) {
        return Err(format!("{what}: the saving forward differs from the plain one").into());
    }
    Ok(())
}

impl Saved {
    fn bytes(&self) -> usize {
        [&self.x, &self.q, &self.k, &self.v, &self.p, &self.ctx, &self.u]
            .iter()
            .map(|k| k.bytes())
            .chain(self.h.iter().map(Kept::bytes))
            .chain(self.g.iter().map(Kept::bytes))
            .sum::<usize>()
            + self.ln1.bytes()
            + self.ln2.bytes()
    }
    /// Saved elements (LayerNorm: its input / x̂) — the bf16 run keeps each as 2 bytes.
    fn numel(&self) -> usize {
        [&self.x, &self.q, &self.k, &self.v, &self.p, &self.ctx, &self.u]
            .iter()
            .map(|k| k.numel())
            .chain(self.h.iter().map(Kept::numel))
            .chain(self.g.iter().map(Kept::numel))
            .sum::<usize>()
            + 2 * T * C
    }
}

// ---------------------------------------------------------------------------------------
// Backward.

/// Names of the gradients, in the order of [`backward`]'s result.
pub const GRAD_NAMES: [&str; 17] = [
    "wq",
    "bq",
    "wk",
    "bk",
    "wv",
    "bv",
    "wo",
    "bo",
    "ln1_weight",
    "ln1_bias",
    "w1",
    "b1",
    "w2",
    "b2",
    "ln2_weight",
    "ln2_bias",
    "input",
];

/// The upstream gradient: `r` of the loss `Σ r ⊙ Out`, uniform in [−1, 1] from a fixed
/// splitmix64 sequence (the same for every run).
#[must_use]
pub fn upstream_gradient() -> Vec<f32> {
    let mut state = LOSS_SEED;
    (0..T * C)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn ln_backward(device: &Device, kept: &KeptLn, weight: &[f32], dy: &[f32]) -> Result<[Vec<f32>; 3]> {
    let l = Layout::contiguous(&[T, C]);
    let dyb = device.upload(dy)?;
    let wb = device.upload(weight)?;
    let mut dx = device.alloc_zeros::<f32>(T * C)?;
    let mut dw = device.alloc_zeros::<f32>(C)?;
    let mut db = device.alloc_zeros::<f32>(C)?;
    match kept {
        KeptLn::Codes(s) => layer_norm_backward(
            device,
            &LayerNormBackward { saved: s, weight: Some(&vref(&wb)?), dy: &TensorRef::new(&dyb, &l)? },
            LayerNormGrads {
                dx: &mut TensorMut::new(&mut dx, &l)?,
                dweight: &mut vmut(&mut dw)?,
                dbias: &mut vmut(&mut db)?,
            },
        )?,
        KeptLn::Full { .. } => {
            let (xh, rstd) = kept.xhat(device)?;
            let (xhb, rb): (Buffer<f32>, Buffer<f32>) = (device.upload(&xh)?, device.upload(&rstd)?);
            layer_norm_backward_plain(
                device,
                &LayerNormBackwardPlain {
                    xhat: &TensorRef::new(&xhb, &l)?,
                    rstd: &vref(&rb)?,
                    weight: Some(&vref(&wb)?),
                    dy: &TensorRef::new(&dyb, &l)?,
                },
                LayerNormGrads {
                    dx: &mut TensorMut::new(&mut dx, &l)?,
                    dweight: &mut vmut(&mut dw)?,
                    dbias: &mut vmut(&mut db)?,
                },
            )?;
        }
    }
    Ok([dx.to_vec()?, dw.to_vec()?, db.to_vec()?])
}

/// The backward of the block from what `mode` keeps: the 16 parameter gradients and the
/// input gradient, in the order of [`GRAD_NAMES`], and the bytes kept.
///
/// # Errors
/// Kernel errors.
pub fn backward(device: &Device, fix: &BlockFixture, fwd: &Forward, mode: Mode) -> Result<(Vec<Vec<f32>>, Saved)> {
    let saved = save(device, fix, fwd, mode)?;
    let pr = &fix.params;
    let dout = upstream_gradient();
    // LN2
    let [dr2, dln2w, dln2b] = ln_backward(device, &saved.ln2, &pr.ln2_weight, &dout)?;
    // FC2: its input G, kept or rebuilt as gelu(Û)
    let lu = Layout::contiguous(&[T, F]);
    let g_hat = match &saved.g {
        Some(g) => g.values(device)?,
        None => {
            let ub = device.upload(&saved.u.values(device)?)?;
            let mut gb = device.alloc_zeros::<f32>(T * F)?;
            gelu(device, GeluForm::Erf, &TensorRef::new(&ub, &lu)?, &mut TensorMut::new(&mut gb, &lu)?)?;
            gb.to_vec()?
        }
    };
    let [dw2, db2, dg] = linear_backward(&dr2, &g_hat, &pr.w2, T, F, C);
    // GELU
    let dgb = device.upload(&dg)?;
    let mut dub = device.alloc_zeros::<f32>(T * F)?;
    match &saved.u {
        Kept::Codes(s) => {
            gelu_backward(device, GeluForm::Erf, s, &TensorRef::new(&dgb, &lu)?, &mut TensorMut::new(&mut dub, &lu)?)?
        }
        Kept::Full(u) => gelu_backward_plain(
            device,
            &GeluBackwardPlain {
                form: GeluForm::Erf,
                x: &TensorRef::new(&device.upload(u)?, &lu)?,
                dy: &TensorRef::new(&dgb, &lu)?,
            },
            &mut TensorMut::new(&mut dub, &lu)?,
        )?,
    }
    let du = dub.to_vec()?;
    // FC1: its input H, kept or rebuilt as x̂1·γ1 + β1
    let h_hat = match &saved.h {
        Some(h) => h.values(device)?,
        None => {
            let (xh, _) = saved.ln1.xhat(device)?;
            xh.iter().enumerate().map(|(i, &v)| v * pr.ln1_weight[i % C] + pr.ln1_bias[i % C]).collect()
        }
    };
    let [dw1, db1, mut dh] = linear_backward(&du, &h_hat, &pr.w1, T, C, F);
    for (a, b) in dh.iter_mut().zip(&dr2) {
        *a += b;
    }
    // LN1
    let [dr1, dln1w, dln1b] = ln_backward(device, &saved.ln1, &pr.ln1_weight, &dh)?;
    // output projection
    let [dwo, dbo, dctx] = linear_backward(&dr1, &saved.ctx.values(device)?, &pr.wo, T, C, C);
    // attention
    let (q, k, v, p) =
        (saved.q.values(device)?, saved.k.values(device)?, saved.v.values(device)?, saved.p.values(device)?);
    let mut dp = vec![0f32; p.len()];
    let mut dv = vec![0f32; T * C];
    for b in 0..B {
        for h in 0..HEADS {
            let dc = head(&dctx, b, h);
            let dph = matmul_nt(&dc, &head(&v, b, h), N, D, N);
            dp[(b * HEADS + h) * N * N..(b * HEADS + h + 1) * N * N].copy_from_slice(&dph);
            let dvh = matmul_nt(&transpose(probs(&p, b, h), N, N), &transpose(&dc, N, D), N, N, D);
            put_head(&mut dv, b, h, &dvh);
        }
    }
    let ls = Layout::contiguous(&[B, HEADS, N, N]);
    let dpb = device.upload(&dp)?;
    let mut dsb = device.alloc_zeros::<f32>(dp.len())?;
    match &saved.p {
        Kept::Codes(s) => {
            softmax_backward(device, s, &TensorRef::new(&dpb, &ls)?, &mut TensorMut::new(&mut dsb, &ls)?)?
        }
        Kept::Full(pf) => softmax_backward_plain(
            device,
            &SoftmaxBackwardPlain { y: &TensorRef::new(&device.upload(pf)?, &ls)?, dy: &TensorRef::new(&dpb, &ls)? },
            &mut TensorMut::new(&mut dsb, &ls)?,
        )?,
    }
    let ds = dsb.to_vec()?;
    let scale = 1.0 / (D as f32).sqrt();
    let mut dq = vec![0f32; T * C];
    let mut dk = vec![0f32; T * C];
    for b in 0..B {
        for h in 0..HEADS {
            let dsh = probs(&ds, b, h);
            let dqh = matmul_nt(dsh, &transpose(&head(&k, b, h), N, D), N, N, D);
            let dkh = matmul_nt(&transpose(dsh, N, N), &transpose(&head(&q, b, h), N, D), N, N, D);
            put_head(&mut dq, b, h, &dqh.iter().map(|x| x * scale).collect::<Vec<_>>());
            put_head(&mut dk, b, h, &dkh.iter().map(|x| x * scale).collect::<Vec<_>>());
        }
    }
    let x_hat = saved.x.values(device)?;
    let [dwq, dbq, dxq] = linear_backward(&dq, &x_hat, &pr.wq, T, C, C);
    let [dwk, dbk, dxk] = linear_backward(&dk, &x_hat, &pr.wk, T, C, C);
    let [dwv, dbv, dxv] = linear_backward(&dv, &x_hat, &pr.wv, T, C, C);
    let dx: Vec<f32> = (0..T * C).map(|i| dxq[i] + dxk[i] + dxv[i] + dr1[i]).collect();
    let grads = vec![dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dln1w, dln1b, dw1, db1, dw2, db2, dln2w, dln2b, dx];
    Ok((grads, saved))
}

// ---------------------------------------------------------------------------------------
// Report.

/// Agreement of one gradient with the full-precision one.
#[derive(Debug, Clone, Copy)]
pub struct Agreement {
    /// Cosine similarity.
    pub cosine: f64,
    /// `‖g − g_ref‖ / ‖g_ref‖`.
    pub rel_l2: f64,
}

fn agreement(g: &[f32], r: &[f32]) -> Agreement {
    let (mut dot, mut gg, mut rr, mut dd) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &b) in g.iter().zip(r) {
        let (a, b) = (f64::from(a), f64::from(b));
        dot += a * b;
        gg += a * a;
        rr += b * b;
        dd += (a - b) * (a - b);
    }
    Agreement { cosine: dot / (gg.sqrt() * rr.sqrt()), rel_l2: (dd / rr).sqrt() }
}

/// One run of the block.
pub struct BlockRun {
    /// How activations were kept.
    pub mode: Mode,
    /// Bytes kept for backward.
    pub saved_bytes: usize,
    /// Per gradient (names [`GRAD_NAMES`]) agreement with the f32 run.
    pub agreement: Vec<Agreement>,
}

impl BlockRun {
    /// Smallest cosine over the weight matrices (Wq, Wk, Wv, Wo, W1, W2).
    #[must_use]
    pub fn min_weight_cosine(&self) -> f64 {
        GRAD_NAMES
            .iter()
            .zip(&self.agreement)
            .filter(|(n, _)| n.starts_with('w'))
            .map(|(_, a)| a.cosine)
            .fold(f64::INFINITY, f64::min)
    }
    /// Smallest cosine over the parameter gradients except `bk`: the key bias's true gradient
    /// is zero (softmax is invariant to adding a constant to a row of scores, and `bk` adds
    /// `q_i · bk` to every score of row i), so its reference is rounding noise.
    #[must_use]
    pub fn min_param_cosine(&self) -> f64 {
        GRAD_NAMES[..16]
            .iter()
            .zip(&self.agreement)
            .filter(|(n, _)| **n != "bk")
            .map(|(_, a)| a.cosine)
            .fold(f64::INFINITY, f64::min)
    }
}

/// The block section of the report.
pub struct BlockReport {
    /// The device of the kernels.
    pub backend: String,
    /// Bytes of the f32 run.
    pub f32_bytes: usize,
    /// Bytes a bf16 run keeps: 2 per saved element + the f32 LayerNorm mean/rstd.
    pub bf16_bytes: usize,
    /// The compressed runs.
    pub runs: Vec<BlockRun>,
    /// Largest |Δ| of the harness's forward against the fixture's numpy output.
    pub forward_max_abs_diff: f64,
    /// Wall time, seconds.
    pub seconds: f64,
}

/// Runs the block at 8, 4 and 2 bits, each with and without sharing.
///
/// # Errors
/// Fixture or kernel errors.
pub fn run(device: &Device, path: &Path) -> Result<BlockReport> {
    let start = std::time::Instant::now();
    let fix = load(path)?;
    let fwd = forward(device, &fix)?;
    let forward_max_abs_diff = fwd.out[..32 * C]
        .iter()
        .zip(&fix.output_seq0)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
        .fold(0.0, f64::max);
    let (reference, full) = backward(device, &fix, &fwd, Mode::Full)?;
    let f32_bytes = full.bytes();
    let bf16_bytes = full.numel() * 2 + 2 * 2 * T * 4;
    let mut runs = Vec::new();
    for bits in [8, 4, 2] {
        for shared in [false, true] {
            let mode = Mode::Compressed { bits, shared };
            let (grads, saved) = backward(device, &fix, &fwd, mode)?;
            let agreement = grads.iter().zip(&reference).map(|(g, r)| agreement(g, r)).collect();
            runs.push(BlockRun { mode, saved_bytes: saved.bytes(), agreement });
        }
    }
    Ok(BlockReport {
        backend: device.description(),
        f32_bytes,
        bf16_bytes,
        runs,
        forward_max_abs_diff,
        seconds: start.elapsed().as_secs_f64(),
    })
}

impl BlockReport {
    /// Prints the block section as tables.
    pub fn print(&self) {
        println!();
        println!("== Transformer block on compressed activations (MiniLM layer 3, batch 4 x 128, real text) ==");
        println!(
            "saved activations: f32 run {} bytes, bf16 run {} bytes (forward vs numpy: max |d| {:.2e}; {:.1} s)",
            self.f32_bytes, self.bf16_bytes, self.forward_max_abs_diff, self.seconds
        );
        println!(
            "{:<16} {:>12} {:>8} {:>8} {:>14} {:>14} {:>12}",
            "run", "saved bytes", "vs f32", "vs bf16", "min cos (W)", "min cos (¬bk)", "relL2 input"
        );
        for r in &self.runs {
            println!(
                "{:<16} {:>12} {:>8.4} {:>8.4} {:>14.6} {:>14.6} {:>12.3e}",
                r.mode.name(),
                r.saved_bytes,
                r.saved_bytes as f64 / self.f32_bytes as f64,
                r.saved_bytes as f64 / self.bf16_bytes as f64,
                r.min_weight_cosine(),
                r.min_param_cosine(),
                r.agreement[16].rel_l2
            );
        }
        println!("per-parameter gradient agreement (cosine / relative L2):");
        print!("{:<12}", "param");
        for r in &self.runs {
            print!(" {:>22}", r.mode.name());
        }
        println!();
        for (i, name) in GRAD_NAMES.iter().enumerate() {
            print!("{name:<12}");
            for r in &self.runs {
                print!(" {:>12.6} / {:<7.1e}", r.agreement[i].cosine, r.agreement[i].rel_l2);
            }
            println!();
        }
        println!(
            "targets (8-bit): saved <= 0.5 x bf16 and <= 0.25 x f32; weight-gradient cosine >= 0.999. \
             'shared' rebuilds FC1/FC2 inputs from the LayerNorm/GELU codes. \
             bk's true gradient is 0 (softmax shift invariance): its agreement is noise."
        );
    }

    /// The block section as JSON (`block` key of the report).
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "fixture": "fixtures/minilm_block.safetensors",
            "backend": self.backend,
            "shape": { "batch": B, "seq": N, "hidden": C, "heads": HEADS, "ffn": F },
            "f32_bytes": self.f32_bytes,
            "bf16_bytes": self.bf16_bytes,
            "forward_max_abs_diff": self.forward_max_abs_diff,
            "seconds": self.seconds,
            "runs": self.runs.iter().map(|r| {
                let (bits, shared) = match r.mode { Mode::Compressed { bits, shared } => (bits, shared), Mode::Full => (32, false) };
                json!({
                    "name": r.mode.name(),
                    "bits": bits,
                    "shared": shared,
                    "saved_bytes": r.saved_bytes,
                    "ratio_vs_f32": r.saved_bytes as f64 / self.f32_bytes as f64,
                    "ratio_vs_bf16": r.saved_bytes as f64 / self.bf16_bytes as f64,
                    "min_weight_cosine": r.min_weight_cosine(),
                    "min_param_cosine": r.min_param_cosine(),
                    "gradients": GRAD_NAMES.iter().zip(&r.agreement).map(|(n, a)| {
                        json!({ "name": n, "cosine": a.cosine, "rel_l2": a.rel_l2 })
                    }).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>(),
        })
    }
}

/// The element count a run keeps (for the test's byte bookkeeping).
#[must_use]
#[allow(dead_code)] // used by tests/block.rs, which includes this module
pub fn saved_numel_literal() -> usize {
    // X, Q, K, V, Ctx, LN1 x̂, H, LN2 x̂: [T, C]; P: [B, H, N, N]; U, G: [T, F]
    8 * T * C + B * HEADS * N * N + 2 * T * F
}
