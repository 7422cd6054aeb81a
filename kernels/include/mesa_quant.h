/* mesa_quant.h — activation compression (Mesa, Pan et al. 2021, §3): quantize-on-save,
 * running estimates, per-group dequantize. Kernels: kernels/quantize.cu.
 *
 * A tensor is seen as [outer, groups, inner] through MesaGrouping: element index j along
 * axis `dim` belongs to group j / span (so span = shape[dim] / count). count = 1 with
 * dim = -1 is one group for the whole tensor (per-tensor).
 *
 * Codes (asymmetric affine, round-to-nearest-even or stochastic):
 *   levels = 2^bits - 1,  scale = range / levels,  code = clamp(round((x - offset) / scale), 0, levels)
 *   x^ = code * scale + offset.
 * Codes are stored in the logical row-major order of the tensor's shape; bits < 8 pack
 * 8/bits codes per byte, the first element in the least significant bits.
 *
 * In-place: not supported by any entry point here (overlapping inputs and outputs: x with
 * codes/params/stats, y with codes/params; the safe crate rejects them with
 * Error::Aliasing). The safe crate launches nothing for an empty tensor (numel 0).
 */
#ifndef MESA_QUANT_H
#define MESA_QUANT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t MesaRounding;
enum MesaRoundingCode {
  MESA_ROUND_NEAREST = 0,    /* round half to even */
  MESA_ROUND_STOCHASTIC = 1  /* (rint(t * 2^16) + u) >> 16, u: 16 bits of Philox4x32-7(seed, element index / 8) */
};

/* How codes map to values. IDENTITY: the codes are of x itself. SQRT (companded, for
 * non-negative x such as probabilities): the codes are of u = sqrt(x) (IEEE sqrtf),
 *   code = clamp(round((sqrt(x) - offset) / scale), 0, levels),
 * and decoding squares: q = fmaf(code, scale, offset), x^ = q * q (one IEEE multiply).
 * Uniform steps in sqrt(x) are steps of ~2 sqrt(x) scale in x: finer near 0. */
typedef int32_t MesaCodeMap;
enum MesaCodeMapCode {
  MESA_CODE_MAP_IDENTITY = 0,
  MESA_CODE_MAP_SQRT = 1
};

typedef struct MesaGrouping {
  int32_t dim;    /* axis of the group index, or -1 for a single group */
  int32_t _pad;
  int64_t span;   /* consecutive indices along `dim` sharing one group (>= 1) */
  int64_t count;  /* number of groups */
} MesaGrouping;

/* What decoding a group needs (saved with the codes). scale = NaN marks a group whose
 * input held a non-finite value: it decodes to NaN, never to a finite stand-in. */
typedef struct MesaGroupParams {
  float offset;
  float scale;
} MesaGroupParams;

/* Per-group reduction of one batch (scratch owned by the quantizer). min/max are stored
 * as order-preserving unsigned keys of the f32 value so that atomicMin/atomicMax apply;
 * only finite values enter them. The reset state is min_key = UINT32_MAX, max_key = 0,
 * nonfinite = 0. */
typedef struct MesaGroupStats {
  uint32_t min_key;
  uint32_t max_key;
  uint32_t nonfinite;
  uint32_t _pad;
} MesaGroupStats;

typedef int32_t MesaFinalizeMode;
enum MesaFinalizeModeCode {
  /* exact per-batch statistics: params <- stats; running <- stats (first batch) or EMA */
  MESA_FINALIZE_EXACT = 0,
  /* one pass: params <- running (what the quantize pass just used); running <- EMA(stats) */
  MESA_FINALIZE_RUNNING = 1
};

/* Per group g (one thread each):
 *   batch range r = max - min over the finite values of the batch (if any);
 *   EXACT:   params[g] = {min, r / levels};  running[g] = initialized ? EMA : {min, r / levels}
 *   RUNNING: params[g] = running[g] (before the update), unless the group escaped it:
 *            with {o, s} = running[g] and L = levels, evaluated in f64 from the f32 values,
 *              escaped = min < o - s  or  max > o + (L + 1) * s
 *            (an element more than one step outside [o, o + L s]); then
 *            params[g] = {min, r / levels} (the batch's exact range) and, if `widen` is not
 *            NULL, widen[g] = 1 (else 0) and widen[count] = number of escaped groups, so that
 *            the widening pass (MesaQuantizeArgs.widen) encodes those groups again.
 *            Groups with non-finite input never escape (their scale is NaN anyway).
 *            running[g] = EMA of the batch statistics (the widened params do not enter it)
 *   EMA:     running.offset = m * running.offset + (1 - m) * min
 *            running.scale  = m * running.scale  + (1 - m) * r / levels   (fmaf, f32)
 *   groups with no finite value keep their running estimate; groups with nonfinite > 0
 *   get params[g].scale = NaN. *nonfinite_total (if not NULL) = sum of nonfinite.
 *   stats[g] is reset afterwards. */
