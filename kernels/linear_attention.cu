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
// Forward (W = D + normalize, c' = [v | 1], a virtual column of ones):
//   den = product(q, k, 1)       -> guarded g(den), f32        (normalize only)
//   out = product(q, k, v) / den
// the state column D holds z = sum k_s, so S' = sum k_s c'_s^T.
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
//                    its chunks are independent (parallel over chunks).
//   SLIM:            only the final state is kept (and a copy of S0'); dq walks the chunks
//                    forward again from S0', so dq_t reads rows s <= t only. (SLiM's own
//                    reversal by subtraction, S <- S - B_c^T C_c, loses the early states to
//                    cancellation when later rows are large: not used.)
// Scratch of the backward: one state per (b, h), M*W f32, in both modes.
//
// Work per chunk and (b,h), Ma = M, Dc = D (FLOPs, f32 FMA = 2):
//   intra  2 C^2 M (per D-tile of 32: recomputed for each of ceil(D/32) tiles)  + 2 C^2 D
//   inter  2 C M D,   update 2 C M D
// Bytes per (b,h): read (2M + D) L sizeof(T), write D L sizeof(T); the state tile is
// read and written once per chunk from L2 (M D 4 bytes each way).
// Reference: crates/mesa-kernels/src/reference/linear_attention.rs. Floors: docs/linear_attention.md.
#include "common.cuh"

