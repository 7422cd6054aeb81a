/* mesa_fused.h — fused producers and consumers of saved activations (Mesa, Pan et al. 2021,
 * §3; BRIEF §5.1): GELU, softmax and LayerNorm forward kernels that write their output AND
 * the codes of what their backward needs in one pass; backward kernels that read those codes
 * directly (dequantized in registers, never materialised). Kernels: kernels/gelu.cu,
 * kernels/softmax.cu, kernels/layernorm.cu, kernels/swiglu.cu, kernels/rope.cu (RoPE keeps
 * nothing for its own backward; its forward can save the codes of its output, the Q and K of
 * attention); shared device pieces: kernels/quant_common.cuh.
 *
 * Codes follow mesa_quant.h exactly (asymmetric affine, logical row-major order of the saved
 * tensor's shape, bits < 8 packed first element in the least significant bits), so a saved
 * tensor written by a producer decodes with mesa_dequantize too.
 *
 * Row ops (softmax, LayerNorm) see a tensor as rows along its LAST axis: the descriptor's
 * last dimension is the row (length shape[ndim-1], any stride), the dimensions before it
 * index the rows (any strides, merged by the caller where contiguous).
 *
 * In-place: not supported by any entry here. The kernels mark every pointer __restrict__
 * (and several passes re-read an input after an output is written), so the input and output
 * ranges of one call, and the outputs among themselves, must be disjoint; the safe crate
 * (crates/mesa-kernels, launch builder) rejects overlapping calls with Error::Aliasing.
 */
#ifndef MESA_FUSED_H
#define MESA_FUSED_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where a producer writes the codes of its saved tensor (the tensor has `numel` elements in
 * logical order; element i belongs to group (i / group_run) % group_count).
 *   codes != NULL: codes[i] = Q(v_i; params[g(i)]), rounding as in MesaQuantizeArgs;
 *   stats != NULL: the same pass reduces min/max/nonfinite of v into stats (running mode,
 *                  or the statistics pass of exact mode with codes == NULL). */
typedef struct MesaCodeSink {
  uint8_t* codes;                 /* ceil(numel * bits / 8) bytes, or NULL */
  const MesaGroupParams* params;  /* [group_count], required when codes != NULL */
  MesaGroupStats* stats;          /* [group_count] or NULL */
  int64_t group_run;              /* >= 1 */
  int64_t group_count;            /* >= 1 */
  uint64_t seed;                  /* stochastic rounding: Philox4x32-7 key (the call's) */
  int32_t bits;                   /* 8, 4 or 2 */
  MesaRounding rounding;
  MesaCodeMap map;                /* SQRT: codes of sqrt(v) (requires stats == NULL) */
  int32_t _pad;
} MesaCodeSink;

/* Codes read back inside a backward kernel: v_i = codes[i] * scale[g(i)] + offset[g(i)]
 * (map SQRT: v_i = q * q with q that value). */
typedef struct MesaCodeSource {
  const uint8_t* codes;           /* NULL: the backward reads a plain tensor instead */
  const MesaGroupParams* params;  /* [group_count] */
  int64_t group_run;
  int64_t group_count;
  int32_t bits;
  MesaCodeMap map;
} MesaCodeSource;

/* ---- GELU ----------------------------------------------------------------------------- */
typedef int32_t MesaGeluForm;
enum MesaGeluFormCode {
  MESA_GELU_ERF = 0,  /* x/2 * (1 + erf(x / sqrt 2)) */
  MESA_GELU_TANH = 1  /* x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) */
};

/* y = gelu(x) (y may be NULL: statistics-only pass); sink receives the codes of x.
 * x, y: same logical shape, any strides (y must not overlap itself), dtype of x.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaGeluForwardArgs {
  const void* x;
  MesaTensorDesc x_desc;
  void* y;
  MesaTensorDesc y_desc;
  MesaCodeSink sink;
  MesaGeluForm form;
  int32_t _pad;
} MesaGeluForwardArgs;

/* dx = dy * gelu'(x), x decoded from `source` (or read from `x` when source.codes == NULL).
 * dy, x, dx: same logical shape, any strides; dtype of dy (x: x_desc.dtype).
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaGeluBackwardArgs {
  const void* dy;
  MesaTensorDesc dy_desc;
  const void* x;
  MesaTensorDesc x_desc;
  MesaCodeSource source;
  void* dx;
  MesaTensorDesc dx_desc;
  MesaGeluForm form;
  int32_t _pad;
} MesaGeluBackwardArgs;

/* ---- softmax over the last axis ---------------------------------------------------------
 * y = softmax(x + mask) per row. A row whose every entry is -inf (fully masked) gives y = 0.
 * mask may be NULL; else same logical shape as x (broadcast strides 0 allowed), x's dtype.
 * sink: codes of y (the stored, dtype-rounded output) with the fixed parameters written to
 * params_out (offset 0, scale 1 / (2^bits - 1)); sink.codes may be NULL (plain forward).
 * sink.map: IDENTITY (linear codes of y) or SQRT (codes of sqrt(y), decoded by squaring:
 * ~2 sqrt(y) / (2^bits - 1) steps, finer for the small probabilities of long rows).
 * Fused codes need shape[last] * bits % 8 == 0 (each row starts on a byte; else the entry
 * returns MESA_STATUS_UNSUPPORTED and the caller quantizes y afterwards with mesa_quantize
 * and these parameters). sink.stats must be NULL.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaSoftmaxForwardArgs {
  const void* x;
  MesaTensorDesc x_desc;
  const void* mask;
  MesaTensorDesc mask_desc;
  void* y;
  MesaTensorDesc y_desc;
  MesaCodeSink sink;
  MesaGroupParams* params_out;  /* [params_count] or NULL: written before the rows */
  int64_t params_count;
  uint32_t* nonfinite;          /* NULL, or a counter += non-finite outputs encoded */
} MesaSoftmaxForwardArgs;

