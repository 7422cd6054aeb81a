/* mesa_gated_linear_attention.h — gated (decayed) causal linear attention with grouped heads
 * (issue 41): RetNet / Lightning Attention (a fixed log-decay per head), Mamba-2's SSD and
 * gated linear attention with a scalar gate (a log-decay per step and head).
 * Kernels and math: kernels/linear_attention.cu ("Gated linear attention": the chunked products
 * with a decay).
 *
 *   S_t = exp(a_t) S_{t-1} + k_t [v_t | 1]^T,   o_t = q_t^T S_t [ / g(q_t^T z_t) ],   a_t <= 0
 *   g(x) = x + eps (x >= 0), x - eps (x < 0);  z_t the state's column D (normalize only)
 *
 * Query head h (of H) reads KV head h / (H / H_kv): its k, v, decay and state.
 * q, out, dout, dq: [B, H, L, M or D]; k, v, dk, dv: [B, H_kv, L, M or D] (MesaLaTensor
 * strided views, one dtype: f32, f16, bf16). decay: f32, contiguous, [B, H_kv, L] (PER_STEP)
 * or [H_kv] (PER_HEAD); -inf allowed (a reset: nothing crosses that step); values > 0 or
 * NaN are the caller's to exclude (they live on the device: not checked). States: f32,
 * contiguous [B, H_kv, M, W], W = D + normalize (column D holds z). Accumulation f32.
 *
 * Packed variable-length sequences (shape.packing, as MesaLaPacking: seq_offsets non-NULL):
 * B = 1, sequence n is rows o_n..o_{n+1} of every head, each walked by its own blocks from its
 * own initial state; no state crosses sequences. Every state (init, final, d_final, d_init)
 * is then [N, H_kv, M, W]; the row tensors, den and a per-step decay keep B = 1. Only
 * seq_offsets and nseq are read, and chunk_offsets and nchunks with boundary states.
 *
 * In-place: not supported (no output may overlap an input or another output; inputs may
 * overlap each other; the safe crate rejects overlap with Error::Aliasing).
 */
#ifndef MESA_GATED_LINEAR_ATTENTION_H
#define MESA_GATED_LINEAR_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Largest chunk (a chunk's C x C weights live in shared memory). */
#define MESA_GLA_MAX_CHUNK 64

typedef int32_t MesaGlaDecayKind;
enum MesaGlaDecayKindCode {
  /* [B, H_kv, L]: one log-decay per step and KV head */
  MESA_GLA_DECAY_PER_STEP = 0,
  /* [H_kv]: one log-decay per KV head, the same at every step */
  MESA_GLA_DECAY_PER_HEAD = 1
};

typedef struct MesaGlaShape {
  int64_t batch;    /* B */
  int64_t heads;    /* H: query heads */
  int64_t kv_heads; /* H_kv: divides H */
  int64_t len;      /* L */
  int64_t feat;     /* M: features of q, k */
  int64_t dim;      /* D: columns of v, out */
  int32_t chunk;    /* C in [1, MESA_GLA_MAX_CHUNK] */
  MesaDType dtype;  /* of every tensor view */
  int32_t normalize;
  float eps;        /* the guard (normalize): finite, > 0 */
  MesaGlaDecayKind decay_kind;
  /* How boundary states are computed (forward, and the backward's dk, dv), as the ungated
   * kernel's MesaLaSchedule: the same results bit for bit; ignored without boundary states. */
  MesaLaSchedule schedule;
  MesaLaPacking packing; /* seq_offsets NULL: not packed */
} MesaGlaShape;

/* Forward. Reads q, k, v, decay, init_state (NULL: 0). Writes out, final_state (the state
 * after row L-1, init_state included; L = 0: a copy of init_state or 0), den (normalize:
 * [B, H, L] f32, the guarded denominators; else may be NULL). work: f32 scratch of
 * MESA_GLA_FORWARD_WORK(NCH, H_kv) elements (the chunk sums' whole decays), NCH the boundary
 * states' chunks with MESA_LA_SCHEDULE_CHUNK_SUMS, else 0 (then work may be NULL). */
typedef struct MesaGlaForwardArgs {
  MesaGlaShape shape;
  MesaLaTensor q, k, v, out;
  const float* decay;
  const float* init_state;
  float* final_state;
  float* den;
  float* work;
  /* Boundary states (NULL: none, SLiM memory): the state entering every chunk (of the KV
   * head, init_state included), f32, [B*H_kv, ceil(L/C), M, W] (the ungated kernel's layout),
   * packed [nchunks, H_kv, M, W], chunk c of sequence n at chunk_offsets[n] + c
   * (chunk_offsets then required). */
  float* boundary;
} MesaGlaForwardArgs;

/* Backward. Reads q, k, v, decay, init_state (the forward's; NULL: 0), out (normalize only),
 * dout, final_state and den (what the forward wrote), d_final ([B, H_kv, M, W], the final
 * state's gradient; NULL: 0). Writes dq, dk, dv (dk, dv summed over each KV head's query
 * heads), d_decay (f32, the decay's shape: [B, H_kv, L] or [H_kv]), d_init ([B, H_kv, M, W];
 * NULL: not wanted). work: f32 scratch of MESA_GLA_BACKWARD_WORK elements, contents on entry
 * ignored. */
typedef struct MesaGlaBackwardArgs {
  MesaGlaShape shape;
  MesaLaTensor q, k, v, out, dout, dq, dk, dv;
  const float* decay;
  const float* init_state;
  const float* final_state;
  const float* den;
  const float* d_final;
  float* d_decay;
  float* d_init;
  float* work;
  /* The forward's boundary states (NULL: the dq walk recomputes them from init_state). Given,
   * dq runs parallel over chunks from them, and so do dk and dv (their own states from chunk
   * sums, unless the schedule is MESA_LA_SCHEDULE_WALK). */
  const float* boundary;
} MesaGlaBackwardArgs;

#define MESA_GLA_FORWARD_WORK(NCH, HKV) ((NCH) * (HKV))

/* Scratch of the backward, in f32 elements, for N units (B, or N packed sequences), G = H / H_kv,
 * T = ceil(M / 32), NCH the boundary states' chunks when dk and dv run as the chunk
 * decomposition (boundary states given, schedule not MESA_LA_SCHEDULE_WALK), else 0: two
 * working states per (unit, KV head), the decomposition's chunk states and whole decays, each
 * 32-column tile's part of q . dq and k . dk per row, the group's f32 dk and dv sums (G > 1),
 * dL/dLam' per row. */
#define MESA_GLA_BACKWARD_WORK(N, NCH, B, H, HKV, L, M, D, W)                                     \
  (2 * (N) * (HKV) * (M) * (W) + (NCH) * (HKV) * ((M) * (W) + 1) +                               \
   (((M) + 31) / 32) * (B) * ((H) + (HKV)) * (L) + ((H) > (HKV) ? (B) * (HKV) * (L) * ((M) + (D)) : 0) + \
   (B) * (HKV) * (L))

MESA_DECLARE_ENTRY(gated_linear_attention_forward, MesaGlaForwardArgs)
MESA_DECLARE_ENTRY(gated_linear_attention_backward, MesaGlaBackwardArgs)

#ifdef __cplusplus
}
#endif

#endif /* MESA_GATED_LINEAR_ATTENTION_H */
