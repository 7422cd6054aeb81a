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
template <typename T>
__device__ void load_rows_t(float (*dst)[kChunk + 1], const Operand& p, int64_t b, int64_t h, int64_t bh, int64_t L,
                            int64_t t0, int rows, int64_t f0) {
  const int64_t width = p.width();
  for (int i = threadIdx.x; i < kTF * rows; i += kThreads) {
    const int f = i % kTF, r = i / kTF;  // consecutive threads: consecutive features
    dst[f][r] = f0 + f < width ? load_operand<T>(p, b, h, bh, L, t0 + r, f0 + f) : 0.0f;
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
  if (d0 == 0 && r < rows) p.den[sq.bh * p.L + t0 + r] = den;
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
template <bool kNorm, typename B>
__device__ __forceinline__ void z_update(const Product& p, const Seq& sq, int rows, int64_t f0, int64_t d0,
                                         const StateView* dst, int64_t dst_bh, int64_t dst_chunk, B b) {
  const int f = fresh_tid();
  if (!kNorm || d0 != 0 || f >= kTF || f0 + f >= p.ma) return;
  float u = 0.0f;
  for (int r = 0; r < rows; ++r) u += b(r, f);
  if (dst != nullptr) {
    *dst->at(dst_bh, dst_chunk, f0 + f, p.dc) = u;
  } else {
    float* z = p.state.at(sq.sidx, 0, f0 + f, p.dc);
    *z = *z + u;
  }
}

// S[:, d0:d0+kTD] += B_c^T C_c (C_c already in tiles.c). Each thread owns 4 state
// elements per feature tile, so the read-modify-write of the global state has one writer.
// With `dst` (kChunkSum): writes U_c = B_c^T C_c to dst at (dst_bh, dst_chunk) instead (the
// same f32 value as 0 + U_c, so a scan of them rounds exactly as the sequential walk).
// (kLo: the tensor-core overload's; f32 tiles have no lo half.)
template <typename T, int kLo, bool kNorm>
__device__ void update_state(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                             const StateView* dst = nullptr, int64_t dst_bh = 0, int64_t dst_chunk = 0) {
  const int fr = threadIdx.x / 8, dcol = (threadIdx.x % 8) * 4;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_t<T>(tl.b, p.b, sq.b, sq.h, sq.bh, p.L, t0, rows, f0);
    __syncthreads();
    z_update<kNorm>(p, sq, rows, f0, d0, dst, dst_bh, dst_chunk, [&](int r, int f) { return tl.b[f][r]; });
    float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < rows; ++r) {
      const float bv = tl.b[fr][r];
#pragma unroll
      for (int j = 0; j < 4; ++j) u[j] = fmaf(bv, tl.c[r][dcol + j], u[j]);
    }
    if (f0 + fr < p.ma) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (d0 + dcol + j >= p.dc) continue;
        if (dst != nullptr) {
          *dst->at(dst_bh, dst_chunk, f0 + fr, d0 + dcol + j) = u[j];
        } else {
          float* s = p.state.at(sq.sidx, 0, f0 + fr, d0 + dcol + j);
          *s = *s + u[j];
        }
      }
    }
  }
  __syncthreads();
}

// Outputs of one chunk: O = A_c S + mask(A_c B_c^T) C_c, written to p.o. `sv` at
// (sv_bh, sv_chunk) is the state to read (nullptr base: no inter-chunk term). Leaves C_c in
// tiles.c.
template <typename T, int kMask, int kLo, bool kNorm>
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
    load_rows_t<T>(tl.a, p.a, b, h, bh, p.L, t0, rows, f0);
    if (intra) load_rows_t<T>(tl.b, p.b, b, h, bh, p.L, t0, rows, f0);
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
        tl.p[r][s] = visible<kMask>(r, s) ? acc_p[i][j] : 0.0f;
      }
  }
  load_rows_c<T>(tl.c, p.c, b, h, bh, p.L, t0, rows, d0);
  __syncthreads();
  if (kNorm) {
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
  T* out = static_cast<T*>(p.o.data);
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
      if (p.o.row_div != nullptr) x = x / p.o.row_div[bh * p.L + t];
      out[b * p.o.sb + h * p.o.sh + t * p.o.sl + d * p.o.sf] = from_float<T>(x);
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
                                int rows, int64_t c0) {
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
    put_split8(dst.hi, dst.lo, r * kLd + c, x);
    return;
  }
  const int64_t width = p.width();
