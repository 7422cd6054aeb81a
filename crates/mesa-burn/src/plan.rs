//! The memory planner: the bytes each mesa-burn op keeps for backward under `Autodiff<Flex>`,
//! as a function of shape, dtype, bits and the op's configuration, and the bytes a whole
//! pre-LN transformer block keeps ([`TransformerBlockConfig::plan`]). Pure arithmetic: no
//! tensor is made, nothing is dispatched.
//!
//! The sizes come from the functions the ops themselves allocate with
//! ([`mesa_kernels::saved_sizes`], `SoftmaxSave::saved_sizes`,
//! [`mesa_kernels::linear_attention::saved_bytes`]) and from the same word rounding as the
//! ops' saved codes, so the planner and the ops cannot drift apart; `tests/memory.rs` holds
//! the planner against a counting allocator (within 2 %, the rest being burn's graph
//! bookkeeping).
//!
//! Counted: the heap bytes of what an op's autodiff state holds that nothing else holds
//! (codes, per-group parameters, per-row statistics, the kernels' saved states), and, where a
//! state holds a handle to a non-parameter tensor (linear attention's inputs and output,
//! burn's matmul operands), that tensor's bytes. Not counted: handles to parameters (the
//! parameter is alive anyway), the fixed-size headers of states and graph nodes (burn's
//! bookkeeping, a few kB per block), and the forward's output (the caller holds it).
use burn::tensor::DType;
use mesa_kernels::linear_attention::{self, Dims, LinearAttentionConfig};

use crate::config::Codes;
use crate::error::{Error, Result};

/// burn's autodiff checkpointing strategy (`Device::autodiff()` and
/// `Device::autodiff().gradient_checkpointing()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpointing {
    /// burn's `NoCheckpointing`: every op keeps what its backward reads.
    None,
    /// burn's `BalancedCheckpointing`: a memory-bound op (add, `mul_scalar`, reshape, slice,
    /// `swap_dims`, …) keeps nothing itself but backs up its tracked parents' outputs until
    /// the backward, to recompute its own output if a later op needs it. mesa-burn's ops are
    /// marked compute-bound, so their own states are the same under both strategies.
    Balanced,
}

/// Heap bytes of the codes of a tensor of `shape` (any dtype): `8·⌈⌈n·bits/8⌉/8⌉` bytes of
/// codes in whole 8-byte words plus 8 bytes (offset, scale) per group, one group per tensor
/// (what the ops' saved codes allocate).
///
/// # Errors
/// [`Error::Config`] (bits not 8/4/2), [`Error::Kernel`] (the element or byte count
/// overflows).
pub fn codes(shape: &[usize], codes: &Codes) -> Result<usize> {
    codes.check()?;
    let sizes = mesa_kernels::saved_sizes(shape, &codes.quant_config())?;
    crate::host::heap_bytes(&sizes).ok_or(Error::Overflow { what: "codes" })
}

/// `gelu` on `x` of `shape`: the codes of `x`.
///
/// # Errors
/// As [`codes`].
pub fn gelu(shape: &[usize], bits: &Codes) -> Result<usize> {
    codes(shape, bits)
}

/// `linear` on `x` of `shape` (`[.., d_in]`): the codes of `x` (and a handle to the weight,
/// not counted).
///
/// # Errors
/// As [`codes`].
pub fn linear(shape: &[usize], bits: &Codes) -> Result<usize> {
    codes(shape, bits)
}

/// `layer_norm` on `x` of `shape` (`[.., C]`): the codes of `x̂` and the per-row `rstd`
/// (f32, 4 bytes per row), and a handle to the weight (not counted).
///
/// # Errors
/// [`Error::Shape`] (rank 0 or `C` = 0), as [`codes`], [`Error::Overflow`].
pub fn layer_norm(shape: &[usize], bits: &Codes) -> Result<usize> {
    norm(shape, bits)
}

/// `rms_norm` on `x` of `shape` (`[.., C]`): the codes of `x̂` (f32) and the per-row `rstd`
/// (f32, 4 bytes per row), and a handle to the weight (not counted).
///
/// # Errors
/// As [`layer_norm`].
pub fn rms_norm(shape: &[usize], bits: &Codes) -> Result<usize> {
    norm(shape, bits)
}

