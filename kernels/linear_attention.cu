// linear_attention.cu — chunked linear attention, forward and exact backward in two memory
// modes (SLiM: Likhosherstov et al. 2020, §3; Performer: Choromanski et al. 2020, §2.2 Eq. 5).
//
// Everything is built from ONE primitive, the chunked causal product of three row operands
// a, b [L, Ma] and c [L, Dc] of one (b, h):
//
//   o_t = sum_{s in W(t)} (a_t . b_s) c_s,   W(t) = {s <= t} (LE), {s >= t} (GE) or all (NONE)
//
// computed chunk by chunk (C rows): with S = sum of b_s c_s^T over the chunks already
// walked (an Ma x Dc f32 state), a chunk's rows get
//   O_c = A_c S  +  mask(A_c B_c^T) C_c          (inter-chunk + masked intra-chunk matmul)
// and the walk updates S += B_c^T C_c.
//
// Forward (W = D + normalize, c' = [v | 1]):
//   den = g(product(q, k, 1)), f32 (normalize only), out = product(q, k, v) / den
// the state column D holds z = sum k_s, so S' = sum k_s c'_s^T. The denominators are scalar
// work of the product itself (Product::self_norm: row sums of its masked P plus q_t . z): in
// the output product of the decomposed forward, in a product without value columns first in
// the walks.
// Backward, with dO' = [dout / den | dden], dden_t = -(dout_t . out_t) / den_t (recomputed
// where it is loaded: no per-row scratch):
//   dq = product(dO', c', k)  LE   state  S0'^T + sum c'_s k_s^T = S'^T   (saved or re-walked)
//   dk = product(c', dO', q)  GE   state  dSL'^T + sum dO'_s q_s^T  -> dS0'^T at the end
//   dv = product(k, q, dout/den) GE   state dSL + sum q_s (dout_s/den_s)^T
// (bidirectional: the same with W = all; dq reads the saved final state.) S0' is the
// caller's initial state, dSL' the final state's gradient (causal; both optional).
//
// Memory modes (causal):
//   BOUNDARY_STATES: the forward writes the state entering every chunk; dq reads it, so
//                    its chunks are independent (parallel over chunks). Those states (and
//                    dk's, dv's) come from the chunk sums and a scan, from a state walk
//                    (MESA_LA_SCHEDULE_STATE_WALK), or from SLiM's walks, the forward's
//                    storing them (MESA_LA_SCHEDULE_WALK): bitwise the same.
//   SLIM:            only the final state is kept (and a copy of S0'); dq walks the chunks
//                    forward again from S0', so dq_t reads rows s <= t only. (SLiM's own
//                    reversal by subtraction, S <- S - B_c^T C_c, loses the early states to
//                    cancellation when later rows are large: not used.)
// Scratch of the backward: one state per (b, h), M*W f32, in both modes.
//
// Work per chunk and (b,h), Ma = M, Dc = D (FLOPs, f32 FMA = 2):
//   intra  2 C^2 M (once per block: per D-tile of 32 in the walks and the FP32 path, per
//          group of D-tiles in the tensor-core per-chunk outputs, value_group)  + 2 C^2 D
//   inter  2 C M D,   update 2 C M D
// Bytes per (b,h): read (2M + D) L sizeof(T), write D L sizeof(T); the state tile is
// read and written once per chunk from L2 (M D 4 bytes each way).
// Reference: crates/mesa-kernels/src/reference/linear_attention.rs. Floors: docs/linear_attention.md.
#include "common.cuh"
#include "split_mma.cuh"

#include <type_traits>