#pragma unroll 1
  for (int j = 0; j < 8; j += 2) {
    const int64_t f = c0 + c + j;
    const float x0 = r < rows && f < width ? load_operand<T>(p, sq.b, sq.h, sq.bh, L, t0 + r, f) : 0.0f;
    const float x1 = r < rows && f + 1 < width ? load_operand<T>(p, sq.b, sq.h, sq.bh, L, t0 + r, f + 1) : 0.0f;
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
    load_rows_split<T>(tl.x.ab.a, p.a, sq, p.L, t0, rows, f0);
    if (intra) load_rows_split<T>(tl.x.ab.b, p.b, sq, p.L, t0, rows, f0);
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
template <int kMask, bool kNorm>
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
      x[j] = visible<kMask>(r, s) ? tl.x.pf[r * kLdPf + s] : 0.0f;
    }
    put_split8(tl.y.p.hi, tl.y.p.lo, r * kLdP + c + h, x);
  }
  if (kNorm)
    den = den_intra(den, rows, [&](int r, int s) { return visible<kMask>(r, s) ? tl.x.pf[r * kLdPf + s] : 0.0f; });
  return den;
}

// The end of a chunk's outputs for D-tile d0: O = acc_o (A_c S, already accumulated) +
// mask(P) C_c (intra: mask(P) in tl.y.p; C_c loaded into tl.c and left there), written to p.o
// (divided by the denominators in den_rows() when self_norm, by p.o.row_div when given).
template <typename T, int kMask, int kLo, bool kNorm>
__device__ __forceinline__ void finish_outputs(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows,
                                               int64_t d0, bool intra, FragAcc& acc_o) {
  const int warp = fresh_tid() / kWarpSize;
  const int wi = warp / 2, wo = warp % 2;
  constexpr bool c_lo = (kLo & kLoC) != 0;
  if (intra) {
    load_rows_split<T>(tl.c, p.c, sq, p.L, t0, rows, d0);
    if (kMask != kMaskNone) flag_nonfinite_rows(tl.c);
  }
  __syncthreads();
  // A masked zero of P times a non-finite c_s is NaN (0 x inf), and in an MMA it reaches the
  // rows that do not see s. Only the diagonal 16 x 16 block of P mixes rows that see s with
  // rows that do not (hidden blocks are skipped): where C's rows of that block hold a
  // non-finite value, the block is summed with scalar FMAs over its visible entries instead.
  const bool diagonal_scalar =
      intra && kMask != kMaskNone && (c_nonfinite()[2 * wi] != 0 || c_nonfinite()[2 * wi + 1] != 0);
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
  if (r < rows && d0 + d < p.dc) {
    const int64_t t = t0 + r;
    const float div = p.o.row_div != nullptr ? p.o.row_div[sq.bh * p.L + t] : 1.0f;
    T* out = static_cast<T*>(p.o.data) + sq.b * p.o.sb + sq.h * p.o.sh + t * p.o.sl;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (d0 + d + j >= p.dc) break;
      float x = tl.x.o[r * kLdO + d + j];
      if (kNorm) x = x / den_rows()[r];
      if (p.o.row_div != nullptr) x = x / div;
      out[(d0 + d + j) * p.o.sf] = from_float<T>(x);
    }
  }
}

// The tensor-core chunk_outputs (same contract, except that C_c is loaded, and left in tl.c,
// only when `intra`: the bidirectional outputs A S do not read it). One feature loop for P and
// A S together (the walks: one D-tile per block).
template <typename T, int kMask, int kLo, bool kNorm>
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
  if (intra) den = stage_p<kMask, kNorm>(tl, p, rows, acc_p, den);
  if (kNorm) den_store(den_final(den, p), den_rows(), p, sq, t0, rows, d0);
  finish_outputs<T, kMask, kLo, kNorm>(tl, p, sq, t0, rows, d0, intra, acc_o);
}

// The outputs of one chunk for the D-tiles [d_begin, d_end) (the per-chunk outputs of the
// decomposition, kReadChunk: intra and inter). P = mask(A_c B_c^T) and the denominators are
// computed once, then each D-tile runs its own feature loop for A_c S (the state tile in
// tl.x.a_s.s, beside A_c, so that mask(P) in tl.y.p stays) and adds P C_c. The same f32
// operations in the same order as chunk_outputs per D-tile: the same bits.
template <typename T, int kMask, int kLo, bool kNorm>
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
  den = stage_p<kMask, kNorm>(tl, p, rows, acc_p, den);
  if (kNorm) den_store(den_final(den, p), den_rows(), p, sq, t0, rows, d_begin);
#pragma unroll 1
  for (int64_t d0 = d_begin; d0 < d_end; d0 += kTD) {
    wmma::fill_fragment(acc_o, 0.0f);
    if (inter)
      feature_loop<T, kMask, kLo>(tl, tl.x.a_s.s, p, sq, t0, rows, d0, sv, sv_bh, sv_chunk, false, true, false,
                                  acc_p, acc_o, den);
    finish_outputs<T, kMask, kLo, kNorm>(tl, p, sq, t0, rows, d0, true, acc_o);
  }
}