fn norm(shape: &[usize], bits: &Codes) -> Result<usize> {
    crate::validate::last_axis(shape)?;
    let rows = shape[..shape.len() - 1].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let rstd = rows.and_then(|r| r.checked_mul(4)).ok_or(Error::Overflow { what: "rstd" })?;
    codes(shape, bits)?.checked_add(rstd).ok_or(Error::Overflow { what: "rstd" })
}

/// `softmax` (masked or not) on `x` of `shape`: the square-root codes of `y` (the mask is
/// not kept).
///
/// # Errors
/// [`Error::Config`] (bits), [`Error::Kernel`] (overflow), [`Error::Overflow`].
pub fn softmax(shape: &[usize], bits: &Codes) -> Result<usize> {
    bits.check()?;
    let sizes = crate::autodiff::softmax_save_config(bits).saved_sizes(shape)?;
    crate::host::heap_bytes(&sizes).ok_or(Error::Overflow { what: "softmax codes" })
}

/// `swiglu` on `gate`, `up` of `shape`: the codes of both.
///
/// # Errors
/// As [`codes`], [`Error::Overflow`].
pub fn swiglu(shape: &[usize], bits: &Codes) -> Result<usize> {
    codes(shape, bits)?.checked_mul(2).ok_or(Error::Overflow { what: "swiglu codes" })
}

/// `linear_attention`'s own state: the kernels' f32 states and denominators
/// (`linear_attention::saved_bytes`: `4·B·H·M·W` for the final state, plus
/// `4·B·H·⌈L/C⌉·M·W` boundary states in [`crate::MemoryMode::BoundaryStates`] when causal,
/// plus `4·B·H·L` denominators when normalised; `W = D + normalize`).
///
/// # Errors
/// [`Error::Kernel`] (the counts overflow).
pub fn linear_attention_states(dims: &Dims, config: &LinearAttentionConfig) -> Result<usize> {
    Ok(linear_attention::saved_bytes(dims, config)?)
}

/// `linear_attention` in all: its state ([`linear_attention_states`]) plus `q`, `k`, `v` and
/// the output it holds handles to, `(2·B·H·L·M + 2·B·H·L·D)·size(dtype)` bytes (when `q`, `k`
/// and `v` are views of one projection's output, that output: the same count).
///
/// # Errors
/// [`Error::Dtype`] (not f32/f16/bf16), [`Error::Kernel`], [`Error::Overflow`].
pub fn linear_attention(dims: &Dims, dtype: DType, config: &LinearAttentionConfig) -> Result<usize> {
    let e = elem(dtype)?;
    let io = mul(&[2, dims.batch, dims.heads, dims.len, dims.feat.checked_add(dims.dim).ok_or(OVERFLOW)?, e])?;
    io.checked_add(linear_attention_states(dims, config)?).ok_or(OVERFLOW)
}

/// Bytes of a tensor of `shape` and `dtype` (f32, f16, bf16): what burn's own ops keep per
/// saved operand.
///
/// # Errors
/// [`Error::Dtype`], [`Error::Overflow`].
pub fn dense(shape: &[usize], dtype: DType) -> Result<usize> {
    let e = elem(dtype)?;
    let mut f = shape.to_vec();
    f.push(e);
    mul(&f)
}

const OVERFLOW: Error = Error::Overflow { what: "block plan" };

fn mul(factors: &[usize]) -> Result<usize> {
    factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f)).ok_or(OVERFLOW)
}

fn elem(dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(dtype.size()),
        other => Err(Error::Dtype { what: "dtype", got: format!("{other:?}") }),
    }
}

/// The attention of a [`TransformerBlockConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attention {
    /// mesa-burn's [`crate::linear_attention`] on `q`, `k`, `v` as they come out of the
    /// projection (identity feature map), with this configuration.
    Linear(LinearAttentionConfig),
    /// Causal softmax attention: burn's `matmul` for `q·kᵀ`, burn's `mul_scalar` by
    /// `1/√d_head`, mesa-burn's [`crate::softmax`] with an additive causal mask (codes of
    /// `P`), burn's `matmul` for `P·v`. burn's two matmuls keep their operands: `q`, `kᵀ`,
    /// `v` (views of the projection's output) and `P` in full precision.
    Softmax,
}

