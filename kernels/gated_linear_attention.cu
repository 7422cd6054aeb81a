// gated_linear_attention.cu — gated (decayed) causal linear attention with grouped heads
// (issue 41): f32 state and arithmetic, one thread block per head walking the chunks in order.
// f32 inputs run on CUDA-core FMAs (gla_forward_kernel, gla_dq_kernel, gla_dkdv_kernel); f16
// and bf16 inputs run every chunk product on tensor cores as split bf16 pairs (the *_tc_kernel
// instances, "Tensor cores" below; kTensorCores<T> picks per dtype, as linear_attention.cu).
// Packed variable-length sequences (shape.packing): one block per (sequence, head) instead of
// per (b, head), its rows o_n..o_{n+1} (gla_span), its state n; the recurrence below applies to
// each sequence alone (rows, chunks and Lam' counted from its first row). Boundary states
// (args.boundary non-NULL): the forward also writes the state entering each chunk, and dq runs
// one block per (chunk, h) from them (gla_dq_kernel<T, true>), bit for bit the walk's dq. No
// LASP yet (docs/linear_attention.md, "Gated linear attention").
//
// Math (reference: crates/mesa-kernels/src/reference/gated_linear_attention.rs). For one query
// head h reading KV head kh = h / (H / H_kv), with v'_s = [v_s | 1] (the 1 only when normalised)
// and the log-decay a_t <= 0 of kh (per step, or one value per head):
//   S_t = exp(a_t) S_{t-1} + k_t v'_t^T,   o_t = q_t^T S_t  [ / g(q_t^T z_t) ]
//   o_t = sum_{s<=t} w_ts (q_t . k_s) v'_s + w_{t,-1} q_t^T S_{-1},  w_ts = exp(sum_{r=s+1..t} a_r)
//   g(x) = x + eps·sign(x) (sign(0) = +1), z the state's column D.
//
// Chunk recurrence (chunk c = rows t0..t0+n-1, S the state entering it). Within the chunk,
// Lam_t = sum_{r=t0..t} a_r, restarted at a reset (a_r = -inf: Lam_r = 0, seg_t = the last
// reset row <= t, or none). Weights are differences only, never exp of a positive number
// (Lam is non-increasing within a segment, also in f32: adding a value <= 0 never rounds up):
//   intra  w_ts = exp(Lam_t - Lam_s)   (s <= t, s >= seg_t; else exactly 0)
//   inter  e_t  = exp(Lam_t)           (no reset in t0..t; else exactly 0)
//   O_c    = diag(e) Q_c S + mask(W ∘ Q_c K_c^T) V'_c
//   S     <- e_end S + sum_s w_{end,s} k_s v'_s^T
// so a reset lets nothing cross it and produces no NaN (no -inf - -inf).
//
// Backward (dv'_t = [dout_t / g_t | -(dout_t . out_t) / g_t], the second part when normalised):
//   dq_t = e_t S dv'_t + sum_{s<=t} w_ts (v'_s . dv'_t) k_s          (forward walk, per query head)
//   dk_s = sum_{t>=s} w_ts (v'_s . dv'_t) q_t + w_{end,s} dS v'_s     (reverse walk, per KV head,
//   dv_s = sum_{t>=s} w_ts (q_t . k_s) dv_t + w_{end,s} dS^T k_s        over its query heads)
//   dS   <- e_end dS + sum_t e_t q_t dv'_t^T   (dS: the gradient of the state leaving the chunk)
// from dS = d_final at the end; d_init is dS after chunk 0.
// da: with Lam'_t = sum_{r<=t} a_r over the whole sequence, q~_t = exp(Lam'_t) q_t and
// k~_s = exp(-Lam'_s) k_s, every weighted product is q~_t . k~_s (and the initial state's term
// exp(Lam'_t) q_t^T S_{-1}), while S_final = exp(Lam'_{L-1}) (S_{-1} + sum_s k~_s v'_s^T). So
//   dL/dLam'_t = q_t . dq_t - k_t . dk_t  (+ <dS_final, S_final> at t = L-1),
//   da_r = sum_{t>=r} dL/dLam'_t,
// summed over the group (q . dq per query head, k . dk once with dk the group's sum). A reset
// splits the sequence into independent pieces: the suffix sum restarts there, and da = 0 at
// the reset row (every weight that spans it is exactly 0). Per-head decay: da summed over B, L.
//
// Accuracy of the log-space differences: Lam_t is a prefix sum of at most C values, so in f32
// it is off by at most C·u·sum_{r=t0..t} |a_r| (u = 2^-24), and the exponent Lam_t - Lam_s of a
// weight by up to 2·C·u·(|sum_{r=s+1..t} a_r| + C·alpha) for |a_r| <= alpha: both prefix sums'
// errors, each carrying up to C steps before s that the weight does not span. That is the
// weight's relative error, where the direct sum over r = s+1..t would be off by
// (t - s)·u·|sum_{r=s+1..t} a_r| only. Worst case for a chunk of strongly decaying steps,
// C = 64 and alpha = 8 (exp(-8) per step: the state forgets within a few steps), at the end of
// the chunk, for the weights that matter (t - s small): 2·64·64·8·2^-24 = 3.9e-3 relative
// (alpha = 1: 4.9e-4). It shrinks as C^2: a caller with such decays can pick a smaller chunk.
// (tests/gated_linear_attention.rs adds exactly this term to its bounds.)
//
// Work per (b, h) and chunk (FLOPs, FMA = 2): scores C^2 M, outputs 2 C M W + C^2 W, state
// 2 C M W. Bytes per (b, h): read (2M + D) L sizeof(T) + 4L (decay), write D L sizeof(T) (+4L
// den); the working state M W 4 bytes is read and written once per chunk (L1/L2: it is the
// block's own). With groups, each query head's block re-reads its KV head's k, v (G times, from
// L2). Backward: dq walk reads q, k, v, dout (+ out) and writes dq; the dk/dv walk reads k, v
// once and q, dout (+ out) per group head, writes dk, dv, da.
#include "quant_common.cuh"  // dispatch_dtype
#include "split_mma.cuh"