namespace MESA_NS {

// Tiles. kChunk rows of a chunk, kTF features of Ma per step, kTD columns of Dc per block.
// 256 threads: P = A B^T is 64 x 64 (16 per thread), O is 64 x 32 (8 per thread), the state
// update 32 x 32 (4 per thread). Shared memory 46 KiB (< 48 KiB static); at most 128
// registers per thread, so two blocks per SM (the register file is the limit, not shared memory).
constexpr int kThreads = 256;
constexpr int kChunk = MESA_LA_MAX_CHUNK;
constexpr int kTF = 32;
constexpr int kTD = 32;

enum Mask { kMaskNone = 0, kMaskLE = 1, kMaskGE = 2 };

// Whether row r of a chunk sees row s of it under the mask (a template parameter of the kernel:
// the direction is fixed per call).
template <int kMask>
__host__ __device__ __forceinline__ constexpr bool visible(int r, int s) {
  return kMask == kMaskLE ? s <= r : (kMask == kMaskGE ? s >= r : true);
}
enum Mode {
  kAccumulate = 0,  // S from `init` (base NULL: 0), walk in the mask's direction
  kReadChunk = 1,   // S of chunk c read from `init` (per-chunk states): chunks independent
  kBidir = 2,       // phase 1: S = sum over all chunks (or init if given); phase 2: O = A S
  kChunkSum = 3,    // U_c = B_c^T C_c of every chunk into `boundary` (chunks independent);
                    // la_scan_kernel then turns them into the states entering each chunk
  kStateWalk = 4    // S from `init`, walk in the mask's direction writing the state entering
                    // each chunk to `boundary` (no outputs): kChunkSum + scan in one pass
};

// Per-chunk work items (state or head, chunk, D-tile) rather than (state, D-tile).
__host__ __device__ __forceinline__ bool per_chunk(int mode) { return mode == kReadChunk || mode == kChunkSum; }

// Virtual column of an operand (index nfeat).
enum Extra {
  kExtraNone = 0,
  kExtraOnes = 1,  // 1
  kExtraDden = 2   // dden_t = -(x_t . y_t) / row_div_t, x = this operand's stored row, y = `dot`
};

// One row operand [B, H, L, nfeat] (+ a virtual column at index nfeat).
struct Operand {
  const void* data;
  int64_t sb, sh, sl, sf;
  int64_t nfeat;
  const float* row_div;  // NULL or [B*H*L]: stored columns divided by it
  const void* dot;       // kExtraDden: the forward output [B, H, L, nfeat] (strides db..df)
  int64_t db, dh, dl, df;
  int extra_kind;        // Extra
  int rows16;            // rows readable as 16-byte runs (rows_16b): stride-1 features, every row 16-byte aligned
  __host__ __device__ int64_t width() const { return nfeat + (extra_kind != kExtraNone ? 1 : 0); }
};

struct OutView {
  void* data;
  int64_t sb, sh, sl, sf;
  int64_t width;
  const float* row_div;  // NULL or [B*H*L]
  // The gated backward (issue 41): `f32` outputs are floats (T otherwise), `accumulate` adds to
  // what is there (a group's products summed in a fixed order); with `dots`, each D-tile's part
  // of the row dot x_t . o_t (f32, before any rounding; x of T at `dot`, o's layout with strides
  // db..df) goes to dots[(d0 / kTD) * dots_tile + row] (row: the row arrays' index).
  int f32, accumulate;
  const void* dot;
  int64_t db, dh, dl, df;
  float* dots;
  int64_t dots_tile;
};

// The log-decay of a gated product (issue 41; a == NULL: none, the ungated product): a_t <= 0
// of row t of (b, h) at a[b*sb + h*sh + t*sl] (one value per head: sb = sl = 0). The chunk sums
// (kChunkSum) also write each chunk's whole decay to chunk_factor[bidx*fb + chunk*fc] (the
// boundary states' (bidx, chunk)), which la_scan_kernel multiplies the running state by.
struct DecayView {
  const float* a;
  int64_t sb, sh, sl;
  float* chunk_factor;
  int64_t fb, fc;
};

// f32 state element (bh, chunk, r, c) at base + bh*s_bh + chunk*s_chunk + r*s_r + c*s_c.
struct StateView {
  float* base;
  int64_t s_bh, s_chunk, s_r, s_c;
  __device__ __forceinline__ float* at(int64_t bh, int64_t chunk, int64_t r, int64_t c) const {
    return base + bh * s_bh + chunk * s_chunk + r * s_r + c * s_c;
  }
};

struct Product {
  Operand a, b, c;
  OutView o;
  int64_t B, H, L;
  int64_t ma;  // width of a and b
  int64_t dc;  // width of c (= o.width)
  int chunk;
  int mask;
  int mode;
  StateView state;     // working / final state [B*H, ma, dc]
  StateView init;      // kAccumulate: initial state; kReadChunk: per-chunk states; kBidir: total
                       // state (base NULL: 0, none, summed)
  StateView boundary;  // kChunkSum: the chunk sums, then (la_scan_kernel) the states entering each chunk;
                       // kStateWalk: the states entering each chunk
  // Packed sequences (seq_off != NULL): B = 1 physically; sequence n is rows
  // seq_off[n]..seq_off[n+1] of every head, its state index n*H + h, its chunks the global
  // chunks chunk_off[n]..chunk_off[n+1] (boundary states [nchunks_total, H, ma, dc]).
  const int64_t* seq_off;
  const int64_t* chunk_off;
  int64_t nseq;
  int64_t nchunks_total;
  // Set by run_product (host), read from the kernel's parameter space (no registers): the work
  // items of the launch, D-tile groups per state (or chunk), D-tiles per group (value_group),
  // chunks per (b, h) (not packed).
  int64_t items, ndt, dgroup, nchunks;
  // The normaliser as a column of this product (the decomposed causal forward, c = v): the
  // state's column dc is z = sum of b_s; kChunkSum writes its chunk sums (column sums of B_c),
  // the scan carries it, and kReadChunk computes every row's denominator
  //   den_t = g(sum_{s <= t in the chunk} P_ts + a_t . z_c)
  // from its own P and state, divides its outputs by it and (D-tile 0) writes it to `den`.
  int self_norm;
  float* den;  // [B*H, L] f32 (rows as row_div), the guarded denominators
  float eps;
  // Row arrays (den, row_div, dots) hold row t of (b, h) at index (b*H + h)*rs + t: rs = L, or
  // G*L in a launch over one query head of each group (the gated forward and backward).
  int64_t rs;
  DecayView decay;
  // Which operand's rows the decay weights in the state update: B's (0) or C's (1). A state
  // and its transpose (the forward's S' = sum k~ v'^T, dq's sum v' k~^T) weight the same tensor
  // (k), so that both round alike: the boundary states are then bit for bit the walks'.
  int scale_c;
  // The state is the transpose of the forward's (dq's sum c'_s k_s^T, the forward's k_s c'_s^T):
  // its MMAs add the split pairs' cross terms in the forward's order (B^T C's lo-times-hi first),
  // so that with two lo tiles (f16) a walk and the forward's boundary states round alike.
  int transposed;
};

// One (sequence, head) of a call: where its rows and states are.
struct Seq {
  int32_t b, h;   // physical batch and head of its rows (B, H < 2^31: checked at the entry points)
  int64_t bh;     // b*H + h: index of its per-row arrays (den) as [B*H, L]
  int64_t sidx;   // its state [sidx, ma, dc]
  int64_t t0;     // physical row of its row 0
  int64_t len;    // its rows
  int64_t bidx;   // boundary states: (bidx, cbase + c)
  int64_t cbase;
};

__device__ __forceinline__ Seq seq_of(const Product& p, int64_t sidx) {
  const int64_t n = sidx / p.H;
  const int32_t h = int32_t(sidx % p.H);
  if (p.seq_off == nullptr) return Seq{int32_t(n), h, sidx, sidx, 0, p.L, sidx, 0};
  const int64_t t0 = p.seq_off[n];
  return Seq{0, h, h, sidx, t0, p.seq_off[n + 1] - t0, h, p.chunk_off[n]};
}

// The sequence holding global chunk g (packed sequences): the last n with chunk_off[n] <= g.
__device__ __forceinline__ int64_t seq_of_chunk(const Product& p, int64_t g) {
  int64_t lo = 0, hi = p.nseq - 1;  // chunk_off[0] = 0 <= g < chunk_off[nseq]
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.chunk_off[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}


template <typename T>
__device__ __forceinline__ float load_operand(const Operand& p, int64_t b, int64_t h, int64_t bh, int64_t L,
                                              int64_t t, int64_t f) {
  if (f < p.nfeat) {
    float x = to_float(static_cast<const T*>(p.data)[b * p.sb + h * p.sh + t * p.sl + f * p.sf]);
    if (p.row_div != nullptr) x = x / p.row_div[bh * L + t];
    return x;
  }
  if (f == p.nfeat) {
    if (p.extra_kind == kExtraOnes) return 1.0f;
    if (p.extra_kind == kExtraDden) {
      // recomputed where it is loaded (no [B*H*L] scratch): one dot over D per row and tile
      const T* x = static_cast<const T*>(p.data) + b * p.sb + h * p.sh + t * p.sl;
      const T* y = static_cast<const T*>(p.dot) + b * p.db + h * p.dh + t * p.dl;
      float acc = 0.0f;
      for (int64_t d = 0; d < p.nfeat; ++d) acc = fmaf(to_float(x[d * p.sf]), to_float(y[d * p.df]), acc);
      return -acc / p.row_div[bh * L + t];
    }
  }
  return 0.0f;
}

// dst[f][r] = operand(t0 + r, f0 + f) for r < rows (0 past the operand's width). Rows
// past `rows` are left as they are (zero or an earlier chunk's): no output or state update
// uses them.
// `scale` (NULL: none): row r multiplied by scale[r] (a gated product's state update).
template <typename T>
__device__ void load_rows_t(float (*dst)[kChunk + 1], const Operand& p, int64_t b, int64_t h, int64_t bh, int64_t L,
                            int64_t t0, int rows, int64_t f0, const float* scale = nullptr) {
  const int64_t width = p.width();
  for (int i = threadIdx.x; i < kTF * rows; i += kThreads) {
    const int f = i % kTF, r = i / kTF;  // consecutive threads: consecutive features
    float x = f0 + f < width ? load_operand<T>(p, b, h, bh, L, t0 + r, f0 + f) : 0.0f;
    if (scale != nullptr) x = x * scale[r];
    dst[f][r] = x;
  }
}

// dst[r][d] = operand(t0 + r, d0 + d) for r < rows (0 past the width; rows past `rows` as
// in load_rows_t).
template <typename T>
__device__ void load_rows_c(float (*dst)[kTD], const Operand& p, int64_t b, int64_t h, int64_t bh, int64_t L,
                            int64_t t0, int rows, int64_t d0) {
  const int64_t width = p.width();
  for (int i = threadIdx.x; i < rows * kTD; i += kThreads) {
    const int d = i % kTD, r = i / kTD;
    dst[r][d] = d0 + d < width ? load_operand<T>(p, b, h, bh, L, t0 + r, d0 + d) : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------
// Decay (gated products, issue 41). Within a chunk of rows t0..t0+n-1, with the log-decays a_r:
//   Lam_r = sum_{r' <= r} a_r' over the rows since the chunk's start or the last reset (a row
//   with a_r = -inf: Lam_r = 0 there), seg_r = that reset row (-1: none in the chunk),
// and a weight from an earlier row j to a later row i (nothing crosses a reset; differences
// only, Lam non-increasing within a segment, so never exp of a positive number):
//   pair(i, j) = exp(Lam_i - Lam_j) if seg_i == seg_j, else exactly 0
//   enter_r = exp(Lam_r) if seg_r == -1 (from the state entering the chunk to row r), else 0
//   exit_r  = pair(n-1, r) (from row r to the chunk's last row),  whole = enter_{n-1}.
// A product walking LE (forward, dq) reads o_t = enter_t a_t S + sum_s pair(t, s) (a_t.b_s) c_s
// and updates S <- whole S + sum_s exit_s b_s c_s^T; one walking GE (dk, dv) reads
// o_s = exit_s a_s R + sum_{t>=s} pair(t, s) (a_s.b_t) c_t and updates R <- whole R +
// sum_t enter_t b_t c_t^T. With a = 0 every weight is exactly 1 and every multiplication by it
// exact: the ungated product's results bit for bit.
struct DecayTable {
  float lam[kChunk];
  int seg[kChunk];
  float enter[kChunk];
  float exit[kChunk];
  float whole;
};
__device__ __forceinline__ DecayTable& decay_table() {
  __shared__ DecayTable table;
  return table;
}

// Fills the table for the chunk of `rows` rows at t0 (rows past it: weights 0, lam 0, seg -2).
// Begins and ends with a barrier (the previous chunk's readers are done; every thread sees it).
__device__ void load_decay(const Product& p, const Seq& sq, int64_t t0, int rows) {
  DecayTable& d = decay_table();
  __syncthreads();
  if (threadIdx.x == 0) {
    const float* a = p.decay.a + sq.b * p.decay.sb + sq.h * p.decay.sh;
    float lam = 0.0f;
    int seg = -1;
    for (int r = 0; r < rows; ++r) {
      const float x = a[(t0 + r) * p.decay.sl];
      if (x == -INFINITY) {
        seg = r;
        lam = 0.0f;
      } else {
        lam = lam + x;
      }
      d.lam[r] = lam;
      d.seg[r] = seg;
    }
    for (int r = rows; r < kChunk; ++r) {
      d.lam[r] = 0.0f;
      d.seg[r] = -2;
    }
  }
  __syncthreads();
  const int r = threadIdx.x;
  if (r < kChunk) {
    const int last = rows - 1;
    const bool in = r < rows;
    d.enter[r] = in && d.seg[r] == -1 ? expf(d.lam[r]) : 0.0f;
    d.exit[r] = in && d.seg[r] == d.seg[last] ? expf(d.lam[last] - d.lam[r]) : 0.0f;
    if (r == 0) d.whole = d.seg[last] == -1 ? expf(d.lam[last]) : 0.0f;
  }
  __syncthreads();
}

// pair(i, j), i the later row.
__device__ __forceinline__ float decay_pair(int i, int j) {
  const DecayTable& d = decay_table();
  return d.seg[i] == d.seg[j] ? expf(d.lam[i] - d.lam[j]) : 0.0f;
}
// The weight of the masked intra-chunk product's entry (row r, column s): LE s <= r, GE s >= r.
template <int kMask>
__device__ __forceinline__ float intra_weight(int r, int s) {
  return kMask == kMaskGE ? decay_pair(s, r) : decay_pair(r, s);
}
// Row r's weight of the state entering the chunk (a_r S): LE enter_r, GE exit_r.
template <int kMask>
__device__ __forceinline__ float inter_weight(int r) {
  return kMask == kMaskGE ? decay_table().exit[r] : decay_table().enter[r];
}
// The rows' weights of the state update (b_r c_r^T): LE exit, GE enter; NULL without decay.
template <bool kDecay, int kMask>
__device__ __forceinline__ const float* update_scale() {
  if constexpr (!kDecay) return nullptr;
  return kMask == kMaskGE ? decay_table().enter : decay_table().exit;
}
// The state's new value: whole * S + U (S + U without decay: fmaf(S, 1, U) is the same bits).
template <bool kDecay>
__device__ __forceinline__ float decayed_sum(float s, float u) {
  if constexpr (kDecay) return fmaf(s, decay_table().whole, u);
  return s + u;
}

struct Tiles {
  float a[kTF][kChunk + 1];
  float b[kTF][kChunk + 1];
  float s[kTF][kTD];
  float p[kChunk][kChunk + 1];
  float c[kChunk][kTD];
};

// The per-row denominators of a self-normalising product (Product::self_norm). Thread t owns
// row t / 4 and a quarter of its terms (8 features of a feature tile, 16 columns of P); the
// four quarters are summed across the lanes in a fixed order, so every launch and every
// D-tile's block gets the same bits.
constexpr int kDenLanes = 4;
static_assert(kChunk * kDenLanes == kThreads, "denominators: 4 threads per row");

// a_t . z over this feature tile: `a(r, f)` the tile's value at row r, feature f; z read from
// the state entering the chunk (column p.dc).
template <typename A>
__device__ __forceinline__ float den_inter(float part, const Product& p, const StateView& sv, int64_t sv_bh,
                                           int64_t sv_chunk, int64_t f0, A a) {
  const int tid = fresh_tid(), r = tid / kDenLanes, f = (tid % kDenLanes) * (kTF / kDenLanes);
#pragma unroll
  for (int j = 0; j < kTF / kDenLanes; ++j)
    if (f0 + f + j < p.ma) part = fmaf(a(r, f + j), *sv.at(sv_bh, sv_chunk, f0 + f + j, p.dc), part);
  return part;
}

// + sum over this thread's 16 columns s < rows of P(r, s), the masked intra-chunk products.
template <typename P>
__device__ __forceinline__ float den_intra(float part, int rows, P pm) {
  const int tid = fresh_tid(), r = tid / kDenLanes, c = (tid % kDenLanes) * (kChunk / kDenLanes);
#pragma unroll
  for (int j = 0; j < kChunk / kDenLanes; ++j)
    if (c + j < rows) part += pm(r, c + j);
  return part;
}

// g(part summed over the row's four threads): the guarded denominator, the same in all four.
__device__ __forceinline__ float den_final(float part, const Product& p) {
  part += __shfl_xor_sync(0xffffffffu, part, 1);
  part += __shfl_xor_sync(0xffffffffu, part, 2);
  return part >= 0.0f ? part + p.eps : part - p.eps;
}

// Writes row r's denominator to `den_rows` (shared) and, from the block of D-tile 0, to p.den.
__device__ __forceinline__ void den_store(float den, float* den_rows, const Product& p, const Seq& sq, int64_t t0,
                                          int rows, int64_t d0) {
  const int tid = fresh_tid(), r = tid / kDenLanes;
  if (tid % kDenLanes != 0) return;
  den_rows[r] = den;
  if (d0 == 0 && r < rows) p.den[sq.bh * p.rs + t0 + r] = den;
}

// The block's denominators of the chunk's rows, from den_store to the output loop.
__device__ __forceinline__ float* den_rows() {
  __shared__ float rows[kChunk];
  return rows;
}

// Per warp of the tensor-core chunk_outputs: whether the 8 rows of C_c it loaded hold a value
// that is not finite in bf16 (see diagonal_block).
__device__ __forceinline__ int* c_nonfinite() {
  __shared__ int flags[kThreads / kWarpSize];
  return flags;
}

// The state update's column of z in a self-normalising product (D-tile 0's block): the chunk
// sum over this feature tile, u_f = sum_r b(r, f) in row order, written to column p.dc of `dst`
// (kChunkSum) or added to the state's (the walk: the same f32 operations as the scan's).
// With `blocks` (a tensor-core update: b(r, f, part) gives B's hi (part 0) and lo (part 1)),
// per 16-row block first the hi parts, then the lo parts: the order in which dq's MMA sums its
// state's row of ones times B's pairs (S'^T), so that both give the same bits.
template <bool kNorm, bool kDecay, bool kBlocks = false, typename B>
__device__ __forceinline__ void z_update(const Product& p, const Seq& sq, int rows, int64_t f0, int64_t d0,
                                         const StateView* dst, int64_t dst_bh, int64_t dst_chunk, B b) {
  const int f = fresh_tid();
  if (!kNorm || d0 != 0 || f >= kTF || f0 + f >= p.ma) return;
  float u = 0.0f;
  if constexpr (kBlocks) {
    for (int r0 = 0; r0 < rows; r0 += 16) {
      const int end = r0 + 16 < rows ? r0 + 16 : rows;
      for (int r = r0; r < end; ++r) u += b(r, f, 0);
      for (int r = r0; r < end; ++r) u += b(r, f, 1);
    }
  } else {
    for (int r = 0; r < rows; ++r) u += b(r, f);
  }
  if (dst != nullptr) {
    *dst->at(dst_bh, dst_chunk, f0 + f, p.dc) = u;
  } else {
    float* z = p.state.at(sq.sidx, 0, f0 + f, p.dc);
    *z = decayed_sum<kDecay>(*z, u);
  }
}

// Output element (t, d) of (b, h) = x: as T, or as f32 (o.f32), added to what is there
// (o.accumulate).
template <typename T>
__device__ __forceinline__ void store_out(const OutView& o, int64_t b, int64_t h, int64_t t, int64_t d, float x) {
  const int64_t i = b * o.sb + h * o.sh + t * o.sl + d * o.sf;
  if (o.f32) {
    float* y = static_cast<float*>(o.data) + i;
    *y = o.accumulate ? *y + x : x;
  } else {
    static_cast<T*>(o.data)[i] = from_float<T>(x);
  }
}
// The row dot's other factor: element (t, d) of o.dot.
template <typename T>
__device__ __forceinline__ float dot_factor(const OutView& o, int64_t b, int64_t h, int64_t t, int64_t d) {
  return to_float(static_cast<const T*>(o.dot)[b * o.db + h * o.dh + t * o.dl + d * o.df]);
}
// D-tile d0's part of row t's dot.
__device__ __forceinline__ void store_dot(const Product& p, int64_t bh, int64_t t, int64_t d0, float x) {
  p.o.dots[(d0 / kTD) * p.o.dots_tile + bh * p.rs + t] = x;
}

// S[:, d0:d0+kTD] += B_c^T C_c (C_c already in tiles.c). Each thread owns 4 state
// elements per feature tile, so the read-modify-write of the global state has one writer.
// With `dst` (kChunkSum): writes U_c = B_c^T C_c to dst at (dst_bh, dst_chunk) instead (the
// same f32 value as 0 + U_c, so a scan of them rounds exactly as the sequential walk).
// (kLo: the tensor-core overload's; f32 tiles have no lo half.)
template <typename T, int kLo, bool kNorm, bool kDecay, int kMask, int kMode>
__device__ void update_state(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                             const StateView* dst = nullptr, int64_t dst_bh = 0, int64_t dst_chunk = 0) {
  const int fr = threadIdx.x / 8, dcol = (threadIdx.x % 8) * 4;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_t<T>(tl.b, p.b, sq.b, sq.h, sq.bh, p.rs, t0, rows, f0, p.scale_c ? nullptr : update_scale<kDecay, kMask>());
    __syncthreads();
    z_update<kNorm, kDecay>(p, sq, rows, f0, d0, dst, dst_bh, dst_chunk, [&](int r, int f) { return tl.b[f][r]; });
    float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < rows; ++r) {
      const float bv = tl.b[fr][r];
      if constexpr (kDecay) {
        const float w = p.scale_c ? update_scale<kDecay, kMask>()[r] : 1.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = fmaf(bv, tl.c[r][dcol + j] * w, u[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = fmaf(bv, tl.c[r][dcol + j], u[j]);
      }
    }
    if (f0 + fr < p.ma) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (d0 + dcol + j >= p.dc) continue;
        if (dst != nullptr) {
          *dst->at(dst_bh, dst_chunk, f0 + fr, d0 + dcol + j) = u[j];
        } else {
          float* s = p.state.at(sq.sidx, 0, f0 + fr, d0 + dcol + j);
          *s = decayed_sum<kDecay>(*s, u[j]);
        }
      }
    }
  }
  __syncthreads();
}

// Outputs of one chunk: O = A_c S + mask(A_c B_c^T) C_c, written to p.o. `sv` at
// (sv_bh, sv_chunk) is the state to read (nullptr base: no inter-chunk term). Leaves C_c in
// tiles.c.
template <typename T, int kMask, int kLo, bool kNorm, bool kDecay>
__device__ void chunk_outputs(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                              const StateView& sv, int64_t sv_bh, int64_t sv_chunk, bool intra) {
  const int64_t b = sq.b, h = sq.h, bh = sq.bh;
  const int py = threadIdx.x / 16, px = threadIdx.x % 16;  // P: rows py*4.., cols px*4..
  const int oy = (threadIdx.x / 8) * 2, ox = (threadIdx.x % 8) * 4;  // O: rows oy, oy+1; cols ox..
  float acc_p[4][4] = {};
  float acc_o[2][4] = {};
  float den = 0.0f;  // self_norm: this thread's part of row tid / 4's denominator
  const bool inter = sv.base != nullptr;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_t<T>(tl.a, p.a, b, h, bh, p.rs, t0, rows, f0);
    if (intra) load_rows_t<T>(tl.b, p.b, b, h, bh, p.rs, t0, rows, f0);
    const int kmax = p.ma - f0 < kTF ? int(p.ma - f0) : kTF;
    if (inter) {
      for (int i = threadIdx.x; i < kmax * kTD; i += kThreads) {
        const int f = i / kTD, d = i % kTD;
        float v = 0.0f;
        if (f0 + f < p.ma && d0 + d < p.dc) {
          v = *sv.at(sv_bh, sv_chunk, f0 + f, d0 + d);
        }
        tl.s[f][d] = v;
      }
    }
    __syncthreads();
    if (kNorm && inter)
      den = den_inter(den, p, sv, sv_bh, sv_chunk, f0, [&](int r, int f) { return tl.a[f][r]; });
    // features past ma are not loaded: skip them (small M, and the last tile)
    for (int k = 0; k < kmax; ++k) {
      if (intra) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          av[i] = tl.a[k][py * 4 + i];
          bv[i] = tl.b[k][px * 4 + i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc_p[i][j] = fmaf(av[i], bv[j], acc_p[i][j]);
      }
      if (inter) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float av = tl.a[k][oy + i];
#pragma unroll
          for (int j = 0; j < 4; ++j) acc_o[i][j] = fmaf(av, tl.s[k][ox + j], acc_o[i][j]);
        }
      }
    }
  }
  __syncthreads();
  if (intra) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = py * 4 + i, s = px * 4 + j;
        float x = acc_p[i][j];
        if constexpr (kDecay) x = x * intra_weight<kMask>(r, s);
        tl.p[r][s] = visible<kMask>(r, s) ? x : 0.0f;
      }
  }
  load_rows_c<T>(tl.c, p.c, b, h, bh, p.rs, t0, rows, d0);
  __syncthreads();
  if constexpr (kDecay) {
    if (inter) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float w = inter_weight<kMask>(oy + i);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc_o[i][j] = acc_o[i][j] * w;
      }
    }
  }
  if (kNorm) {
    if (kDecay && inter) den = den * inter_weight<kMask>(fresh_tid() / kDenLanes);
    if (intra) den = den_intra(den, rows, [&](int r, int c) { return tl.p[r][c]; });
    den_store(den_final(den, p), den_rows(), p, sq, t0, rows, d0);
    __syncthreads();
  }
  if (intra) {
    for (int s = 0; s < rows; ++s) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (!visible<kMask>(oy + i, s)) continue;  // a masked 0 times a non-finite c_s is NaN
        const float pv = tl.p[oy + i][s];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc_o[i][j] = fmaf(pv, tl.c[s][ox + j], acc_o[i][j]);
      }
    }
  }
  float dot[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = oy + i;
    if (r >= rows) continue;
    const int64_t t = t0 + r;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t d = d0 + ox + j;
      if (d >= p.dc) continue;
      float x = acc_o[i][j];
      if (kNorm) x = x / den_rows()[r];
      if (p.o.row_div != nullptr) x = x / p.o.row_div[bh * p.rs + t];
      store_out<T>(p.o, b, h, t, d, x);
      if (p.o.dots != nullptr) dot[i] = fmaf(x, dot_factor<T>(p.o, b, h, t, d), dot[i]);
    }
  }
  if (p.o.dots != nullptr) {
    // the 8 threads of a row pair (ox = 4 * (tid % 8)), summed in a fixed order
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 1);
      dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 2);
      dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 4);
      if (threadIdx.x % 8 == 0 && oy + i < rows) store_dot(p, bh, t0 + oy + i, d0, dot[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tensor-core path (f16 and bf16 inputs): the same products on 16x16x16 bf16 MMAs with f32
// accumulators, every operand as a pair of bf16 tiles (split_mma.cuh: the pairs and their
// error); a bf16 input's lo tile is zero and its MMAs are skipped (LoTiles).
//
// Per block (8 warps), for one chunk and D-tile: P (64 x 64) is 4 x 4 blocks of 16 x 16, two
// per warp (row block warp/2, column blocks 2*(warp%2) + 0, 1), blocks the mask hides
// skipped; O (64 x 32) is 4 x 2 blocks, one per warp, accumulated in one fragment over the
// feature tiles (A S), then over the chunk's rows (mask(P) C); U = B^T C (32 x 32 per feature
// tile) is 2 x 2 blocks on warps 0-3. Operand tiles are row-major [row][column] in shared
// memory; B^T is B's tile read column-major. Threads write 16-bit tiles in pairs (4 bytes).

// Leading dimensions (elements). Padding spreads a 16 x 16 block's rows over the banks; the C
// tile is unpadded to stay within 48 KiB of static shared memory.
constexpr int kLdAB = kTF + 8;     // A_c, B_c: [64 rows][32 features] bf16
constexpr int kLdS = kTD + 8;      // the state tile: [32 features][32 columns] bf16
constexpr int kLdP = kChunk + 8;   // mask(P): [64][64] bf16
constexpr int kLdPf = kChunk + 4;  // P as accumulated: [64][64] f32
constexpr int kLdC = kTD;          // C_c: [64 rows][32 columns] bf16
constexpr int kLdO = kTD + 4;      // O and U staged for their global writes: f32

// 47 104 bytes: x and y are each reused by the phases of a chunk (their uses are separated by
// block barriers).
struct TcTiles {
  union alignas(32) {
    struct {
      SplitTile<kChunk, kLdAB> a, b;
    } ab;                        // the feature loop (and B_c in the state update)
    struct {
      SplitTile<kChunk, kLdAB> a;
      SplitTile<kTF, kLdS> s;
    } a_s;                       // A_c S of chunk_outputs_tiles (a: the same bytes as ab.a)
    float pf[kChunk * kLdPf];    // P after it
    float o[kChunk * kLdO];      // O before its global write
  } x;
  union alignas(32) {
    SplitTile<kTF, kLdS> s;      // the feature loop
    SplitTile<kChunk, kLdP> p;   // mask(P) C
    float u[kTF * kLdO];         // U before its global write
  } y;
  SplitTile<kChunk, kLdC> c;
};

// Which operands' tiles have a lo half in the MMAs (a template parameter of the kernel, so that
// no run-time flag costs registers): a bf16 input is exact in hi, so its lo MMAs are skipped
// unless the loaded values are f32 ones (rows divided by the denominator, the dden column);
// f16 inputs always need lo. lo_mask() picks the instance per product.
enum LoTiles { kLoC = 1, kLoB = 2, kLoA = 4, kLoAll = 7 };

// dst[r][c] = operand(t0 + r, c0 + c) split, for 64 rows and 32 columns (a feature tile of A_c,
// B_c or a D-tile of C_c: kTF = kTD); 0 past `rows` and past the operand's width. One run of 8
// columns per thread: a 16-byte load when the operand's rows allow it (rows16) and the run lies
// inside its stored columns, else 8 element loads (strided operands, the virtual column, the
// last run of a width that is not a multiple of 8). Either way the same floats, so the same bits.
static_assert(kTF == kTD, "load_rows_split loads feature tiles and D-tiles alike");
static_assert(kChunk * (kTF / 8) == kThreads, "load_rows_split: one run of 8 columns per thread");
template <typename T, int kLd>
__device__ void load_rows_split(SplitTile<kChunk, kLd>& dst, const Operand& p, const Seq& sq, int64_t L, int64_t t0,
                                int rows, int64_t c0, const float* scale = nullptr) {
  static_assert(kLd % 8 == 0, "16-byte runs in shared memory");
  const int tid = fresh_tid();
  const int r = tid / (kTF / 8), c = (tid % (kTF / 8)) * 8;
  if (r < rows && p.rows16 && c0 + c + 8 <= p.nfeat) {
    const int64_t t = t0 + r;
    const Vec16<T> v = load16(static_cast<const T*>(p.data) + sq.b * p.sb + sq.h * p.sh + t * p.sl + (c0 + c));
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = to_float(v.v[j]);
    if (p.row_div != nullptr) {
      const float div = p.row_div[sq.bh * L + t];
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = x[j] / div;
    }
    if (scale != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = x[j] * scale[r];
    }
    put_split8(dst.hi, dst.lo, r * kLd + c, x);
    return;
  }
  const int64_t width = p.width();
#pragma unroll 1
  for (int j = 0; j < 8; j += 2) {
    const int64_t f = c0 + c + j;
    float x0 = r < rows && f < width ? load_operand<T>(p, sq.b, sq.h, sq.bh, L, t0 + r, f) : 0.0f;
    float x1 = r < rows && f + 1 < width ? load_operand<T>(p, sq.b, sq.h, sq.bh, L, t0 + r, f + 1) : 0.0f;
    if (scale != nullptr && r < rows) {
      x0 = x0 * scale[r];
      x1 = x1 * scale[r];
    }
    put_split(dst.hi, dst.lo, r * kLd + c + j, x0, x1);
  }
}

// Row block bi of P sees column block bj under the mask (a block the mask hides entirely is
// skipped): the same rule on 16-row blocks.
template <int kMask>
__device__ __forceinline__ bool block_visible(int bi, int bj) {
  return visible<kMask>(bi, bj);
}

// Each warp flags whether its threads' runs of the freshly loaded C_c (load_rows_split's: 8 rows
// per warp) hold a non-finite bf16 value (hi: a lo half is always finite).
__device__ __forceinline__ void flag_nonfinite_rows(const SplitTile<kChunk, kLdC>& c) {
  const int tid = fresh_tid();
  const int r = tid / (kTD / 8), col = (tid % (kTD / 8)) * 8;
  bool bad = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) bad |= !is_finite(__bfloat162float(c.hi[r * kLdC + col + j]));
  const bool any = __any_sync(0xffffffffu, bad);
  if (tid % kWarpSize == 0) c_nonfinite()[tid / kWarpSize] = any ? 1 : 0;
}

// Adds the diagonal block of mask(P) C_c to the warp's 16 x 16 block of O (staged in tl.x.o):
// O[r][c] += sum over the block's visible s of P[r][s] C[s][c], scalar FMAs in s order from
// the split tiles (a pair's hi + lo), so that a masked entry multiplies nothing.
template <int kMask>
__device__ void diagonal_block(TcTiles& tl, int wi, int wo) {
  __syncwarp();  // the warp's store_matrix_sync is done
  const int lane = fresh_tid() % kWarpSize;
  const int r = wi * 16 + lane / 2, c0 = wo * 16 + (lane % 2) * 8;
#pragma unroll 1
  for (int j = 0; j < 8; ++j) {
    float x = tl.x.o[r * kLdO + c0 + j];
#pragma unroll 1
    for (int s = wi * 16; s < wi * 16 + 16; ++s)
      if (visible<kMask>(r, s)) x = fmaf(split_value(tl.y.p, r * kLdP + s), split_value(tl.c, s * kLdC + c0 + j), x);
    tl.x.o[r * kLdO + c0 + j] = x;
  }
}

// The feature loop of a chunk's tensor-core products, over the tiles of Ma: P = A_c B_c^T into
// acc_p (intra: the warp's two 16 x 16 blocks, those the mask hides skipped), A_c S into acc_o
// (inter: the state tile of D-tile d0 at (sv_bh, sv_chunk), loaded into `s`), and this thread's
// part of a_t . z into `den` (den_part). A_c is in tl.x.ab.a, B_c in tl.x.ab.b.
template <typename T, int kMask, int kLo>
__device__ __forceinline__ void feature_loop(TcTiles& tl, SplitTile<kTF, kLdS>& s, const Product& p, const Seq& sq,
                                             int64_t t0, int rows, int64_t d0, const StateView& sv, int64_t sv_bh,
                                             int64_t sv_chunk, bool intra, bool inter, bool den_part,
                                             FragAcc (&acc_p)[2], FragAcc& acc_o, float& den) {
  const int warp = fresh_tid() / kWarpSize;
  const int wi = warp / 2, wp = (warp % 2) * 2, wo = warp % 2;
  constexpr bool a_lo = (kLo & kLoA) != 0, b_lo = (kLo & kLoB) != 0;
  FragA ah, al;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_split<T>(tl.x.ab.a, p.a, sq, p.rs, t0, rows, f0);
    if (intra) load_rows_split<T>(tl.x.ab.b, p.b, sq, p.rs, t0, rows, f0);
    if (inter) {
      // 4 consecutive columns of one state row per thread
      static_assert(kTF * kTD == 4 * kThreads, "the state tile: 4 elements per thread");
      const int tid = fresh_tid();
      const int f = tid / (kTD / 4), d = (tid % (kTD / 4)) * 4;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        v[j] = f0 + f < p.ma && d0 + d + j < p.dc ? *sv.at(sv_bh, sv_chunk, f0 + f, d0 + d + j) : 0.0f;
      put_split(s.hi, s.lo, f * kLdS + d, v[0], v[1]);
      put_split(s.hi, s.lo, f * kLdS + d + 2, v[2], v[3]);
    }
    __syncthreads();
    if (den_part)
      den = den_inter(den, p, sv, sv_bh, sv_chunk, f0, [&](int r, int f) { return split_value(tl.x.ab.a, r * kLdAB + f); });
#pragma unroll 1
    for (int kk = 0; kk < kTF / 16; ++kk) {
      wmma::load_matrix_sync(ah, tl.x.ab.a.hi + wi * 16 * kLdAB + kk * 16, kLdAB);
      if (a_lo) wmma::load_matrix_sync(al, tl.x.ab.a.lo + wi * 16 * kLdAB + kk * 16, kLdAB);
      if (intra) {
        for (int j = 0; j < 2; ++j) {
          if (!block_visible<kMask>(wi, wp + j)) continue;
          FragBt bh, bl;  // B_c^T: B's [row][feature] tile read column-major
          wmma::load_matrix_sync(bh, tl.x.ab.b.hi + (wp + j) * 16 * kLdAB + kk * 16, kLdAB);
          if (b_lo) wmma::load_matrix_sync(bl, tl.x.ab.b.lo + (wp + j) * 16 * kLdAB + kk * 16, kLdAB);
          mma_split(acc_p[j], ah, al, a_lo, bh, bl, b_lo);
        }
      }
      if (inter) {
        FragB sh, sl;
        wmma::load_matrix_sync(sh, s.hi + kk * 16 * kLdS + wo * 16, kLdS);
        wmma::load_matrix_sync(sl, s.lo + kk * 16 * kLdS + wo * 16, kLdS);
        mma_split(acc_o, ah, al, a_lo, sh, sl, true);
      }
    }
  }
  __syncthreads();
}