/// A pre-LN transformer block on `x` `[batch, seq_len, d_model]`, built from mesa-burn ops
/// with burn's own reshapes and adds, in this order (what [`Self::plan`] counts and
/// `tests/memory.rs` runs):
///
/// ```text
/// a   = LN1(x)                                   mesa layer_norm
/// qkv = a·Wqkv + bqkv                            mesa linear, [B, L, 3·d_model]
/// t   = qkv.reshape([B, L, 3·H, d_head]).swap_dims(1, 2)      [B, 3·H, L, d_head], a view
/// q, k, v = t.slice(heads 0..H, H..2H, 2H..3H)   views of qkv's storage, [B, H, L, d_head]
/// o   = attention(q, k, v)                       [B, H, L, d_head]   (Attention)
/// h   = x + (o.swap_dims(1, 2).reshape([B, L, d_model]))·Wo + bo     mesa linear
/// y   = h + GELU(LN2(h)·W1 + b1)·W2 + b2         mesa layer_norm, linear, gelu, linear
/// ```
///
/// (burn's reshape of a non-contiguous view copies; `o`'s copy is consumed by `Wo`'s linear
/// and freed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransformerBlockConfig {
    /// `B`.
    pub batch: usize,
    /// `L`.
    pub seq_len: usize,
    /// `d_model` (a multiple of `heads`).
    pub d_model: usize,
    /// `H`; `d_head = d_model / H`.
    pub heads: usize,
    /// Width of the MLP's hidden layer.
    pub d_ff: usize,
    /// The codes every mesa-burn op of the block keeps.
    pub codes: Codes,
    /// The dtype of `x` and of every parameter: f32, f16 or bf16.
    pub dtype: DType,
    /// Linear or softmax attention.
    pub attention: Attention,
    /// burn's checkpointing strategy.
    pub checkpointing: Checkpointing,
    /// Whether `x` requires a gradient (a block after another one) or not (the first block on
    /// an untracked input). Under [`Checkpointing::Balanced`] it decides which operands of the
    /// residual adds burn backs up.
    pub input_tracked: bool,
}

/// What one op of a block keeps for backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The op, as in [`TransformerBlockConfig`]'s listing.
    pub op: &'static str,
    /// What it keeps.
    pub what: &'static str,
    /// Heap bytes.
    pub bytes: usize,
}

/// The bytes a block keeps for backward, op by op ([`TransformerBlockConfig::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPlan {
    /// One entry per op that keeps anything (burn's ops that keep nothing are left out).
    pub kept: Vec<Kept>,
}

impl BlockPlan {
    /// The sum of [`BlockPlan::kept`] (checked against overflow when the plan was made).
    #[must_use]
    pub fn total(&self) -> usize {
        self.kept.iter().map(|k| k.bytes).sum()
    }
}