namespace MESA_NS {

// Tiles. kChunk rows of a chunk, kTF features of Ma per step, kTD columns of Dc per block.
// 256 threads: P = A B^T is 64 x 64 (16 per thread), O is 64 x 32 (8 per thread), the state
// update 32 x 32 (4 per thread). Shared memory 45 KiB (< 48 KiB static), so 4-5 blocks fit
// an SM of an H200 (228 KiB).
constexpr int kThreads = 256;
constexpr int kChunk = MESA_LA_MAX_CHUNK;
constexpr int kTF = 32;
constexpr int kTD = 32;

enum Mask { kMaskNone = 0, kMaskLE = 1, kMaskGE = 2 };
enum Mode {
  kAccumulate = 0,  // S from `init` (base NULL: 0), walk in the mask's direction (+ boundary write)
  kReadChunk = 1,   // S of chunk c read from `init` (per-chunk states): chunks independent
  kBidir = 2,       // phase 1: S = sum over all chunks (or init if given); phase 2: O = A S
  kChunkSum = 3     // U_c = B_c^T C_c of every chunk into `boundary` (chunks independent);
                    // la_scan_kernel then turns them into the states entering each chunk
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
  __host__ __device__ int64_t width() const { return nfeat + (extra_kind != kExtraNone ? 1 : 0); }
};

struct OutView {
  void* data;
  int64_t sb, sh, sl, sf;
  int64_t width;
  const float* row_div;  // NULL or [B*H*L]
  int guard;             // write g(x) = x + eps*sign(x) (the denominators)
  float eps;
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
  StateView boundary;  // kAccumulate: write the state entering each chunk (base NULL: no)
  // Packed sequences (seq_off != NULL): B = 1 physically; sequence n is rows
  // seq_off[n]..seq_off[n+1] of every head, its state index n*H + h, its chunks the global
  // chunks chunk_off[n]..chunk_off[n+1] (boundary states [nchunks_total, H, ma, dc]).
  const int64_t* seq_off;
  const int64_t* chunk_off;
  int64_t nseq;
  int64_t nchunks_total;
};

// One (sequence, head) of a call: where its rows and states are.
struct Seq {
  int64_t b, h;   // physical batch and head of its rows
  int64_t bh;     // b*H + h: index of its per-row arrays (den) as [B*H, L]
  int64_t sidx;   // its state [sidx, ma, dc]
  int64_t t0;     // physical row of its row 0
  int64_t len;    // its rows
  int64_t bidx;   // boundary states: (bidx, cbase + c)
  int64_t cbase;
};

__device__ __forceinline__ Seq seq_of(const Product& p, int64_t sidx) {
  if (p.seq_off == nullptr) return Seq{sidx / p.H, sidx % p.H, sidx, sidx, 0, p.L, sidx, 0};
  const int64_t n = sidx / p.H, h = sidx % p.H;
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

// S[:, d0:d0+kTD] += B_c^T C_c (C_c already in tiles.c). Each thread owns 4 state
// elements per feature tile, so the read-modify-write of the global state has one writer.
template <typename T>
// With `dst` (kChunkSum): writes U_c = B_c^T C_c to dst at (dst_bh, dst_chunk) instead (the
// same f32 value as 0 + U_c, so a scan of them rounds exactly as the sequential walk).
__device__ void update_state(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                             const StateView* dst = nullptr, int64_t dst_bh = 0, int64_t dst_chunk = 0) {
  const int fr = threadIdx.x / 8, dcol = (threadIdx.x % 8) * 4;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_t<T>(tl.b, p.b, sq.b, sq.h, sq.bh, p.L, t0, rows, f0);
    __syncthreads();
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
// (sv_bh, sv_chunk) is the state to read (nullptr base: no inter-chunk term); `save`, if
// given, receives it at (sq.bidx, save_chunk). Leaves C_c in tiles.c.
template <typename T, typename TO>
__device__ void chunk_outputs(Tiles& tl, const Product& p, const Seq& sq, int64_t t0, int rows, int64_t d0,
                              const StateView& sv, int64_t sv_bh, int64_t sv_chunk, bool intra,
                              const StateView* save, int64_t save_chunk) {
  const int64_t b = sq.b, h = sq.h, bh = sq.bh;
  const int py = threadIdx.x / 16, px = threadIdx.x % 16;  // P: rows py*4.., cols px*4..
  const int oy = (threadIdx.x / 8) * 2, ox = (threadIdx.x % 8) * 4;  // O: rows oy, oy+1; cols ox..
  float acc_p[4][4] = {};
  float acc_o[2][4] = {};
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
          if (save != nullptr) *save->at(sq.bidx, save_chunk, f0 + f, d0 + d) = v;
        }
        tl.s[f][d] = v;
      }
    }
    __syncthreads();
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
        const bool keep = p.mask == kMaskLE ? s <= r : (p.mask == kMaskGE ? s >= r : true);
        tl.p[r][s] = keep ? acc_p[i][j] : 0.0f;
      }
  }
  load_rows_c<T>(tl.c, p.c, b, h, bh, p.L, t0, rows, d0);
  __syncthreads();
  if (intra) {
    for (int s = 0; s < rows; ++s) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float pv = tl.p[oy + i][s];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc_o[i][j] = fmaf(pv, tl.c[s][ox + j], acc_o[i][j]);
      }
    }
  }
  TO* out = static_cast<TO*>(p.o.data);
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
      if (p.o.row_div != nullptr) x = x / p.o.row_div[bh * p.L + t];
      if (p.o.guard) x = x >= 0.0f ? x + p.o.eps : x - p.o.eps;
      out[b * p.o.sb + h * p.o.sh + t * p.o.sl + d * p.o.sf] = from_float<TO>(x);
    }
  }
}

// Sets the block's state tile [ma, d0:d0+kTD] to `src` (base NULL: zero).
__device__ void init_state(const Product& p, int64_t sidx, int64_t d0, const StateView& src) {
  __syncthreads();
  for (int64_t i = threadIdx.x; i < p.ma * kTD; i += kThreads) {
    const int64_t f = i / kTD, d = d0 + i % kTD;
    if (d >= p.dc) continue;
    *p.state.at(sidx, 0, f, d) = src.base != nullptr ? *src.at(sidx, 0, f, d) : 0.0f;
  }
  __syncthreads();
}

// Work items of a launch: (state index, D-tile), or with per-chunk states (state index,
// chunk, D-tile); packed sequences number their chunks globally (head, global chunk, tile).
__host__ __device__ __forceinline__ int64_t product_items(const Product& p) {
  const int64_t ndt = ceil_div(p.dc, kTD);
  const int64_t nstates = (p.seq_off != nullptr ? p.nseq : p.B) * p.H;
  if (!per_chunk(p.mode)) return nstates * ndt;
  return p.seq_off != nullptr ? p.H * p.nchunks_total * ndt : nstates * ceil_div(p.L, p.chunk) * ndt;
}

