/* mesa_linear_attention.h — chunked linear attention (SLiM, Likhosherstov et al. 2020 §3;
 * Performer, Choromanski et al. 2020 §2-3) and its feature maps.
 * Kernels: kernels/linear_attention.cu, kernels/feature_maps.cu.
 *
 * Tensors are 4-d [B, H, L, F] views with arbitrary element strides (b, h, l, f), so that
 * q/k/v may be views of one packed [B, L, H, .] tensor. q, k: feature-mapped, F = M;
 * v, out: F = D. All of q, k, v, out, dout, dq, dk, dv share one dtype (f32, f16, bf16);
 * state, denominators and accumulation are f32.
 *
 *   causal:        out_t = sum_{s<=t} (q_t . k_s) v_s   [ / g(q_t . sum_{s<=t} k_s) ]
 *   bidirectional: out_t = sum_{s}    (q_t . k_s) v_s   [ / g(q_t . sum_{s} k_s) ]
 *   guard:         g(x) = x + eps   (x >= 0),   x - eps   (x < 0)
 *
 * State: S = sum_s k_s [v_s | 1]^T, f32, [B*H, M, W] with W = D + normalize (column D
 * holds the normaliser z = sum_s k_s). Chunked: inside a chunk of C rows a masked C x C
 * matmul, across chunks the prefix-sum state. With packed sequences (MesaLaPacking) every
 * "B*H" of a state below is N*H, and the boundary states are [nchunks, H, M, W].
 *
 * In-place: not supported by any entry point here (the kernels re-read inputs after writing
 * outputs; pointers are __restrict__): no output may overlap an input or another output of
 * the same call. Inputs may overlap each other. The safe crate rejects overlapping inputs
 * and outputs (Error::Aliasing).
 */
#ifndef MESA_LINEAR_ATTENTION_H
#define MESA_LINEAR_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Largest chunk the kernels tile (rows of one chunk live in shared memory). */
#define MESA_LA_MAX_CHUNK 64

typedef int32_t MesaLaMemory;
enum MesaLaMemoryCode {
  /* forward keeps the state entering every chunk: [B*H, ceil(L/C), M, W] f32 */
  MESA_LA_BOUNDARY_STATES = 0,
  /* forward keeps only the final state (and a copy of the initial one, if given); the
   * backward's dq walks the chunks forward again from the initial state */
  MESA_LA_SLIM = 1
};

typedef int32_t MesaLaSchedule;
enum MesaLaScheduleCode {
  /* causal MESA_LA_BOUNDARY_STATES: how the states entering every chunk are computed (the
   * forward's, and the per-chunk states of the backward's dk and dv, or none). The results are
   * bitwise the same; only the work's shape differs (docs/linear_attention.md, "Schedules"). */
  /* every chunk's sum B_c^T C_c in parallel, then a scan of them (the chunk decomposition) */
  MESA_LA_SCHEDULE_CHUNK_SUMS = 0,
  /* one sequential walk per (state, 32-column tile) writing the state entering each chunk */
  MESA_LA_SCHEDULE_STATE_WALK = 1,
  /* the forward's output walk (as MESA_LA_SLIM) writes them as it goes; dk and dv walk back
   * as in MESA_LA_SLIM; dq reads the states, parallel over chunks */
  MESA_LA_SCHEDULE_WALK = 2
};

/* A [B, H, L, F] view: element (b, h, l, f) at data + b*s[0] + h*s[1] + l*s[2] + f*s[3]. */
typedef struct MesaLaTensor {
  void* data;
  int64_t strides[4];
} MesaLaTensor;

/* Packed variable-length sequences (flash-linear-attention's cu_seqlens). seq_offsets NULL:
 * none. Otherwise B = 1, nseq = N, and two [N+1] int64 arrays in device memory, validated by
 * the caller: seq_offsets 0 = o_0 <= o_1 <= ... <= o_N = L (sequence n is rows o_n..o_{n+1}
 * of every head; no state crosses from one to the next), chunk_offsets c_n = sum_{m<n}
 * ceil((o_{m+1} - o_m) / C), nchunks = c_N. States are then per (sequence, head),
 * [N*H, M, W], and the boundary states [nchunks, H, M, W]. */
typedef struct MesaLaPacking {
  const int64_t* seq_offsets;
  const int64_t* chunk_offsets;
  int64_t nseq;
  int64_t nchunks;
} MesaLaPacking;

typedef struct MesaLaShape {
  int64_t batch;   /* B */
  int64_t heads;   /* H */
  int64_t len;     /* L */
  int64_t feat;    /* M: feature dim of q, k */
  int64_t dim;     /* D: dim of v, out */
  int32_t chunk;   /* C in [1, MESA_LA_MAX_CHUNK] */
  MesaDType dtype; /* of every tensor view */
  int32_t causal;  /* 1 causal, 0 bidirectional */
  int32_t normalize;
  float eps;       /* guard of the denominator (normalize) */
  MesaLaMemory memory;
  MesaLaSchedule schedule; /* ignored unless causal with MESA_LA_BOUNDARY_STATES */
  MesaLaPacking packing;
} MesaLaShape;

