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
// Backward, with dO' = [dout / den | dden], dden_t = -(dout_t . out_t) / den_t:
//   dq = product(dO', c', k)  LE   state  sum c'_s k_s^T = S'^T   (saved or rebuilt)
//   dk = product(c', dO', q)  GE   state  sum dO'_s q_s^T         (reverse accumulation)
//   dv = product(k, q, dout/den) GE   state sum q_s (dout_s/den_s)^T
// (bidirectional: the same with W = all; dq reads the saved final state.)
//
// Memory modes (causal):
//   BOUNDARY_STATES: the forward writes the state entering every chunk; dq reads it, so
//                    its chunks are independent (parallel over chunks).
//   SLIM:            only the final state is kept; dq walks the chunks in reverse,
//                    S <- S - B_c^T C_c before each chunk (SLiM's reversal by subtraction).
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
  kAccumulate = 0,  // S from 0 (+ optional boundary write), walk in the mask's direction
  kReadChunk = 1,   // S of chunk c read from `init` (per-chunk states): chunks independent
  kRebuild = 2,     // S from init (the total), walk backwards, S -= B_c^T C_c before each chunk
  kBidir = 3        // phase 1: S = sum over all chunks (or init if given); phase 2: O = A S
};

// One row operand [B, H, L, nfeat] (+ a virtual column at index nfeat).
struct Operand {
  const void* data;
  int64_t sb, sh, sl, sf;
  int64_t nfeat;
  const float* row_div;  // NULL or [B*H*L]: stored columns divided by it
  const float* extra;    // extra_kind 2: [B*H*L] values of the virtual column
  int extra_kind;        // 0 none, 1 ones, 2 from `extra`
  __host__ __device__ int64_t width() const { return nfeat + (extra_kind != 0 ? 1 : 0); }
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
  StateView init;      // kReadChunk: per-chunk states; kRebuild, kBidir: total state (or base NULL)
  StateView boundary;  // kAccumulate: write the state entering each chunk (base NULL: no)
};

template <typename T>
__device__ __forceinline__ float load_operand(const Operand& p, int64_t b, int64_t h, int64_t bh, int64_t L,
                                              int64_t t, int64_t f) {
  if (f < p.nfeat) {
    float x = to_float(static_cast<const T*>(p.data)[b * p.sb + h * p.sh + t * p.sl + f * p.sf]);
    if (p.row_div != nullptr) x = x / p.row_div[bh * L + t];
    return x;
  }
  if (f == p.nfeat) {
    if (p.extra_kind == 1) return 1.0f;
    if (p.extra_kind == 2) return p.extra[bh * L + t];
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

// S[:, d0:d0+kTD] += sign * B_c^T C_c (C_c already in tiles.c). Each thread owns 4 state
// elements per feature tile, so the read-modify-write of the global state has one writer.
template <typename T>
__device__ void update_state(Tiles& tl, const Product& p, int64_t b, int64_t h, int64_t bh, int64_t t0, int rows,
                             int64_t d0, float sign) {
  const int fr = threadIdx.x / 8, dcol = (threadIdx.x % 8) * 4;
  for (int64_t f0 = 0; f0 < p.ma; f0 += kTF) {
    __syncthreads();
    load_rows_t<T>(tl.b, p.b, b, h, bh, p.L, t0, rows, f0);
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
        float* s = p.state.at(bh, 0, f0 + fr, d0 + dcol + j);
        *s = sign > 0.0f ? *s + u[j] : *s - u[j];
      }
    }
  }
  __syncthreads();
}