namespace MESA_NS {

constexpr int kGlaThreads = 128;
constexpr int kGlaChunk = MESA_GLA_MAX_CHUNK;
// The dk/dv walk asks for at least 4 blocks of 128 threads per SM: that caps its registers at
// 128 per thread (uncapped it takes 164 on sm_80 for 16-bit inputs); its inner loops over the
// chunk's rows are not unrolled, so that the cap causes no spills.
constexpr int kGlaMinBlocks = 4;
// The f32 forward asks for 6 blocks per SM (at most 80 registers): left to itself, ptxas holds
// it to 64 registers and spills since the packed row range (a per-block end row) became live.
constexpr int kGlaForwardMinBlocks = 6;

// ---------------------------------------------------------------------------------------
// Device helpers.

// Element (b, h, l, f) of a strided view, as f32.
template <typename T>
__device__ __forceinline__ float gla_load(const MesaLaTensor& x, int64_t b, int64_t h, int64_t l, int64_t f) {
  const T* p = static_cast<const T*>(x.data);
  return to_float(p[b * x.strides[0] + h * x.strides[1] + l * x.strides[2] + f * x.strides[3]]);
}
template <typename T>
__device__ __forceinline__ void gla_store(const MesaLaTensor& x, int64_t b, int64_t h, int64_t l, int64_t f,
                                          float v) {
  T* p = static_cast<T*>(x.data);
  p[b * x.strides[0] + h * x.strides[1] + l * x.strides[2] + f * x.strides[3]] = from_float<T>(v);
}

__device__ __forceinline__ float gla_guard(float x, float eps) { return x >= 0.0f ? x + eps : x - eps; }

__device__ __forceinline__ bool is_reset(float a) { return a == -INFINITY; }

// a_t of KV head kh of batch b.
__device__ __forceinline__ float gla_decay(const float* decay, const MesaGlaShape& s, int64_t b, int64_t kh,
                                           int64_t t) {
  return s.decay_kind == MESA_GLA_DECAY_PER_HEAD ? decay[kh] : decay[(b * s.kv_heads + kh) * s.len + t];
}

// The rows one block walks: batch b of the row tensors (q, k, v, ..., den, a per-step decay),
// unit u of the states (state u * H_kv + kh), rows begin..end. Unpacked: u = b = the block's
// batch, rows 0..L; packed: b = 0, u = the sequence n, rows o_n..o_{n+1}.
struct GlaSpan {
  int64_t b, u, begin, end;
};
__device__ __forceinline__ GlaSpan gla_span(const MesaGlaShape& s, int64_t u) {
  const int64_t* o = s.packing.seq_offsets;
  GlaSpan r;
  r.b = o != nullptr ? 0 : u;
  r.u = u;
  r.begin = o != nullptr ? o[u] : 0;
  r.end = o != nullptr ? o[u + 1] : s.len;
  return r;
}

// Boundary states: the first global chunk of unit u, and the unit of global chunk g (packed:
// the last sequence n with chunk_offsets[n] <= g, by bisection; empty sequences own no chunk).
__device__ __forceinline__ int64_t gla_first_chunk(const MesaGlaShape& s, int64_t u) {
  return s.packing.seq_offsets != nullptr ? s.packing.chunk_offsets[u] : u * ((s.len + s.chunk - 1) / s.chunk);
}
__device__ __forceinline__ int64_t gla_chunk_unit(const MesaGlaShape& s, int64_t g) {
  if (s.packing.seq_offsets == nullptr) return g / ((s.len + s.chunk - 1) / s.chunk);
  int64_t lo = 0, hi = s.packing.nseq - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (s.packing.chunk_offsets[mid] <= g)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Blocks per head: B, or N packed sequences.
inline int64_t gla_units(const MesaGlaShape& s) {
  return s.packing.seq_offsets != nullptr ? s.packing.nseq : s.batch;
}
// Chunks of all units (the boundary states' count per KV head).
inline int64_t gla_chunks(const MesaGlaShape& s) {
  return s.packing.seq_offsets != nullptr ? s.packing.nchunks : s.batch * ((s.len + s.chunk - 1) / s.chunk);
}

// The chunk's log-decays (shared): lam[t] = Lam_t, seg[t] = the last reset row <= t (-1: none).
struct ChunkDecay {
  float lam[kGlaChunk];
  int seg[kGlaChunk];
};

// One thread walks the chunk's n steps (C <= 64 additions).
__device__ __forceinline__ void chunk_decay(ChunkDecay& cd, const float* decay, const MesaGlaShape& s, int64_t b,
                                            int64_t kh, int64_t t0, int n) {
  float lam = 0.0f;
  int seg = -1;
  for (int t = 0; t < n; ++t) {
    const float a = gla_decay(decay, s, b, kh, t0 + t);
    if (is_reset(a)) {
      lam = 0.0f;
      seg = t;
    } else {
      lam += a;
    }
    cd.lam[t] = lam;
    cd.seg[t] = seg;
  }
}

// w_ts within the chunk (s <= t).
__device__ __forceinline__ float intra_weight(const ChunkDecay& cd, int t, int s) {
  return cd.seg[t] > s ? 0.0f : expf(cd.lam[t] - cd.lam[s]);
}
// e_t: the weight of the state entering the chunk at row t.
__device__ __forceinline__ float inter_weight(const ChunkDecay& cd, int t) {
  return cd.seg[t] >= 0 ? 0.0f : expf(cd.lam[t]);
}

// S <- e_end S + sum_s w_{end,s} k_s v'_s^T, thread-strided over the M x W elements.
template <typename T>
__device__ void update_state(float* S, const ChunkDecay& cd, const MesaLaTensor& k, const MesaLaTensor& v,
                             int64_t b, int64_t kh, int64_t t0, int n, int64_t M, int64_t D, int64_t W) {
  const float e_end = inter_weight(cd, n - 1);
  for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) {
    const int64_t i = e / W, j = e % W;
    float x = e_end * S[e];
    for (int s = 0; s < n; ++s) {
      const float w = intra_weight(cd, n - 1, s);
      if (w == 0.0f) continue;
      const float vs = j < D ? gla_load<T>(v, b, kh, t0 + s, j) : 1.0f;
      x = fmaf(w * gla_load<T>(k, b, kh, t0 + s, i), vs, x);
    }
    S[e] = x;
  }
}

// ---------------------------------------------------------------------------------------
// Forward: one block per (b, h), walking the chunks in order with its own working state.
template <typename T>
__global__ void __launch_bounds__(kGlaThreads, kGlaForwardMinBlocks) gla_forward_kernel(const MesaGlaForwardArgs a) {
  __shared__ ChunkDecay cd;
  __shared__ float P[kGlaChunk][kGlaChunk];  // w_ts (q_t . k_s), s <= t
  __shared__ float den[kGlaChunk];
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0);
  const int64_t bh = blockIdx.x, h = bh % H;
  const GlaSpan span = gla_span(sh, bh / H);
  const int64_t b = span.b, kh = h / (H / sh.kv_heads), bk = span.u * sh.kv_heads + kh;
  float* S = a.work + bh * M * W;
  float* den_h = a.den + (b * H + h) * L;  // this head's denominators (normalize)
  for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) S[e] = a.init_state ? a.init_state[bk * M * W + e] : 0.0f;
  // boundary states: the group's first query head writes the state entering each chunk
  float* bnd = a.boundary != nullptr && h % (H / sh.kv_heads) == 0
                   ? a.boundary + (gla_first_chunk(sh, span.u) * sh.kv_heads + kh) * M * W
                   : nullptr;
  __syncthreads();
  for (int64_t t0 = span.begin; t0 < span.end; t0 += sh.chunk) {
    const int n = int(span.end - t0 < sh.chunk ? span.end - t0 : sh.chunk);
    if (bnd != nullptr) {
      for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) bnd[e] = S[e];
      bnd += sh.kv_heads * M * W;
    }
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    __syncthreads();
    for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
      const int t = e / n, s = e % n;
      const float w = s <= t ? intra_weight(cd, t, s) : 0.0f;
      float dot = 0.0f;
      if (w != 0.0f)
        for (int64_t i = 0; i < M; ++i)
          dot = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), gla_load<T>(a.k, b, kh, t0 + s, i), dot);
      P[t][s] = w * dot;
    }
    __syncthreads();
    if (sh.normalize) {
      for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const float e_t = inter_weight(cd, t);
        float x = 0.0f;
        if (e_t != 0.0f)
          for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), S[i * W + D], x);
        x *= e_t;
        for (int s = 0; s <= t; ++s) x += P[t][s];
        den[t] = gla_guard(x, sh.eps);
        den_h[t0 + t] = den[t];
      }
      __syncthreads();
    }
    for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x) {
      const int t = int(e / D);
      const int64_t j = e % D;
      const float e_t = inter_weight(cd, t);
      float x = 0.0f;
      if (e_t != 0.0f)
        for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), S[i * W + j], x);
      x *= e_t;
      for (int s = 0; s <= t; ++s) x = fmaf(P[t][s], gla_load<T>(a.v, b, kh, t0 + s, j), x);
      if (sh.normalize) x /= den[t];
      gla_store<T>(a.out, b, h, t0 + t, j, x);
    }
    __syncthreads();
    update_state<T>(S, cd, a.k, a.v, b, kh, t0, n, M, D, W);
    __syncthreads();
  }
  // the KV head's final state, from the first query head of its group (all compute the same)
  if (h % (H / sh.kv_heads) == 0)
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) a.final_state[bk * M * W + e] = S[e];
}

// ---------------------------------------------------------------------------------------
// Backward.

// Per row t of a chunk: g_t and dden_t = -(dout_t . out_t) / g_t (normalised), else 1 and 0.
template <typename T>
__device__ void row_grads(const MesaGlaBackwardArgs& a, int64_t b, int64_t h, int64_t t0, int n, float* g,
                          float* dden) {
  const MesaGlaShape& sh = a.shape;
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    if (!sh.normalize) {
      g[t] = 1.0f;
      dden[t] = 0.0f;
      continue;
    }
    const float gt = a.den[(b * sh.heads + h) * sh.len + t0 + t];
    float x = 0.0f;
    for (int64_t j = 0; j < sh.dim; ++j)
      x = fmaf(gla_load<T>(a.dout, b, h, t0 + t, j), gla_load<T>(a.out, b, h, t0 + t, j), x);
    g[t] = gt;
    dden[t] = -x / gt;
  }
}

// E[t][s] = w_ts (v'_s . dv'_t) for s <= t (and, when A is given, A[t][s] = w_ts (q_t . k_s)).
template <typename T>
__device__ void chunk_scores(const MesaGlaBackwardArgs& a, const ChunkDecay& cd, int64_t b, int64_t h, int64_t kh,
                             int64_t t0, int n, const float* g, const float* dden, float (*E)[kGlaChunk],
                             float (*A)[kGlaChunk]) {
  const MesaGlaShape& sh = a.shape;
  for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
    const int t = e / n, s = e % n;
    const float w = s <= t ? intra_weight(cd, t, s) : 0.0f;
    float vd = 0.0f, qk = 0.0f;
    if (w != 0.0f) {
      for (int64_t j = 0; j < sh.dim; ++j)
        vd = fmaf(gla_load<T>(a.v, b, kh, t0 + s, j), gla_load<T>(a.dout, b, h, t0 + t, j), vd);
      vd = vd / g[t] + dden[t];
      if (A != nullptr)
        for (int64_t i = 0; i < sh.feat; ++i)
          qk = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), gla_load<T>(a.k, b, kh, t0 + s, i), qk);
    }
    E[t][s] = w * vd;
    if (A != nullptr) A[t][s] = w * qk;
  }
}