// The tensor-core update_state (same contract; C_c already in tl.c).
template <typename T, int kLo, bool kNorm>
__device__ void update_state(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                             const StateView* dst = nullptr, int64_t dst_bh = 0, int64_t dst_chunk = 0) {
  const int warp = fresh_tid() / kWarpSize;
  constexpr bool b_lo = (kLo & kLoB) != 0, c_lo = (kLo & kLoC) != 0;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_split<T>(tl.x.ab.b, p.b, sq, p.L, t0, rows, f0);
    __syncthreads();
    z_update<kNorm>(p, sq, rows, f0, d0, dst, dst_bh, dst_chunk,
             [&](int r, int f) { return split_value(tl.x.ab.b, r * kLdAB + f); });
    if (warp < 4) {
      const int fi = warp / 2, dj = warp % 2;
      FragAcc u;
      wmma::fill_fragment(u, 0.0f);
      for (int kk = 0; kk < kChunk / 16 && kk * 16 < rows; ++kk) {
        FragAt bh, bl;  // B_c^T [feature][row]: B's [row][feature] tile read column-major
        FragB ch, cl;
        wmma::load_matrix_sync(bh, tl.x.ab.b.hi + kk * 16 * kLdAB + fi * 16, kLdAB);
        if (b_lo) wmma::load_matrix_sync(bl, tl.x.ab.b.lo + kk * 16 * kLdAB + fi * 16, kLdAB);
        wmma::load_matrix_sync(ch, tl.c.hi + kk * 16 * kLdC + dj * 16, kLdC);
        if (c_lo) wmma::load_matrix_sync(cl, tl.c.lo + kk * 16 * kLdC + dj * 16, kLdC);
        mma_split(u, bh, bl, b_lo, ch, cl, c_lo);
      }
      wmma::store_matrix_sync(tl.y.u + fi * 16 * kLdO + dj * 16, u, kLdO, wmma::mem_row_major);
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
          *s = *s + x;
        }
      }
    }
  }
  __syncthreads();
}

// C_c into the tiles (the state update's third operand, when chunk_outputs did not load it).
template <typename T>
__device__ void load_c_tile(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0) {
  load_rows_c<T>(tl.c, p.c, sq.b, sq.h, sq.bh, p.L, t0, rows, d0);
}
template <typename T>
__device__ void load_c_tile(TcTiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0) {
  load_rows_split<T>(tl.c, p.c, sq, p.L, t0, rows, d0);
}

// The FP32 path's outputs of one chunk for the D-tiles [d_begin, d_end): chunk_outputs per
// D-tile (its launch policy gives it one D-tile per block, value_group()).
template <typename T, int kMask, int kLo, bool kNorm>
__device__ void chunk_outputs_tiles(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows,
                                    int64_t d_begin, int64_t d_end, const StateView& sv, int64_t sv_bh,
                                    int64_t sv_chunk) {
  for (int64_t d0 = d_begin; d0 < d_end; d0 += kTD)
    chunk_outputs<T, kMask, kLo, kNorm>(tl, p, sq, t0, rows, d0, sv, sv_bh, sv_chunk, true);
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
template <typename T, int kMode, int kMask, int kLo, bool kNorm>
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
          chunk_outputs<T, kMask, kLo, kNorm>(tl, p, sq, t0, rows_of(c), it.d0, p.state, it.sidx, 0, true);
          update_state<T, kLo, kNorm>(tl, p, sq, t0, rows_of(c), it.d0);
        }
        break;
      }
      case kReadChunk: {
        const int64_t d_end = it.d0 + p.dgroup * kTD, d_last = value_tiles(p) * kTD;
        chunk_outputs_tiles<T, kMask, kLo, kNorm>(tl, p, sq, sq.t0 + it.c_read * p.chunk, rows_of(it.c_read), it.d0,
                                           d_end < d_last ? d_end : d_last, p.init, sq.bidx, sq.cbase + it.c_read);
        break;
      }
      case kChunkSum: {
        const int64_t t0 = sq.t0 + it.c_read * p.chunk;
        load_c_tile<T>(tl, p, sq, t0, rows_of(it.c_read), it.d0);
        update_state<T, kLo, kNorm>(tl, p, sq, t0, rows_of(it.c_read), it.d0, &p.boundary, sq.bidx, sq.cbase + it.c_read);
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
          load_c_tile<T>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
          update_state<T, kLo, kNorm>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
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
            update_state<T, kLo, kNorm>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0);
          }
        }
        for (int64_t c = 0; c < it.nchunks; ++c)
          chunk_outputs<T, kMask, kLo, kNorm>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), it.d0, given ? p.init : p.state, it.sidx,
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
      run = run + x;
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