// One block per work item, grid-stride over items (grid.x only, so B*H is never limited by
// grid.y/z).
template <typename T, typename TO>
__global__ void __launch_bounds__(kThreads, 1) la_product_kernel(Product p) {
  __shared__ Tiles tl;
  // chunk_outputs' 4x4 products read every row of the a/b tiles, also the rows past a short
  // chunk's last row, which load_rows_t leaves as they are (and whose results are dropped):
  // zeroed once, so that no read sees shared memory this block never wrote
  for (int i = threadIdx.x; i < kTF * (kChunk + 1); i += kThreads) {
    tl.a[i / (kChunk + 1)][i % (kChunk + 1)] = 0.0f;
    tl.b[i / (kChunk + 1)][i % (kChunk + 1)] = 0.0f;
  }
  const int64_t ndt = ceil_div(p.dc, kTD);
  const int64_t items = product_items(p);
  const StateView none{nullptr, 0, 0, 0, 0};
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t d0 = (item % ndt) * kTD;
    const int64_t r = item / ndt;
    // per chunk: r = (state, chunk) [or (head, global chunk) when packed]; else r = state
    int64_t sidx = r, c_read = 0;
    if (per_chunk(p.mode)) {
      if (p.seq_off != nullptr) {
        const int64_t g = r % p.nchunks_total, h = r / p.nchunks_total;
        const int64_t n = seq_of_chunk(p, g);
        sidx = n * p.H + h;
        c_read = g - p.chunk_off[n];
      } else {
        const int64_t nc = ceil_div(p.L, p.chunk);
        sidx = r / nc;
        c_read = r % nc;
      }
    }
    const Seq sq = seq_of(p, sidx);
    const int64_t nchunks = ceil_div(sq.len, p.chunk);
    auto rows_of = [&](int64_t c) { return int(sq.len - c * p.chunk < p.chunk ? sq.len - c * p.chunk : p.chunk); };
    switch (p.mode) {
      case kAccumulate: {
        init_state(p, sidx, d0, p.init);
        const bool save = p.boundary.base != nullptr;
        for (int64_t i = 0; i < nchunks; ++i) {
          const int64_t c = p.mask == kMaskGE ? nchunks - 1 - i : i;
          const int64_t t0 = sq.t0 + c * p.chunk;
          chunk_outputs<T, TO>(tl, p, sq, t0, rows_of(c), d0, p.state, sidx, 0, true,
                               save ? &p.boundary : nullptr, sq.cbase + c);
          update_state<T>(tl, p, sq, t0, rows_of(c), d0);
        }
        break;
      }
      case kReadChunk: {
        chunk_outputs<T, TO>(tl, p, sq, sq.t0 + c_read * p.chunk, rows_of(c_read), d0, p.init, sq.bidx,
                             sq.cbase + c_read, true, nullptr, 0);
        break;
      }
      case kChunkSum: {
        const int64_t t0 = sq.t0 + c_read * p.chunk;
        __syncthreads();
        load_rows_c<T>(tl.c, p.c, sq.b, sq.h, sq.bh, p.L, t0, rows_of(c_read), d0);
        update_state<T>(tl, p, sq, t0, rows_of(c_read), d0, &p.boundary, sq.bidx, sq.cbase + c_read);
        break;
      }
      case kBidir: {
        const bool given = p.init.base != nullptr;
        if (!given) {
          init_state(p, sidx, d0, none);
          for (int64_t c = 0; c < nchunks; ++c) {
            __syncthreads();
            load_rows_c<T>(tl.c, p.c, sq.b, sq.h, sq.bh, p.L, sq.t0 + c * p.chunk, rows_of(c), d0);
            update_state<T>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), d0);
          }
        }
        for (int64_t c = 0; c < nchunks; ++c)
          chunk_outputs<T, TO>(tl, p, sq, sq.t0 + c * p.chunk, rows_of(c), d0, given ? p.init : p.state, sidx, 0,
                               false, nullptr, 0);
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
  const int64_t per = p.ma * p.dc;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nstates * per;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t sidx = i / per, r = (i % per) / p.dc, c = i % p.dc;
    const Seq sq = seq_of(p, sidx);
    float run = p.init.base != nullptr ? *p.init.at(sidx, 0, r, c) : 0.0f;
    const int64_t nchunks = ceil_div(sq.len, p.chunk);
    for (int64_t i = 0; i < nchunks; ++i) {
      const int64_t k = p.mask == kMaskGE ? nchunks - 1 - i : i;  // GE: from the last chunk
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
inline Operand operand(const MesaLaTensor& t, int64_t nfeat) {
  return Operand{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3], nfeat, nullptr,
                 nullptr, 0, 0, 0, 0, kExtraNone};
}
inline Operand ones_only() { return Operand{nullptr, 0, 0, 0, 0, 0, nullptr, nullptr, 0, 0, 0, 0, kExtraOnes}; }
inline OutView out_view(const MesaLaTensor& t, int64_t width) {
  return OutView{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3], width, nullptr, 0, 0.0f};
}

