//! The user API: `Tensor<D>` in, validated, dispatched to [`MesaOps`].
use burn::backend::Dispatch;
use burn::tensor::Tensor;

use crate::config::Codes;
use crate::error::{Error, Result};
use crate::ops::MesaOps;
use crate::validate;
use mesa_kernels::GeluForm;

/// GELU, `y = gelu(x)` elementwise (`form`: [`GeluForm::Erf`] as burn's `activation::gelu`,
/// [`GeluForm::Tanh`] as `activation::gelu_approximate`), keeping for backward the codes of
/// `x` (`codes.bits`/8 bytes per element) instead of `x`.
///
/// Shapes: `x` any shape, `y` the same. Dtypes: f32, f16, bf16 (`y` has `x`'s). The forward
/// is exact; the gradient is `dy·gelu'(x̃)` at the decoded `x̃` (`|x̃ − x| ≤ scale/2` with
/// nearest rounding, `scale = (max x − min x)/(2^bits − 1)`).
///
/// # Errors
/// [`Error::Backend`] (not a Flex tensor, nor with the `cuda` feature a tensor of burn's CUDA
/// backend on a CUDA device), [`Error::Dtype`], [`Error::Config`] (bits not 8/4/2),
/// [`Error::Kernel`] (a size that overflows; on CUDA also: mesa-kernels built without CUDA
/// kernels, no driver, no such device). Nothing is dispatched on an error.
///
/// On CUDA (`cuda` feature; type-checked only, never run) the forward and the backward each
/// synchronise the host twice (docs/burn.md, "CUDA"), and the codes live in cubecl's device
/// memory.
pub fn gelu<const D: usize>(x: Tensor<D>, form: GeluForm, codes: Codes) -> Result<Tensor<D>> {
    validate::float_or_cuda(&x, "x")?;
    validate::codes(&codes, &x.dims())?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_gelu(x.into_dispatch(), form, codes)))
}

/// LayerNorm over the last axis: `y = (x − mean)/sqrt(var + eps)·weight + bias` (biased
/// variance, as burn-nn's `LayerNorm`), keeping for backward the codes of
/// `x̂ = (x − mean)/sqrt(var + eps)`, the per-row `1/sqrt(var + eps)` (4 bytes per row) and
/// a handle to `weight` (no copy), not `x`.
///
/// Shapes: `x` `[.., C]` (rank ≥ 1, `C` > 0), `weight` and `bias` `[C]`, `y` as `x`.
/// Dtypes: f32, f16, bf16, all three tensors alike; statistics in f32. `eps`: positive and
/// finite (burn-nn's default is 1e-5), applied in f32.
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`] (rank 0, `C` = 0, a
/// parameter not `[C]`), [`Error::Config`] (bits, eps), [`Error::Kernel`] (also, on CUDA:
/// mesa-kernels without CUDA kernels, no driver, no such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) the forward and the backward each
/// synchronise the host twice (docs/burn.md, "CUDA"); the codes and `rstd` live in cubecl's
/// device memory; `dweight` and `dbias` are accumulated in f32 and cast to the weight's dtype.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    bias: Tensor<1>,
    eps: f64,
    codes: Codes,
) -> Result<Tensor<D>> {
    validate::float_or_cuda(&x, "x")?;
    validate::same(&weight, &x, "weight")?;
    validate::same(&bias, &x, "bias")?;
    let dims = x.dims();
    let cols = validate::last_axis(&dims)?;
    validate::vector(&weight, cols, "weight")?;
    validate::vector(&bias, cols, "bias")?;
    let eps32 = validate::eps(eps)?;
    validate::codes(&codes, &dims)?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_layer_norm(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        eps32,
        codes,
    )))
}

/// A linear layer, `y = x·weight + bias` over the last axis (burn-nn's `Linear` with its
/// default row layout), keeping for backward the codes of `x` and a handle to `weight` (no
/// copy), not `x`. `dx = dy·weightᵀ` is exact; `dweight = x̃ᵀ·dy` uses the decoded `x̃`;
/// `dbias = Σ dy` over all leading axes.
///
/// Shapes: `x` `[.., d_in]` (rank ≥ 1), `weight` `[d_in, d_out]`, `bias` `[d_out]` or `None`
/// (zeros, not tracked), `y` `[.., d_out]`. Dtypes: f32, f16, bf16, all alike.
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`], [`Error::Config`]
/// (bits), [`Error::Kernel`] (also, on CUDA: mesa-kernels without CUDA kernels, no driver, no
/// such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) the matmuls are burn's cubecl ops;
/// quantizing `x` (forward) and decoding it (backward, for `dweight`) each synchronise the host
/// twice (docs/burn.md, "CUDA"); the codes live in cubecl's device memory.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    codes: Codes,
) -> Result<Tensor<D>> {
    validate::float_or_cuda(&x, "x")?;
    validate::same(&weight, &x, "weight")?;
    let dims = x.dims();
    let [d_in, d_out] = weight.dims();
    if dims.last() != Some(&d_in) {
        return Err(Error::Shape { what: "x", why: format!("last axis of {dims:?} is not weight's d_in = {d_in}") });
    }
    let bias = match bias {
        Some(b) => {
            validate::same(&b, &x, "bias")?;
            validate::vector(&b, d_out, "bias")?;
            b
        }
        None => Tensor::<1>::zeros([d_out], &x.device()).cast(x.dtype()),
    };
    validate::codes(&codes, &dims)?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        codes,
    )))
}