// mask(P) as split tiles in tl.y.p, from the accumulated acc_p (staged in tl.x.pf), and the
// intra part of this thread's denominator (self_norm). Ends without a barrier: what follows
// loads its own tiles first (C_c, or a feature loop after its barrier).
template <int kMask, bool kNorm, bool kDecay>
__device__ __forceinline__ float stage_p(TcTiles& tl, const Product& p, int rows, FragAcc (&acc_p)[2], float den) {
  const int warp = fresh_tid() / kWarpSize;
  const int wi = warp / 2, wp = (warp % 2) * 2;
  for (int j = 0; j < 2; ++j)
    wmma::store_matrix_sync(tl.x.pf + wi * 16 * kLdPf + (wp + j) * 16, acc_p[j], kLdPf, wmma::mem_row_major);
  __syncthreads();
  // two runs of 8 columns of one row per thread
  static_assert(kChunk * kChunk == 16 * kThreads, "mask(P): 16 elements per thread");
  const int tid = fresh_tid();
  const int r = tid / (kChunk / 16), c = (tid % (kChunk / 16)) * 16;
#pragma unroll
  for (int h = 0; h < 16; h += 8) {
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int s = c + h + j;
      float v = tl.x.pf[r * kLdPf + s];
      if constexpr (kDecay) v = v * intra_weight<kMask>(r, s);
      x[j] = visible<kMask>(r, s) ? v : 0.0f;
    }
    put_split8(tl.y.p.hi, tl.y.p.lo, r * kLdP + c + h, x);
  }
  if (kNorm)
    den = den_intra(den, rows, [&](int r, int s) {
      float v = tl.x.pf[r * kLdPf + s];
      if constexpr (kDecay) v = v * intra_weight<kMask>(r, s);
      return visible<kMask>(r, s) ? v : 0.0f;
    });
  return den;
}

// The end of a chunk's outputs for D-tile d0: O = acc_o (A_c S, already accumulated) +
// mask(P) C_c (intra: mask(P) in tl.y.p; C_c loaded into tl.c and left there), written to p.o
// (divided by the denominators in den_rows() when self_norm, by p.o.row_div when given).
template <typename T, int kMask, int kLo, bool kNorm, bool kDecay>
__device__ __forceinline__ void finish_outputs(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows,
                                               int64_t d0, bool intra, bool inter, FragAcc& acc_o) {
  const int warp = fresh_tid() / kWarpSize;
  const int wi = warp / 2, wo = warp % 2;
  constexpr bool c_lo = (kLo & kLoC) != 0;
  if (intra) {
    load_rows_split<T>(tl.c, p.c, sq, p.rs, t0, rows, d0);
    if (kMask != kMaskNone) flag_nonfinite_rows(tl.c);
  }
  __syncthreads();
  // A masked zero of P times a non-finite c_s is NaN (0 x inf), and in an MMA it reaches the
  // rows that do not see s. Only the diagonal 16 x 16 block of P mixes rows that see s with
  // rows that do not (hidden blocks are skipped): where C's rows of that block hold a
  // non-finite value, the block is summed with scalar FMAs over its visible entries instead.
  const bool diagonal_scalar =
      intra && kMask != kMaskNone && (c_nonfinite()[2 * wi] != 0 || c_nonfinite()[2 * wi + 1] != 0);
  if constexpr (kDecay) {
    // A_c S's rows times their inter-chunk weights, through the warp's own block of the
    // staging tile (every thread is past the barrier: nothing reads tl.x there any more)
    if (inter) {
      float* blk = tl.x.o + wi * 16 * kLdO + wo * 16;
      wmma::store_matrix_sync(blk, acc_o, kLdO, wmma::mem_row_major);
      __syncwarp();
      const int lane = fresh_tid() % kWarpSize, r = lane / 2, c = (lane % 2) * 8;
      const float w = inter_weight<kMask>(wi * 16 + r);
#pragma unroll
      for (int j = 0; j < 8; ++j) blk[r * kLdO + c + j] = blk[r * kLdO + c + j] * w;
      __syncwarp();
      wmma::load_matrix_sync(acc_o, blk, kLdO, wmma::mem_row_major);
    }
  }
  if (intra) {
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      if (!block_visible<kMask>(wi, kk) || kk * 16 >= rows || (diagonal_scalar && kk == wi)) continue;
      FragA ph, pl;
      FragB ch, cl;
      wmma::load_matrix_sync(ph, tl.y.p.hi + wi * 16 * kLdP + kk * 16, kLdP);
      wmma::load_matrix_sync(pl, tl.y.p.lo + wi * 16 * kLdP + kk * 16, kLdP);
      wmma::load_matrix_sync(ch, tl.c.hi + kk * 16 * kLdC + wo * 16, kLdC);
      if (c_lo) wmma::load_matrix_sync(cl, tl.c.lo + kk * 16 * kLdC + wo * 16, kLdC);
      mma_split(acc_o, ph, pl, true, ch, cl, c_lo);
    }
  }
  wmma::store_matrix_sync(tl.x.o + wi * 16 * kLdO + wo * 16, acc_o, kLdO, wmma::mem_row_major);
  if (diagonal_scalar) diagonal_block<kMask>(tl, wi, wo);
  __syncthreads();
  // 8 consecutive columns of one row per thread
  static_assert(kChunk * kTD == 8 * kThreads, "O: 8 elements per thread");
  const int tid = fresh_tid();
  const int r = tid / (kTD / 8), d = (tid % (kTD / 8)) * 8;
  float dot = 0.0f;
  if (r < rows && d0 + d < p.dc) {
    const int64_t t = t0 + r;
    const float div = p.o.row_div != nullptr ? p.o.row_div[sq.bh * p.rs + t] : 1.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (d0 + d + j >= p.dc) break;
      float x = tl.x.o[r * kLdO + d + j];
      if (kNorm) x = x / den_rows()[r];
      if (p.o.row_div != nullptr) x = x / div;
      store_out<T>(p.o, sq.b, sq.h, t, d0 + d + j, x);
      if (p.o.dots != nullptr) dot = fmaf(x, dot_factor<T>(p.o, sq.b, sq.h, t, d0 + d + j), dot);
    }
  }
  if (p.o.dots != nullptr) {
    // the 4 threads of a row, summed in a fixed order
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    dot += __shfl_xor_sync(0xffffffffu, dot, 2);
    if (tid % (kTD / 8) == 0 && r < rows) store_dot(p, sq.bh, t0 + r, d0, dot);
  }
}