// dq: one block per (b, h), walking forward again from the initial state (as the forward);
// kBoundary: one block per (chunk, h), reading the state entering its chunk from the forward's
// boundary states (the same values the walk recomputes: the same dq, bit for bit).
// Writes dq and, per row, q_t . dq_t (f32) to qdq [B*H*L] for da.
template <typename T, bool kBoundary>
__global__ void __launch_bounds__(kGlaThreads) gla_dq_kernel(const MesaGlaBackwardArgs a, float* work_states,
                                                             float* work_dq, float* qdq) {
  __shared__ ChunkDecay cd;
  __shared__ float E[kGlaChunk][kGlaChunk];
  __shared__ float g[kGlaChunk];
  __shared__ float dden[kGlaChunk];
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0), C = sh.chunk;
  const int64_t bh = blockIdx.x, h = bh % H;
  const int64_t kh = h / (H / sh.kv_heads);
  GlaSpan span;
  float* S;
  if constexpr (kBoundary) {  // block (g, h): chunk g alone, from its boundary state (read only)
    const int64_t g = bh / H;
    span = gla_span(sh, gla_chunk_unit(sh, g));
    span.begin += (g - gla_first_chunk(sh, span.u)) * C;
    span.end = span.end - span.begin < C ? span.end : span.begin + C;
    S = const_cast<float*>(a.boundary) + (g * sh.kv_heads + kh) * M * W;
  } else {  // block (u, h): every chunk of unit u, walking the state
    span = gla_span(sh, bh / H);
    S = work_states + bh * M * W;
    const int64_t bk = span.u * sh.kv_heads + kh;
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) S[e] = a.init_state ? a.init_state[bk * M * W + e] : 0.0f;
  }
  const int64_t b = span.b;
  float* tile = work_dq + bh * C * M;  // the chunk's dq in f32
  __syncthreads();
  for (int64_t t0 = span.begin; t0 < span.end; t0 += C) {
    const int n = int(span.end - t0 < C ? span.end - t0 : C);
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    row_grads<T>(a, b, h, t0, n, g, dden);
    __syncthreads();
    chunk_scores<T>(a, cd, b, h, kh, t0, n, g, dden, E, nullptr);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < n * M; e += blockDim.x) {
      const int t = int(e / M);
      const int64_t i = e % M;
      const float e_t = inter_weight(cd, t);
      float x = 0.0f;
      if (e_t != 0.0f) {
        for (int64_t j = 0; j < D; ++j) x = fmaf(S[i * W + j], gla_load<T>(a.dout, b, h, t0 + t, j), x);
        x /= g[t];
        if (sh.normalize) x = fmaf(S[i * W + D], dden[t], x);
        x *= e_t;
      }
      for (int s = 0; s <= t; ++s) x = fmaf(E[t][s], gla_load<T>(a.k, b, kh, t0 + s, i), x);
      tile[e] = x;
      gla_store<T>(a.dq, b, h, t0 + t, i, x);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
      float x = 0.0f;
      for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), tile[t * M + i], x);
      qdq[(b * H + h) * L + t0 + t] = x;
    }
    if constexpr (!kBoundary) update_state<T>(S, cd, a.k, a.v, b, kh, t0, n, M, D, W);
    __syncthreads();
  }
}

// dk, dv, dS, da: one block per (b, kh), walking the chunks in reverse and, in each chunk,
// over the group's query heads in order (deterministic sums, no atomics). Per-step decay: da
// into d_decay; per-head: into da_rows [B*H_kv*L] for gla_da_reduce_kernel.
// The end of a dk/dv walk's chunk (both walks; after a barrier): dk and dv of its rows stored,
// k . dk per row (kdk, shared), then thread 0 adds each row's dL/dLam'_t = sum_h q . dq - k . dk
// to the suffix sum acc and writes da_t (0 on a reset row, where the sum restarts).
template <typename T>
__device__ __forceinline__ void gla_dkdv_chunk_end(const MesaGlaBackwardArgs& a, int64_t b, int64_t kh, int64_t t0,
                                                   int n, const float* dk_acc, const float* dv_acc,
                                                   const float* qdq, float* kdk, float* da_kh, float& acc) {
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, G = H / sh.kv_heads;
  for (int64_t e = threadIdx.x; e < n * M; e += blockDim.x)
    gla_store<T>(a.dk, b, kh, t0 + e / M, e % M, dk_acc[e]);
  for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x)
    gla_store<T>(a.dv, b, kh, t0 + e / D, e % D, dv_acc[e]);
  for (int s = threadIdx.x; s < n; s += blockDim.x) {
    float x = 0.0f;
    for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.k, b, kh, t0 + s, i), dk_acc[s * M + i], x);
    kdk[s] = x;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int t = n - 1; t >= 0; --t) {
      float x = -kdk[t];
      for (int64_t hq = kh * G; hq < (kh + 1) * G; ++hq) x += qdq[(b * H + hq) * L + t0 + t];
      acc += x;
      const bool reset = is_reset(gla_decay(a.decay, sh, b, kh, t0 + t));
      da_kh[t0 + t] = reset ? 0.0f : acc;
      if (reset) acc = 0.0f;  // the rows before it form an independent sequence
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kGlaThreads, kGlaMinBlocks)
    gla_dkdv_kernel(const MesaGlaBackwardArgs a, float* work_ds, float* work_dkdv, const float* qdq, float* da_rows) {
  __shared__ ChunkDecay cd;
  __shared__ float E[kGlaChunk][kGlaChunk];  // w_ts (v'_s . dv'_t)
  __shared__ float A[kGlaChunk][kGlaChunk];  // w_ts (q_t . k_s)
  __shared__ float g[kGlaChunk];
  __shared__ float dden[kGlaChunk];
  __shared__ float kdk[kGlaChunk];
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0), C = sh.chunk;
  const int64_t G = H / sh.kv_heads;
  const int64_t bk = blockIdx.x, kh = bk % sh.kv_heads;
  const GlaSpan span = gla_span(sh, bk / sh.kv_heads);
  const int64_t b = span.b;
  float* dS = work_ds + bk * 2 * M * W;  // the gradient of the state leaving the chunk
  float* dS_next = dS + M * W;           // ... and of the one entering it
  float* dk_acc = work_dkdv + bk * C * (M + W);
  float* dv_acc = dk_acc + C * M;
  float* da_kh = (sh.decay_kind == MESA_GLA_DECAY_PER_STEP ? a.d_decay : da_rows) + (b * sh.kv_heads + kh) * L;
  for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) dS[e] = a.d_final ? a.d_final[bk * M * W + e] : 0.0f;
  float acc = 0.0f;  // thread 0: the suffix sum of dL/dLam'
  if (threadIdx.x == 0 && a.d_final != nullptr)
    for (int64_t e = 0; e < M * W; ++e) acc = fmaf(a.d_final[bk * M * W + e], a.final_state[bk * M * W + e], acc);
  __syncthreads();
  const int64_t nchunks = (span.end - span.begin + C - 1) / C;
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t t0 = span.begin + c * C;
    const int n = int(span.end - t0 < C ? span.end - t0 : C);
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    __syncthreads();
    const float e_end = inter_weight(cd, n - 1);
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) dS_next[e] = e_end * dS[e];
    // the final-state terms through dS
    for (int64_t e = threadIdx.x; e < n * M; e += blockDim.x) {
      const int s = int(e / M);
      const int64_t i = e % M;
      const float w = intra_weight(cd, n - 1, s);
      float x = 0.0f;
      if (w != 0.0f) {
        for (int64_t j = 0; j < D; ++j) x = fmaf(dS[i * W + j], gla_load<T>(a.v, b, kh, t0 + s, j), x);
        if (sh.normalize) x += dS[i * W + D];
      }
      dk_acc[e] = w * x;
    }
    for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x) {
      const int s = int(e / D);
      const int64_t j = e % D;
      const float w = intra_weight(cd, n - 1, s);
      float x = 0.0f;
      if (w != 0.0f)
        for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.k, b, kh, t0 + s, i), dS[i * W + j], x);
      dv_acc[e] = w * x;
    }
    for (int64_t hq = kh * G; hq < (kh + 1) * G; ++hq) {
      __syncthreads();  // the previous head's scores have been used
      row_grads<T>(a, b, hq, t0, n, g, dden);
      __syncthreads();
      chunk_scores<T>(a, cd, b, hq, kh, t0, n, g, dden, E, A);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < n * M; e += blockDim.x) {
        const int s = int(e / M);
        const int64_t i = e % M;
        float x = dk_acc[e];
        _Pragma("unroll 1") for (int t = s; t < n; ++t) x = fmaf(E[t][s], gla_load<T>(a.q, b, hq, t0 + t, i), x);
        dk_acc[e] = x;
      }
      for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x) {
        const int s = int(e / D);
        const int64_t j = e % D;
        float x = dv_acc[e];
        _Pragma("unroll 1") for (int t = s; t < n; ++t)
            x = fmaf(A[t][s], gla_load<T>(a.dout, b, hq, t0 + t, j) / g[t], x);
        dv_acc[e] = x;
      }
      for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) {
        const int64_t i = e / W, j = e % W;
        float x = dS_next[e];
        _Pragma("unroll 1") for (int t = 0; t < n; ++t) {
          const float e_t = inter_weight(cd, t);
          if (e_t == 0.0f) continue;
          const float dvt = j < D ? gla_load<T>(a.dout, b, hq, t0 + t, j) / g[t] : dden[t];
          x = fmaf(e_t * gla_load<T>(a.q, b, hq, t0 + t, i), dvt, x);
        }
        dS_next[e] = x;
      }
    }
    __syncthreads();
    gla_dkdv_chunk_end<T>(a, b, kh, t0, n, dk_acc, dv_acc, qdq, kdk, da_kh, acc);
    float* tmp = dS;
    dS = dS_next;
    dS_next = tmp;
    __syncthreads();
  }
  if (a.d_init != nullptr)
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) a.d_init[bk * M * W + e] = dS[e];
}