/// RMSNorm over the last axis: `y = x/sqrt(mean(x²) + eps)·weight` (as burn-nn's
/// `RmsNorm`: statistics in f32), keeping for backward the codes of
/// `x̂ = x/sqrt(mean(x²) + eps)` (computed in f32), the per-row `1/sqrt(mean(x²) + eps)`
/// (4 bytes per row) and a handle to `weight` (no copy), not `x`. Backward:
/// `dx = rstd·(g − x̃·mean(g·x̃))` with `g = dy·weight`, `dweight = Σ dy·x̃`, from the decoded
/// `x̃`. mesa-kernels has no RMSNorm kernel: the arithmetic is Flex's ops; the codes are
/// the kernels' quantize and dequantize.
///
/// Shapes: `x` `[.., C]` (rank ≥ 1, `C` > 0), `weight` `[C]`, `y` as `x`. Dtypes: f32, f16,
/// bf16, both alike. `eps`: positive and finite in f32.
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`], [`Error::Config`]
/// (bits, eps), [`Error::Kernel`] (also, on CUDA: mesa-kernels without CUDA kernels, no
/// driver, no such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) the arithmetic is burn's cubecl ops
/// in f32; quantizing `x̂` (forward) and decoding it (backward) each synchronise the host
/// twice (docs/burn.md, "CUDA"); codes and `rstd` live in cubecl's device memory.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64, codes: Codes) -> Result<Tensor<D>> {
    validate::float_or_cuda(&x, "x")?;
    validate::same(&weight, &x, "weight")?;
    let dims = x.dims();
    let cols = validate::last_axis(&dims)?;
    validate::vector(&weight, cols, "weight")?;
    let eps32 = validate::eps(eps)?;
    validate::codes(&codes, &dims)?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_rms_norm(
        x.into_dispatch(),
        weight.into_dispatch(),
        eps32,
        codes,
    )))
}

/// Softmax over the last axis, `y = softmax(x + mask)`, keeping for backward square-root
/// companded codes of `y` (`codes.bits`/8 bytes per element, fixed parameters: decoded
/// `ŷ = (c/L)²`, `L = 2^bits − 1`, `|ŷ − y| ≤ (√y + 1/(4L))/L` with nearest rounding), not
/// `y`. Backward: `dx = ŷ·(dy − Σ dy·ŷ)` per row.
///
/// Shapes: `x` rank ≥ 1 (rows along the last axis); `mask` (additive, `−inf` allowed; a
/// fully masked row gives 0) of `x`'s rank, each axis equal to `x`'s or 1 (broadcast). A
/// tracked mask (a learnt bias) gets `dmask = dx`, summed over its broadcast axes; with an
/// empty `x` it gets none. Dtypes: f32, f16, bf16, alike.
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`] (rank 0,
/// a mask axis that does not broadcast), [`Error::Config`] (bits), [`Error::Kernel`] (also, on
/// CUDA: mesa-kernels without CUDA kernels, no driver, no such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) a broadcast mask is copied to
/// `x`'s shape first; the forward and the backward each synchronise the host twice
/// (docs/burn.md, "CUDA"), and the codes live in cubecl's device memory.
pub fn softmax<const D: usize>(x: Tensor<D>, mask: Option<Tensor<D>>, codes: Codes) -> Result<Tensor<D>> {
    validate::float_or_cuda(&x, "x")?;
    let dims = x.dims();
    validate::last_axis_any(&dims)?;
    codes.check()?;
    let _sizes = crate::autodiff::softmax_save_config(&codes).saved_sizes(&dims)?;
    let y = match mask {
        None => <Dispatch as MesaOps>::mesa_softmax(x.into_dispatch(), codes),
        Some(m) => {
            validate::same(&m, &x, "mask")?;
            let md = m.dims();
            if md.iter().zip(&dims).any(|(&a, &b)| a != b && a != 1) {
                return Err(Error::Shape { what: "mask", why: format!("{md:?} does not broadcast to {dims:?}") });
            }
            if dims.contains(&0) {
                // nothing to mask, and burn's expand refuses a zero extent: the unmasked op
                // (the mask is not a parent, so it gets no gradient)
                return Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_softmax(x.into_dispatch(), codes)));
            }
            let m = if md == dims { m } else { m.expand(dims) };
            <Dispatch as MesaOps>::mesa_softmax_masked(x.into_dispatch(), m.into_dispatch(), codes)
        }
    };
    Ok(Tensor::from_dispatch(y))
}