template <typename T, int kMode, int kMask, int kLo, bool kNorm>
MesaStatus launch_instance(const Product& p, void* stream) {
  if constexpr ((lo_used<kMode, kMask>(kLo) || kLo == kLoAll) && (!kNorm || norm_used<kMode, kMask>(kLo))) {
    auto kernel = la_product_kernel<T, kMode, kMask, kLo, kNorm>;
    const dim3 grid(resident_grid(kernel, p.items * kThreads, kThreads));
    return status_from(MESA_LAUNCH(kernel, grid, dim3(kThreads), 0, stream, p));
  } else {
    return MESA_STATUS_INVALID_ARGUMENT;
  }
}

// Normalisation: a template parameter (the denominators' code is compiled only where used).
template <typename T, int kMode, int kMask, int kLo>
MesaStatus launch_normalised(const Product& p, void* stream) {
  return p.self_norm ? launch_instance<T, kMode, kMask, kLo, true>(p, stream)
                     : launch_instance<T, kMode, kMask, kLo, false>(p, stream);
}

template <typename T, int kMode, int kMask>
MesaStatus launch_product(const Product& p, void* stream) {
  if constexpr (!std::is_same_v<T, __nv_bfloat16>) {
    return launch_normalised<T, kMode, kMask, kLoAll>(p, stream);
  } else {
    switch (lo_mask<T>(p)) {
      case 0: return launch_normalised<T, kMode, kMask, 0>(p, stream);
      case kLoA: return launch_normalised<T, kMode, kMask, kLoA>(p, stream);
      case kLoB: return launch_normalised<T, kMode, kMask, kLoB>(p, stream);
      case kLoC: return launch_normalised<T, kMode, kMask, kLoC>(p, stream);
      default: return MESA_STATUS_INVALID_ARGUMENT;
    }
  }
}

// The mode and the direction: a causal walk or per-chunk outputs LE (forward, dq) or GE (dk,
// dv); the chunk sums read no mask (the scan walks in its direction); bidirectional none.
template <typename T, int kMode>
MesaStatus launch_masked(const Product& p, void* stream) {
  if constexpr (kMode == kChunkSum) {
    return launch_product<T, kMode, kMaskNone>(p, stream);
  } else if constexpr (kMode == kBidir) {
    return p.mask == kMaskNone ? launch_product<T, kMode, kMaskNone>(p, stream) : MESA_STATUS_INVALID_ARGUMENT;
  } else {
    switch (p.mask) {
      case kMaskLE: return launch_product<T, kMode, kMaskLE>(p, stream);
      case kMaskGE: return launch_product<T, kMode, kMaskGE>(p, stream);
      default: return MESA_STATUS_INVALID_ARGUMENT;
    }
  }
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
    case kAccumulate: return launch_masked<T, kAccumulate>(p, stream);
    case kReadChunk: return launch_masked<T, kReadChunk>(p, stream);
    case kChunkSum: return launch_masked<T, kChunkSum>(p, stream);
    case kBidir: return launch_masked<T, kBidir>(p, stream);
    case kStateWalk: return launch_masked<T, kStateWalk>(p, stream);
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
MesaStatus run_product_decomposed(Product p, MesaLaSchedule schedule, void* stream) {
  MesaStatus st = MESA_STATUS_OK;
  if (schedule == MESA_LA_SCHEDULE_STATE_WALK) {
    p.mode = kStateWalk;
    st = run_product<T>(p, stream);
    if (st != MESA_STATUS_OK) return st;
  } else {
    p.mode = kChunkSum;
    st = run_product<T>(p, stream);
    if (st != MESA_STATUS_OK) return st;
    const int64_t n = ((p.seq_off != nullptr ? p.nseq : p.B) * p.H) * p.ma * (p.dc + (p.self_norm ? 1 : 0));
    const int64_t want = ceil_div(n, kThreads), cap = int64_t(sm_count()) * 8;
    st = status_from(MESA_LAUNCH(la_scan_kernel, dim3(unsigned(want < 1 ? 1 : (want < cap ? want : cap))),
                                 dim3(kThreads), 0, stream, p));
    if (st != MESA_STATUS_OK) return st;
  }
  p.mode = kReadChunk;
  p.init = p.boundary;
  p.boundary = StateView{nullptr, 0, 0, 0, 0};
  return run_product<T>(p, stream);
}

inline Product base_product(const MesaLaShape& s) {
  Product p{};
  p.B = s.batch;
  p.H = s.heads;
  p.L = s.len;
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