// Per-head decay: d_decay[kh] = sum over b and t of da_rows, one block per KV head, in a fixed
// order (thread-strided partial sums, then a tree).
__global__ void __launch_bounds__(kGlaThreads) gla_da_reduce_kernel(const float* da_rows, float* d_decay,
                                                                    int64_t B, int64_t Hkv, int64_t L) {
  __shared__ float part[kGlaThreads];
  const int64_t kh = blockIdx.x;
  float x = 0.0f;
  for (int64_t e = threadIdx.x; e < B * L; e += blockDim.x) x += da_rows[((e / L) * Hkv + kh) * L + e % L];
  part[threadIdx.x] = x;
  __syncthreads();
  for (int w = kGlaThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) d_decay[kh] = part[0];
}

// ---------------------------------------------------------------------------------------
// Tensor cores (f16, bf16: kTensorCores<T>): the forward and the backward's two walks, with the
// same chunk recurrence, scratch and scalar parts as the CUDA-core kernels above, their chunk
// products as 16x16x16 bf16 MMAs with f32 accumulators over split pairs (split_mma.cuh): a
// 16-bit input is exact in hi (+ lo for f16), an f32 value (the weighted scores, the state and
// its gradient, rows scaled by a weight or divided by g) within 2^-18 relative, so each term of
// a product is off by at most 3·2^-18 of its magnitude and a term that passes two products (P
// then P V', the state's update then Q~ S) by 6·2^-18. The chunk is padded to 64 rows with
// zeros (any C <= 64; only the 16-row blocks holding rows are computed):
//   forward  P   = Q_c K_c^T                MMA; then W ∘ P (and the mask) in f32, split
//            O   = Q~_c S + (W ∘ P) V'_c     Q~_t = e_t q_t (f32); S the f32 state
//   dq       E   = dout_c V_c^T             MMA; then E_ts = w_ts (E_ts / g_t + dden_t), split
//            dq  = Y~_c S^T + E K_c          Y~_t = e_t dv'_t (f32)
//   both     S  <- e_end S + K~_c^T V'_c      K~_s = w_{end,s} k_s (f32); e_end S in f32
//   dk/dv    dk  = V~'_c dS^T + sum_h E_h^T Q_h,c        V~'_s = w_{end,s} v'_s (f32)
//            dv  = K~_c dS[:, :D] + sum_h A_h^T (dout_h,c / g)   A = W ∘ (Q K^T)
//            dS <- e_end dS + sum_h Q~_h,c^T dv'_h,c
// The denominators, g, dden, q_t . dq_t, k_s . dk_s and da stay scalar f32, as above.
// Per block (4 warps): warp w owns row block w of the scores (column blocks 0..w; the blocks
// above the diagonal are never computed) and of the outputs (64 x 32 per tile of 32 columns:
// two 16 x 16 blocks); U = X_c^T Y_c (32 x 32 per pair of column tiles: the state update, dS)
// is 2 x 2 blocks, one per warp. Operand tiles are [row][column] bf16 pairs in shared memory
// (38 912 B, reused by the phases of a chunk), a transposed operand read column-major; each is
// loaded element by element with its strides (no 16-byte path yet). FLOPs as the CUDA-core
// kernels' (x3 MMAs per f32 pair, x1-3 per 16-bit one); global reads per chunk of the forward:
// q once for P and once per value tile (Q~), k once for P and once per value tile of W (K~),
// v twice; the backward's likewise per product.
// A non-finite input value in a masked product (P C_c, P^T C_c) is kept out of the rows the
// mask hides from it by summing its diagonal 16 x 16 block with scalar FMAs (gla_tc_rows).
constexpr int kGlaTile = 32;             // features (of M) and value columns (of D, W) per tile
constexpr int kGlaLdR = kGlaTile + 8;    // row tiles [64][32] (bf16 pairs)
constexpr int kGlaLdS = kGlaTile + 8;    // the state tile [32][32] (bf16 pair)
constexpr int kGlaLdP = kGlaChunk + 8;   // the weighted scores [64][64] (bf16 pair)
constexpr int kGlaLdPf = kGlaChunk + 4;  // the scores as accumulated [64][64] (f32)
constexpr int kGlaLdO = kGlaTile + 4;    // outputs [64][32] and U [32][32] staged (f32)
constexpr int kGlaWarps = kGlaThreads / kWarpSize;
static_assert(kGlaWarps * 16 == kGlaChunk, "one 16-row block of the chunk per warp");

// 38 912 bytes; each union's members are used in phases separated by block barriers (vo.o
// beside vo.v: the diagonal blocks' scalar sums read C while O is staged).
struct GlaTcTiles {
  union alignas(32) {
    struct {
      SplitTile<kGlaChunk, kGlaLdR> a, b;
    } ab;  // the two operands of the scores; K~, V' of the state update
    struct {
      SplitTile<kGlaChunk, kGlaLdR> a;
      SplitTile<kGlaTile, kGlaLdS> s;
    } as;                             // Q~ (Y~) and a state tile
    float pf[kGlaChunk * kGlaLdPf];  // the scores as accumulated
    struct {
      SplitTile<kGlaChunk, kGlaLdR> v;  // the right operand of the weighted scores
      float o[kGlaChunk * kGlaLdO];     // outputs before their global write (v still read)
    } vo;
  } x;
  union alignas(32) {
    SplitTile<kGlaChunk, kGlaLdP> p;  // the weighted scores
    float u[kGlaTile * kGlaLdO];      // U before the state's update
  } y;
};

// dst[r][c] = value(r, c) split, for the 64 (or 32) rows and 32 columns of a tile; value gives
// 0 past the chunk's rows and the operand's width. Two columns per thread and step.
template <int kRows, int kLd, typename F>
__device__ __forceinline__ void gla_tile(SplitTile<kRows, kLd>& dst, F value) {
  for (int e = fresh_tid(); e < kRows * kGlaTile / 2; e += blockDim.x) {
    const int r = e / (kGlaTile / 2), c = (e % (kGlaTile / 2)) * 2;
    put_split(dst.hi, dst.lo, r * kLd + c, value(r, c), value(r, c + 1));
  }
}

// acc[j] (j <= warp) = A_c B_c^T over `width` columns (tiles of 32): the row block `warp` of
// the chunk's scores, column blocks 0..warp. a(r, c), b(r, c): the operands' values (row r of
// the chunk, column c), 0 past the chunk's rows and the width. kLo: their lo tiles are used.
template <bool kLo, typename FA, typename FB>
__device__ __forceinline__ void gla_tc_scores(GlaTcTiles& tl, int64_t width, int n, FA a, FB b,
                                              FragAcc (&acc)[kGlaWarps]) {
  const int warp = fresh_tid() / kWarpSize;
#pragma unroll
  for (int j = 0; j < kGlaWarps; ++j) wmma::fill_fragment(acc[j], 0.0f);
  for (int64_t c0 = 0; c0 < width; c0 += kGlaTile) {
    __syncthreads();
    gla_tile(tl.x.ab.a, [&](int r, int c) { return a(r, c0 + c); });
    gla_tile(tl.x.ab.b, [&](int r, int c) { return b(r, c0 + c); });
    __syncthreads();
    if (warp * 16 >= n) continue;
#pragma unroll 1
    for (int kk = 0; kk < kGlaTile / 16; ++kk) {
      FragA ah, al;
      wmma::load_matrix_sync(ah, tl.x.ab.a.hi + warp * 16 * kGlaLdR + kk * 16, kGlaLdR);
      if (kLo) wmma::load_matrix_sync(al, tl.x.ab.a.lo + warp * 16 * kGlaLdR + kk * 16, kGlaLdR);
#pragma unroll
      for (int j = 0; j < kGlaWarps; ++j) {
        if (j > warp) continue;
        FragBt bh, bl;  // B_c^T: B's [row][column] tile read column-major
        wmma::load_matrix_sync(bh, tl.x.ab.b.hi + j * 16 * kGlaLdR + kk * 16, kGlaLdR);
        if (kLo) wmma::load_matrix_sync(bl, tl.x.ab.b.lo + j * 16 * kGlaLdR + kk * 16, kGlaLdR);
        mma_split(acc[j], ah, al, kLo, bh, bl, kLo);
      }
    }
  }
}