// Grid: enough blocks for 4 per SM (45 KiB shared each), no more; items are grid-strided.
inline unsigned grid_for_items(int64_t items) {
  const int64_t cap = int64_t(sm_count()) * 4;
  return unsigned(items < 1 ? 1 : (items < cap ? items : cap));
}

template <typename T, typename TO>
MesaStatus run_product(const Product& p, void* stream) {
  return status_from(MESA_LAUNCH((la_product_kernel<T, TO>), dim3(grid_for_items(product_items(p))),
                                 dim3(kThreads), 0, stream, p));
}

// A causal forward product that keeps its boundary states, as the chunk decomposition:
// (i) U_c = B_c^T C_c of all chunks in parallel, (ii) the light scan turning them into the
// states entering each chunk (and the final state), (iii) the outputs of all chunks in
// parallel from the chunk's own masked A_c B_c^T and its entering state. Bitwise the same
// results as the sequential walk (kAccumulate with a boundary write).
template <typename T, typename TO>
MesaStatus run_product_decomposed(Product p, void* stream) {
  p.mode = kChunkSum;
  MesaStatus st = run_product<T, TO>(p, stream);
  if (st != MESA_STATUS_OK) return st;
  const int64_t n = ((p.seq_off != nullptr ? p.nseq : p.B) * p.H) * p.ma * p.dc;
  const int64_t want = ceil_div(n, kThreads), cap = int64_t(sm_count()) * 8;
  st = status_from(MESA_LAUNCH(la_scan_kernel, dim3(unsigned(want < 1 ? 1 : (want < cap ? want : cap))),
                               dim3(kThreads), 0, stream, p));
  if (st != MESA_STATUS_OK) return st;
  p.mode = kReadChunk;
  p.init = p.boundary;
  p.boundary = StateView{nullptr, 0, 0, 0, 0};
  return run_product<T, TO>(p, stream);
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
  // The state S' [bh, M, W]; the normaliser's launch owns column D. It starts from the
  // caller's initial state (causal) or 0.
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
  p.a = operand(a.q, M);
  p.b = operand(a.k, M);
  p.ma = M;
  p.mask = s.causal ? kMaskLE : kMaskNone;
  p.mode = s.causal ? kAccumulate : kBidir;
  if (s.normalize) {
    Product z = p;
    z.c = ones_only();
    z.dc = 1;
    const MesaLaTensor den_t{a.den, {s.heads * s.len, s.len, 1, 0}};
    z.o = out_view(den_t, 1);
    z.o.guard = 1;
    z.o.eps = s.eps;
    z.state = StateView{a.state + D, M * W, 0, W, 1};
    z.init = s0 != nullptr ? StateView{const_cast<float*>(s0) + D, M * W, 0, W, 1} : none;
    z.boundary = boundary ? boundary_view(s, a.boundary, M, W, D, false) : none;
    const MesaStatus st = boundary ? run_product_decomposed<T, float>(z, stream) : run_product<T, float>(z, stream);
    if (st != MESA_STATUS_OK) return st;
  }
  p.c = operand(a.v, D);
  p.dc = D;
  p.o = out_view(a.out, D);
  p.o.row_div = s.normalize ? a.den : nullptr;
  p.state = state;
  p.init = s0 != nullptr ? StateView{const_cast<float*>(s0), M * W, 0, W, 1} : none;
  p.boundary = boundary ? boundary_view(s, a.boundary, M, W, 0, false) : none;
  if (D == 0) return MESA_STATUS_OK;
  return boundary ? run_product_decomposed<T, T>(p, stream) : run_product<T, T>(p, stream);
}