// The tensor-core chunk_outputs (same contract, except that C_c is loaded, and left in tl.c,
// only when `intra`: the bidirectional outputs A S do not read it). One feature loop for P and
// A S together (the walks: one D-tile per block).
template <typename T, int kMask, int kLo, bool kNorm, bool kDecay>
__device__ void chunk_outputs(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                              const StateView& sv, int64_t sv_bh, int64_t sv_chunk, bool intra) {
  const bool inter = sv.base != nullptr;
  FragAcc acc_p[2], acc_o;
  wmma::fill_fragment(acc_p[0], 0.0f);
  wmma::fill_fragment(acc_p[1], 0.0f);
  wmma::fill_fragment(acc_o, 0.0f);
  float den = 0.0f;  // self_norm: this thread's part of row tid / 4's denominator
  feature_loop<T, kMask, kLo>(tl, tl.y.s, p, sq, t0, rows, d0, sv, sv_bh, sv_chunk, intra, inter,
                              kNorm && inter, acc_p, acc_o, den);
  if (kDecay && kNorm && inter) den = den * inter_weight<kMask>(fresh_tid() / kDenLanes);
  if (intra) den = stage_p<kMask, kNorm, kDecay>(tl, p, rows, acc_p, den);
  if (kNorm) den_store(den_final(den, p), den_rows(), p, sq, t0, rows, d0);
  finish_outputs<T, kMask, kLo, kNorm, kDecay>(tl, p, sq, t0, rows, d0, intra, inter, acc_o);
}

// The outputs of one chunk for the D-tiles [d_begin, d_end) (the per-chunk outputs of the
// decomposition, kReadChunk: intra and inter). P = mask(A_c B_c^T) and the denominators are
// computed once, then each D-tile runs its own feature loop for A_c S (the state tile in
// tl.x.a_s.s, beside A_c, so that mask(P) in tl.y.p stays) and adds P C_c. The same f32
// operations in the same order as chunk_outputs per D-tile: the same bits.
template <typename T, int kMask, int kLo, bool kNorm, bool kDecay>
__device__ void chunk_outputs_tiles(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows,
                                    int64_t d_begin, int64_t d_end, const StateView& sv, int64_t sv_bh,
                                    int64_t sv_chunk) {
  const bool inter = sv.base != nullptr;
  FragAcc acc_p[2], acc_o;
  wmma::fill_fragment(acc_p[0], 0.0f);
  wmma::fill_fragment(acc_p[1], 0.0f);
  float den = 0.0f;
  feature_loop<T, kMask, kLo>(tl, tl.y.s, p, sq, t0, rows, d_begin, sv, sv_bh, sv_chunk, true, false,
                              kNorm && inter, acc_p, acc_o, den);
  if (kDecay && kNorm && inter) den = den * inter_weight<kMask>(fresh_tid() / kDenLanes);
  den = stage_p<kMask, kNorm, kDecay>(tl, p, rows, acc_p, den);
  if (kNorm) den_store(den_final(den, p), den_rows(), p, sq, t0, rows, d_begin);
#pragma unroll 1
  for (int64_t d0 = d_begin; d0 < d_end; d0 += kTD) {
    wmma::fill_fragment(acc_o, 0.0f);
    if (inter)
      feature_loop<T, kMask, kLo>(tl, tl.x.a_s.s, p, sq, t0, rows, d0, sv, sv_bh, sv_chunk, false, true, false,
                                  acc_p, acc_o, den);
    finish_outputs<T, kMask, kLo, kNorm, kDecay>(tl, p, sq, t0, rows, d0, true, inter, acc_o);
  }
}

// U = B_c^T C_c of one feature tile into tl.y.u (warps 0-3: 2 x 2 blocks of 16), with or
// without each operand's lo tile.
template <bool kBLo, bool kCLo>
__device__ __forceinline__ void update_mma(TcTiles& tl, int rows, bool transposed) {
  const int warp = fresh_tid() / kWarpSize;
  if (warp >= 4) return;
  const int fi = warp / 2, dj = warp % 2;
  FragAcc u;
  wmma::fill_fragment(u, 0.0f);
  for (int kk = 0; kk < kChunk / 16 && kk * 16 < rows; ++kk) {
    FragAt bh, bl;  // B_c^T [feature][row]: B's [row][feature] tile read column-major
    FragB ch, cl;
    wmma::load_matrix_sync(bh, tl.x.ab.b.hi + kk * 16 * kLdAB + fi * 16, kLdAB);
    if (kBLo) wmma::load_matrix_sync(bl, tl.x.ab.b.lo + kk * 16 * kLdAB + fi * 16, kLdAB);
    wmma::load_matrix_sync(ch, tl.c.hi + kk * 16 * kLdC + dj * 16, kLdC);
    if (kCLo) wmma::load_matrix_sync(cl, tl.c.lo + kk * 16 * kLdC + dj * 16, kLdC);
    if (kBLo && kCLo && transposed) {
      // hi hi, then B's lo times C's hi, then B's hi times C's lo (Product::transposed)
      wmma::mma_sync(u, bh, ch, u);
      wmma::mma_sync(u, bl, ch, u);
      wmma::mma_sync(u, bh, cl, u);
    } else {
      mma_split(u, bh, bl, kBLo, ch, cl, kCLo);
    }
  }
  wmma::store_matrix_sync(tl.y.u + fi * 16 * kLdO + dj * 16, u, kLdO, wmma::mem_row_major);
}

// Which operand a decayed state update weights (Product::scale_c), per instance: the weighted
// one's values are f32 and need a lo tile, so where one operand has a lo tile already (bf16
// kLoB or kLoC alone) the update weights that one, never the other (two lo fragments live at
// once spill); the chunk sums and state walks weight C only where C alone has a lo tile (dv,
// normalised, bf16), and the walks (kAccumulate) either (the forward B = k, dq C = k). Fixed per
// instance where possible, so that an instance compiles one variant. launch_product refuses a
// product asking for a side its instance does not have.
__host__ __device__ constexpr bool can_scale_c(int mode, int lo) {
  return mode == kAccumulate ? (lo & kLoB) == 0 || (lo & kLoC) != 0 : lo == kLoC;
}
__host__ __device__ constexpr bool can_scale_b(int /*mode: any*/, int lo) {
  return !((lo & kLoC) != 0 && (lo & kLoB) == 0);
}
// The side a product's update weights in this instance: C (true) or B.
template <int kMode, int kLo>
__device__ __forceinline__ bool scales_c(const Product& p) {
  if constexpr (!can_scale_b(kMode, kLo)) return true;
  if constexpr (!can_scale_c(kMode, kLo)) return false;
  return p.scale_c != 0;
}

// The tensor-core update_state (same contract; C_c already in tl.c).
// A decayed update that weights C (scales_c) finds C_c loaded with its weights (load_c_tile's
// scale: the kernel loads it again after a walk's outputs), so that the walk and the chunk sums
// weight the same loaded f32 values.
template <typename T, int kLo, bool kNorm, bool kDecay, int kMask, int kMode>
__device__ void update_state(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                             const StateView* dst = nullptr, int64_t dst_bh = 0, int64_t dst_chunk = 0) {
  constexpr bool kBLo = (kLo & kLoB) != 0, kCLo = (kLo & kLoC) != 0;
  const bool scale_c = kDecay && scales_c<kMode, kLo>(p);
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_split<T>(tl.x.ab.b, p.b, sq, p.rs, t0, rows, f0, scale_c ? nullptr : update_scale<kDecay, kMask>());
    __syncthreads();
    // (the self-normalising products are the forward's: B = k, weighted when decayed)
    z_update<kNorm, kDecay, true>(p, sq, rows, f0, d0, dst, dst_bh, dst_chunk, [&](int r, int f, int part) {
      const int i = r * kLdAB + f;
      return __bfloat162float(part == 0 ? tl.x.ab.b.hi[i] : tl.x.ab.b.lo[i]);
    });
    if constexpr (!kDecay) {
      update_mma<kBLo, kCLo>(tl, rows, p.transposed != 0);
    } else {
      // the weighted operand's values are f32: its lo tile too (one call where both sides give
      // the same instance)
      if constexpr (kBLo && kCLo) {
        update_mma<true, true>(tl, rows, p.transposed != 0);
      } else {
        if constexpr (can_scale_c(kMode, kLo)) {
          if (scale_c) update_mma<kBLo, true>(tl, rows, p.transposed != 0);
        }
        if constexpr (can_scale_b(kMode, kLo)) {
          if (!scale_c) update_mma<true, kCLo>(tl, rows, p.transposed != 0);
        }
      }
    }
    __syncthreads();
    // 4 consecutive columns of one state row per thread
    const int tid = fresh_tid();
    const int f = tid / (kTD / 4), d = (tid % (kTD / 4)) * 4;
    if (f0 + f < p.ma) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (d0 + d + j >= p.dc) break;
        const float x = tl.y.u[f * kLdO + d + j];
        if (dst != nullptr) {
          *dst->at(dst_bh, dst_chunk, f0 + f, d0 + d + j) = x;
        } else {
          float* s = p.state.at(sq.sidx, 0, f0 + f, d0 + d + j);
          *s = decayed_sum<kDecay>(*s, x);
        }
      }
    }
  }
  __syncthreads();
}

// C_c into the tiles (the state update's third operand, when chunk_outputs did not load it).
template <typename T>
__device__ void load_c_tile(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                            const float* /*scale: the FP32 update weights C itself*/ = nullptr) {
  load_rows_c<T>(tl.c, p.c, sq.b, sq.h, sq.bh, p.rs, t0, rows, d0);
}
template <typename T>
__device__ void load_c_tile(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                            const float* scale = nullptr) {
  load_rows_split<T>(tl.c, p.c, sq, p.rs, t0, rows, d0, scale);
}

// The FP32 path's outputs of one chunk for the D-tiles [d_begin, d_end): chunk_outputs per
// D-tile (its launch policy gives it one D-tile per block, value_group()).
template <typename T, int kMask, int kLo, bool kNorm, bool kDecay>
__device__ void chunk_outputs_tiles(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows,
                                    int64_t d_begin, int64_t d_end, const StateView& sv, int64_t sv_bh,
                                    int64_t sv_chunk) {
  for (int64_t d0 = d_begin; d0 < d_end; d0 += kTD)
    chunk_outputs<T, kMask, kLo, kNorm, kDecay>(tl, p, sq, t0, rows, d0, sv, sv_bh, sv_chunk, true);
}

// chunk_outputs' 4x4 products (FP32 path) read every row of the a/b tiles, also the rows past
// a short chunk's last row, which load_rows_t leaves as they are (and whose results are
// dropped): zeroed once, so that no read sees shared memory this block never wrote. The
// tensor-core loaders write zeros there themselves.
__device__ void init_tiles(Tiles& tl) {
  for (int i = threadIdx.x; i < kTF * (kChunk + 1); i += kThreads) {
    tl.a[i / (kChunk + 1)][i % (kChunk + 1)] = 0.0f;
    tl.b[i / (kChunk + 1)][i % (kChunk + 1)] = 0.0f;
  }
}
__device__ void init_tiles(TcTiles&) {}

// Sets the block's state tile [ma, d0:d0+kTD] to `src` (base NULL: zero).
// A self-normalising product's D-tile 0 also owns the state's z column (p.dc).
template <bool kNorm>
__device__ void init_state(const Product& p, int64_t sidx, int64_t d0, const StateView& src) {
  __syncthreads();
  const int64_t cols = kNorm && d0 == 0 ? kTD + 1 : kTD;
  for (int64_t i = threadIdx.x; i < p.ma * cols; i += kThreads) {
    const int64_t f = i / cols, c = i % cols, d = c == kTD ? p.dc : d0 + c;
    if (c < kTD && d >= p.dc) continue;
    *p.state.at(sidx, 0, f, d) = src.base != nullptr ? *src.at(sidx, 0, f, d) : 0.0f;
  }
  __syncthreads();
}

// boundary at (bidx, chunk) = the block's state tile [ma, d0:d0+kTD] (and, like init_state,
// the z column in a self-normalising product's D-tile 0): the state entering that chunk.
template <bool kNorm>
__device__ void store_entering_state(const Product& p, int64_t sidx, int64_t d0, int64_t bidx, int64_t chunk) {
  const int64_t cols = kNorm && d0 == 0 ? kTD + 1 : kTD;
  for (int64_t i = threadIdx.x; i < p.ma * cols; i += kThreads) {
    const int64_t f = i / cols, c = i % cols, d = c == kTD ? p.dc : d0 + c;
    if (c < kTD && d >= p.dc) continue;
    *p.boundary.at(bidx, chunk, f, d) = *p.state.at(sidx, 0, f, d);
  }
}

// The weights a decayed chunk-sum or state-walk update loads C_c with (NULL: none, or B's).
template <bool kDecay, int kMask, int kMode, int kLo>
__device__ __forceinline__ const float* c_weights(const Product& p) {
  if constexpr (!kDecay) return nullptr;
  return scales_c<kMode, kLo>(p) ? update_scale<kDecay, kMask>() : nullptr;
}

// The block's tiles: one __shared__ union for every instance of la_product_kernel (52 of
// them). On a GPU each kernel gets its own static allocation; the emulator keeps one copy per
// instance in every OS thread that runs it, ~1 MiB per thread with a copy each
// (docs/emulator.md, "Resources").
union ProductTiles {
  Tiles fp32;
  TcTiles tc;
};

// A work item's bookkeeping, written by thread 0 and read by every thread from shared memory
// (reloaded after each barrier rather than held in ~14 registers across the chunks of a walk:
// that is what brings every instance to 128 registers, two blocks per SM, without spills).
struct Item {
  Seq sq;
  int64_t d0;       // first column of the D-tile
  int64_t sidx;     // state index
  int64_t c_read;   // per-chunk modes: the chunk (within its sequence)
  int64_t nchunks;  // chunks of the sequence
};

struct ProductShared {
  ProductTiles tiles;
  Item item;
  int64_t next;  // the block's next work item (grid-stride), advanced by thread 0
};
__device__ __forceinline__ ProductShared& product_shared() {
  __shared__ ProductShared shared;
  return shared;
}
template <typename T>
__device__ __forceinline__ auto& tiles_for(ProductTiles& u) {
  if constexpr (kTensorCores<T>) {
    return u.tc;
  } else {
    return u.fp32;
  }
}

// D-tiles of a product: a self-normalising one has at least one (the denominators' block) even
// with no value columns.
__host__ __device__ __forceinline__ int64_t value_tiles(const Product& p) {
  const int64_t n = ceil_div(p.dc, kTD);
  return p.self_norm && n == 0 ? 1 : n;
}