// The scores as accumulated into tl.x.pf (kept there for the scalar row sums), then
// tl.y.p = f(t, s, score) split for s <= t < n, 0 elsewhere. Ends with a barrier.
template <typename F>
__device__ __forceinline__ void gla_tc_stage(GlaTcTiles& tl, FragAcc (&acc)[kGlaWarps], int n, F f) {
  const int warp = fresh_tid() / kWarpSize;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kGlaWarps; ++j)
    if (j <= warp)
      wmma::store_matrix_sync(tl.x.pf + warp * 16 * kGlaLdPf + j * 16, acc[j], kGlaLdPf, wmma::mem_row_major);
  __syncthreads();
  for (int e = fresh_tid(); e < kGlaChunk * kGlaChunk / 2; e += blockDim.x) {
    const int t = e / (kGlaChunk / 2), s = (e % (kGlaChunk / 2)) * 2;
    const float p0 = t < n && s <= t ? f(t, s, tl.x.pf[t * kGlaLdPf + s]) : 0.0f;
    const float p1 = t < n && s + 1 <= t ? f(t, s + 1, tl.x.pf[t * kGlaLdPf + s + 1]) : 0.0f;
    put_split(tl.y.p.hi, tl.y.p.lo, t * kGlaLdP + s, p0, p1);
  }
  __syncthreads();
}

// The outputs of one tile of 32 columns, acc[jo] = row block `warp`, columns 16 jo..16 jo + 15:
//   acc = A B (over `inner`, tiles of 32; none when inner = 0) + P C_c,
// P the weighted scores in tl.y.p as they are (kP = kGlaP: row t sums s <= t), transposed
// (kGlaPt: row s sums t >= s) or not at all (kGlaNoP). a(r, k): row r of the chunk (f32
// values: split with lo), b(k, c), c(s, c): 0 past the widths. kCLo: C's lo tiles are used
// (B's always are). Then out(t, c, value) for every row t < n and column c < 32 of the tile,
// from tl.x.o (f32).
enum GlaP { kGlaNoP = 0, kGlaP = 1, kGlaPt = 2 };
template <int kP, bool kCLo, typename FA, typename FB, typename FC, typename FO>
__device__ __forceinline__ void gla_tc_rows(GlaTcTiles& tl, int64_t inner, int n, FA a, FB b, FC c, FO out) {
  const int warp = fresh_tid() / kWarpSize;
  const bool rows = warp * 16 < n;
  FragAcc acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t k0 = 0; k0 < inner; k0 += kGlaTile) {
    __syncthreads();
    gla_tile(tl.x.as.a, [&](int r, int k) { return a(r, k0 + k); });
    gla_tile(tl.x.as.s, [&](int k, int cc) { return b(k0 + k, cc); });
    __syncthreads();
    if (!rows) continue;
#pragma unroll
    for (int kk = 0; kk < kGlaTile / 16; ++kk) {
      FragA ah, al;
      wmma::load_matrix_sync(ah, tl.x.as.a.hi + warp * 16 * kGlaLdR + kk * 16, kGlaLdR);
      wmma::load_matrix_sync(al, tl.x.as.a.lo + warp * 16 * kGlaLdR + kk * 16, kGlaLdR);
#pragma unroll
      for (int jo = 0; jo < 2; ++jo) {
        FragB bh, bl;
        wmma::load_matrix_sync(bh, tl.x.as.s.hi + kk * 16 * kGlaLdS + jo * 16, kGlaLdS);
        wmma::load_matrix_sync(bl, tl.x.as.s.lo + kk * 16 * kGlaLdS + jo * 16, kGlaLdS);
        mma_split(acc[jo], ah, al, true, bh, bl, true);
      }
    }
  }
  __syncthreads();
  // A masked zero of P times a non-finite C value is NaN, and in an MMA it reaches the rows the
  // mask hides from that value. Only the diagonal 16 x 16 block mixes them (the blocks beyond
  // it are never computed): when the warp's 16 rows of C hold a non-finite value (in hi; lo is
  // always finite), that block is summed with scalar FMAs over its visible entries instead.
  bool diag_scalar = false;
  if (kP != kGlaNoP) {
    gla_tile(tl.x.vo.v, c);
    __syncthreads();
    const int lane = fresh_tid() % kWarpSize;
    bool bad = false;
#pragma unroll 1
    for (int i = lane; i < 16 * kGlaTile; i += kWarpSize) {
      const float x = __bfloat162float(tl.x.vo.v.hi[(warp * 16 + i / kGlaTile) * kGlaLdR + i % kGlaTile]);
      bad = bad || !(x - x == 0.0f);
    }
    diag_scalar = __any_sync(0xffffffffu, bad);
  }
  if (kP == kGlaP && rows) {
#pragma unroll 1
    for (int kk = 0; kk <= warp; ++kk) {
      if (diag_scalar && kk == warp) continue;
      FragA ph, pl;
      wmma::load_matrix_sync(ph, tl.y.p.hi + warp * 16 * kGlaLdP + kk * 16, kGlaLdP);
      wmma::load_matrix_sync(pl, tl.y.p.lo + warp * 16 * kGlaLdP + kk * 16, kGlaLdP);
#pragma unroll
      for (int jo = 0; jo < 2; ++jo) {
        FragB ch, cl;
        wmma::load_matrix_sync(ch, tl.x.vo.v.hi + kk * 16 * kGlaLdR + jo * 16, kGlaLdR);
        if (kCLo) wmma::load_matrix_sync(cl, tl.x.vo.v.lo + kk * 16 * kGlaLdR + jo * 16, kGlaLdR);
        mma_split(acc[jo], ph, pl, true, ch, cl, kCLo);
      }
    }
  }
  if (kP == kGlaPt && rows) {
#pragma unroll 1
    for (int kk = warp; kk * 16 < n; ++kk) {
      if (diag_scalar && kk == warp) continue;
      FragAt ph, pl;  // P^T: P's [t][s] tile read column-major
      wmma::load_matrix_sync(ph, tl.y.p.hi + kk * 16 * kGlaLdP + warp * 16, kGlaLdP);
      wmma::load_matrix_sync(pl, tl.y.p.lo + kk * 16 * kGlaLdP + warp * 16, kGlaLdP);
#pragma unroll
      for (int jo = 0; jo < 2; ++jo) {
        FragB ch, cl;
        wmma::load_matrix_sync(ch, tl.x.vo.v.hi + kk * 16 * kGlaLdR + jo * 16, kGlaLdR);
        if (kCLo) wmma::load_matrix_sync(cl, tl.x.vo.v.lo + kk * 16 * kGlaLdR + jo * 16, kGlaLdR);
        mma_split(acc[jo], ph, pl, true, ch, cl, kCLo);
      }
    }
  }
  if (kP != kGlaNoP) __syncthreads();
  wmma::store_matrix_sync(tl.x.vo.o + warp * 16 * kGlaLdO, acc[0], kGlaLdO, wmma::mem_row_major);
  wmma::store_matrix_sync(tl.x.vo.o + warp * 16 * kGlaLdO + 16, acc[1], kGlaLdO, wmma::mem_row_major);
  if (diag_scalar && rows) {
    // out[r][cc] += sum over the block's visible x of P(r, x) C[x][cc], in x order, from the
    // pairs (hi + lo): P(r, x) = P[r][x] for x <= r (kGlaP), P[x][r] for x >= r (kGlaPt)
    __syncwarp();  // the warp's store_matrix_sync is done
    const int lane = fresh_tid() % kWarpSize;
    const int r = warp * 16 + lane / 2, c0 = (lane % 2) * 16;
#pragma unroll 1
    for (int j = 0; j < 16; ++j) {
      float x = tl.x.vo.o[r * kGlaLdO + c0 + j];
#pragma unroll 1
      for (int y = warp * 16; y < warp * 16 + 16; ++y) {
        if (kP == kGlaP ? y > r : y < r) continue;
        const int pi = kP == kGlaP ? r * kGlaLdP + y : y * kGlaLdP + r;
        x = fmaf(split_value(tl.y.p, pi), split_value(tl.x.vo.v, y * kGlaLdR + c0 + j), x);
      }
      tl.x.vo.o[r * kGlaLdO + c0 + j] = x;
    }
  }
  __syncthreads();
  for (int e = fresh_tid(); e < kGlaChunk * kGlaTile; e += blockDim.x) {
    const int t = e / kGlaTile, cc = e % kGlaTile;
    if (t < n) out(t, cc, tl.x.vo.o[t * kGlaLdO + cc]);
  }
}