/* dx = y * (dy - sum_row(dy * y)), y decoded from `source` (or read from `y`).
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaSoftmaxBackwardArgs {
  const void* dy;
  MesaTensorDesc dy_desc;
  const void* y;
  MesaTensorDesc y_desc;
  MesaCodeSource source;
  void* dx;
  MesaTensorDesc dx_desc;
} MesaSoftmaxBackwardArgs;

/* ---- LayerNorm over the last axis (C = shape[last]) -------------------------------------
 * mean = sum x / C, var = sum (x - mean)^2 / C, rstd = 1 / sqrt(var + eps),
 * xhat = (x - mean) * rstd, y = xhat * weight + bias.
 * weight, bias: [C] contiguous, dtype of x (NULL: 1 and 0). y may be NULL (statistics pass).
 * mean, rstd: [rows] f32 or NULL. sink: codes of xhat (f32 value) in x's logical order.
 * Fused codes need C % (8 / bits) == 0; otherwise codes_only = 1 runs an elementwise pass
 * that reads x, mean, rstd and writes only the codes (after a pass that wrote mean/rstd):
 * it re-reads x after y was written. codes_only with `widen` not NULL (sink.stats NULL) is
 * the widening pass of the running estimate (mesa_quant.h, MesaQuantizeArgs.widen): only
 * the units holding an element of a widened group are encoded again.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaLayerNormForwardArgs {
  const void* x;
  MesaTensorDesc x_desc;
  const void* weight;
  const void* bias;
  void* y;
  MesaTensorDesc y_desc;
  float* mean;
  float* rstd;
  MesaCodeSink sink;
  float eps;
  int32_t codes_only;
  const uint32_t* widen;  /* NULL, or [sink.group_count + 1] from quant_finalize (codes_only only) */
} MesaLayerNormForwardArgs;

/* g = dy * weight;  dx = rstd * (g - mean_row(g) - xhat * mean_row(g * xhat))
 * dweight[c] = sum_rows dy * xhat,  dbias[c] = sum_rows dy  (f32, deterministic: per-block
 * partials over fixed row ranges, then one ordered sum per column; no float atomics).
 * xhat decoded from `source` (or read from `xhat`). partials: [2 * partial_blocks * C] f32
 * scratch, partial_blocks in [1, 65535] (no rows: ignored, dweight = dbias = 0). dx, dweight/dbias may be NULL (skipped; dweight and
 * dbias are both NULL or both set). The dweight/dbias pass re-reads dy after dx is written.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaLayerNormBackwardArgs {
  const void* dy;
  MesaTensorDesc dy_desc;
  const void* xhat;
  MesaTensorDesc xhat_desc;
  MesaCodeSource source;
  const float* rstd;
  const void* weight;
  void* dx;
  MesaTensorDesc dx_desc;
  float* partials;
  int64_t partial_blocks;
  float* dweight;
  float* dbias;
} MesaLayerNormBackwardArgs;

/* ---- SwiGLU (Shazeer 2020, eq. 6): y = silu(g) * u, silu(g) = g * sigmoid(g) ------------
 * Elementwise; g, u, y: same element count and dtype, any strides (logical order: each
 * tensor's own row-major order of its shape). The sink encodes one input, `saved`: the gate g
 * (with y written: one read of g and u) or the up projection u (y may then be NULL: a pass
 * that reads u only). y may be NULL when the sink has codes or statistics.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef int32_t MesaSwigluSaved;
enum MesaSwigluSavedCode {
  MESA_SWIGLU_SAVE_GATE = 0,
  MESA_SWIGLU_SAVE_UP = 1
};

typedef struct MesaSwigluForwardArgs {
  const void* g;
  MesaTensorDesc g_desc;
  const void* u;
  MesaTensorDesc u_desc;
  void* y;
  MesaTensorDesc y_desc;
  MesaCodeSink sink;
  MesaSwigluSaved saved;
  int32_t _pad;
} MesaSwigluForwardArgs;

/* dg = dy * u * silu'(g), du = dy * silu(g), silu'(g) = sigmoid(g) * (1 + g * sigmoid(-g));
 * g and u decoded from gate_source and up_source (both set), or read from g and u (both
 * sources' codes NULL). dy, dg, du (and g, u): same element count and dtype, any strides.
 * In-place: not supported: every pointer is __restrict__ and no output may overlap an input
 * or another output (the safe crate rejects such calls with Error::Aliasing). */