// A launch's work items before its D-tiles: (state index), or with per-chunk states (state
// index, chunk); packed sequences number their chunks globally (head, global chunk). Each has
// p.ndt groups of D-tiles.
__host__ __device__ __forceinline__ int64_t row_items(const Product& p) {
  const int64_t nstates = (p.seq_off != nullptr ? p.nseq : p.B) * p.H;
  if (!per_chunk(p.mode)) return nstates;
  return p.seq_off != nullptr ? p.H * p.nchunks_total : nstates * ceil_div(p.L, p.chunk);
}

// One block per work item, grid-stride over items (grid.x only, so B*H is never limited by
// grid.y/z); the item index and its bookkeeping live in shared memory (Item). Every instance,
// the tensor-core tiles of f16/bf16 and the FP32 tiles of f32 alike, is bounded to 128
// registers: two blocks per SM, without spills (scripts/sass_tensor_cores.py checks both).
template <typename T, int kMode, int kMask, int kLo, bool kNorm, bool kDecay>
__global__ void __launch_bounds__(kThreads, 2) la_product_kernel(Product p) {
  ProductShared& shared = product_shared();
  auto& tl = tiles_for<T>(shared.tiles);
  init_tiles(tl);
  const Item& it = shared.item;
  const StateView none{nullptr, 0, 0, 0, 0};
  if (threadIdx.x == 0) shared.next = blockIdx.x;
  __syncthreads();
  for (;;) {
    const int64_t item = shared.next;  // the same for every thread: the loop's exit is uniform
    if (item >= p.items) break;
    __syncthreads();  // every thread has read `next` before thread 0 advances it
    if (threadIdx.x == 0) {
      shared.next = item + gridDim.x;
      // per chunk: r = (state, chunk) [or (head, global chunk) when packed]; else r = state
      const int64_t r = item / p.ndt;
      int64_t sidx = r, c_read = 0;
      if (per_chunk(kMode)) {
        if (p.seq_off != nullptr) {
          const int64_t g = r % p.nchunks_total, h = r / p.nchunks_total;
          const int64_t n = seq_of_chunk(p, g);
          sidx = n * p.H + h;
          c_read = g - p.chunk_off[n];
        } else {
          sidx = r / p.nchunks;
          c_read = r % p.nchunks;
        }
      }
      const Seq sq = seq_of(p, sidx);
      shared.item = Item{sq, (item % p.ndt) * p.dgroup * kTD, sidx, c_read, ceil_div(sq.len, p.chunk)};
    }
    __syncthreads();
    const Seq& sq = it.sq;
    auto rows_of = [&](int64_t c) {
      const int64_t left = it.sq.len - c * p.chunk;
      return int(left < p.chunk ? left : p.chunk);
    };
    // a gated product: chunk c's decay table (between barriers), before anything reads it
    auto decay_of = [&](int64_t c) {
      if constexpr (kDecay) load_decay(p, it.sq, it.sq.t0 + c * p.chunk, rows_of(c));
    };
    switch (kMode) {
      case kAccumulate: {
        init_state<kNorm>(p, it.sidx, it.d0, p.init);
        for (int64_t i = 0; i < it.nchunks; ++i) {
          const int64_t c = kMask == kMaskGE ? it.nchunks - 1 - i : i;
          const int64_t t0 = sq.t0 + c * p.chunk;
          // MESA_LA_SCHEDULE_WALK: the forward's walk also keeps the state entering each chunk
          // (update_state's barriers order it as in kStateWalk)
          if (kMask == kMaskLE && p.boundary.base != nullptr)
            store_entering_state<kNorm>(p, it.sidx, it.d0, sq.bidx, sq.cbase + c);
          decay_of(c);
          chunk_outputs<T, kMask, kLo, kNorm, kDecay>(tl, p, sq, t0, rows_of(c), it.d0, p.state, it.sidx, 0, true);
          if constexpr (kDecay && kTensorCores<T>) {
            // C_c again, weighted for the update (update_state) when the update weights C
            if (scales_c<kMode, kLo>(p)) {
              __syncthreads();
              load_c_tile<T>(tl, p, sq, t0, rows_of(c), it.d0, update_scale<kDecay, kMask>());
            }
          }
          update_state<T, kLo, kNorm, kDecay, kMask, kMode>(tl, p, sq, t0, rows_of(c), it.d0);
        }
        break;
      }
      case kReadChunk: {
        const int64_t d_end = it.d0 + p.dgroup * kTD, d_last = value_tiles(p) * kTD;
        decay_of(it.c_read);
        chunk_outputs_tiles<T, kMask, kLo, kNorm, kDecay>(tl, p, sq, sq.t0 + it.c_read * p.chunk, rows_of(it.c_read), it.d0,
                                           d_end < d_last ? d_end : d_last, p.init, sq.bidx, sq.cbase + it.c_read);
        break;
      }
      case kChunkSum: {
        const int64_t t0 = sq.t0 + it.c_read * p.chunk;
        decay_of(it.c_read);
        if constexpr (kDecay) {
          // the chunk's whole decay, for the scan (once per chunk: D-tile 0's block)
          if (it.d0 == 0 && threadIdx.x == 0)
            p.decay.chunk_factor[sq.bidx * p.decay.fb + (sq.cbase + it.c_read) * p.decay.fc] = decay_table().whole;
        }
        load_c_tile<T>(tl, p, sq, t0, rows_of(it.c_read), it.d0, c_weights<kDecay, kMask, kMode, kLo>(p));
        update_state<T, kLo, kNorm, kDecay, kMask, kMode>(tl, p, sq, t0, rows_of(it.c_read), it.d0, &p.boundary,
                                                          sq.bidx, sq.cbase + it.c_read);
        break;
      }
      case kStateWalk: {
        // S_{c+1} = S_c + U_c: the scan's f32 operations, so the same states bit for bit
        init_state<kNorm>(p, it.sidx, it.d0, p.init);
        // (init_state and update_state end with a barrier, and update_state begins with one:
        // each store reads the state tile after the last update wrote it, before the next does)
        for (int64_t i = 0; i < it.nchunks; ++i) {
          const int64_t c = kMask == kMaskGE ? it.nchunks - 1 - i : i;
          store_entering_state<kNorm>(p, it.sidx, it.d0, sq.bidx, sq.cbase + c);
          decay_of(c);
          load_c_tile<T>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0, c_weights<kDecay, kMask, kMode, kLo>(p));
          update_state<T, kLo, kNorm, kDecay, kMask, kMode>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
        }
        break;
      }
      case kBidir: {
        const bool given = p.init.base != nullptr;
        if (!given) {
          init_state<kNorm>(p, it.sidx, it.d0, none);
          for (int64_t c = 0; c < it.nchunks; ++c) {
            __syncthreads();
            load_c_tile<T>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
            update_state<T, kLo, kNorm, false, kMask, kMode>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
          }
        }
        for (int64_t c = 0; c < it.nchunks; ++c)
          chunk_outputs<T, kMask, kLo, kNorm, false>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0, given ? p.init : p.state, it.sidx,
                               0, false);
        break;
      }
      default: break;
    }
    __syncthreads();
  }
}

// The light scan of the chunk decomposition, one thread per (state, element): with U_c the
// chunk sums in `boundary` (kChunkSum), writes the state entering chunk c, S_0 + sum_{c'<c}
// U_c' (GE: sum over c' > c, walking from the last chunk), over U_c, and the final state to
// `state`. Reads and writes each boundary element
// once (2 x 4 bytes per chunk, state element and (b, h)); sequential over the chunks of one
// element only.
__global__ void __launch_bounds__(kThreads) la_scan_kernel(Product p) {
  const int64_t nstates = (p.seq_off != nullptr ? p.nseq : p.B) * p.H;
  const int64_t width = p.dc + (p.self_norm ? 1 : 0);  // a self-normalising product's z column too
  const int64_t per = p.ma * width;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nstates * per;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t sidx = i / per, r = (i % per) / width, c = i % width;
    const Seq sq = seq_of(p, sidx);
    float run = p.init.base != nullptr ? *p.init.at(sidx, 0, r, c) : 0.0f;
    const int64_t nchunks = ceil_div(sq.len, p.chunk);
    for (int64_t j = 0; j < nchunks; ++j) {
      const int64_t k = p.mask == kMaskGE ? nchunks - 1 - j : j;  // GE: from the last chunk
      float* u = p.boundary.at(sq.bidx, sq.cbase + k, r, c);
      const float x = *u;
      *u = run;
      // gated: S <- whole_k S + U_k (fmaf(S, 1, U) = S + U: a = 0 gives the ungated bits)
      run = p.decay.a != nullptr ? fmaf(run, p.decay.chunk_factor[sq.bidx * p.decay.fb + (sq.cbase + k) * p.decay.fc], x)
                                 : run + x;
    }
    *p.state.at(sidx, 0, r, c) = run;
  }
}

// dst[i] = src[i], i < n (the initial state kept for a SLiM backward).
__global__ void __launch_bounds__(kThreads) la_copy_kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    dst[i] = src[i];
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
template <typename T>
inline Operand operand(const MesaLaTensor& t, int64_t nfeat) {
  return Operand{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3], nfeat, nullptr,
                 nullptr, 0, 0, 0, 0, kExtraNone, rows_16b<T>(t) ? 1 : 0};
}
inline Operand ones_only() { return Operand{nullptr, 0, 0, 0, 0, 0, nullptr, nullptr, 0, 0, 0, 0, kExtraOnes, 0}; }
inline OutView out_view(const MesaLaTensor& t, int64_t width) {
  return OutView{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3], width, nullptr};
}


// The lo tiles a product's operands need (LoTiles): a bf16 operand only when its loaded values
// are f32 (a row divisor or the dden column); f16 always.
template <typename T>
inline int lo_mask(const Product& p) {
  if (!std::is_same_v<T, __nv_bfloat16>) return kLoAll;
  auto f32_values = [](const Operand& o) { return o.row_div != nullptr || o.extra_kind == kExtraDden; };
  return (f32_values(p.a) ? kLoA : 0) | (f32_values(p.b) ? kLoB : 0) | (f32_values(p.c) ? kLoC : 0);
}

// One block per item, at most as many as the device holds at once (occupancy API). The one
// dispatch point of the products: mode, and for bf16 the lo tiles. The patterns that occur:
// the forward's products and an unnormalised backward read bf16 values only (0); normalised,
// dq's a = dO' (kLoA), dk's b = dO' (kLoB), dv's c = dout / den (kLoC). Any other pattern has
// no instance: an internal error, never a wrong result.
// The lo patterns a (mode, direction) meets: LE the forward (0) and dq (kLoA when normalised);
// GE dk (kLoB) and dv (kLoC); the chunk sums and the state walks the forward (LE), dk and dv
// (GE); bidirectional all of them. Only these are compiled (37 of the 48 combinations, before
// normalisation: norm_used).
template <int kMode, int kMask>
constexpr bool lo_used(int lo) {
  if (lo == 0 || kMode == kBidir) return true;
  if (kMode == kChunkSum || kMask == kMaskGE) return lo == kLoB || lo == kLoC;
  return lo == kLoA && kMode != kStateWalk;  // the state walk LE is the forward's only
}

// The products that normalise themselves (Product::self_norm) are the forward's: its chunk
// sums or state walk and per-chunk outputs (boundary states), the denominator product before
// the walks (LE) and the bidirectional one. Their operands are the inputs' own values (bf16:
// no lo tiles). Only these get a normalising instance (15 more: 52 in all).
template <int kMode, int kMask>
constexpr bool norm_used(int lo) {
  return (lo == 0 || lo == kLoAll) && (kMode == kChunkSum || kMode == kBidir || kMask == kMaskLE);
}

// Decay (gated products): never bidirectional; the chunk sums walk a direction (their update
// weights are LE's or GE's); only the forward's products (LE) normalise themselves.
template <int kMode, int kMask, bool kNorm>
constexpr bool decay_used() {
  return kMode != kBidir && kMask != kMaskNone && (!kNorm || kMask == kMaskLE);
}

template <typename T, int kMode, int kMask, int kLo, bool kNorm, bool kDecay>
MesaStatus launch_instance(const Product& p, void* stream) {
  if constexpr ((lo_used<kMode, kMask>(kLo) || kLo == kLoAll) && (!kNorm || norm_used<kMode, kMask>(kLo)) &&
                (!kDecay || decay_used<kMode, kMask, kNorm>())) {
    auto kernel = la_product_kernel<T, kMode, kMask, kLo, kNorm, kDecay>;
    const dim3 grid(resident_grid(kernel, p.items * kThreads, kThreads));
    return status_from(MESA_LAUNCH(kernel, grid, dim3(kThreads), 0, stream, p));
  } else {
    return MESA_STATUS_INVALID_ARGUMENT;
  }
}

// Normalisation: a template parameter (the denominators' code is compiled only where used).
template <typename T, int kMode, int kMask, int kLo, bool kDecay>
MesaStatus launch_normalised(const Product& p, void* stream) {
  return p.self_norm ? launch_instance<T, kMode, kMask, kLo, true, kDecay>(p, stream)
                     : launch_instance<T, kMode, kMask, kLo, false, kDecay>(p, stream);
}

template <typename T, int kMode, int kMask, bool kDecay>
MesaStatus launch_product(const Product& p, void* stream) {
  if constexpr (!std::is_same_v<T, __nv_bfloat16>) {
    return launch_normalised<T, kMode, kMask, kLoAll, kDecay>(p, stream);
  } else {
    const int lo = lo_mask<T>(p);
    // a decayed state update weights the operand without a lo tile of its own (can_scale_b/c)
    if (kDecay && kMode != kReadChunk && (p.scale_c ? !can_scale_c(kMode, lo) : !can_scale_b(kMode, lo)))
      return MESA_STATUS_INVALID_ARGUMENT;
    switch (lo) {
      case 0: return launch_normalised<T, kMode, kMask, 0, kDecay>(p, stream);
      case kLoA: return launch_normalised<T, kMode, kMask, kLoA, kDecay>(p, stream);
      case kLoB: return launch_normalised<T, kMode, kMask, kLoB, kDecay>(p, stream);
      case kLoC: return launch_normalised<T, kMode, kMask, kLoC, kDecay>(p, stream);
      default: return MESA_STATUS_INVALID_ARGUMENT;
    }
  }
}

// The mode and the direction: a causal walk or per-chunk outputs LE (forward, dq) or GE (dk,
// dv); the chunk sums read no mask (the scan walks in its direction) unless decayed;
// bidirectional none.
template <typename T, int kMode, bool kDecay>
MesaStatus launch_masked(const Product& p, void* stream) {
  if constexpr (kMode == kChunkSum && !kDecay) {
    return launch_product<T, kMode, kMaskNone, false>(p, stream);
  } else if constexpr (kMode == kBidir) {
    return p.mask == kMaskNone && !kDecay ? launch_product<T, kMode, kMaskNone, false>(p, stream)
                                          : MESA_STATUS_INVALID_ARGUMENT;
  } else {
    switch (p.mask) {
      case kMaskLE: return launch_product<T, kMode, kMaskLE, kDecay>(p, stream);
      case kMaskGE: return launch_product<T, kMode, kMaskGE, kDecay>(p, stream);
      default: return MESA_STATUS_INVALID_ARGUMENT;
    }
  }
}

template <typename T, int kMode>
MesaStatus launch_decayed(const Product& p, void* stream) {
  return p.decay.a != nullptr ? launch_masked<T, kMode, true>(p, stream) : launch_masked<T, kMode, false>(p, stream);
}