// U = A_c^T B_c over the chunk's rows, per tile of 32 columns of B (width wb) and of A (width
// wa): U block (warp / 2, warp % 2) of 32 x 32 per warp; then f(i, j, U_ij) for i < wa, j < wb
// (one thread per element). a(r, i): f32 values (split with lo), b(r, j): kBLo, its lo tiles.
template <bool kBLo, typename FA, typename FB, typename F>
__device__ __forceinline__ void gla_tc_cols(GlaTcTiles& tl, int n, int64_t wa, int64_t wb, FA a, FB b, F f) {
  const int warp = fresh_tid() / kWarpSize, wi = warp / 2, wj = warp % 2;
  for (int64_t j0 = 0; j0 < wb; j0 += kGlaTile) {
    __syncthreads();
    gla_tile(tl.x.ab.b, [&](int r, int c) { return b(r, j0 + c); });
    for (int64_t i0 = 0; i0 < wa; i0 += kGlaTile) {
      __syncthreads();
      gla_tile(tl.x.ab.a, [&](int r, int c) { return a(r, i0 + c); });
      __syncthreads();
      FragAcc acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll 1
      for (int kk = 0; kk * 16 < n; ++kk) {
        FragAt ah, al;  // A_c^T: A's [row][column] tile read column-major
        FragB bh, bl;
        wmma::load_matrix_sync(ah, tl.x.ab.a.hi + kk * 16 * kGlaLdR + wi * 16, kGlaLdR);
        wmma::load_matrix_sync(al, tl.x.ab.a.lo + kk * 16 * kGlaLdR + wi * 16, kGlaLdR);
        wmma::load_matrix_sync(bh, tl.x.ab.b.hi + kk * 16 * kGlaLdR + wj * 16, kGlaLdR);
        if (kBLo) wmma::load_matrix_sync(bl, tl.x.ab.b.lo + kk * 16 * kGlaLdR + wj * 16, kGlaLdR);
        mma_split(acc, ah, al, true, bh, bl, kBLo);
      }
      wmma::store_matrix_sync(tl.y.u + wi * 16 * kGlaLdO + wj * 16, acc, kGlaLdO, wmma::mem_row_major);
      __syncthreads();
      for (int e = fresh_tid(); e < kGlaTile * kGlaTile; e += blockDim.x) {
        const int64_t i = i0 + e / kGlaTile, j = j0 + e % kGlaTile;
        if (i < wa && j < wb) f(i, j, tl.y.u[(e / kGlaTile) * kGlaLdO + e % kGlaTile]);
      }
    }
  }
}

// S <- e_end S + K~_c^T V'_c (K~_s = w_{end,s} k_s). V' rows of weight 0 are loaded as 0 (a
// non-finite v_s before a reset stays out of the state, as in update_state).
template <typename T>
__device__ __forceinline__ void gla_tc_update(GlaTcTiles& tl, const ChunkDecay& cd, float* S, const MesaLaTensor& k,
                                              const MesaLaTensor& v, int64_t b, int64_t kh, int64_t t0, int n,
                                              int64_t M, int64_t D, int64_t W) {
  constexpr bool kLo = std::is_same_v<T, __half>;  // bf16 values: lo = 0, skipped
  const float e_end = inter_weight(cd, n - 1);
  gla_tc_cols<kLo>(
      tl, n, M, W,
      [&](int r, int64_t i) {
        const float w = r < n ? intra_weight(cd, n - 1, r) : 0.0f;
        return w != 0.0f && i < M ? w * gla_load<T>(k, b, kh, t0 + r, i) : 0.0f;
      },
      [&](int r, int64_t j) {
        if (r >= n || j >= W || intra_weight(cd, n - 1, r) == 0.0f) return 0.0f;
        return j < D ? gla_load<T>(v, b, kh, t0 + r, j) : 1.0f;
      },
      [&](int64_t i, int64_t j, float u) { S[i * W + j] = fmaf(e_end, S[i * W + j], u); });
}

// Forward on tensor cores: one block per (b, h), as gla_forward_kernel.
template <typename T>
__global__ void __launch_bounds__(kGlaThreads, kGlaMinBlocks) gla_forward_tc_kernel(const MesaGlaForwardArgs a) {
  __shared__ ChunkDecay cd;
  __shared__ GlaTcTiles tl;
  __shared__ float den[kGlaChunk];
  constexpr bool kLo = std::is_same_v<T, __half>;  // 16-bit values: lo only for f16
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0);
  const int64_t bh = blockIdx.x, h = bh % H;
  const GlaSpan span = gla_span(sh, bh / H);
  const int64_t b = span.b, kh = h / (H / sh.kv_heads), bk = span.u * sh.kv_heads + kh;
  float* S = a.work + bh * M * W;
  for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) S[e] = a.init_state ? a.init_state[bk * M * W + e] : 0.0f;
  // boundary states: the group's first query head writes the state entering each chunk
  float* bnd = a.boundary != nullptr && h % (H / sh.kv_heads) == 0
                   ? a.boundary + (gla_first_chunk(sh, span.u) * sh.kv_heads + kh) * M * W
                   : nullptr;
  for (int64_t t0 = span.begin; t0 < span.end; t0 += sh.chunk) {
    const int n = int(span.end - t0 < sh.chunk ? span.end - t0 : sh.chunk);
    __syncthreads();  // the previous chunk's state update is done
    if (bnd != nullptr) {
      for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) bnd[e] = S[e];
      bnd += sh.kv_heads * M * W;
    }
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    // P = Q_c K_c^T, then W ∘ P
    FragAcc acc[kGlaWarps];
    gla_tc_scores<kLo>(
        tl, M, n, [&](int r, int64_t c) { return r < n && c < M ? gla_load<T>(a.q, b, h, t0 + r, c) : 0.0f; },
        [&](int r, int64_t c) { return r < n && c < M ? gla_load<T>(a.k, b, kh, t0 + r, c) : 0.0f; }, acc);
    gla_tc_stage(tl, acc, n, [&](int t, int s, float p) {
      const float w = intra_weight(cd, t, s);
      return w == 0.0f ? 0.0f : w * p;
    });
    if (sh.normalize) {
      for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const float e_t = inter_weight(cd, t);
        float x = 0.0f;
        if (e_t != 0.0f)
          for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), S[i * W + D], x);
        x *= e_t;
        for (int s = 0; s <= t; ++s) {
          const float w = intra_weight(cd, t, s);
          x += w == 0.0f ? 0.0f : w * tl.x.pf[t * kGlaLdPf + s];
        }
        den[t] = gla_guard(x, sh.eps);
        a.den[(b * H + h) * L + t0 + t] = den[t];
      }
    }
    // O = Q~_c S + (W ∘ P) V'_c, per value tile of 32 columns
    for (int64_t d0 = 0; d0 < D; d0 += kGlaTile) {
      __syncthreads();  // (synccheck: a loop around barriers holds one itself)
      gla_tc_rows<kGlaP, kLo>(
          tl, M, n,
          [&](int r, int64_t i) {
            const float e_r = r < n ? inter_weight(cd, r) : 0.0f;
            return e_r != 0.0f && i < M ? e_r * gla_load<T>(a.q, b, h, t0 + r, i) : 0.0f;
          },
          [&](int64_t i, int c) { return i < M && d0 + c < D ? S[i * W + d0 + c] : 0.0f; },
          [&](int s, int c) { return s < n && d0 + c < D ? gla_load<T>(a.v, b, kh, t0 + s, d0 + c) : 0.0f; },
          [&](int t, int c, float x) {
            if (d0 + c < D) gla_store<T>(a.out, b, h, t0 + t, d0 + c, sh.normalize ? x / den[t] : x);
          });
    }
    gla_tc_update<T>(tl, cd, S, a.k, a.v, b, kh, t0, n, M, D, W);
  }
  __syncthreads();
  // the KV head's final state, from the first query head of its group (all compute the same)
  if (h % (H / sh.kv_heads) == 0)
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) a.final_state[bk * M * W + e] = S[e];
}