typedef struct MesaQuantFinalizeArgs {
  MesaGroupStats* stats;           /* [count], read then reset */
  MesaGroupParams* running;        /* [count], the running estimate (offset, scale) */
  MesaGroupParams* params;         /* [count], written: what decoding this batch needs */
  uint32_t* nonfinite_total;       /* one counter, written, or NULL */
  uint32_t* widen;                 /* [count + 1], written in RUNNING mode, or NULL */
  int64_t count;
  float momentum;                  /* m in [0, 1] */
  int32_t bits;
  MesaFinalizeMode mode;
  int32_t running_initialized;     /* 0 on the first batch of a quantizer */
} MesaQuantFinalizeArgs;

/* A statistics pass that finalizes the batch itself (instead of a separate quant_finalize
 * launch): each block, once its statistics are reduced into `args.stats`, counts itself in
 * `*arrivals`; the last block to arrive runs quant_finalize's work on `args` (after every
 * other block's statistics are visible) and leaves `*arrivals` at 0 again (one atomicInc
 * that wraps at the grid size). arrivals = NULL: no fused finalize (the caller launches
 * quant_finalize). Otherwise *arrivals must be 0 before the launch (a zeroed counter that
 * only these passes touch, one launch at a time), and args.stats must be the pass's stats.
 * Used by quant_stats (EXACT mode) and by quantize with stats (RUNNING mode). */
typedef struct MesaFusedFinalize {
  MesaQuantFinalizeArgs args;
  uint32_t* arrivals;              /* one counter, or NULL */
} MesaFusedFinalize;

/* Statistics pass: stats[g] <- reduce(stats[g], x in group g). */
typedef struct MesaQuantStatsArgs {
  const void* x;
  MesaTensorDesc x_desc;
  MesaGrouping grouping;
  MesaGroupStats* stats;   /* [grouping.count], reduced into (not reset; finalize resets it) */
  MesaFusedFinalize finalize;
} MesaQuantStatsArgs;

/* Quantize pass: codes <- Q(x; params). If `stats` is not NULL the same pass also reduces
 * this batch's statistics into it (one read of x for both).
 * Widening pass (`widen` not NULL, stats NULL): only the units of 8 logical elements that
 * hold an element of a widened group are encoded again (every element of such a unit with
 * its own group's params); the other codes are left as they are. Nothing is read or written
 * when widen[count] is 0. See MesaQuantFinalizeArgs for the widen array. */
typedef struct MesaQuantizeArgs {
  const void* x;
  MesaTensorDesc x_desc;
  MesaGrouping grouping;
  const MesaGroupParams* params;  /* [grouping.count] */
  uint8_t* codes;                 /* ceil(numel * bits / 8) bytes */
  MesaGroupStats* stats;          /* [grouping.count] or NULL */
  uint64_t seed;                  /* stochastic rounding: Philox4x32-7 key (the call's: seed + call * 0x9E3779B97F4A7C15) */
  int32_t bits;                   /* 8, 4 or 2 */
  MesaRounding rounding;
  MesaCodeMap map;                /* SQRT requires stats == NULL */
  int32_t _pad;
  const uint32_t* widen;          /* NULL, or [grouping.count + 1] from quant_finalize (requires stats == NULL) */
  MesaFusedFinalize finalize;     /* arrivals != NULL requires stats != NULL */
} MesaQuantizeArgs;

/* Dequantize: y <- codes * scale[g] + offset[g] (map SQRT: that value squared), converted
 * to y_desc.dtype, written through y_desc's strides (any layout; codes are in logical order). */
typedef struct MesaDequantizeArgs {
  const uint8_t* codes;
  const MesaGroupParams* params;
  MesaGrouping grouping;
  void* y;
  MesaTensorDesc y_desc;
  int32_t bits;
  MesaCodeMap map;
} MesaDequantizeArgs;

MESA_DECLARE_ENTRY(quant_stats, MesaQuantStatsArgs)
MESA_DECLARE_ENTRY(quantize, MesaQuantizeArgs)
MESA_DECLARE_ENTRY(quant_finalize, MesaQuantFinalizeArgs)
MESA_DECLARE_ENTRY(dequantize, MesaDequantizeArgs)

#ifdef __cplusplus
}
#endif

#endif /* MESA_QUANT_H */