// Launch policy of the per-chunk outputs (kReadChunk) on tensor cores: how many of a product's
// D-tiles one block computes (its value tile: dgroup x kTD columns). The block computes
// P = mask(A_c B_c^T) of its chunk once for all of them, so the widest value tile saves the
// most recomputation; it is narrowed until the launch has kWaves work items per block the
// device holds at once. The FP32 path recomputes P per D-tile anyway: one D-tile per block.
constexpr int64_t kWaves = 4;
// Blocks of la_product_kernel resident per SM (__launch_bounds__(kThreads, 2)).
constexpr int64_t kBlocksPerSm = 2;
#ifdef MESA_EMU
// The emulator's notional device for this policy: one SM (its worker threads vary by machine,
// the groups a test meets should not; and small test shapes already form groups).
constexpr int64_t kEmuPolicySms = 1;
#endif
template <typename T>
inline int64_t value_group(const Product& p, int64_t tiles) {
  if (!kTensorCores<T> || p.mode != kReadChunk || tiles <= 1) return 1;
#ifdef MESA_EMU
  const int64_t sms = kEmuPolicySms;
#else
  const int64_t sms = sm_count();
#endif
  const int64_t want = kWaves * kBlocksPerSm * sms, rows = row_items(p);
  // the fewest groups that reach `want` items (one per D-tile when none does), as even as they go
  int64_t groups = 1;
  while (groups < tiles && rows * groups < want) ++groups;
  return ceil_div(tiles, groups);
}

template <typename T>
MesaStatus run_product(Product p, void* stream) {
  const int64_t tiles = value_tiles(p);
  p.dgroup = value_group<T>(p, tiles);
  p.ndt = ceil_div(tiles, p.dgroup);
  p.items = row_items(p) * p.ndt;
  p.nchunks = ceil_div(p.L, p.chunk);
  // a walk's D-tiles run in separate blocks, and D-tile 0's owns z: a self-normalising walk
  // must have that one tile only (forward() gives it no value columns)
  if (p.self_norm && (p.mode == kAccumulate || p.mode == kBidir) && p.ndt != 1) return MESA_STATUS_INVALID_ARGUMENT;
  switch (p.mode) {
    case kAccumulate: return launch_decayed<T, kAccumulate>(p, stream);
    case kReadChunk: return launch_decayed<T, kReadChunk>(p, stream);
    case kChunkSum: return launch_decayed<T, kChunkSum>(p, stream);
    case kBidir: return launch_decayed<T, kBidir>(p, stream);
    case kStateWalk: return launch_decayed<T, kStateWalk>(p, stream);
    default: return MESA_STATUS_INVALID_ARGUMENT;
  }
}

// A causal forward product that keeps its boundary states, as the chunk decomposition:
// (i) U_c = B_c^T C_c of all chunks in parallel, (ii) the light scan turning them into the
// states entering each chunk (and the final state), (iii) the outputs of all chunks in
// parallel from the chunk's own masked A_c B_c^T and its entering state. Bitwise the same
// results as the sequential walk (kAccumulate: SLiM mode).
// With MESA_LA_SCHEDULE_STATE_WALK, (i) and (ii) are one sequential walk per (state, D-tile)
// instead (kStateWalk): the same states, bit for bit, with half the state bytes and
// B*H*ceil(D/32) blocks in place of one per chunk (docs/linear_attention.md, "Schedules").
template <typename T>
MesaStatus run_boundary_states(Product p, MesaLaSchedule schedule, void* stream) {
  if (schedule == MESA_LA_SCHEDULE_STATE_WALK) {
    p.mode = kStateWalk;
    return run_product<T>(p, stream);
  }
  p.mode = kChunkSum;
  const MesaStatus st = run_product<T>(p, stream);
  if (st != MESA_STATUS_OK) return st;
  const int64_t n = ((p.seq_off != nullptr ? p.nseq : p.B) * p.H) * p.ma * (p.dc + (p.self_norm ? 1 : 0));
  const int64_t want = ceil_div(n, kThreads), cap = int64_t(sm_count()) * 8;
  return status_from(MESA_LAUNCH(la_scan_kernel, dim3(unsigned(want < 1 ? 1 : (want < cap ? want : cap))),
                                 dim3(kThreads), 0, stream, p));
}

// (iii) alone: the per-chunk outputs from the boundary states (p.boundary) already computed.
template <typename T>
MesaStatus run_chunk_outputs(Product p, void* stream) {
  p.mode = kReadChunk;
  p.init = p.boundary;
  p.boundary = StateView{nullptr, 0, 0, 0, 0};
  return run_product<T>(p, stream);
}

template <typename T>
MesaStatus run_product_decomposed(const Product& p, MesaLaSchedule schedule, void* stream) {
  const MesaStatus st = run_boundary_states<T>(p, schedule, stream);
  return st != MESA_STATUS_OK ? st : run_chunk_outputs<T>(p, stream);
}

inline Product base_product(const MesaLaShape& s) {
  Product p{};
  p.B = s.batch;
  p.H = s.heads;
  p.L = s.len;
  p.rs = s.len;
  p.chunk = s.chunk;
  p.seq_off = s.packing.seq_offsets;
  p.chunk_off = s.packing.chunk_offsets;
  p.nseq = s.packing.nseq;
  p.nchunks_total = s.packing.nchunks;
  return p;
}

// The boundary states [B*H, ceil(L/C), M, W], or packed [nchunks, H, M, W], as (bidx, chunk)
// at column `col`; `transposed` reads element (r, c) as (c, r).
inline StateView boundary_view(const MesaLaShape& s, const float* base, int64_t M, int64_t W, int64_t col,
                               bool transposed) {
  const bool packed = s.packing.seq_offsets != nullptr;
  const int64_t s_bh = packed ? M * W : ceil_div(s.len, s.chunk) * M * W;
  const int64_t s_chunk = packed ? s.heads * M * W : M * W;
  float* b = const_cast<float*>(base) + col;
  return transposed ? StateView{b, s_bh, s_chunk, 1, W} : StateView{b, s_bh, s_chunk, W, 1};
}

// Per-chunk states of `rows x cols` at `base` (row-major): [nstates, ceil(L/C), rows, cols], or
// packed [nchunks, H, rows, cols] — the layout boundary_view describes for the forward's.
inline StateView chunk_states(const MesaLaShape& s, float* base, int64_t rows, int64_t cols) {
  const bool packed = s.packing.seq_offsets != nullptr;
  const int64_t n = rows * cols;
  return StateView{base, packed ? n : ceil_div(s.len, s.chunk) * n, packed ? s.heads * n : n, cols, 1};
}

// States [nstates, M, W]: one per (b, h), or per (sequence, head) when packed.
inline int64_t state_count(const MesaLaShape& s) {
  return (s.packing.seq_offsets != nullptr ? s.packing.nseq : s.batch) * s.heads;
}

template <typename T>
MesaStatus forward(const MesaLaForwardArgs& a, void* stream) {
  const MesaLaShape& s = a.shape;
  const int64_t M = s.feat, D = s.dim, W = D + (s.normalize ? 1 : 0);
  const int64_t BH = state_count(s);
  const bool boundary = s.causal && s.memory == MESA_LA_BOUNDARY_STATES;
  // MESA_LA_SCHEDULE_WALK: SLiM's walks, keeping the state entering each chunk as they go
  const bool walk = boundary && s.schedule == MESA_LA_SCHEDULE_WALK;
  // The state S' [bh, M, W], column D the normaliser's z. It starts from the caller's initial
  // state (causal) or 0.
  const StateView state{a.state, M * W, 0, W, 1};
  const StateView none{nullptr, 0, 0, 0, 0};
  const float* s0 = a.init_state;
  if (s0 != nullptr && a.init_copy != nullptr && BH * M * W > 0) {
    // SLiM: the backward's dq walk starts from it again
    const int64_t n = BH * M * W;
    const int64_t want = ceil_div(n, kThreads), cap = int64_t(sm_count()) * 8;
    const MesaStatus st = status_from(MESA_LAUNCH(la_copy_kernel, dim3(unsigned(want < cap ? want : cap)),
                                                  dim3(kThreads), 0, stream, a.init_copy, s0, n));
    if (st != MESA_STATUS_OK) return st;
  }
  Product p = base_product(s);
  p.a = operand<T>(a.q, M);
  p.b = operand<T>(a.k, M);
  p.ma = M;
  p.mask = s.causal ? kMaskLE : kMaskNone;
  p.mode = s.causal ? kAccumulate : kBidir;
  // The denominators are computed by a product itself (self_norm: from its own P and the z
  // column, Product). The decomposed causal forward (boundary states) does it in the output
  // product: one chunk-sum launch, one scan, one output launch for v and the normaliser alike.
  // A walk (SLiM, bidirectional) runs its D-tiles in separate blocks that each need z before
  // the next chunk, so there a product with no value columns computes them first (the same
  // operations: both memory modes give bitwise the same results).
  const bool fold = s.normalize && boundary && !walk;
  if (s.normalize && !fold) {
    Product z = p;
    z.c = ones_only();
    z.dc = 0;
    z.o = out_view(a.out, 0);
    z.self_norm = 1;
    z.den = a.den;
    z.eps = s.eps;
    z.state = StateView{a.state != nullptr ? a.state + D : nullptr, M * W, 0, W, 1};
    z.init = s0 != nullptr ? StateView{const_cast<float*>(s0) + D, M * W, 0, W, 1} : none;
    z.boundary = walk ? boundary_view(s, a.boundary, M, W, D, false) : none;
    const MesaStatus st = run_product<T>(z, stream);
    if (st != MESA_STATUS_OK) return st;
  }
  p.c = operand<T>(a.v, D);
  p.dc = D;
  p.o = out_view(a.out, D);
  p.o.row_div = s.normalize && !fold ? a.den : nullptr;
  p.self_norm = fold ? 1 : 0;
  p.den = a.den;
  p.eps = s.eps;
  p.state = state;
  p.init = s0 != nullptr ? StateView{const_cast<float*>(s0), M * W, 0, W, 1} : none;
  p.boundary = boundary ? boundary_view(s, a.boundary, M, W, 0, false) : none;
  if (D == 0 && !fold) return MESA_STATUS_OK;
  return boundary && !walk ? run_product_decomposed<T>(p, s.schedule, stream) : run_product<T>(p, stream);
}