template <typename T>
MesaStatus backward(const MesaLaBackwardArgs& a, void* stream) {
  const MesaLaShape& s = a.shape;
  const int64_t M = s.feat, D = s.dim, W = D + (s.normalize ? 1 : 0);
  const StateView none{nullptr, 0, 0, 0, 0};
  // dO' = [dout / den | dden] and c' = [v | 1]; dden_t = -(dout_t . out_t) / den_t is
  // recomputed where it is loaded (kExtraDden), so the scratch does not grow with L.
  Operand dO = operand(a.dout, D);
  Operand cv = operand(a.v, D);
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
  // the workspace after one state per (b, h)
  const bool decompose = s.causal && s.memory == MESA_LA_BOUNDARY_STATES;
  float* chunk_work = a.work + state_count(s) * M * W;

  // dq = product(dO', c', k), LE: state sum c'_s k_s^T = S'^T, the forward's states read
  // through transposed strides (boundary mode) or accumulated again from the initial state
  // (SLiM: the same forward walk as the forward's, so dq_t never sees a row s > t).
  {
    Product p = base_product(s);
    p.a = dO;
    p.b = cv;
    p.c = operand(a.k, M);
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
      const MesaStatus st = run_product<T, T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dk = product(c', dO', q), reverse: state dS'_final^T + sum dO'_s q_s^T [bh, W, M]; its
  // value after the walk is the initial state's gradient (written to d_init when given).
  {
    Product p = base_product(s);
    p.a = cv;
    p.b = dO;
    p.c = operand(a.q, M);
    p.ma = W;
    p.dc = M;
    p.o = out_view(a.dk, M);
    p.mask = mask_rev;
    p.mode = s.causal ? kAccumulate : kBidir;
    p.state = a.d_init != nullptr ? transposed(a.d_init) : work;
    p.init = a.d_final != nullptr ? transposed(a.d_final) : none;
    p.boundary = decompose ? chunk_states(s, chunk_work, W, M) : none;
    if (M > 0) {
      const MesaStatus st = decompose ? run_product_decomposed<T, T>(p, stream) : run_product<T, T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dv = product(k, q, dout / den), reverse: state dS_final[:, :D] + sum q_s (dout_s/den_s)^T
  // [bh, M, D].
  {
    Operand g = operand(a.dout, D);
    g.row_div = s.normalize ? a.den : nullptr;
    Product p = base_product(s);
    p.a = operand(a.k, M);
    p.b = operand(a.q, M);
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
      const MesaStatus st = decompose ? run_product_decomposed<T, T>(p, stream) : run_product<T, T>(p, stream);
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

}  // namespace MESA_NS

using namespace MESA_NS;

// ---------------------------------------------------------------------------------------
// C entry points: they re-check what would make a kernel touch memory it should not (the
// safe crate checks buffer extents first).
extern "C" MesaStatus MESA_ENTRY(linear_attention_forward)(const MesaLaForwardArgs* a, void* stream) {
  if (a == nullptr || !shape_valid(a->shape)) return MESA_STATUS_INVALID_ARGUMENT;
  const MesaLaShape& s = a->shape;
  if (is_empty(s)) return MESA_STATUS_OK;
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