/// SwiGLU, `y = silu(gate)·up` elementwise (`silu(g) = g·σ(g)`), keeping for backward the
/// codes of `gate` and of `up` (2·`codes.bits`/8 bytes per element), not the inputs.
/// Backward: `dgate = dy·up~·silu'(gate~)`, `dup = dy·silu(gate~)` from the decoded inputs.
///
/// Shapes: `gate`, `up`, `y` one shape. Dtypes: f32, f16, bf16, alike.
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`] (the
/// shapes differ), [`Error::Config`] (bits), [`Error::Kernel`] (also, on CUDA: mesa-kernels
/// without CUDA kernels, no driver, no such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) the forward and the backward each
/// synchronise the host twice (docs/burn.md, "CUDA"), and the codes live in cubecl's device
/// memory.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>, codes: Codes) -> Result<Tensor<D>> {
    validate::float_or_cuda(&gate, "gate")?;
    validate::same(&up, &gate, "up")?;
    if up.dims() != gate.dims() {
        return Err(Error::Shape {
            what: "up",
            why: format!("{:?} given, the gate's {:?} expected", up.dims(), gate.dims()),
        });
    }
    validate::codes(&codes, &gate.dims())?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_swiglu(gate.into_dispatch(), up.into_dispatch(), codes)))
}

/// Chunked linear attention (mesa-kernels' kernels, SLiM / Katharopoulos et al.):
/// `out_t = Σ_{s≤t} (q_t·k_s)·v_s / g(q_t·Σ_{s≤t} k_s)` (causal and normalised: `config`;
/// `g(x) = x + ε·sign(x)`), exact up to f32 rounding (no codes). `q` and `k` are the
/// feature-mapped queries and keys. The backward keeps handles to `q`, `k`, `v` and the
/// output (no copies: the kernels' backward reads them; the saving against softmax attention
/// is the `L×L` matrix, never formed) plus the kernels' states and denominators in f32
/// (`LinearAttentionSaved`: boundary states `B·H·⌈L/C⌉·M·(D+1)·4` bytes by default).
///
/// Shapes: `q`, `k` `[B, H, L, M]`, `v` `[B, H, L, D]`, output `[B, H, L, D]`. Dtypes: f32,
/// f16, bf16, alike (state and accumulation in f32).
///
/// # Errors
/// [`Error::Backend`] (not Flex, nor with the `cuda` feature a CUDA device of burn's CUDA
/// backend), [`Error::Dtype`], [`Error::DtypeMismatch`], [`Error::Shape`] (`k` not `q`'s
/// shape, `v` not `[B, H, L, ·]`), [`Error::Config`] (chunk outside `1..=64`, ε not positive
/// and finite when normalising), [`Error::Kernel`] (saved sizes overflow; on CUDA also:
/// mesa-kernels without CUDA kernels, no driver, no such device).
///
/// On CUDA (`cuda` feature; type-checked only, never run) the forward and the backward each
/// synchronise the host twice (docs/burn.md, "CUDA"); the kernels' saved states are
/// mesa-kernels `Buffer`s on mesa's stream (device memory, outside burn's allocator).
pub fn linear_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    config: mesa_kernels::linear_attention::LinearAttentionConfig,
) -> Result<Tensor<4>> {
    validate::float_or_cuda(&q, "q")?;
    validate::same(&k, &q, "k")?;
    validate::same(&v, &q, "v")?;
    let (qd, vd) = (q.dims(), v.dims());
    if k.dims() != qd {
        return Err(Error::Shape { what: "k", why: format!("{:?} given, q's {qd:?} expected", k.dims()) });
    }
    if vd[..3] != qd[..3] {
        return Err(Error::Shape {
            what: "v",
            why: format!("{vd:?} given, [B, H, L, D] with q's {:?} expected", &qd[..3]),
        });
    }
    if config.chunk == 0 || config.chunk > mesa_kernels::linear_attention::MAX_CHUNK {
        return Err(Error::Config { what: "chunk", why: format!("{} is outside 1..=64", config.chunk) });
    }
    if config.normalize && !(config.eps > 0.0 && config.eps.is_finite()) {
        return Err(Error::Config { what: "eps", why: format!("{} must be positive and finite", config.eps) });
    }
    let dims = mesa_kernels::linear_attention::Dims { batch: qd[0], heads: qd[1], len: qd[2], feat: qd[3], dim: vd[3] };
    let _bytes = mesa_kernels::linear_attention::saved_bytes(&dims, &config)?;
    Ok(Tensor::from_dispatch(<Dispatch as MesaOps>::mesa_linear_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        config,
    )))
}