// dq on tensor cores: one block per (b, h) or (chunk, h), as gla_dq_kernel (the same scratch
// and qdq).
template <typename T, bool kBoundary>
__global__ void __launch_bounds__(kGlaThreads, kGlaMinBlocks)
    gla_dq_tc_kernel(const MesaGlaBackwardArgs a, float* work_states, float* work_dq, float* qdq) {
  __shared__ ChunkDecay cd;
  __shared__ GlaTcTiles tl;
  __shared__ float g[kGlaChunk];
  __shared__ float dden[kGlaChunk];
  constexpr bool kLo = std::is_same_v<T, __half>;
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0), C = sh.chunk;
  const int64_t bh = blockIdx.x, h = bh % H;
  const int64_t kh = h / (H / sh.kv_heads);
  GlaSpan span;
  float* S;
  if constexpr (kBoundary) {  // block (g, h): chunk g alone, from its boundary state (read only)
    const int64_t g = bh / H;
    span = gla_span(sh, gla_chunk_unit(sh, g));
    span.begin += (g - gla_first_chunk(sh, span.u)) * C;
    span.end = span.end - span.begin < C ? span.end : span.begin + C;
    S = const_cast<float*>(a.boundary) + (g * sh.kv_heads + kh) * M * W;
  } else {  // block (u, h): every chunk of unit u, walking the state
    span = gla_span(sh, bh / H);
    S = work_states + bh * M * W;
    const int64_t bk = span.u * sh.kv_heads + kh;
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) S[e] = a.init_state ? a.init_state[bk * M * W + e] : 0.0f;
  }
  const int64_t b = span.b;
  float* tile = work_dq + bh * C * M;  // the chunk's dq in f32
  for (int64_t t0 = span.begin; t0 < span.end; t0 += C) {
    const int n = int(span.end - t0 < C ? span.end - t0 : C);
    __syncthreads();
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    row_grads<T>(a, b, h, t0, n, g, dden);
    // E = dout_c V_c^T, then w_ts (E_ts / g_t + dden_t)
    FragAcc acc[kGlaWarps];
    gla_tc_scores<kLo>(
        tl, D, n, [&](int r, int64_t c) { return r < n && c < D ? gla_load<T>(a.dout, b, h, t0 + r, c) : 0.0f; },
        [&](int r, int64_t c) { return r < n && c < D ? gla_load<T>(a.v, b, kh, t0 + r, c) : 0.0f; }, acc);
    gla_tc_stage(tl, acc, n, [&](int t, int s, float x) {
      const float w = intra_weight(cd, t, s);
      return w == 0.0f ? 0.0f : w * (x / g[t] + dden[t]);
    });
    // dq = Y~_c S^T + E K_c, per feature tile of 32
    for (int64_t f0 = 0; f0 < M; f0 += kGlaTile) {
      __syncthreads();  // (synccheck: a loop around barriers holds one itself)
      gla_tc_rows<kGlaP, kLo>(
          tl, W, n,
          [&](int r, int64_t j) {
            const float e_r = r < n ? inter_weight(cd, r) : 0.0f;
            if (e_r == 0.0f || j >= W) return 0.0f;
            return e_r * (j < D ? gla_load<T>(a.dout, b, h, t0 + r, j) / g[r] : dden[r]);
          },
          [&](int64_t j, int c) { return j < W && f0 + c < M ? S[(f0 + c) * W + j] : 0.0f; },
          [&](int s, int c) { return s < n && f0 + c < M ? gla_load<T>(a.k, b, kh, t0 + s, f0 + c) : 0.0f; },
          [&](int t, int c, float x) {
            if (f0 + c >= M) return;
            tile[t * M + f0 + c] = x;
            gla_store<T>(a.dq, b, h, t0 + t, f0 + c, x);
          });
    }
    __syncthreads();
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
      float x = 0.0f;
      for (int64_t i = 0; i < M; ++i) x = fmaf(gla_load<T>(a.q, b, h, t0 + t, i), tile[t * M + i], x);
      qdq[(b * H + h) * L + t0 + t] = x;
    }
    if constexpr (!kBoundary) gla_tc_update<T>(tl, cd, S, a.k, a.v, b, kh, t0, n, M, D, W);
  }
}

// dk, dv, dS, da on tensor cores: one block per (b, kh), as gla_dkdv_kernel (the same scratch,
// walk, group order and da). Per chunk, with V~'_s = w_{end,s} v'_s, K~_s = w_{end,s} k_s:
//   dk  = V~'_c dS^T + sum_h E_h^T Q_h,c            E = w ∘ (dout V^T / g + dden), as dq's
//   dv  = K~_c dS[:, :D] + sum_h A_h^T (dout_h,c / g) A = w ∘ (Q K^T)
//   dS' = e_end dS + sum_h Q~_h,c^T dv'_h,c          Q~_t = e_t q_t
template <typename T>
__global__ void __launch_bounds__(kGlaThreads, kGlaMinBlocks)
    gla_dkdv_tc_kernel(const MesaGlaBackwardArgs a, float* work_ds, float* work_dkdv, const float* qdq, float* da_rows) {
  __shared__ ChunkDecay cd;
  __shared__ GlaTcTiles tl;
  __shared__ float g[kGlaChunk];
  __shared__ float dden[kGlaChunk];
  __shared__ float kdk[kGlaChunk];
  constexpr bool kLo = std::is_same_v<T, __half>;
  const MesaGlaShape& sh = a.shape;
  const int64_t H = sh.heads, L = sh.len, M = sh.feat, D = sh.dim, W = D + (sh.normalize ? 1 : 0), C = sh.chunk;
  const int64_t G = H / sh.kv_heads;
  const int64_t bk = blockIdx.x, kh = bk % sh.kv_heads;
  const GlaSpan span = gla_span(sh, bk / sh.kv_heads);
  const int64_t b = span.b;
  float* dS = work_ds + bk * 2 * M * W;  // the gradient of the state leaving the chunk
  float* dS_next = dS + M * W;           // ... and of the one entering it
  float* dk_acc = work_dkdv + bk * C * (M + W);
  float* dv_acc = dk_acc + C * M;
  float* da_kh = (sh.decay_kind == MESA_GLA_DECAY_PER_STEP ? a.d_decay : da_rows) + (b * sh.kv_heads + kh) * L;
  for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) dS[e] = a.d_final ? a.d_final[bk * M * W + e] : 0.0f;
  float acc = 0.0f;  // thread 0: the suffix sum of dL/dLam'
  if (threadIdx.x == 0 && a.d_final != nullptr)
    for (int64_t e = 0; e < M * W; ++e) acc = fmaf(a.d_final[bk * M * W + e], a.final_state[bk * M * W + e], acc);
  const int64_t nchunks = (span.end - span.begin + C - 1) / C;
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t t0 = span.begin + c * C;
    const int n = int(span.end - t0 < C ? span.end - t0 : C);
    __syncthreads();
    if (threadIdx.x == 0) chunk_decay(cd, a.decay, sh, b, kh, t0, n);
    __syncthreads();
    const float e_end = inter_weight(cd, n - 1);
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) dS_next[e] = e_end * dS[e];
    // the final-state terms through dS: dk = V~'_c dS^T, dv = K~_c dS[:, :D]
    for (int64_t f0 = 0; f0 < M; f0 += kGlaTile) {
      __syncthreads();  // (synccheck: a loop around barriers holds one itself)
      gla_tc_rows<kGlaNoP, false>(
          tl, W, n,
          [&](int r, int64_t j) {
            const float w = r < n ? intra_weight(cd, n - 1, r) : 0.0f;
            if (w == 0.0f || j >= W) return 0.0f;
            return j < D ? w * gla_load<T>(a.v, b, kh, t0 + r, j) : w;
          },
          [&](int64_t j, int cc) { return j < W && f0 + cc < M ? dS[(f0 + cc) * W + j] : 0.0f; },
          [&](int, int) { return 0.0f; },
          [&](int t, int cc, float x) {
            if (f0 + cc < M) dk_acc[t * M + f0 + cc] = x;
          });
    }
    for (int64_t d0 = 0; d0 < D; d0 += kGlaTile) {
      __syncthreads();  // (synccheck)
      gla_tc_rows<kGlaNoP, false>(
          tl, M, n,
          [&](int r, int64_t i) {
            const float w = r < n ? intra_weight(cd, n - 1, r) : 0.0f;
            return w != 0.0f && i < M ? w * gla_load<T>(a.k, b, kh, t0 + r, i) : 0.0f;
          },
          [&](int64_t i, int cc) { return i < M && d0 + cc < D ? dS[i * W + d0 + cc] : 0.0f; },
          [&](int, int) { return 0.0f; },
          [&](int t, int cc, float x) {
            if (d0 + cc < D) dv_acc[t * D + d0 + cc] = x;
          });
    }
    for (int64_t hq = kh * G; hq < (kh + 1) * G; ++hq) {
      __syncthreads();  // the previous head's scores have been used
      row_grads<T>(a, b, hq, t0, n, g, dden);
      // dk += E^T Q_c
      FragAcc sc[kGlaWarps];
      gla_tc_scores<kLo>(
          tl, D, n, [&](int r, int64_t j) { return r < n && j < D ? gla_load<T>(a.dout, b, hq, t0 + r, j) : 0.0f; },
          [&](int r, int64_t j) { return r < n && j < D ? gla_load<T>(a.v, b, kh, t0 + r, j) : 0.0f; }, sc);
      gla_tc_stage(tl, sc, n, [&](int t, int s, float x) {
        const float w = intra_weight(cd, t, s);
        return w == 0.0f ? 0.0f : w * (x / g[t] + dden[t]);
      });
      for (int64_t f0 = 0; f0 < M; f0 += kGlaTile) {
        __syncthreads();  // (synccheck)
        gla_tc_rows<kGlaPt, kLo>(
            tl, 0, n, [&](int, int64_t) { return 0.0f; }, [&](int64_t, int) { return 0.0f; },
            [&](int t, int cc) { return t < n && f0 + cc < M ? gla_load<T>(a.q, b, hq, t0 + t, f0 + cc) : 0.0f; },
            [&](int s, int cc, float x) {
              if (f0 + cc < M) dk_acc[s * M + f0 + cc] += x;
            });
      }
      // dv += A^T (dout_c / g)
      gla_tc_scores<kLo>(
          tl, M, n, [&](int r, int64_t i) { return r < n && i < M ? gla_load<T>(a.q, b, hq, t0 + r, i) : 0.0f; },
          [&](int r, int64_t i) { return r < n && i < M ? gla_load<T>(a.k, b, kh, t0 + r, i) : 0.0f; }, sc);
      gla_tc_stage(tl, sc, n, [&](int t, int s, float x) {
        const float w = intra_weight(cd, t, s);
        return w == 0.0f ? 0.0f : w * x;
      });
      for (int64_t d0 = 0; d0 < D; d0 += kGlaTile) {
        __syncthreads();  // (synccheck)
        gla_tc_rows<kGlaPt, true>(
            tl, 0, n, [&](int, int64_t) { return 0.0f; }, [&](int64_t, int) { return 0.0f; },
            [&](int t, int cc) {
              return t < n && d0 + cc < D ? gla_load<T>(a.dout, b, hq, t0 + t, d0 + cc) / g[t] : 0.0f;
            },
            [&](int s, int cc, float x) {
              if (d0 + cc < D) dv_acc[s * D + d0 + cc] += x;
            });
      }
      // dS' += Q~_c^T dv'_c
      gla_tc_cols<true>(
          tl, n, M, W,
          [&](int r, int64_t i) {
            const float e_r = r < n ? inter_weight(cd, r) : 0.0f;
            return e_r != 0.0f && i < M ? e_r * gla_load<T>(a.q, b, hq, t0 + r, i) : 0.0f;
          },
          [&](int r, int64_t j) {
            if (r >= n || j >= W) return 0.0f;
            return j < D ? gla_load<T>(a.dout, b, hq, t0 + r, j) / g[r] : dden[r];
          },
          [&](int64_t i, int64_t j, float u) { dS_next[i * W + j] += u; });
    }
    __syncthreads();
    gla_dkdv_chunk_end<T>(a, b, kh, t0, n, dk_acc, dv_acc, qdq, kdk, da_kh, acc);
    float* tmp = dS;
    dS = dS_next;
    dS_next = tmp;
  }
  __syncthreads();
  if (a.d_init != nullptr)
    for (int64_t e = threadIdx.x; e < M * W; e += blockDim.x) a.d_init[bk * M * W + e] = dS[e];
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): one block of 128 threads per (b, h) — or per (b, kh) for dk/dv —,
// each walking its L / C chunks in order; packed, per (sequence, h) and (sequence, kh), each
// walking its sequence's chunks.
template <typename T>
struct GlaForwardLaunch {
  static MesaStatus run(const MesaGlaForwardArgs& a, void* stream) {
    const dim3 blocks(unsigned(gla_units(a.shape) * a.shape.heads));
    if constexpr (kTensorCores<T>)
      return status_from(MESA_LAUNCH((gla_forward_tc_kernel<T>), blocks, dim3(kGlaThreads), 0, stream, a));
    else
      return status_from(MESA_LAUNCH((gla_forward_kernel<T>), blocks, dim3(kGlaThreads), 0, stream, a));
  }
};