// Outputs of one chunk: O = A_c S + mask(A_c B_c^T) C_c, written to p.o. `sv`/`chunk_idx`
// name the state to read (nullptr base: no inter-chunk term). Leaves C_c in tiles.c.
template <typename T, typename TO>
__device__ void chunk_outputs(Tiles& tl, const Product& p, int64_t b, int64_t h, int64_t bh, int64_t t0, int rows,
                              int64_t d0, const StateView& sv, int64_t chunk_idx, bool intra, const StateView* save,
                              int64_t save_chunk) {
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
          v = *sv.at(bh, chunk_idx, f0 + f, d0 + d);
          if (save != nullptr) *save->at(bh, save_chunk, f0 + f, d0 + d) = v;
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
__device__ void init_state(const Product& p, int64_t bh, int64_t d0, const StateView& src) {
  __syncthreads();
  for (int64_t i = threadIdx.x; i < p.ma * kTD; i += kThreads) {
    const int64_t f = i / kTD, d = d0 + i % kTD;
    if (d >= p.dc) continue;
    *p.state.at(bh, 0, f, d) = src.base != nullptr ? *src.at(bh, 0, f, d) : 0.0f;
  }
  __syncthreads();
}

// One block per work item (b*h, D-tile[, chunk]), grid-stride over items (grid.x only, so
// B*H is never limited by grid.y/z).
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
  const int64_t nchunks = ceil_div(p.L, p.chunk);
  const int64_t per_bh = p.mode == kReadChunk ? ndt * nchunks : ndt;
  const int64_t items = p.B * p.H * per_bh;
  const StateView none{nullptr, 0, 0, 0, 0};
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t bh = item / per_bh;
    const int64_t rest = item % per_bh;
    const int64_t d0 = (rest % ndt) * kTD;
    const int64_t b = bh / p.H, h = bh % p.H;
    auto rows_of = [&](int64_t c) { return int(p.L - c * p.chunk < p.chunk ? p.L - c * p.chunk : p.chunk); };
    switch (p.mode) {
      case kAccumulate: {
        init_state(p, bh, d0, none);
        const bool save = p.boundary.base != nullptr;
        for (int64_t i = 0; i < nchunks; ++i) {
          const int64_t c = p.mask == kMaskGE ? nchunks - 1 - i : i;
          const int64_t t0 = c * p.chunk;
          chunk_outputs<T, TO>(tl, p, b, h, bh, t0, rows_of(c), d0, p.state, 0, true, save ? &p.boundary : nullptr,
                               c);
          update_state<T>(tl, p, b, h, bh, t0, rows_of(c), d0, 1.0f);
        }
        break;
      }
      case kReadChunk: {
        const int64_t c = rest / ndt;
        chunk_outputs<T, TO>(tl, p, b, h, bh, c * p.chunk, rows_of(c), d0, p.init, c, true, nullptr, 0);
        break;
      }
      case kRebuild: {
        init_state(p, bh, d0, p.init);
        for (int64_t c = nchunks - 1; c >= 0; --c) {
          const int64_t t0 = c * p.chunk;
          __syncthreads();
          load_rows_c<T>(tl.c, p.c, b, h, bh, p.L, t0, rows_of(c), d0);
          update_state<T>(tl, p, b, h, bh, t0, rows_of(c), d0, -1.0f);
          chunk_outputs<T, TO>(tl, p, b, h, bh, t0, rows_of(c), d0, p.state, 0, true, nullptr, 0);
        }
        break;
      }
      case kBidir: {
        const bool given = p.init.base != nullptr;
        if (!given) {
          init_state(p, bh, d0, none);
          for (int64_t c = 0; c < nchunks; ++c) {
            __syncthreads();
            load_rows_c<T>(tl.c, p.c, b, h, bh, p.L, c * p.chunk, rows_of(c), d0);
            update_state<T>(tl, p, b, h, bh, c * p.chunk, rows_of(c), d0, 1.0f);
          }
        }
        for (int64_t c = 0; c < nchunks; ++c)
          chunk_outputs<T, TO>(tl, p, b, h, bh, c * p.chunk, rows_of(c), d0, given ? p.init : p.state, 0, false,
                               nullptr, 0);
        break;
      }
      default: break;
    }
    __syncthreads();
  }
}