template <typename T>
MesaStatus backward(const MesaLaBackwardArgs& a, void* stream) {
  const MesaLaShape& s = a.shape;
  const int64_t M = s.feat, D = s.dim, W = D + (s.normalize ? 1 : 0);
  const StateView none{nullptr, 0, 0, 0, 0};
  // dO' = [dout / den | dden] and c' = [v | 1]; dden_t = -(dout_t . out_t) / den_t is
  // recomputed where it is loaded (kExtraDden), so the scratch does not grow with L.
  Operand dO = operand<T>(a.dout, D);
  Operand cv = operand<T>(a.v, D);
  if (s.normalize) {
    dO.row_div = a.den;
    dO.dot = a.out.data;
    dO.db = a.out.strides[0];
    dO.dh = a.out.strides[1];
    dO.dl = a.out.strides[2];
    dO.df = a.out.strides[3];
    dO.extra_kind = kExtraDden;
    cv.extra_kind = kExtraOnes;
  }
  const int mask_fwd = s.causal ? kMaskLE : kMaskNone;
  const int mask_rev = s.causal ? kMaskGE : kMaskNone;
  // the [bh, W, M] view (row w, column f) of a [bh, M, W] state
  auto transposed = [&](const float* base) { return StateView{const_cast<float*>(base), M * W, 0, 1, W}; };
  const StateView work{a.work, W * M, 0, M, 1};
  // boundary mode (causal): dk and dv as the chunk decomposition, their per-chunk states in
  // the workspace after one state per (b, h); walked as in SLiM with MESA_LA_SCHEDULE_WALK
  const bool decompose = s.causal && s.memory == MESA_LA_BOUNDARY_STATES && s.schedule != MESA_LA_SCHEDULE_WALK;
  float* chunk_work = a.work + state_count(s) * M * W;

  // dq = product(dO', c', k), LE: state sum c'_s k_s^T = S'^T, the forward's states read
  // through transposed strides (boundary mode) or accumulated again from the initial state
  // (SLiM: the same forward walk as the forward's, so dq_t never sees a row s > t).
  {
    Product p = base_product(s);
    p.a = dO;
    p.b = cv;
    p.c = operand<T>(a.k, M);
    p.ma = W;
    p.dc = M;
    p.o = out_view(a.dq, M);
    p.transposed = 1;
    p.mask = mask_fwd;
    p.state = work;
    p.boundary = none;
    if (!s.causal) {
      p.mode = kBidir;
      p.init = transposed(a.state);
    } else if (s.memory == MESA_LA_BOUNDARY_STATES) {
      p.mode = kReadChunk;
      p.init = boundary_view(s, a.boundary, M, W, 0, true);
    } else {
      p.mode = kAccumulate;
      p.init = a.init_state != nullptr ? transposed(a.init_state) : none;
    }
    if (M > 0) {
      const MesaStatus st = run_product<T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dk = product(c', dO', q), reverse: state dS'_final^T + sum dO'_s q_s^T [bh, W, M]; its
  // value after the walk is the initial state's gradient (written to d_init when given).
  {
    Product p = base_product(s);
    p.a = cv;
    p.b = dO;
    p.c = operand<T>(a.q, M);
    p.ma = W;
    p.dc = M;
    p.o = out_view(a.dk, M);
    p.mask = mask_rev;
    p.mode = s.causal ? kAccumulate : kBidir;
    p.state = a.d_init != nullptr ? transposed(a.d_init) : work;
    p.init = a.d_final != nullptr ? transposed(a.d_final) : none;
    p.boundary = decompose ? chunk_states(s, chunk_work, W, M) : none;
    if (M > 0) {
      const MesaStatus st = decompose ? run_product_decomposed<T>(p, s.schedule, stream) : run_product<T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dv = product(k, q, dout / den), reverse: state dS_final[:, :D] + sum q_s (dout_s/den_s)^T
  // [bh, M, D].
  {
    Operand g = operand<T>(a.dout, D);
    g.row_div = s.normalize ? a.den : nullptr;
    Product p = base_product(s);
    p.a = operand<T>(a.k, M);
    p.b = operand<T>(a.q, M);
    p.c = g;
    p.ma = M;
    p.dc = D;
    p.o = out_view(a.dv, D);
    p.mask = mask_rev;
    p.mode = s.causal ? kAccumulate : kBidir;
    p.state = StateView{a.work, M * D, 0, D, 1};
    p.init = a.d_final != nullptr ? StateView{const_cast<float*>(a.d_final), M * W, 0, W, 1} : none;
    p.boundary = decompose ? chunk_states(s, chunk_work, M, D) : none;
    if (D > 0) {
      const MesaStatus st = decompose ? run_product_decomposed<T>(p, s.schedule, stream) : run_product<T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  return MESA_STATUS_OK;
}

template <template <typename> class F, typename Args>
MesaStatus dispatch(MesaDType t, const Args& a, void* stream) {
  switch (t) {
    case MESA_DTYPE_F32: return F<float>::run(a, stream);
    case MESA_DTYPE_F16: return F<__half>::run(a, stream);
    case MESA_DTYPE_BF16: return F<__nv_bfloat16>::run(a, stream);
    default: return MESA_STATUS_UNSUPPORTED;
  }
}
template <typename T> struct ForwardOp { static MesaStatus run(const MesaLaForwardArgs& a, void* s) { return forward<T>(a, s); } };
template <typename T> struct BackwardOp { static MesaStatus run(const MesaLaBackwardArgs& a, void* s) { return backward<T>(a, s); } };

inline bool shape_valid(const MesaLaShape& s) {
  if (s.batch < 0 || s.heads < 0 || s.len < 0 || s.feat < 0 || s.dim < 0) return false;
  if (s.chunk < 1 || s.chunk > MESA_LA_MAX_CHUNK) return false;
  if (s.dtype != MESA_DTYPE_F32 && s.dtype != MESA_DTYPE_F16 && s.dtype != MESA_DTYPE_BF16) return false;
  if (s.memory != MESA_LA_BOUNDARY_STATES && s.memory != MESA_LA_SLIM) return false;
  if (s.schedule != MESA_LA_SCHEDULE_CHUNK_SUMS && s.schedule != MESA_LA_SCHEDULE_STATE_WALK &&
      s.schedule != MESA_LA_SCHEDULE_WALK)
    return false;
  if (s.normalize && !(s.eps >= 0.0f)) return false;
  const MesaLaPacking& k = s.packing;
  if (k.seq_offsets != nullptr &&
      (s.batch != 1 || k.chunk_offsets == nullptr || k.nseq < 0 || k.nchunks < 0 || (k.nseq == 0 && s.len != 0)))
    return false;
  return true;
}

inline bool is_empty(const MesaLaShape& s) {
  return s.batch == 0 || s.heads == 0 || (s.packing.seq_offsets != nullptr && s.packing.nseq == 0);
}

// The kernels hold a row's batch and head in 32 bits (Seq): checked once a call has work.
inline bool fits_32_bit_indices(const MesaLaShape& s) { return s.batch <= INT32_MAX && s.heads <= INT32_MAX; }


// ---------------------------------------------------------------------------------------
// Gated linear attention (issue 41; ABI kernels/include/mesa_gated_linear_attention.h): the
// products above with a decay (DecayView), so that every memory mode and schedule of the
// ungated kernel, the tensor cores and the packed sequences serve it, and a = 0 gives the
// ungated results bit for bit. For one query head h of KV head kh = h / G (G = H / H_kv), with
// v' = [v | 1] (the 1 when normalised), S' the state [M, W] of kh, dO' = [dout/g | dden]:
//   out = product(q_h, k, v') LE                           (+ the normaliser, as ungated)
//   dq_h = product(dO'_h, v', k) LE                         state S'^T
//   dk = sum_h product(v', dO'_h, q_h) GE, dv = sum_h product(k, q_h, dout_h/g_h) GE
//   dL/dLam'_t = sum_h q_h,t . dq_h,t - k_t . dk_t  (+ <dS_final, S_final> at the last row),
//   da_r = sum over t >= r up to the next reset of dL/dLam'_t, 0 on a reset row,
// Lam'_t the log-decay summed over the whole sequence: with q~_t = exp(Lam'_t) q_t and
// k~_s = exp(-Lam'_s) k_s every weighted product is q~_t . k~_s (and the initial state's term
// exp(Lam'_t) q_t^T S_{-1}), while S_final = exp(Lam'_{L-1}) (S_{-1} + sum_s k~_s v'_s^T).
// A reset splits the sequence into independent pieces (every weight across it is exactly 0).
// Per-head decay: da summed over B and L in a fixed order.
//
// Grouped heads: a launch covers one query head g of every KV head (H_kv heads; the query
// tensors' head stride times G, offset by g; the row arrays (den, dots) with row stride G*L,
// offset g*L). What depends on k and v alone runs once: the forward's boundary states. The
// group's dk and dv are the sum of G products (one per g; outputs added in f32 in the order
// g = 0, 1, ..., then rounded once), each with its own state; the final states' gradient
// dS_final enters g = 0's only.
//
// q . dq and k . dk come from the f32 values before rounding: each product's epilogue writes
// every 32-column tile's part of its row dot (OutView::dots), summed here in tile order.
//
// Accuracy of the log-space differences: Lam is a prefix sum of at most C values, so in f32
// it is off by at most C·u·sum |a_r| (u = 2^-24), and the exponent Lam_i - Lam_j of a weight
// by up to 2·C·u·(|sum_{r=j+1..i} a_r| + C·alpha) for |a_r| <= alpha: both prefix sums'
// errors, each carrying up to C steps before j that the weight does not span (the direct sum
// over r = j+1..i would be off by (i - j)·u·|sum a_r| only). Worst case for a chunk of strongly
// decaying steps, C = 64 and alpha = 8, at the end of the chunk, for the weights that matter
// (i - j small): 2·64·64·8·2^-24 = 3.9e-3 relative (alpha = 1: 4.9e-4). It shrinks as C^2: a
// caller with such decays can pick a smaller chunk. (tests/gated_linear_attention.rs adds
// exactly this term to its bounds.)

// Sequences per head: B, or N packed sequences.
inline int64_t gla_units(const MesaGlaShape& s) {
  return s.packing.seq_offsets != nullptr ? s.packing.nseq : s.batch;
}
// Chunks of all units (the boundary states' count per KV head).
inline int64_t gla_chunks(const MesaGlaShape& s) {
  return s.packing.seq_offsets != nullptr ? s.packing.nchunks : s.batch * ceil_div(s.len, int64_t(s.chunk));
}

// The products' shape: B (or one packed row set) by H_kv heads, causal.
inline MesaLaShape gla_product_shape(const MesaGlaShape& g) {
  MesaLaShape s{};
  s.batch = g.batch;
  s.heads = g.kv_heads;
  s.len = g.len;
  s.feat = g.feat;
  s.dim = g.dim;
  s.chunk = g.chunk;
  s.dtype = g.dtype;
  s.causal = 1;
  s.normalize = g.normalize;
  s.eps = g.eps;
  s.schedule = g.schedule;
  s.packing = g.packing;
  return s;
}

// Query head g of every group: the head stride times G, the data offset by g heads.
template <typename T>
inline MesaLaTensor group_view(const MesaLaTensor& t, int64_t G, int64_t g) {
  MesaLaTensor v = t;
  if (v.data != nullptr) v.data = static_cast<T*>(t.data) + g * t.strides[1];
  v.strides[1] = t.strides[1] * G;
  return v;
}
inline float* group_rows(const float* rows, int64_t L, int64_t g) {
  return rows != nullptr ? const_cast<float*>(rows) + g * L : nullptr;
}

// The decay of KV head h: [B, H_kv, L] per step, [H_kv] per head; the chunk sums' whole decays
// in `factors` as the boundary states' (bidx, chunk): [B*H_kv, nch], packed [nchunks, H_kv].
inline DecayView gla_decay_view(const MesaGlaShape& s, const float* a, float* factors) {
  const bool step = s.decay_kind == MESA_GLA_DECAY_PER_STEP;
  const bool packed = s.packing.seq_offsets != nullptr;
  return DecayView{a,       step ? s.kv_heads * s.len : 0, step ? s.len : 1, step ? 1 : 0, factors,
                   packed ? 1 : ceil_div(s.len, int64_t(s.chunk)), packed ? s.kv_heads : 1};
}

template <typename T>
MesaStatus gla_forward(const MesaGlaForwardArgs& a, void* stream) {
  const MesaGlaShape& gs = a.shape;
  const MesaLaShape s = gla_product_shape(gs);
  const int64_t M = gs.feat, D = gs.dim, W = D + (gs.normalize ? 1 : 0), L = gs.len;
  const int64_t G = gs.heads / gs.kv_heads;
  const bool boundary = a.boundary != nullptr;
  const bool walk = boundary && gs.schedule == MESA_LA_SCHEDULE_WALK;
  const bool fold = gs.normalize && boundary && !walk;
  const StateView none{nullptr, 0, 0, 0, 0};
  const float* s0 = a.init_state;
  Product base = base_product(s);
  base.rs = G * L;
  base.decay = gla_decay_view(gs, a.decay, a.work);
  base.b = operand<T>(a.k, M);
  base.ma = M;
  base.mask = kMaskLE;
  base.mode = kAccumulate;
  for (int64_t g = 0; g < G; ++g) {
    Product p = base;
    p.a = operand<T>(group_view<T>(a.q, G, g), M);
    float* den = group_rows(a.den, L, g);
    if (gs.normalize && !fold) {
      // the denominators first, by a product without value columns (as the ungated walks)
      Product z = p;
      z.c = ones_only();
      z.dc = 0;
      z.o = out_view(group_view<T>(a.out, G, g), 0);
      z.self_norm = 1;
      z.den = den;
      z.eps = gs.eps;
      z.state = StateView{a.final_state + D, M * W, 0, W, 1};
      z.init = s0 != nullptr ? StateView{const_cast<float*>(s0) + D, M * W, 0, W, 1} : none;
      z.boundary = walk && g == 0 ? boundary_view(s, a.boundary, M, W, D, false) : none;
      const MesaStatus st = run_product<T>(z, stream);
      if (st != MESA_STATUS_OK) return st;
    }
    if (D == 0 && !fold) continue;
    p.c = operand<T>(a.v, D);
    p.dc = D;
    p.o = out_view(group_view<T>(a.out, G, g), D);
    p.o.row_div = gs.normalize && !fold ? den : nullptr;
    p.self_norm = fold ? 1 : 0;
    p.den = den;
    p.eps = gs.eps;
    p.state = StateView{a.final_state, M * W, 0, W, 1};
    p.init = s0 != nullptr ? StateView{const_cast<float*>(s0), M * W, 0, W, 1} : none;
    p.boundary = boundary ? boundary_view(s, a.boundary, M, W, 0, false) : none;
    MesaStatus st = MESA_STATUS_OK;
    if (boundary && !walk) {
      // the states depend on k, v and the decay only: once, then each query head's outputs
      if (g == 0) st = run_boundary_states<T>(p, gs.schedule, stream);
      if (st == MESA_STATUS_OK) st = run_chunk_outputs<T>(p, stream);
    } else {
      if (g > 0) p.boundary = none;
      st = run_product<T>(p, stream);
    }
    if (st != MESA_STATUS_OK) return st;
  }
  return MESA_STATUS_OK;
}

// The backward's scratch, as MESA_GLA_BACKWARD_WORK lays it out.
struct GlaWork {
  float *work, *work2, *chunk_work, *factors, *qdq, *kdk, *acc, *da_rows;
};
inline GlaWork gla_work(const MesaGlaBackwardArgs& a, bool decompose) {
  const MesaGlaShape& s = a.shape;
  const int64_t B = s.batch, H = s.heads, Hkv = s.kv_heads, L = s.len, M = s.feat, D = s.dim;
  const int64_t W = D + (s.normalize ? 1 : 0), N = gla_units(s), NCH = decompose ? gla_chunks(s) : 0;
  const int64_t G = H / Hkv, tiles = ceil_div(M, int64_t(kTD));
  GlaWork w;
  w.work = a.work;
  w.work2 = w.work + N * Hkv * M * W;
  w.chunk_work = w.work2 + N * Hkv * M * W;
  w.factors = w.chunk_work + NCH * Hkv * M * W;
  w.qdq = w.factors + NCH * Hkv;
  w.kdk = w.qdq + tiles * B * H * L;
  w.acc = w.kdk + tiles * B * Hkv * L;
  w.da_rows = w.acc + (G > 1 ? B * Hkv * L * (M + D) : 0);
  return w;
}

// The f32 sums of a group's dk and dv ([B, H_kv, L, M] and [B, H_kv, L, D], contiguous) as T,
// and k_t . dk_t of each row (f32, in column order) to kdk. One thread per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) gla_round_kernel(const MesaGlaBackwardArgs a, const float* acc,
                                                             float* kdk) {
  const MesaGlaShape& s = a.shape;
  const int64_t Hkv = s.kv_heads, L = s.len, M = s.feat, D = s.dim, rows = s.batch * Hkv * L;
  const float* dv_acc = acc + rows * M;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < rows; i += int64_t(gridDim.x) * kThreads) {
    const int64_t b = i / (Hkv * L), h = (i / L) % Hkv, t = i % L;
    const T* k = static_cast<const T*>(a.k.data) + b * a.k.strides[0] + h * a.k.strides[1] + t * a.k.strides[2];
    T* dk = static_cast<T*>(a.dk.data) + b * a.dk.strides[0] + h * a.dk.strides[1] + t * a.dk.strides[2];
    float dot = 0.0f;
    for (int64_t m = 0; m < M; ++m) {
      const float x = acc[i * M + m];
      dk[m * a.dk.strides[3]] = from_float<T>(x);
      dot = fmaf(x, to_float(k[m * a.k.strides[3]]), dot);
    }
    kdk[i] = dot;
    T* dv = static_cast<T*>(a.dv.data) + b * a.dv.strides[0] + h * a.dv.strides[1] + t * a.dv.strides[2];
    for (int64_t d = 0; d < D; ++d) dv[d * a.dv.strides[3]] = from_float<T>(dv_acc[i * D + d]);
  }
}

// dL/dLam'_t of each row of each KV head: sum over the group's query heads and the tiles of
// q . dq, minus k . dk (its tiles: kdk_tiles), into da_rows [B*H_kv, L]. One thread per row.
__global__ void __launch_bounds__(kThreads) gla_rows_kernel(const MesaGlaShape s, const float* qdq, const float* kdk,
                                                            int64_t kdk_tiles, float* da_rows) {
  const int64_t H = s.heads, Hkv = s.kv_heads, L = s.len, G = H / Hkv, rows = s.batch * Hkv * L;
  const int64_t tiles = ceil_div(s.feat, int64_t(kTD));
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < rows; i += int64_t(gridDim.x) * kThreads) {
    const int64_t bk = i / L, t = i % L, b = bk / Hkv, kh = bk % Hkv;
    float x = 0.0f;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < tiles; ++j) x += qdq[j * s.batch * H * L + (b * H + kh * G + g) * L + t];
    float y = 0.0f;
    for (int64_t j = 0; j < kdk_tiles; ++j) y += kdk[j * rows + i];
    da_rows[i] = x - y;
  }
}

// da of one (sequence, KV head) per block: the suffix sums of its rows' dL/dLam', restarted at
// each reset (0 on the reset row), plus <dS_final, S_final> from the last row back to the
// last reset. Each thread takes a run of rows; a run's carry is the sum of its rows (or, with a
// reset in it, of its rows before its first reset); thread 0 chains the carries from the last
// run, and each thread walks its run again from its carry. A fixed order throughout.
__global__ void __launch_bounds__(kThreads) gla_da_scan_kernel(const MesaGlaShape s, const float* decay,
                                                               const float* d_final, const float* final_state,
                                                               const float* da_rows, float* da) {
  __shared__ float part[kThreads];
  __shared__ float carry[kThreads];
  __shared__ int reset[kThreads];
  const int64_t Hkv = s.kv_heads, L = s.len, MW = s.feat * (s.dim + (s.normalize ? 1 : 0));
  const int64_t unit = blockIdx.x / Hkv, kh = blockIdx.x % Hkv;
  const bool packed = s.packing.seq_offsets != nullptr;
  const int64_t b = packed ? 0 : unit;
  const int64_t begin = packed ? s.packing.seq_offsets[unit] : 0, end = packed ? s.packing.seq_offsets[unit + 1] : L;
  const int64_t row0 = (b * Hkv + kh) * L;
  const bool step = s.decay_kind == MESA_GLA_DECAY_PER_STEP;
  auto is_reset = [&](int64_t t) { return (step ? decay[row0 + t] : decay[kh]) == -INFINITY; };
  const int tid = threadIdx.x;
  // <dS_final, S_final>: strided parts, then a tree
  float f = 0.0f;
  if (d_final != nullptr)
    for (int64_t e = tid; e < MW; e += kThreads) f = fmaf(d_final[blockIdx.x * MW + e], final_state[blockIdx.x * MW + e], f);
  part[tid] = f;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (tid < w) part[tid] += part[tid + w];
    __syncthreads();
  }
  const float final_term = part[0];
  __syncthreads();
  const int64_t n = end - begin, per = ceil_div(n, int64_t(kThreads));
  const int64_t lo = begin + tid * per < end ? begin + tid * per : end;
  const int64_t hi = lo + per < end ? lo + per : end;
  float c = 0.0f;
  bool any = false;
  for (int64_t t = hi - 1; t >= lo; --t) {
    if (is_reset(t)) {
      c = 0.0f;
      any = true;
    } else {
      c = c + da_rows[row0 + t];
    }
  }
  part[tid] = c;
  reset[tid] = any ? 1 : 0;
  __syncthreads();
  if (tid == 0) {
    float run = final_term;
    for (int j = kThreads - 1; j >= 0; --j) {
      carry[j] = run;
      run = reset[j] ? part[j] : run + part[j];
    }
  }
  __syncthreads();
  c = carry[tid];
  for (int64_t t = hi - 1; t >= lo; --t) {
    if (is_reset(t)) {
      c = 0.0f;
      da[row0 + t] = 0.0f;
    } else {
      c = c + da_rows[row0 + t];
      da[row0 + t] = c;
    }
  }
}

// Per-head decay: d_decay[kh] = sum over b and t of da, one block per KV head, in a fixed
// order (thread-strided partial sums, then a tree).
__global__ void __launch_bounds__(kThreads) gla_da_reduce_kernel(const float* da, float* d_decay, int64_t B,
                                                                 int64_t Hkv, int64_t L) {
  __shared__ float part[kThreads];
  const int64_t kh = blockIdx.x;
  float x = 0.0f;
  for (int64_t e = threadIdx.x; e < B * L; e += kThreads) x += da[((e / L) * Hkv + kh) * L + e % L];
  part[threadIdx.x] = x;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) d_decay[kh] = part[0];
}