typedef struct MesaSwigluBackwardArgs {
  const void* dy;
  MesaTensorDesc dy_desc;
  const void* g;
  MesaTensorDesc g_desc;
  MesaCodeSource gate_source;
  const void* u;
  MesaTensorDesc u_desc;
  MesaCodeSource up_source;
  void* dg;
  MesaTensorDesc dg_desc;
  void* du;
  MesaTensorDesc du_desc;
} MesaSwigluBackwardArgs;

/* ---- rotary position embeddings (Su et al. 2021, RoFormer, eq. 34) -----------------------
 * x, y: logical shape [..., S, D] (seq_len S, head_dim D; the descriptors may merge axes: the
 * logical order gives the position and the dim), any strides, same dtype. A row at index s of
 * the sequence axis has position p = position_offset + s; pair i < R/2 of the first R =
 * rotary_dims dims is rotated by theta = p * base^(-2i/R) (f32, as Hugging Face's cache), by
 * -theta when `inverse` (the backward: the rotation is orthogonal, nothing is kept). Dims R..D
 * are copied. Pairing: HALVES (i, i + R/2), GPT-NeoX / Llama / Hugging Face; INTERLEAVED
 * (2i, 2i + 1), GPT-J. R even, 2 <= R <= D; base > 1.
 * In-place: not supported: both pointers are __restrict__ (the safe crate rejects overlap). */
typedef int32_t MesaRopePairing;
enum MesaRopePairingCode {
  MESA_ROPE_HALVES = 0,
  MESA_ROPE_INTERLEAVED = 1
};

typedef struct MesaRopeArgs {
  const void* x;
  MesaTensorDesc x_desc;
  void* y;
  MesaTensorDesc y_desc;
  int64_t seq_len;
  int64_t head_dim;
  int64_t rotary_dims;
  int64_t position_offset;
  float base;
  MesaRopePairing pairing;
  int32_t inverse;
  int32_t _pad;
} MesaRopeArgs;

/* RoPE whose output's codes are saved in the pass that writes it (issue 40: the rotation fused
 * into the save of the Q and K codes). `rope` as for mesa_rope, with inverse = 0 (the forward;
 * its backward keeps nothing and is mesa_rope with inverse = 1); the sink receives the codes
 * of y — the stored, dtype-rounded output, in y's logical order — exactly as mesa_quantize of
 * that y would write them, with the statistics of y when sink.stats != NULL. rope.y may be
 * NULL when sink.codes is NULL (the statistics pass of exact mode: x is read and rotated in
 * registers, only the statistics are written). sink.map must be IDENTITY.
 * In-place: not supported: every pointer is __restrict__ (the safe crate rejects overlap). */
typedef struct MesaRopeSaveArgs {
  MesaRopeArgs rope;
  MesaCodeSink sink;
} MesaRopeSaveArgs;

MESA_DECLARE_ENTRY(gelu_forward, MesaGeluForwardArgs)
MESA_DECLARE_ENTRY(gelu_backward, MesaGeluBackwardArgs)
MESA_DECLARE_ENTRY(softmax_forward, MesaSoftmaxForwardArgs)
MESA_DECLARE_ENTRY(softmax_backward, MesaSoftmaxBackwardArgs)
MESA_DECLARE_ENTRY(layernorm_forward, MesaLayerNormForwardArgs)
MESA_DECLARE_ENTRY(layernorm_backward, MesaLayerNormBackwardArgs)
MESA_DECLARE_ENTRY(swiglu_forward, MesaSwigluForwardArgs)
MESA_DECLARE_ENTRY(swiglu_backward, MesaSwigluBackwardArgs)
MESA_DECLARE_ENTRY(rope, MesaRopeArgs)
MESA_DECLARE_ENTRY(rope_save, MesaRopeSaveArgs)

#ifdef __cplusplus
}
#endif

#endif /* MESA_FUSED_H */