// dden_t = -(dout_t . out_t) / den_t (f32), one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) la_dden_kernel(MesaLaTensor dout, MesaLaTensor out, const float* den,
                                                          float* dden, int64_t B, int64_t H, int64_t L, int64_t D) {
  const int64_t rows = B * H * L;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / kWarpSize);
  const int lane = threadIdx.x % kWarpSize;
  const T* po = static_cast<const T*>(out.data);
  const T* pd = static_cast<const T*>(dout.data);
  for (int64_t row = int64_t(blockIdx.x) * (kThreads / kWarpSize) + threadIdx.x / kWarpSize; row < rows;
       row += warps) {
    const int64_t t = row % L, bh = row / L, b = bh / H, h = bh % H;
    float acc = 0.0f;
    for (int64_t d = lane; d < D; d += kWarpSize) {
      const float x = to_float(pd[b * dout.strides[0] + h * dout.strides[1] + t * dout.strides[2] + d * dout.strides[3]]);
      const float y = to_float(po[b * out.strides[0] + h * out.strides[1] + t * out.strides[2] + d * out.strides[3]]);
      acc = fmaf(x, y, acc);
    }
    acc = warp_reduce_sum(acc);
    if (lane == 0) dden[row] = -acc / den[row];
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
inline Operand operand(const MesaLaTensor& t, int64_t nfeat) {
  return Operand{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3], nfeat, nullptr, nullptr, 0};
}
inline Operand ones_only() { return Operand{nullptr, 0, 0, 0, 0, 0, nullptr, nullptr, 1}; }
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
  const int64_t ndt = ceil_div(p.dc, kTD);
  const int64_t per_bh = p.mode == kReadChunk ? ndt * ceil_div(p.L, p.chunk) : ndt;
  return status_from(MESA_LAUNCH((la_product_kernel<T, TO>), dim3(grid_for_items(p.B * p.H * per_bh)),
                                 dim3(kThreads), 0, stream, p));
}

inline Product base_product(const MesaLaShape& s) {
  Product p{};
  p.B = s.batch;
  p.H = s.heads;
  p.L = s.len;
  p.chunk = s.chunk;
  return p;
}

template <typename T>
MesaStatus forward(const MesaLaForwardArgs& a, void* stream) {
  const MesaLaShape& s = a.shape;
  const int64_t M = s.feat, D = s.dim, W = D + (s.normalize ? 1 : 0);
  const int64_t nchunks = ceil_div(s.len, s.chunk);
  const bool boundary = s.causal && s.memory == MESA_LA_BOUNDARY_STATES;
  // The state S' [bh, M, W]; the normaliser's launch owns column D.
  const StateView state{a.state, M * W, 0, W, 1};
  const StateView bnd{a.boundary, nchunks * M * W, M * W, W, 1};
  const StateView none{nullptr, 0, 0, 0, 0};
  Product p = base_product(s);
  p.a = operand(a.q, M);
  p.b = operand(a.k, M);
  p.ma = M;
  p.mask = s.causal ? kMaskLE : kMaskNone;
  p.mode = s.causal ? kAccumulate : kBidir;
  p.init = none;
  if (s.normalize) {
    Product z = p;
    z.c = ones_only();
    z.dc = 1;
    const MesaLaTensor den_t{a.den, {s.heads * s.len, s.len, 1, 0}};
    z.o = out_view(den_t, 1);
    z.o.guard = 1;
    z.o.eps = s.eps;
    z.state = StateView{a.state + D, M * W, 0, W, 1};
    z.boundary = boundary ? StateView{a.boundary + D, nchunks * M * W, M * W, W, 1} : none;
    const MesaStatus st = run_product<T, float>(z, stream);
    if (st != MESA_STATUS_OK) return st;
  }
  p.c = operand(a.v, D);
  p.dc = D;
  p.o = out_view(a.out, D);
  p.o.row_div = s.normalize ? a.den : nullptr;
  p.state = state;
  p.boundary = boundary ? bnd : none;
  if (D == 0) return MESA_STATUS_OK;
  return run_product<T, T>(p, stream);
}