impl TransformerBlockConfig {
    /// The bytes each op of the block keeps for backward after the forward, with the block's
    /// input dropped by the caller and its output held (not counted).
    ///
    /// burn's ops in the block, from burn-autodiff 0.22.1's `src/ops/tensor.rs`: `float_add`
    /// keeps the two shapes; `float_reshape` the two shapes, `float_swap_dims` the two axes,
    /// `float_slice` the ranges, the input's shape and device, `float_mul_scalar` the scalar
    /// (all memory-bound, all no tensor); `float_matmul` (compute-bound) checkpoints each
    /// operand whose partner is tracked, i.e. keeps both here. Under balanced checkpointing a
    /// memory-bound op backs up its parents (`checkpoint_parents` in
    /// `src/checkpoint/strategy.rs`; a compute-bound parent's output is kept, a memory-bound
    /// one is recomputed), unless one parent is untracked, and then nothing
    /// (`CheckpointingError::UntrackedParent`): so the backups counted are those of the
    /// residual adds, `mul_scalar`'s scores, and `swap_dims`' `o` (the reshape's, slices' and
    /// swap's backups of `qkv` and of linear attention's output share storage with what is
    /// kept anyway).
    ///
    /// # Errors
    /// [`Error::Shape`] (a zero size, `d_model` not a multiple of `heads`), [`Error::Config`]
    /// (bits; linear attention's chunk outside `1..=64`), [`Error::Dtype`],
    /// [`Error::Kernel`], [`Error::Overflow`].
    pub fn plan(&self) -> Result<BlockPlan> {
        let &TransformerBlockConfig { batch, seq_len, d_model, heads, d_ff, codes: c, dtype, attention, .. } = self;
        if [batch, seq_len, d_model, heads, d_ff].contains(&0) {
            return Err(Error::Shape { what: "block", why: format!("a zero size in {self:?}") });
        }
        if d_model % heads != 0 {
            return Err(Error::Shape { what: "d_model", why: format!("{d_model} is not a multiple of {heads} heads") });
        }
        c.check()?;
        let d_head = d_model / heads;
        let x = [batch, seq_len, d_model];
        let hidden = [batch, seq_len, d_ff];
        let scores = [batch, heads, seq_len, seq_len];
        let tokens = dense(&x, dtype)?;
        let balanced = self.checkpointing == Checkpointing::Balanced;
        let mut kept = vec![
            Kept { op: "LN1", what: "codes of x̂, rstd", bytes: layer_norm(&x, &c)? },
            Kept { op: "Wqkv", what: "codes of LN1(x)", bytes: linear(&x, &c)? },
        ];
        match attention {
            Attention::Linear(config) => {
                if config.chunk == 0 || config.chunk > linear_attention::MAX_CHUNK {
                    return Err(Error::Config { what: "chunk", why: format!("{} is outside 1..=64", config.chunk) });
                }
                let dims = Dims { batch, heads, len: seq_len, feat: d_head, dim: d_head };
                kept.push(Kept {
                    op: "linear_attention",
                    what: "q, k, v (qkv's storage) and its output",
                    bytes: linear_attention(&dims, dtype, &config)? - linear_attention_states(&dims, &config)?,
                });
                kept.push(Kept {
                    op: "linear_attention",
                    what: "the kernels' states and denominators",
                    bytes: linear_attention_states(&dims, &config)?,
                });
            }
            Attention::Softmax => {
                kept.push(Kept { op: "q·kᵀ, P·v", what: "q, kᵀ, v (qkv's storage)", bytes: mul(&[3, tokens])? });
                if balanced {
                    kept.push(Kept {
                        op: "mul_scalar",
                        what: "backup of the scores q·kᵀ",
                        bytes: dense(&scores, dtype)?,
                    });
                }
                kept.push(Kept { op: "softmax", what: "codes of P", bytes: softmax(&scores, &c)? });
                kept.push(Kept { op: "P·v", what: "P", bytes: dense(&scores, dtype)? });
                if balanced {
                    kept.push(Kept { op: "swap_dims", what: "backup of o", bytes: tokens });
                }
            }
        }
        kept.push(Kept { op: "Wo", what: "codes of o", bytes: linear(&x, &c)? });
        if balanced && self.input_tracked {
            kept.push(Kept { op: "x + ·", what: "backups of x and of Wo's output", bytes: mul(&[2, tokens])? });
        }
        kept.extend([
            Kept { op: "LN2", what: "codes of ĥ, rstd", bytes: layer_norm(&x, &c)? },
            Kept { op: "W1", what: "codes of LN2(h)", bytes: linear(&x, &c)? },
            Kept { op: "GELU", what: "codes of its input", bytes: gelu(&hidden, &c)? },
            Kept { op: "W2", what: "codes of GELU's output", bytes: linear(&hidden, &c)? },
        ]);
        if balanced {
            // h is recomputed when x is tracked (the first add is then memory-bound), kept
            // when it is not (the first add fell back to compute-bound)
            let (what, n) =
                if self.input_tracked { ("backup of W2's output", 1) } else { ("backups of h and of W2's output", 2) };
            kept.push(Kept { op: "h + ·", what, bytes: mul(&[n, tokens])? });
        }
        kept.iter().try_fold(0usize, |a, k| a.checked_add(k.bytes)).ok_or(OVERFLOW)?;
        Ok(BlockPlan { kept })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesa_kernels::linear_attention::MemoryMode;

    fn block(attention: Attention, checkpointing: Checkpointing, input_tracked: bool) -> TransformerBlockConfig {
        TransformerBlockConfig {
            batch: 2,
            seq_len: 128,
            d_model: 128,
            heads: 4,
            d_ff: 512,
            codes: Codes::bits(8),
            dtype: DType::F32,
            attention,
            checkpointing,
            input_tracked,
        }
    }

    /// The per-op formulas against sizes worked out by hand (docs/burn.md's table).
    #[test]
    fn per_op_bytes_by_hand() {
        let c8 = Codes::bits(8);
        let c4 = Codes::bits(4);
        let c2 = Codes::bits(2);
        // 15 elements: ⌈15·b/8⌉ code bytes in whole words, + one 8-byte group
        assert_eq!(codes(&[3, 5], &c8).unwrap(), 16 + 8);
        assert_eq!(codes(&[3, 5], &c4).unwrap(), 8 + 8);
        assert_eq!(codes(&[3, 5], &c2).unwrap(), 8 + 8);
        // [256, 1024] at 4 bits: 131 072 bytes of codes + 8
        assert_eq!(gelu(&[256, 1024], &c4).unwrap(), 131_080);
        assert_eq!(layer_norm(&[2, 128, 256], &c8).unwrap(), 65_536 + 8 + 4 * 256);
        assert_eq!(rms_norm(&[2, 128, 256], &c2).unwrap(), 16_384 + 8 + 4 * 256);
        assert_eq!(swiglu(&[7], &c8).unwrap(), 2 * (8 + 8));
        // softmax: fixed parameters (one group of 8 bytes, as the others)
        assert_eq!(softmax(&[2, 4, 128, 128], &c8).unwrap(), 131_072 + 8);
        // linear attention, causal, chunk 64, L = 128, M = D = 32, B·H = 8, boundary states:
        // final state 8·32·33 + boundaries 8·2·32·33 + denominators 8·128, all f32
        let dims = Dims { batch: 2, heads: 4, len: 128, feat: 32, dim: 32 };
        let la = LinearAttentionConfig::causal();
        assert_eq!(linear_attention_states(&dims, &la).unwrap(), 4 * (8 * 32 * 33 * 3 + 8 * 128));
        let slim = LinearAttentionConfig { memory: MemoryMode::Slim, normalize: false, ..la };
        assert_eq!(linear_attention_states(&dims, &slim).unwrap(), 4 * 8 * 32 * 32);
        assert_eq!(
            linear_attention(&dims, DType::BF16, &slim).unwrap(),
            4 * (8 * 128 * 32) * 2 + 4 * 8 * 32 * 32,
            "q, k, v and the output in bf16"
        );
    }

    /// Bad input is a typed error, and an overflow is not a panic.
    #[test]
    fn bad_input() {
        assert!(matches!(codes(&[4], &Codes::bits(3)), Err(Error::Config { what: "bits", .. })));
        assert!(matches!(codes(&[usize::MAX, 2], &Codes::bits(8)), Err(Error::Kernel(_))));
        assert!(matches!(layer_norm(&[4, 0], &Codes::bits(8)), Err(Error::Shape { .. })));
        assert!(matches!(dense(&[usize::MAX, 2], DType::F32), Err(Error::Overflow { .. })));
        assert!(matches!(dense(&[2], DType::I32), Err(Error::Dtype { .. })));
        let ok = block(Attention::Softmax, Checkpointing::None, false);
        assert!(ok.plan().is_ok());
        for bad in [
            TransformerBlockConfig { heads: 3, ..ok },
            TransformerBlockConfig { batch: 0, ..ok },
            TransformerBlockConfig { codes: Codes::bits(16), ..ok },
            TransformerBlockConfig { dtype: DType::F64, ..ok },
            TransformerBlockConfig { seq_len: usize::MAX / 2, ..ok },
            TransformerBlockConfig {
                attention: Attention::Linear(LinearAttentionConfig { chunk: 65, ..LinearAttentionConfig::causal() }),
                ..ok
            },
        ] {
            assert!(bad.plan().is_err(), "{bad:?}");
        }
    }

    /// The block's total, worked out by hand for the test's sizes (N = 256 rows of 128).
    #[test]
    fn block_total_by_hand() {
        let n = 256;
        let codes_nd = n * 128 + 8;
        let codes_nf = n * 512 + 8;
        let ln = codes_nd + 4 * n;
        let mesa = 2 * ln + 3 * codes_nd + 2 * codes_nf;
        let la = LinearAttentionConfig { normalize: false, ..LinearAttentionConfig::causal() };
        // q, k, v, o in f32 + final and boundary states (8·32·32·(1 + 2)·4)
        let attn = 4 * n * 128 * 4 + 8 * 32 * 32 * 3 * 4;
        let p = block(Attention::Linear(la), Checkpointing::None, false).plan().unwrap();
        assert_eq!(p.total(), mesa + attn);
        let p = block(Attention::Linear(la), Checkpointing::Balanced, false).plan().unwrap();
        assert_eq!(p.total(), mesa + attn + 2 * n * 128 * 4);
        let scores = 2 * 4 * 128 * 128;
        let p = block(Attention::Softmax, Checkpointing::None, false).plan().unwrap();
        assert_eq!(p.total(), mesa + 3 * n * 128 * 4 + (scores + 8) + 4 * scores);
    }
}