template <typename T>
struct GlaBackwardLaunch {
  static MesaStatus run(const MesaGlaBackwardArgs& a, void* stream) {
    const MesaGlaShape& s = a.shape;
    const int64_t B = s.batch, H = s.heads, Hkv = s.kv_heads, L = s.len, M = s.feat, C = s.chunk;
    const int64_t W = s.dim + (s.normalize ? 1 : 0), N = gla_units(s), NCH = gla_chunks(s);
    // the scratch, as MESA_GLA_PACKED_BACKWARD_WORK lays it out (unpacked: N = B), or with
    // boundary states MESA_GLA_BOUNDARY_BACKWARD_WORK (no working states, a dq chunk per block)
    const bool boundary = a.boundary != nullptr;
    float* states = a.work;
    float* dq_tiles = boundary ? a.work : states + N * H * M * W;
    float* qdq = dq_tiles + (boundary ? NCH : N) * H * C * M;
    float* ds = qdq + B * H * L;
    float* dkdv = ds + N * Hkv * 2 * M * W;
    float* da_rows = dkdv + N * Hkv * C * (M + W);
    cudaError_t e = cudaSuccess;
    if (N > 0) {
      if (boundary && NCH > 0) {
        const dim3 grid(unsigned(NCH * H));
        if constexpr (kTensorCores<T>)
          e = MESA_LAUNCH((gla_dq_tc_kernel<T, true>), grid, dim3(kGlaThreads), 0, stream, a, states, dq_tiles, qdq);
        else
          e = MESA_LAUNCH((gla_dq_kernel<T, true>), grid, dim3(kGlaThreads), 0, stream, a, states, dq_tiles, qdq);
      } else if (!boundary) {
        const dim3 grid(unsigned(N * H));
        if constexpr (kTensorCores<T>)
          e = MESA_LAUNCH((gla_dq_tc_kernel<T, false>), grid, dim3(kGlaThreads), 0, stream, a, states, dq_tiles, qdq);
        else
          e = MESA_LAUNCH((gla_dq_kernel<T, false>), grid, dim3(kGlaThreads), 0, stream, a, states, dq_tiles, qdq);
      }
      if (e != cudaSuccess) return status_from(e);
      if constexpr (kTensorCores<T>)
        e = MESA_LAUNCH((gla_dkdv_tc_kernel<T>), dim3(unsigned(N * Hkv)), dim3(kGlaThreads), 0, stream, a, ds, dkdv,
                        qdq, da_rows);
      else
        e = MESA_LAUNCH((gla_dkdv_kernel<T>), dim3(unsigned(N * Hkv)), dim3(kGlaThreads), 0, stream, a, ds, dkdv,
                        qdq, da_rows);
    }
    // per-head decay: also with B = 0 (its gradient is then 0)
    if (e != cudaSuccess || s.decay_kind != MESA_GLA_DECAY_PER_HEAD) return status_from(e);
    return status_from(MESA_LAUNCH(gla_da_reduce_kernel, dim3(unsigned(Hkv)), dim3(kGlaThreads), 0, stream, da_rows,
                                   a.d_decay, B, Hkv, L));
  }
};

// The entry points' own checks (the safe crate checks everything first, with typed errors).
inline bool gla_shape_valid(const MesaGlaShape& s) {
  if (s.batch < 0 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.len < 0 || s.feat < 0 ||
      s.dim < 0 || s.chunk < 1 || s.chunk > MESA_GLA_MAX_CHUNK)
    return false;
  if (s.decay_kind != MESA_GLA_DECAY_PER_STEP && s.decay_kind != MESA_GLA_DECAY_PER_HEAD) return false;
  if (s.normalize && !(s.eps > 0.0f && s.eps < INFINITY)) return false;
  // packed: B = 1 and N >= 1 sequences (the offsets themselves are the caller's to check)
  if (s.packing.seq_offsets != nullptr && (s.batch != 1 || s.packing.nseq < 1)) return false;
  // one block per (b or sequence, h): the grid's x limit
  return gla_units(s) * s.heads <= int64_t(0x7fffffff);
}

// Boundary states (given): packed, the chunk offsets too; one dq block per (chunk, h).
inline bool gla_boundary_valid(const MesaGlaShape& s, const void* boundary) {
  if (boundary == nullptr) return true;
  if (s.packing.seq_offsets != nullptr && s.packing.chunk_offsets == nullptr) return false;
  return gla_chunks(s) * s.heads <= int64_t(0x7fffffff);
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(gated_linear_attention_forward)(const MesaGlaForwardArgs* a, void* stream) {
  if (a == nullptr || !gla_shape_valid(a->shape) || !gla_boundary_valid(a->shape, a->boundary))
    return MESA_STATUS_INVALID_ARGUMENT;
  const MesaGlaShape& s = a->shape;
  if (s.batch == 0) return MESA_STATUS_OK;
  // an empty tensor may come as NULL: the per-step decay when L = 0
  const bool decay_empty = s.decay_kind == MESA_GLA_DECAY_PER_STEP && s.len == 0;
  if ((a->decay == nullptr && !decay_empty) || a->final_state == nullptr || a->work == nullptr ||
      (s.normalize && a->den == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.batch > 0 && s.len > 0 &&
      (a->q.data == nullptr || a->k.data == nullptr || a->v.data == nullptr || a->out.data == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<GlaForwardLaunch>(s.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(gated_linear_attention_backward)(const MesaGlaBackwardArgs* a, void* stream) {
  if (a == nullptr || !gla_shape_valid(a->shape) || !gla_boundary_valid(a->shape, a->boundary))
    return MESA_STATUS_INVALID_ARGUMENT;
  const MesaGlaShape& s = a->shape;
  // an empty tensor may come as NULL: the per-step decay and its gradient when B·L = 0, the
  // row tensors when B·L = 0
  const bool decay_empty = s.decay_kind == MESA_GLA_DECAY_PER_STEP && s.batch * s.len == 0;
  if (((a->decay == nullptr || a->d_decay == nullptr) && !decay_empty) || a->work == nullptr ||
      a->final_state == nullptr || (s.normalize && a->den == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.batch > 0 && s.len > 0 &&
      (a->q.data == nullptr || a->k.data == nullptr || a->v.data == nullptr || a->dout.data == nullptr ||
       a->dq.data == nullptr || a->dk.data == nullptr || a->dv.data == nullptr ||
       (s.normalize && a->out.data == nullptr)))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<GlaBackwardLaunch>(s.dtype, *a, stream);
}