template <typename T>
MesaStatus backward(const MesaLaBackwardArgs& a, void* stream) {
  const MesaLaShape& s = a.shape;
  const int64_t M = s.feat, D = s.dim, W = D + (s.normalize ? 1 : 0);
  const int64_t BH = s.batch * s.heads;
  const int64_t nchunks = ceil_div(s.len, s.chunk);
  const StateView none{nullptr, 0, 0, 0, 0};
  float* dden = s.normalize ? a.work + BH * M * W : nullptr;
  if (s.normalize) {
    // one warp per row; D = 0 gives dden = -0 (out is empty)
    const int64_t rows = BH * s.len;
    const int64_t want = ceil_div(rows, kThreads / kWarpSize);
    const int64_t cap = int64_t(sm_count()) * 8;
    const unsigned grid = unsigned(want < 1 ? 1 : (want < cap ? want : cap));
    const MesaStatus st = status_from(MESA_LAUNCH((la_dden_kernel<T>), dim3(grid), dim3(kThreads), 0, stream, a.dout,
                                                  a.out, a.den, dden, s.batch, s.heads, s.len, D));
    if (st != MESA_STATUS_OK) return st;
  }
  // dO' = [dout / den | dden] and c' = [v | 1]
  Operand dO = operand(a.dout, D);
  Operand cv = operand(a.v, D);
  if (s.normalize) {
    dO.row_div = a.den;
    dO.extra = dden;
    dO.extra_kind = 2;
    cv.extra_kind = 1;
  }
  const int mask_fwd = s.causal ? kMaskLE : kMaskNone;
  const int mask_rev = s.causal ? kMaskGE : kMaskNone;
  const StateView work{a.work, W * M, 0, M, 1};  // [bh, W, M] or [bh, M, W] by the launch

  // dq = product(dO', c', k): state sum c'_s k_s^T = S'^T, read through transposed strides.
  {
    Product p = base_product(s);
    p.a = dO;
    p.b = cv;
    p.c = operand(a.k, M);
    p.ma = W;
    p.dc = M;
    p.o = out_view(a.dq, M);
    p.mask = mask_fwd;
    p.state = StateView{a.work, W * M, 0, M, 1};
    p.boundary = none;
    float* saved = const_cast<float*>(a.state);  // read only: kRebuild copies it into `work`
    if (!s.causal) {
      p.mode = kBidir;
      p.init = StateView{saved, M * W, 0, 1, W};
    } else if (s.memory == MESA_LA_BOUNDARY_STATES) {
      p.mode = kReadChunk;
      p.init = StateView{const_cast<float*>(a.boundary), nchunks * M * W, M * W, 1, W};
    } else {
      p.mode = kRebuild;
      p.init = StateView{saved, M * W, 0, 1, W};
    }
    if (M > 0) {
      const MesaStatus st = run_product<T, T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dk = product(c', dO', q), reverse: state sum dO'_s q_s^T [bh, W, M].
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
    p.state = work;
    p.init = none;
    p.boundary = none;
    if (M > 0) {
      const MesaStatus st = run_product<T, T>(p, stream);
      if (st != MESA_STATUS_OK) return st;
    }
  }
  // dv = product(k, q, dout / den), reverse: state sum q_s (dout_s/den_s)^T [bh, M, D].
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
    p.init = none;
    p.boundary = none;
    if (D > 0) {
      const MesaStatus st = run_product<T, T>(p, stream);
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
  return true;
}

inline bool is_empty(const MesaLaShape& s) { return s.batch == 0 || s.heads == 0; }

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
  if (is_empty(s) || s.len == 0) return MESA_STATUS_OK;
  const bool has_state = s.feat > 0 && (s.dim > 0 || s.normalize);
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