/* Forward. In-place: not supported (out, state, boundary, den, init_copy overlap none of
 * q, k, v, init_state, nor each other -> Error::Aliasing in the safe crate). Reads
 * init_state (causal only; NULL: 0): [B*H, M, W] f32, the state before row 0 (column D:
 * the normaliser's z). Writes out, state ([B*H, M, W] f32: the final state, init_state
 * included), boundary (causal and MESA_LA_BOUNDARY_STATES: [B*H, ceil(L/C), M, W], the
 * state entering each chunk; else unused, may be NULL), den (normalize: [B*H*L] f32, the
 * guarded denominators g(.); else may be NULL), init_copy (MESA_LA_SLIM with an
 * init_state: [B*H, M, W], a copy of it for the backward; else may be NULL). */
typedef struct MesaLaForwardArgs {
  MesaLaShape shape;
  MesaLaTensor q, k, v, out;
  float* state;
  float* boundary;
  float* den;
  const float* init_state;
  float* init_copy;
} MesaLaForwardArgs;

/* Backward. In-place: not supported (dq, dk, dv, d_init, work overlap no input nor each
 * other -> Error::Aliasing in the safe crate). Reads q, k, v, dout, out (normalize only),
 * what the forward saved (state, boundary, den, init_state = the forward's init_copy, NULL
 * when it had no initial state), d_final ([B*H, M, W] f32, the gradient of the final state;
 * NULL: 0; causal only); writes dq, dk, dv and d_init ([B*H, M, W] f32, the gradient of the
 * initial state; NULL: not wanted; causal only). work: f32 scratch of B*H*M*W elements
 * (independent of L), plus, causal with MESA_LA_BOUNDARY_STATES, as many as the boundary
 * states (dk, dv run as the chunk decomposition; not with MESA_LA_SCHEDULE_WALK); contents on
 * entry ignored. The saved
 * state is not modified. */
typedef struct MesaLaBackwardArgs {
  MesaLaShape shape;
  MesaLaTensor q, k, v, out, dout, dq, dk, dv;
  const float* state;
  const float* boundary;
  const float* den;
  const float* init_state;
  const float* d_final;
  float* d_init;
  float* work;
} MesaLaBackwardArgs;

/* ---- feature maps ------------------------------------------------------------------
 * x [B, H, L, d] -> phi [B, H, L, m] (any strides, x and phi of one dtype).
 *   RELU:    phi = max(x, 0)                       (m = d)
 *   ELU1:    phi = x + 1 (x > 0), exp(x) (x <= 0)  (m = d)
 *   FAVOR+:  x' = x d^(-1/4),  u_i = w_i . x' - |x'|^2 / 2,
 *            phi_i = exp(u_i - c) / sqrt(m)        (w: [m, d] f32, row-major)
 *            c per MesaFavorStabilizer.
 * In-place: not supported (phi must not overlap x -> Error::Aliasing in the safe crate). */
typedef int32_t MesaFeatureMap;
enum MesaFeatureMapCode {
  MESA_FEATURE_RELU = 0,
  MESA_FEATURE_ELU1 = 1,
  MESA_FEATURE_FAVOR = 2
};

typedef int32_t MesaFavorStabilizer;
enum MesaFavorStabilizerCode {
  /* c = 0 */
  MESA_FAVOR_NONE = 0,
  /* c = max_i u_i of the row (queries: cancels in the normalised output) */
  MESA_FAVOR_ROW_MAX = 1,
  /* c = max_i |w_i|^2 / 2, a constant that bounds every u_i (causal keys: phi <= 1/sqrt(m)) */
  MESA_FAVOR_BOUND = 2,
  /* c = max over the whole (b, h) sequence and features (bidirectional keys) */
  MESA_FAVOR_SEQUENCE_MAX = 3
};

typedef struct MesaFeatureArgs {
  MesaFeatureMap map;
  MesaFavorStabilizer stabilizer; /* FAVOR+ only */
  MesaDType dtype;
  int32_t _pad;
  int64_t batch, heads, len;
  int64_t in_dim;   /* d */
  int64_t out_dim;  /* m (= d for RELU, ELU1) */
  MesaLaTensor x;   /* [B, H, L, d] */
  MesaLaTensor phi; /* [B, H, L, m], written */
  const float* omega; /* FAVOR+: [m, d] f32 */
  float bound;        /* FAVOR+ BOUND: the constant c (max_i |w_i|^2 / 2, computed by the caller) */
  int32_t _pad2;
} MesaFeatureArgs;

/* Backward: dx from dphi. In-place: not supported (dx overlaps none of x, phi, dphi ->
 * Error::Aliasing in the safe crate). RELU, ELU1 read x; FAVOR+ reads x and phi (the forward output):
 *   dx' = sum_i g_i w_i - x' sum_i g_i,  g_i = dphi_i phi_i,  dx = d^(-1/4) dx'
 * (the stabiliser c is treated as a constant: the normalised attention output does not
 * depend on it). */
typedef struct MesaFeatureBackwardArgs {
  MesaFeatureMap map;
  MesaDType dtype;
  int64_t batch, heads, len;
  int64_t in_dim;
  int64_t out_dim;
  MesaLaTensor x;
  MesaLaTensor phi;   /* FAVOR+ only */
  MesaLaTensor dphi;
  MesaLaTensor dx;    /* written */
  const float* omega;
} MesaFeatureBackwardArgs;

MESA_DECLARE_ENTRY(linear_attention_forward, MesaLaForwardArgs)
MESA_DECLARE_ENTRY(linear_attention_backward, MesaLaBackwardArgs)
MESA_DECLARE_ENTRY(feature_map_forward, MesaFeatureArgs)
MESA_DECLARE_ENTRY(feature_map_backward, MesaFeatureBackwardArgs)

#ifdef __cplusplus
}
#endif

#endif /* MESA_LINEAR_ATTENTION_H */