// dst[i] += src[i], i < n (a later group head's state gradient into d_init).
__global__ void __launch_bounds__(kThreads) la_add_kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    dst[i] = dst[i] + src[i];
}

// A grid for n threads of a grid-stride kernel: at most 8 blocks per SM, at least one.
inline dim3 stride_grid(int64_t n) {
  const int64_t want = ceil_div(n, int64_t(kThreads)), cap = int64_t(sm_count()) * 8;
  return dim3(unsigned(want < 1 ? 1 : (want < cap ? want : cap)));
}

template <typename T>
MesaStatus gla_backward(const MesaGlaBackwardArgs& a, void* stream) {
  const MesaGlaShape& gs = a.shape;
  const MesaLaShape s = gla_product_shape(gs);
  const int64_t B = gs.batch, H = gs.heads, Hkv = gs.kv_heads, L = gs.len, M = gs.feat, D = gs.dim;
  const int64_t W = D + (gs.normalize ? 1 : 0), G = H / Hkv, N = gla_units(gs);
  const bool boundary = a.boundary != nullptr;
  // boundary states: dk and dv as the chunk decomposition (parallel over chunks), their states
  // in chunk_work; walked (reverse) with MESA_LA_SCHEDULE_WALK and in SLiM mode
  const bool decompose = boundary && gs.schedule != MESA_LA_SCHEDULE_WALK;
  const GlaWork w = gla_work(a, decompose);
  const StateView none{nullptr, 0, 0, 0, 0};
  // the [unit*H_kv, W, M] view (row w, column f) of a [unit*H_kv, M, W] state
  auto transposed = [&](const float* p) { return StateView{const_cast<float*>(p), M * W, 0, 1, W}; };
  Product base = base_product(s);
  base.rs = G * L;
  base.decay = gla_decay_view(gs, a.decay, w.factors);
  Operand cv = operand<T>(a.v, D);
  if (gs.normalize) cv.extra_kind = kExtraOnes;
  // dO' = [dout/g | dden] of query head g of each group (dden recomputed where loaded)
  auto d_out = [&](int64_t g) {
    Operand o = operand<T>(group_view<T>(a.dout, G, g), D);
    if (gs.normalize) {
      const MesaLaTensor out = group_view<T>(a.out, G, g);
      o.row_div = group_rows(a.den, L, g);
      o.dot = out.data;
      o.db = out.strides[0];
      o.dh = out.strides[1];
      o.dl = out.strides[2];
      o.df = out.strides[3];
      o.extra_kind = kExtraDden;
    }
    return o;
  };
  const int64_t tiles = ceil_div(M, int64_t(kTD));
  MesaStatus st = MESA_STATUS_OK;
  for (int64_t g = 0; g < G && M > 0; ++g) {
    // dq_g = product(dO'_g, v', k), LE: state S'^T, the forward's boundary states read through
    // transposed strides, or accumulated again from the initial state (SLiM)
    Product p = base;
    p.a = d_out(g);
    p.b = cv;
    p.c = operand<T>(a.k, M);
    p.ma = W;
    p.dc = M;
    const MesaLaTensor q = group_view<T>(a.q, G, g);
    p.o = out_view(group_view<T>(a.dq, G, g), M);
    p.o.dot = q.data;
    p.o.db = q.strides[0];
    p.o.dh = q.strides[1];
    p.o.dl = q.strides[2];
    p.o.df = q.strides[3];
    p.o.dots = w.qdq + g * L;
    p.o.dots_tile = B * H * L;
    p.scale_c = 1;  // the state S'^T: k weighted, as the forward's S'
    p.transposed = 1;
    p.mask = kMaskLE;
    p.state = StateView{w.work, W * M, 0, M, 1};
    if (boundary) {
      p.mode = kReadChunk;
      p.init = boundary_view(s, a.boundary, M, W, 0, true);
    } else {
      p.mode = kAccumulate;
      p.init = a.init_state != nullptr ? transposed(a.init_state) : none;
    }
    if ((st = run_product<T>(p, stream)) != MESA_STATUS_OK) return st;
  }
  for (int64_t g = 0; g < G; ++g) {
    // dk += product(v', dO'_g, q_g), GE: state dS_final'^T (g = 0) + sum dO'_s q_s^T; its value
    // after the walk is the initial state's gradient
    Product p = base;
    p.a = cv;
    p.b = d_out(g);
    p.c = operand<T>(group_view<T>(a.q, G, g), M);
    p.ma = W;
    p.dc = M;
    if (G == 1) {
      p.o = out_view(a.dk, M);
      p.o.dot = a.k.data;
      p.o.db = a.k.strides[0];
      p.o.dh = a.k.strides[1];
      p.o.dl = a.k.strides[2];
      p.o.df = a.k.strides[3];
      p.o.dots = w.kdk;
      p.o.dots_tile = B * Hkv * L;
    } else {
      p.o = OutView{w.acc, Hkv * L * M, L * M, M, 1, M, nullptr};
      p.o.f32 = 1;
      p.o.accumulate = g > 0 ? 1 : 0;
    }
    p.mask = kMaskGE;
    p.mode = kAccumulate;
    p.state = g == 0 ? (a.d_init != nullptr ? transposed(a.d_init) : StateView{w.work, W * M, 0, M, 1})
                     : transposed(w.work2);
    p.init = g == 0 && a.d_final != nullptr ? transposed(a.d_final) : none;
    p.boundary = decompose ? chunk_states(s, w.chunk_work, W, M) : none;
    if (M > 0) {
      if ((st = decompose ? run_product_decomposed<T>(p, gs.schedule, stream) : run_product<T>(p, stream)) !=
          MESA_STATUS_OK)
        return st;
    }
    if (g > 0 && a.d_init != nullptr && N * Hkv * M * W > 0) {
      const int64_t n = N * Hkv * M * W;
      if ((st = status_from(MESA_LAUNCH(la_add_kernel, stride_grid(n), dim3(kThreads), 0, stream, a.d_init,
                                        static_cast<const float*>(w.work2), n))) != MESA_STATUS_OK)
        return st;
    }
    // dv += product(k, q_g, dout_g / g_g), GE: state dS_final[:, :D] (g = 0) + sum q_s (dout_s/g_s)^T
    Product v = base;
    Operand go = operand<T>(group_view<T>(a.dout, G, g), D);
    go.row_div = gs.normalize ? group_rows(a.den, L, g) : nullptr;
    v.a = operand<T>(a.k, M);
    v.b = operand<T>(group_view<T>(a.q, G, g), M);
    v.c = go;
    v.ma = M;
    v.dc = D;
    if (G == 1) {
      v.o = out_view(a.dv, D);
    } else {
      v.o = OutView{w.acc + B * Hkv * L * M, Hkv * L * D, L * D, D, 1, D, nullptr};
      v.o.f32 = 1;
      v.o.accumulate = g > 0 ? 1 : 0;
    }
    v.mask = kMaskGE;
    v.mode = kAccumulate;
    // bf16, normalised: C = dout / g alone has a lo tile: weight it (can_scale_c)
    v.scale_c = gs.normalize && std::is_same_v<T, __nv_bfloat16> ? 1 : 0;
    v.state = StateView{w.work, M * D, 0, D, 1};
    v.init = g == 0 && a.d_final != nullptr ? StateView{const_cast<float*>(a.d_final), M * W, 0, W, 1} : none;
    v.boundary = decompose ? chunk_states(s, w.chunk_work, M, D) : none;
    if (D > 0) {
      if ((st = decompose ? run_product_decomposed<T>(v, gs.schedule, stream) : run_product<T>(v, stream)) !=
          MESA_STATUS_OK)
        return st;
    }
  }
  const int64_t rows = B * Hkv * L;
  if (G > 1 && rows > 0) {
    if ((st = status_from(MESA_LAUNCH(gla_round_kernel<T>, stride_grid(rows), dim3(kThreads), 0, stream, a,
                                      static_cast<const float*>(w.acc), w.kdk))) != MESA_STATUS_OK)
      return st;
  }
  const bool step = gs.decay_kind == MESA_GLA_DECAY_PER_STEP;
  if (rows > 0) {
    if ((st = status_from(MESA_LAUNCH(gla_rows_kernel, stride_grid(rows), dim3(kThreads), 0, stream, gs,
                                      static_cast<const float*>(w.qdq), static_cast<const float*>(w.kdk),
                                      G > 1 ? int64_t(1) : tiles, w.da_rows))) != MESA_STATUS_OK)
      return st;
    if ((st = status_from(MESA_LAUNCH(gla_da_scan_kernel, dim3(unsigned(N * Hkv)), dim3(kThreads), 0, stream, gs,
                                      a.decay, a.d_final, a.final_state, static_cast<const float*>(w.da_rows),
                                      step ? a.d_decay : w.da_rows))) != MESA_STATUS_OK)
      return st;
  }
  // per-head decay: also with B*L = 0 (its gradient is then 0)
  if (step) return MESA_STATUS_OK;
  return status_from(MESA_LAUNCH(gla_da_reduce_kernel, dim3(unsigned(Hkv)), dim3(kThreads), 0, stream,
                                 static_cast<const float*>(w.da_rows), a.d_decay, B, Hkv, L));
}

template <typename T> struct GlaForwardOp { static MesaStatus run(const MesaGlaForwardArgs& a, void* s) { return gla_forward<T>(a, s); } };
template <typename T> struct GlaBackwardOp { static MesaStatus run(const MesaGlaBackwardArgs& a, void* s) { return gla_backward<T>(a, s); } };

// The entry points' own checks (the safe crate checks everything first, with typed errors).
inline bool gla_shape_valid(const MesaGlaShape& s) {
  if (s.batch < 0 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.len < 0 || s.feat < 0 ||
      s.dim < 0 || s.chunk < 1 || s.chunk > MESA_GLA_MAX_CHUNK)
    return false;
  if (s.dtype != MESA_DTYPE_F32 && s.dtype != MESA_DTYPE_F16 && s.dtype != MESA_DTYPE_BF16) return false;
  if (s.decay_kind != MESA_GLA_DECAY_PER_STEP && s.decay_kind != MESA_GLA_DECAY_PER_HEAD) return false;
  if (s.schedule != MESA_LA_SCHEDULE_CHUNK_SUMS && s.schedule != MESA_LA_SCHEDULE_STATE_WALK &&
      s.schedule != MESA_LA_SCHEDULE_WALK)
    return false;
  if (s.normalize && !(s.eps > 0.0f && s.eps < INFINITY)) return false;
  // packed: B = 1 and N >= 1 sequences (the offsets themselves are the caller's to check)
  if (s.packing.seq_offsets != nullptr && (s.batch != 1 || s.packing.nseq < 1)) return false;
  // one da block per (unit, KV head); rows and heads in 32 bits (Seq)
  return gla_units(s) * s.kv_heads <= int64_t(0x7fffffff) && s.batch <= INT32_MAX && s.heads <= INT32_MAX;
}

// Boundary states (given): packed, the chunk offsets too.
inline bool gla_boundary_valid(const MesaGlaShape& s, const void* boundary) {
  return boundary == nullptr || s.packing.seq_offsets == nullptr || s.packing.chunk_offsets != nullptr;
}

}  // namespace MESA_NS

using namespace MESA_NS;

// ---------------------------------------------------------------------------------------
// C entry points: they re-check what would make a kernel touch memory it should not (the
// safe crate checks buffer extents first).
extern "C" MesaStatus MESA_ENTRY(linear_attention_forward)(const MesaLaForwardArgs* a, void* stream) {
  if (a == nullptr || !shape_valid(a->shape)) return MESA_STATUS_INVALID_ARGUMENT;
  const MesaLaShape& s = a->shape;
  if (is_empty(s)) return MESA_STATUS_OK;
  if (!fits_32_bit_indices(s)) return MESA_STATUS_INVALID_ARGUMENT;
  const bool has_state = s.feat > 0 && (s.dim > 0 || s.normalize);
  if (has_state && a->state == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  if (has_state && s.causal && s.memory == MESA_LA_BOUNDARY_STATES && s.len > 0 && a->boundary == nullptr)
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.normalize && s.len > 0 && a->den == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  // an initial state: causal only; SLiM keeps a copy for the backward
  if (a->init_state != nullptr && !s.causal) return MESA_STATUS_INVALID_ARGUMENT;
  if (has_state && a->init_state != nullptr && s.memory == MESA_LA_SLIM && a->init_copy == nullptr)
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.len > 0 && ((s.feat > 0 && (a->q.data == nullptr || a->k.data == nullptr)) ||
                    (s.dim > 0 && (a->v.data == nullptr || a->out.data == nullptr))))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.len == 0) {
    // empty sequence: the state is zero (nothing to walk)
    if (!has_state) return MESA_STATUS_OK;
  }
  return dispatch<ForwardOp>(s.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(linear_attention_backward)(const MesaLaBackwardArgs* a, void* stream) {
  if (a == nullptr || !shape_valid(a->shape)) return MESA_STATUS_INVALID_ARGUMENT;
  const MesaLaShape& s = a->shape;
  const bool has_state = s.feat > 0 && (s.dim > 0 || s.normalize);
  // state gradients: causal only
  if (!s.causal && (a->init_state != nullptr || a->d_final != nullptr || a->d_init != nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  // L = 0: nothing to write but d_init (= d_final, or 0)
  if (is_empty(s) || (s.len == 0 && (a->d_init == nullptr || !has_state))) return MESA_STATUS_OK;
  if (!fits_32_bit_indices(s)) return MESA_STATUS_INVALID_ARGUMENT;
  if ((s.feat > 0 || s.dim > 0) && a->work == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  if (has_state && a->state == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  if (has_state && s.causal && s.memory == MESA_LA_BOUNDARY_STATES && a->boundary == nullptr)
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.normalize && (a->den == nullptr || (s.dim > 0 && a->out.data == nullptr))) return MESA_STATUS_INVALID_ARGUMENT;
  if (s.feat > 0 && (a->q.data == nullptr || a->k.data == nullptr || a->dq.data == nullptr || a->dk.data == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.dim > 0 && (a->v.data == nullptr || a->dout.data == nullptr || a->dv.data == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch<BackwardOp>(s.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(gated_linear_attention_forward)(const MesaGlaForwardArgs* a, void* stream) {
  if (a == nullptr || !gla_shape_valid(a->shape) || !gla_boundary_valid(a->shape, a->boundary))
    return MESA_STATUS_INVALID_ARGUMENT;
  const MesaGlaShape& s = a->shape;
  if (s.batch == 0) return MESA_STATUS_OK;
  // an empty tensor may come as NULL: the per-step decay when L = 0
  const bool decay_empty = s.decay_kind == MESA_GLA_DECAY_PER_STEP && s.len == 0;
  const bool chunk_sums = a->boundary != nullptr && s.schedule == MESA_LA_SCHEDULE_CHUNK_SUMS;
  if ((a->decay == nullptr && !decay_empty) || a->final_state == nullptr || (chunk_sums && a->work == nullptr) ||
      (s.normalize && a->den == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (s.len > 0 && (a->q.data == nullptr || a->k.data == nullptr || a->v.data == nullptr || a->out.data == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch<GlaForwardOp>(s.dtype, *a, stream);
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
  return dispatch<GlaBackwardOp>(s.dtype, *a, stream);
}
