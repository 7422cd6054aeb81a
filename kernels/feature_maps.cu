// feature_maps.cu — the feature maps of linear attention, forward and backward:
// ReLU, ELU+1 (Katharopoulos et al. 2020) and FAVOR+ positive random features
// (Choromanski et al. 2020, §2.3 Lemma 1, Eq. 7; orthogonal w §2.4).
//
//   RELU    phi = max(x, 0)                 dx = dphi [x > 0]
//   ELU1    phi = x + 1 (x > 0), exp(x)     dx = dphi (1 if x > 0 else exp(x))
//   FAVOR+  x' = x d^(-1/4),  u_i = w_i . x' - |x'|^2/2,  phi_i = exp(u_i - c) / sqrt(m)
//           so that E_w[phi(q) . phi(k)] = exp(-c_q - c_k) exp(q . k / sqrt(d)) / m * m.
//           dx' = sum_i g_i w_i - x' sum_i g_i,  g_i = dphi_i phi_i,  dx = d^(-1/4) dx'
//           (the stabiliser c is a constant of the backward: exact for the normalised
//           attention, whose output does not depend on c; see docs/linear_attention.md).
// Stabilisers c: NONE 0; ROW_MAX max_i u_i (queries); BOUND max_i |w_i|^2/2 >= u_i for
// every x (causal keys: no statistic of any position, phi_i = exp(-|x' - w_i|^2/2 - ...)
// <= 1/sqrt(m)); SEQUENCE_MAX max over the (b,h) sequence (bidirectional keys).
//
// Bytes: elementwise maps read + write n sizeof(T); FAVOR+ reads d, writes m elements per
// row and w (m d 4 bytes, cached). FLOPs: FAVOR+ 2 m d per row (twice with ROW_MAX or
// SEQUENCE_MAX: the maximum is taken in a first pass, the row recomputed in a second);
// backward 4 m d per row (m reads of dphi, phi per element of dx: L1-cached broadcasts).
#include "common.cuh"
#include "split_mma.cuh"

#include <type_traits>

namespace MESA_NS {

constexpr int kFmThreads = 256;
constexpr int kFavorMaxIn = 1024;   // d: one row of x' in shared memory
constexpr int kFavorMaxOut = 4096;  // m: bound of the API (loops, no shared memory)

struct Tensor4 {
  void* data;
  int64_t s0, s1, s2, s3;
  __device__ __forceinline__ int64_t off(int64_t b, int64_t h, int64_t l, int64_t f) const {
    return b * s0 + h * s1 + l * s2 + f * s3;
  }
};
inline Tensor4 tensor4(const MesaLaTensor& t) {
  return Tensor4{t.data, t.strides[0], t.strides[1], t.strides[2], t.strides[3]};
}

struct Dims {
  int64_t B, H, L, din, dout;
};

// ---------------------------------------------------------------------------------------
// Elementwise maps (m = d): the value and the slope, one definition for both paths.
template <int kMap>
__device__ __forceinline__ float feature_value(float v) {
  return kMap == MESA_FEATURE_RELU ? fmaxf(v, 0.0f) : (v > 0.0f ? v + 1.0f : expf(v));
}
template <int kMap>
__device__ __forceinline__ float feature_slope(float v) {
  return kMap == MESA_FEATURE_RELU ? (v > 0.0f ? 1.0f : 0.0f) : (v > 0.0f ? 1.0f : expf(v));
}

// Dense path: every tensor contiguous [B,H,L,D] and 16-byte aligned, so the map runs over one
// flat array of `total` elements in 16-byte vectors, two per thread in flight, without index
// arithmetic (the strided kernels below divide the logical index per element). The last
// total % N elements by one thread.
template <typename T, int kMap, bool kBackward>
__global__ void __launch_bounds__(kFmThreads) elementwise_dense_kernel(const T* __restrict__ x,
                                                                       const T* __restrict__ dphi,
                                                                       T* __restrict__ out, int64_t total) {
  constexpr int N = Vec16<T>::N;
  const int64_t nvec = total / N;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  auto apply = [&](int64_t v, const Vec16<T>& in, const Vec16<T>& g) {
    Vec16<T> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float xv = to_float(in.v[j]);
      o.v[j] = from_float<T>(kBackward ? to_float(g.v[j]) * feature_slope<kMap>(xv) : feature_value<kMap>(xv));
    }
    store16(out + v * N, o);
  };
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec; v += 2 * stride) {
    const bool second = v + stride < nvec;
    Vec16<T> a = load16(x + v * N), b = a, ga = a, gb = a;
    if (second) b = load16(x + (v + stride) * N);
    if (kBackward) {
      ga = load16(dphi + v * N);
      if (second) gb = load16(dphi + (v + stride) * N);
    }
    apply(v, a, ga);
    if (second) apply(v + stride, b, gb);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int64_t i = nvec * N; i < total; ++i) {
      const float xv = to_float(x[i]);
      out[i] = from_float<T>(kBackward ? to_float(dphi[i]) * feature_slope<kMap>(xv) : feature_value<kMap>(xv));
    }
}

// ---------------------------------------------------------------------------------------
// Elementwise maps (m = d), grid-stride over the logical elements.
template <typename T, int kMap>
__global__ void __launch_bounds__(kFmThreads) elementwise_forward_kernel(Tensor4 x, Tensor4 phi, Dims n) {
  const int64_t total = n.B * n.H * n.L * n.din;
  const T* px = static_cast<const T*>(x.data);
  T* py = static_cast<T*>(phi.data);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t f = i % n.din, r = i / n.din, l = r % n.L, bh = r / n.L, h = bh % n.H, b = bh / n.H;
    py[phi.off(b, h, l, f)] = from_float<T>(feature_value<kMap>(to_float(px[x.off(b, h, l, f)])));
  }
}

template <typename T, int kMap>
__global__ void __launch_bounds__(kFmThreads) elementwise_backward_kernel(Tensor4 x, Tensor4 dphi, Tensor4 dx, Dims n) {
  const int64_t total = n.B * n.H * n.L * n.din;
  const T* px = static_cast<const T*>(x.data);
  const T* pg = static_cast<const T*>(dphi.data);
  T* pd = static_cast<T*>(dx.data);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t f = i % n.din, r = i / n.din, l = r % n.L, bh = r / n.L, h = bh % n.H, b = bh / n.H;
    const float v = to_float(px[x.off(b, h, l, f)]);
    pd[dx.off(b, h, l, f)] = from_float<T>(to_float(pg[dphi.off(b, h, l, f)]) * feature_slope<kMap>(v));
  }
}

// ---------------------------------------------------------------------------------------
// FAVOR+ forward. One warp per row (8 rows per block): x' of the row in shared memory, the
// lanes over the m features, reductions by warp shuffles only. SEQUENCE_MAX: one block per
// (b, h) sequence, its warps over the rows, one block reduction for the maximum.
struct FavorParams {
  const float* omega;  // [m, d]
  float xscale;        // d^(-1/4)
  float inv_sqrt_m;
  int stabilizer;
  float bound;
};

constexpr int kFavorWarps = kFmThreads / kWarpSize;
// x' rows of the block's warps: 8 x 1024 f32 = 32 KiB
constexpr int kFavorRowSmem = kFavorMaxIn;

// Loads x'_row into xs (this warp's slice) and returns |x'|^2 / 2 (all lanes).
template <typename T>
__device__ float warp_load_xrow(const Tensor4& x, const Dims& n, int64_t b, int64_t h, int64_t l, float xscale,
                                float* xs) {
  const T* px = static_cast<const T*>(x.data);
  const int lane = threadIdx.x % kWarpSize;
  float sq = 0.0f;
  __syncwarp();
  for (int64_t j = lane; j < n.din; j += kWarpSize) {
    const float v = __fmul_rn(to_float(px[x.off(b, h, l, j)]), xscale);
    xs[j] = v;
    sq = fmaf(v, v, sq);
  }
  __syncwarp();
  return 0.5f * warp_reduce_sum(sq);
}

__device__ __forceinline__ float projection(const float* __restrict__ w_row, const float* xs, int64_t d, float half_sq) {
  float u = 0.0f;
  for (int64_t j = 0; j < d; ++j) u = fmaf(w_row[j], xs[j], u);
  return u - half_sq;
}

// The row's maximum of u_i over the features (all lanes).
__device__ float warp_row_max(const FavorParams& fp, const Dims& n, const float* xs, float half_sq) {
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x % kWarpSize; i < n.dout; i += kWarpSize)
    mx = fmaxf(mx, projection(fp.omega + i * n.din, xs, n.din, half_sq));
  return warp_reduce_max(mx);
}

template <typename T>
__device__ void warp_write_row(T* py, const Tensor4& phi, const FavorParams& fp, const Dims& n, int64_t b, int64_t h,
                               int64_t l, const float* xs, float half_sq, float c) {
  for (int64_t i = threadIdx.x % kWarpSize; i < n.dout; i += kWarpSize) {
    const float u = projection(fp.omega + i * n.din, xs, n.din, half_sq);
    py[phi.off(b, h, l, i)] = from_float<T>(__fmul_rn(expf(u - c), fp.inv_sqrt_m));
  }
}

template <typename T>
__global__ void __launch_bounds__(kFmThreads, 2) favor_forward_kernel(Tensor4 x, Tensor4 phi, Dims n, FavorParams fp) {
  __shared__ float xrows[kFavorWarps][kFavorRowSmem];
  __shared__ float scratch[kFavorWarps];
  T* py = static_cast<T*>(phi.data);
  const int warp = threadIdx.x / kWarpSize;
  float* xs = xrows[warp];
  if (fp.stabilizer == MESA_FAVOR_SEQUENCE_MAX) {
    for (int64_t bh = blockIdx.x; bh < n.B * n.H; bh += gridDim.x) {
      const int64_t b = bh / n.H, h = bh % n.H;
      float mx = -INFINITY;
      for (int64_t l = warp; l < n.L; l += kFavorWarps) {
        const float half_sq = warp_load_xrow<T>(x, n, b, h, l, fp.xscale, xs);
        mx = fmaxf(mx, warp_row_max(fp, n, xs, half_sq));
      }
      __syncthreads();
      if (threadIdx.x % kWarpSize == 0) scratch[warp] = mx;
      __syncthreads();
      float c = scratch[0];
      for (int w = 1; w < kFavorWarps; ++w) c = fmaxf(c, scratch[w]);
      if (!(c > -INFINITY)) c = 0.0f;
      for (int64_t l = warp; l < n.L; l += kFavorWarps) {
        const float half_sq = warp_load_xrow<T>(x, n, b, h, l, fp.xscale, xs);
        warp_write_row<T>(py, phi, fp, n, b, h, l, xs, half_sq, c);
      }
    }
    return;
  }
  // one row per warp; warps of a block never synchronise with each other
  const int64_t rows = n.B * n.H * n.L;
  for (int64_t row = int64_t(blockIdx.x) * kFavorWarps + warp; row < rows; row += int64_t(gridDim.x) * kFavorWarps) {
    const int64_t l = row % n.L, bh = row / n.L, b = bh / n.H, h = bh % n.H;
    const float half_sq = warp_load_xrow<T>(x, n, b, h, l, fp.xscale, xs);
    float c = fp.stabilizer == MESA_FAVOR_BOUND ? fp.bound : 0.0f;
    if (fp.stabilizer == MESA_FAVOR_ROW_MAX) {
      c = warp_row_max(fp, n, xs, half_sq);
      if (!(c > -INFINITY)) c = 0.0f;
    }
    warp_write_row<T>(py, phi, fp, n, b, h, l, xs, half_sq, c);
  }
}

// FAVOR+ backward, one thread per (row, j): dx'_j = sum_i g_i w_ij - x'_j sum_i g_i with
// g_i = dphi_i phi_i read by every thread of the row (broadcast loads), w read column-wise
// (coalesced over j). No shared memory, no synchronisation.
template <typename T>
__global__ void __launch_bounds__(kFmThreads) favor_backward_kernel(Tensor4 x, Tensor4 phi, Tensor4 dphi, Tensor4 dx,
                                                                    Dims n, const float* omega, float xscale) {
  const T* px = static_cast<const T*>(x.data);
  const T* pp = static_cast<const T*>(phi.data);
  const T* pg = static_cast<const T*>(dphi.data);
  T* pd = static_cast<T*>(dx.data);
  const int64_t total = n.B * n.H * n.L * n.din;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % n.din, row = e / n.din;
    const int64_t l = row % n.L, bh = row / n.L, b = bh / n.H, h = bh % n.H;
    float acc = 0.0f, gsum = 0.0f;
    for (int64_t i = 0; i < n.dout; ++i) {
      const float gi = to_float(pg[dphi.off(b, h, l, i)]) * to_float(pp[phi.off(b, h, l, i)]);
      acc = fmaf(gi, omega[i * n.din + j], acc);
      gsum += gi;
    }
    const float xp = __fmul_rn(to_float(px[x.off(b, h, l, j)]), xscale);
    const float dxp = fmaf(-xp, gsum, acc);
    pd[dx.off(b, h, l, j)] = from_float<T>(__fmul_rn(dxp, xscale));
  }
}

// ---------------------------------------------------------------------------------------
// FAVOR+ on tensor cores (f16, bf16 inputs): the projections as bf16 split-pair MMAs with f32
// accumulators (split_mma.cuh: the pairs and their error). Every row (b, h, l) projects
// through the same ω, so both are plain matrix products over the B·H·L rows:
//   forward   U = X Ω^T   [rows, d] x [d, m]:  u_i = d^(-1/4) (x . ω_i) - |x'|^2/2
//   backward  Y = G Ω     [rows, m] x [m, d]:  dx = d^(-1/4) (y - x' Σ_i g_i),  g = dphi ⊙ phi
// x enters as its own pair (bf16 exact in hi: its lo MMAs are compiled out; f16 exact in
// hi + lo), ω and g (a product of two 16-bit values, exact in f32 unless it underflows) as
// f32 pairs.
// Tiles of 64 rows x 64 columns (features m forward, columns of d backward), k in steps of
// 32; per block (8 warps) 4 x 4 blocks of 16 x 16, two per warp (row block warp/2, column
// blocks 2*(warp%2) + 0, 1), staged in shared memory for the epilogue: thread t owns row t/4,
// columns 16*(t%4) .. +16 of the tile. Rows past the range and columns past m or d are
// zeros in the tiles and never written.
// Bytes per row, from HBM: forward d + m elements (x once more for |x'|^2/2 of each row tile,
// x again per 64-feature tile and, with ROW_MAX/SEQUENCE_MAX, once more for the maximum pass:
// those re-reads hit L1/L2), ω from L2; backward 2m + 2d elements (phi and dphi read again per
// 64 columns of d). FLOPs on tensor cores: 2 m d per row and MMA (2-3 MMAs per product of pairs).
constexpr int kFvRows = 64;                 // rows of a tile
constexpr int kFvCols = 64;                 // output columns of a tile
constexpr int kFvK = 32;                    // k per step
constexpr int kLdK = kFvK + 8;              // [64][32] operand tiles, bf16
constexpr int kLdN = kFvCols + 8;           // [32][64] ω tile of the backward, bf16
constexpr int kLdStage = kFvCols + 4;       // [64][64] f32 results
static_assert(kFvRows * (kFvK / 8) == kFmThreads, "one run of 8 k per thread and row");
static_assert(kFvK * (kFvCols / 8) == kFmThreads, "one run of 8 columns per thread and k");

// Per-call facts the host checks once (16-byte runs allowed).
struct FavorTc {
  int x16;      // forward: x's rows as 16-byte runs (rows_16b)
  int g16;      // backward: phi's and dphi's rows as 16-byte runs
  int out16;    // phi's (forward) or dx's (backward) rows as 16-byte runs
  int omega16;  // ω as 16-byte runs of 4 floats: aligned, d % 4 == 0
};

// The element offset of row `row` (< B H L) of a [B, H, L, ·] tensor. Strides may be negative
// (raw C ABI), so an offset is no flag: a tile holds how many of its rows are valid (`rows`).
__device__ __forceinline__ int64_t row_offset(const Tensor4& t, const Dims& n, int64_t row) {
  const int64_t l = row % n.L, bh = row / n.L;
  return (bh / n.H) * t.s0 + (bh % n.H) * t.s1 + l * t.s2;
}

// 8 consecutive values of a 16-bit row (k0 .. k0 + 8 of `width`; zeros past it or for a row
// that is not `valid`): one 16-byte load when the row allows (`vec`) and the run is whole.
template <typename T>
__device__ __forceinline__ void load_run8(float (&v)[8], const T* base, int64_t off, bool valid, int64_t s3,
                                          int64_t k0, int64_t width, bool vec) {
  if (valid && vec && k0 + 8 <= width) {
    const Vec16<T> r = load16(base + off + k0);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(r.v[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = valid && k0 + j < width ? to_float(base[off + (k0 + j) * s3]) : 0.0f;
}

// ω[f][k0 .. k0 + 8) (zeros past m or d): two 16-byte loads when allowed.
__device__ __forceinline__ void load_omega8(float (&v)[8], const float* omega, const Dims& n, int64_t f, int64_t k0,
                                            bool vec) {
  if (f < n.dout && vec && k0 + 8 <= n.din) {
    const float4 a = *reinterpret_cast<const float4*>(omega + f * n.din + k0);
    const float4 b = *reinterpret_cast<const float4*>(omega + f * n.din + k0 + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = f < n.dout && k0 + j < n.din ? omega[f * n.din + k0 + j] : 0.0f;
}

// Writes 16 values of row `off` from column c0 (those below `width`).
template <typename T>
__device__ __forceinline__ void store_run16(T* base, int64_t off, int64_t s3, int64_t c0, int64_t width, bool vec,
                                            const float (&v)[16]) {
#pragma unroll
  for (int h = 0; h < 16; h += 8) {
    if (vec && c0 + h + 8 <= width) {
      Vec16<T> r;
#pragma unroll
      for (int j = 0; j < 8; ++j) r.v[j] = from_float<T>(v[h + j]);
      store16(base + off + c0 + h, r);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (c0 + h + j < width) base[off + (c0 + h + j) * s3] = from_float<T>(v[h + j]);
    }
  }
}

struct FavorForwardTiles {
  SplitTile<kFvRows, kLdK> x;        // x rows [64][32 k]
  SplitTile<kFvCols, kLdK> w;        // ω rows [64 features][32 k]
  float u[kFvRows * kLdStage];       // the tile's x . ω_i
  int64_t row_x[kFvRows], row_phi[kFvRows];
  float half_sq[kFvRows];            // |x'|^2 / 2
  float block_max[kFmThreads / kWarpSize];
  int rows;                          // valid rows of the tile (<= 64)
};

struct FavorBackwardTiles {
  SplitTile<kFvRows, kLdK> g;        // g rows [64][32 features]
  SplitTile<kFvK, kLdN> w;           // ω [32 features][64 columns of d]
  float y[kFvRows * kLdStage];       // the tile's G Ω
  int64_t row_x[kFvRows], row_phi[kFvRows], row_dphi[kFvRows], row_dx[kFvRows];
  int rows;                          // valid rows of the tile (<= 64)
};

// The block's tiles: one __shared__ union for every FAVOR+ tensor-core instance (10). On a GPU
// each kernel gets its own static allocation; the emulator keeps one copy per instance in every
// OS thread that runs it (docs/emulator.md, "Resources").
union FavorTiles {
  FavorForwardTiles fwd;
  FavorBackwardTiles bwd;
};
__device__ __forceinline__ FavorTiles& favor_tiles() {
  __shared__ FavorTiles tiles;
  return tiles;
}

// Row offsets and |x'|^2/2 of the rows r0 .. r0 + 64 (< end): four threads per row.
template <typename T>
__device__ void favor_tile_rows(FavorForwardTiles& sm, const Tensor4& x, const Tensor4& phi, const Dims& n,
                                const FavorParams& fp, int64_t r0, int64_t end) {
  const int r = threadIdx.x / 4, q = threadIdx.x % 4;
  const bool valid = r0 + r < end;
  const int64_t ox = valid ? row_offset(x, n, r0 + r) : 0;
  const T* px = static_cast<const T*>(x.data);
  float sq = 0.0f;
  if (valid)
    for (int64_t j = q; j < n.din; j += 4) {
      const float v = __fmul_rn(to_float(px[ox + j * x.s3]), fp.xscale);
      sq = fmaf(v, v, sq);
    }
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  sq += __shfl_xor_sync(0xffffffffu, sq, 2);
  __syncthreads();  // the previous tile's readers are done
  if (q == 0) {
    sm.row_x[r] = ox;
    sm.row_phi[r] = valid ? row_offset(phi, n, r0 + r) : 0;
    sm.half_sq[r] = 0.5f * sq;
  }
  if (threadIdx.x == 0) sm.rows = int(end - r0);
  __syncthreads();
}

// sm.u = X Ω^T for the tile's rows and features f0 .. f0 + 64, x unscaled (exact pairs).
template <typename T>
__device__ void favor_u_tile(FavorForwardTiles& sm, const Tensor4& x, const Dims& n, const FavorParams& fp,
                             const FavorTc& tc, int64_t f0) {
  constexpr bool kXLo = std::is_same_v<T, __half>;  // bf16 x: lo = 0, its MMAs compiled out
  const int tid = threadIdx.x, warp = tid / kWarpSize;
  const int wi = warp / 2, wj = 2 * (warp % 2);
  const int r = tid / 4, c = (tid % 4) * 8;
  FragAcc acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t k0 = 0; k0 < n.din; k0 += kFvK) {
    float v[8];
    load_run8<T>(v, static_cast<const T*>(x.data), sm.row_x[r], r < sm.rows, x.s3, k0 + c, n.din, tc.x16 != 0);
    put_split8(sm.x.hi, sm.x.lo, r * kLdK + c, v);
    load_omega8(v, fp.omega, n, f0 + r, k0 + c, tc.omega16 != 0);
    put_split8(sm.w.hi, sm.w.lo, r * kLdK + c, v);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kFvK / 16; ++kk) {
      FragA ah, al;
      wmma::load_matrix_sync(ah, sm.x.hi + wi * 16 * kLdK + kk * 16, kLdK);
      if (kXLo) wmma::load_matrix_sync(al, sm.x.lo + wi * 16 * kLdK + kk * 16, kLdK);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        FragBt bh, bl;  // Ω^T: the ω tile read column-major
        wmma::load_matrix_sync(bh, sm.w.hi + (wj + j) * 16 * kLdK + kk * 16, kLdK);
        wmma::load_matrix_sync(bl, sm.w.lo + (wj + j) * 16 * kLdK + kk * 16, kLdK);
        mma_split(acc[j], ah, al, kXLo, bh, bl, true);
      }
    }
    __syncthreads();
  }
  wmma::store_matrix_sync(sm.u + wi * 16 * kLdStage + wj * 16, acc[0], kLdStage, wmma::mem_row_major);
  wmma::store_matrix_sync(sm.u + wi * 16 * kLdStage + (wj + 1) * 16, acc[1], kLdStage, wmma::mem_row_major);
  __syncthreads();
}

// This thread's 16 exponents u of the staged tile (row t/4; -inf past m or the rows).
__device__ __forceinline__ void favor_u_values(float (&u)[16], const FavorForwardTiles& sm, const Dims& n,
                                               const FavorParams& fp, int64_t f0) {
  const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 16;
  const bool row = r < sm.rows;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    u[j] = row && f0 + c + j < n.dout ? __fmul_rn(sm.u[r * kLdStage + c + j], fp.xscale) - sm.half_sq[r] : -INFINITY;
}

template <typename T, int kStab>
__global__ void __launch_bounds__(kFmThreads, 2) favor_forward_tc_kernel(Tensor4 x, Tensor4 phi, Dims n,
                                                                         FavorParams fp, FavorTc tc) {
  FavorForwardTiles& sm = favor_tiles().fwd;
  T* py = static_cast<T*>(phi.data);
  const int64_t rows = n.B * n.H * n.L;
  const int64_t items = kStab == MESA_FAVOR_SEQUENCE_MAX ? n.B * n.H : ceil_div(rows, int64_t(kFvRows));
  const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 16;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    // SEQUENCE_MAX: the item is a (b, h) sequence; otherwise 64 rows
    const int64_t span = kStab == MESA_FAVOR_SEQUENCE_MAX ? n.L : kFvRows;
    const int64_t begin = item * span, end = begin + span < rows ? begin + span : rows;
    float cseq = kStab == MESA_FAVOR_BOUND ? fp.bound : 0.0f;
    if (kStab == MESA_FAVOR_SEQUENCE_MAX) {
      float mx = -INFINITY;
      for (int64_t r0 = begin; r0 < end; r0 += kFvRows) {
        favor_tile_rows<T>(sm, x, phi, n, fp, r0, end);
        for (int64_t f0 = 0; f0 < n.dout; f0 += kFvCols) {
          favor_u_tile<T>(sm, x, n, fp, tc, f0);
          float u[16];
          favor_u_values(u, sm, n, fp, f0);
#pragma unroll
          for (int j = 0; j < 16; ++j) mx = fmaxf(mx, u[j]);
          __syncthreads();  // sm.u read before the next tile
        }
      }
      mx = warp_reduce_max(mx);
      if (threadIdx.x % kWarpSize == 0) sm.block_max[threadIdx.x / kWarpSize] = mx;
      __syncthreads();
      mx = sm.block_max[0];
      for (int w = 1; w < kFmThreads / kWarpSize; ++w) mx = fmaxf(mx, sm.block_max[w]);
      __syncthreads();  // block_max read before the next item writes it
      cseq = mx > -INFINITY ? mx : 0.0f;
    }
    for (int64_t r0 = begin; r0 < end; r0 += kFvRows) {
      favor_tile_rows<T>(sm, x, phi, n, fp, r0, end);
      float cr = cseq;
      if (kStab == MESA_FAVOR_ROW_MAX) {
        float mx = -INFINITY;
        for (int64_t f0 = 0; f0 < n.dout; f0 += kFvCols) {
          favor_u_tile<T>(sm, x, n, fp, tc, f0);
          float u[16];
          favor_u_values(u, sm, n, fp, f0);
#pragma unroll
          for (int j = 0; j < 16; ++j) mx = fmaxf(mx, u[j]);
          __syncthreads();
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        cr = mx > -INFINITY ? mx : 0.0f;
      }
      for (int64_t f0 = 0; f0 < n.dout; f0 += kFvCols) {
        favor_u_tile<T>(sm, x, n, fp, tc, f0);
        float u[16];
        favor_u_values(u, sm, n, fp, f0);
        const int64_t off = sm.row_phi[r];
        if (r < sm.rows) {
#pragma unroll
          for (int j = 0; j < 16; ++j) u[j] = __fmul_rn(expf(u[j] - cr), fp.inv_sqrt_m);
          store_run16<T>(py, off, phi.s3, f0 + c, n.dout, tc.out16 != 0, u);
        }
        __syncthreads();
      }
    }
  }
}

// dx for tiles of 64 rows x 64 columns of d: Y = G Ω over the m features, then the epilogue.
template <typename T>
__global__ void __launch_bounds__(kFmThreads, 2) favor_backward_tc_kernel(Tensor4 x, Tensor4 phi, Tensor4 dphi,
                                                                          Tensor4 dx, Dims n, const float* omega,
                                                                          float xscale, FavorTc tc) {
  FavorBackwardTiles& sm = favor_tiles().bwd;
  const T* px = static_cast<const T*>(x.data);
  const T* pp = static_cast<const T*>(phi.data);
  const T* pg = static_cast<const T*>(dphi.data);
  const int64_t rows = n.B * n.H * n.L;
  const int64_t ncol = ceil_div(n.din, int64_t(kFvCols));
  const int64_t items = ceil_div(rows, int64_t(kFvRows)) * ncol;
  const int tid = threadIdx.x, warp = tid / kWarpSize;
  const int wi = warp / 2, wj = 2 * (warp % 2);
  const int r = tid / 4, q = tid % 4;
  const int wk = tid / (kFvCols / 8), wc = (tid % (kFvCols / 8)) * 8;  // this thread's run of the ω tile
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t r0 = (item / ncol) * kFvRows, c0 = (item % ncol) * kFvCols;
    const int64_t end = r0 + kFvRows < rows ? r0 + kFvRows : rows;
    __syncthreads();  // the previous item's readers are done
    if (q == 0) {  // offsets of rows past the range: 0, never dereferenced
      const bool valid = r0 + r < end;
      sm.row_x[r] = valid ? row_offset(x, n, r0 + r) : 0;
      sm.row_phi[r] = valid ? row_offset(phi, n, r0 + r) : 0;
      sm.row_dphi[r] = valid ? row_offset(dphi, n, r0 + r) : 0;
      sm.row_dx[r] = valid ? row_offset(dx, n, r0 + r) : 0;
    }
    if (tid == 0) sm.rows = int(end - r0);
    __syncthreads();
    FragAcc acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
    float gsum = 0.0f;  // this thread's part of row r's Σ g (features 8q.. of every step)
    for (int64_t k0 = 0; k0 < n.dout; k0 += kFvK) {
      float gp[8], gd[8], w[8];
      const bool valid = r < sm.rows;
      load_run8<T>(gp, pp, sm.row_phi[r], valid, phi.s3, k0 + q * 8, n.dout, tc.g16 != 0);
      load_run8<T>(gd, pg, sm.row_dphi[r], valid, dphi.s3, k0 + q * 8, n.dout, tc.g16 != 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        gp[j] = gd[j] * gp[j];  // exact in f32: two 16-bit significands
        gsum += gp[j];
      }
      put_split8(sm.g.hi, sm.g.lo, r * kLdK + q * 8, gp);
      load_omega8(w, omega, n, k0 + wk, c0 + wc, tc.omega16 != 0);  // row k0 + wk of ω, columns of d
      put_split8(sm.w.hi, sm.w.lo, wk * kLdN + wc, w);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kFvK / 16; ++kk) {
        FragA ah, al;
        wmma::load_matrix_sync(ah, sm.g.hi + wi * 16 * kLdK + kk * 16, kLdK);
        wmma::load_matrix_sync(al, sm.g.lo + wi * 16 * kLdK + kk * 16, kLdK);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          FragB bh, bl;
          wmma::load_matrix_sync(bh, sm.w.hi + kk * 16 * kLdN + (wj + j) * 16, kLdN);
          wmma::load_matrix_sync(bl, sm.w.lo + kk * 16 * kLdN + (wj + j) * 16, kLdN);
          mma_split(acc[j], ah, al, true, bh, bl, true);
        }
      }
      __syncthreads();
    }
    gsum += __shfl_xor_sync(0xffffffffu, gsum, 1);
    gsum += __shfl_xor_sync(0xffffffffu, gsum, 2);
    wmma::store_matrix_sync(sm.y + wi * 16 * kLdStage + wj * 16, acc[0], kLdStage, wmma::mem_row_major);
    wmma::store_matrix_sync(sm.y + wi * 16 * kLdStage + (wj + 1) * 16, acc[1], kLdStage, wmma::mem_row_major);
    __syncthreads();
    const int64_t ox = sm.row_x[r], od = sm.row_dx[r];
    if (r < sm.rows) {
      const int c = q * 16;
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t col = c0 + c + j;
        const float xp = col < n.din ? __fmul_rn(to_float(px[ox + col * x.s3]), xscale) : 0.0f;
        v[j] = __fmul_rn(fmaf(-xp, gsum, sm.y[r * kLdStage + c + j]), xscale);
      }
      store_run16<T>(static_cast<T*>(dx.data), od, dx.s3, c0 + c, n.din, tc.out16 != 0, v);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
inline unsigned fm_grid(int64_t items, int per_sm) {
  const int64_t cap = int64_t(sm_count()) * per_sm;
  return unsigned(items < 1 ? 1 : (items < cap ? items : cap));
}

// d^(-1/4) (Performer's x / d^(1/4)); 1 for d = 0, where x is empty and the scale multiplies
// only the empty sums (0 x inf would make u NaN).
inline float favor_xscale(int64_t d) { return d > 0 ? float(1.0 / std::sqrt(std::sqrt(double(d)))) : 1.0f; }

// Contiguous row-major [B,H,L,D] (any stride on an axis of size 1) and 16-byte aligned.
inline bool dense4(const MesaLaTensor& t, const Dims& n) {
  const int64_t shape[4] = {n.B, n.H, n.L, n.din};
  int64_t expect = 1;
  for (int k = 3; k >= 0; --k) {
    if (shape[k] != 1 && t.strides[k] != expect) return false;
    expect *= shape[k];
  }
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

// FAVOR+ on tensor cores: the stabiliser is a template parameter, chosen here.
inline int omega_16b(const float* omega, int64_t d) {
  return reinterpret_cast<uintptr_t>(omega) % 16 == 0 && d % 4 == 0 ? 1 : 0;
}

template <typename T>
MesaStatus launch_favor_forward_tc(const MesaFeatureArgs& a, const Tensor4& x, const Tensor4& phi, const Dims& n,
                                   const FavorParams& fp, void* stream) {
  const FavorTc tc{rows_16b<T>(a.x) ? 1 : 0, 0, rows_16b<T>(a.phi) ? 1 : 0, omega_16b(a.omega, n.din)};
  const int64_t items = a.stabilizer == MESA_FAVOR_SEQUENCE_MAX ? n.B * n.H : ceil_div(n.B * n.H * n.L, int64_t(kFvRows));
  auto go = [&](auto kernel) {
    const unsigned grid = resident_grid(kernel, items * kFmThreads, kFmThreads);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kFmThreads), 0, stream, x, phi, n, fp, tc));
  };
  switch (a.stabilizer) {
    case MESA_FAVOR_NONE: return go(favor_forward_tc_kernel<T, MESA_FAVOR_NONE>);
    case MESA_FAVOR_ROW_MAX: return go(favor_forward_tc_kernel<T, MESA_FAVOR_ROW_MAX>);
    case MESA_FAVOR_BOUND: return go(favor_forward_tc_kernel<T, MESA_FAVOR_BOUND>);
    case MESA_FAVOR_SEQUENCE_MAX: return go(favor_forward_tc_kernel<T, MESA_FAVOR_SEQUENCE_MAX>);
    default: return MESA_STATUS_INVALID_ARGUMENT;
  }
}

template <typename T>
MesaStatus launch_favor_backward_tc(const MesaFeatureBackwardArgs& a, const Tensor4& x, const Tensor4& dphi,
                                    const Tensor4& dx, const Dims& n, void* stream) {
  const FavorTc tc{0, rows_16b<T>(a.phi) && rows_16b<T>(a.dphi) ? 1 : 0, rows_16b<T>(a.dx) ? 1 : 0,
                   omega_16b(a.omega, n.din)};
  const int64_t items = ceil_div(n.B * n.H * n.L, int64_t(kFvRows)) * ceil_div(n.din, int64_t(kFvCols));
  const auto kernel = favor_backward_tc_kernel<T>;
  const unsigned grid = resident_grid(kernel, items * kFmThreads, kFmThreads);
  return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kFmThreads), 0, stream, x, tensor4(a.phi), dphi, dx, n,
                                 a.omega, favor_xscale(n.din), tc));
}

// The dense elementwise kernel of a map, forward or backward: one launch site.
template <typename T, bool kBackward>
MesaStatus launch_elementwise_dense(int32_t map, const void* x, const void* dphi, void* out, int64_t total,
                                    void* stream) {
  auto go = [&](auto kernel) {
    const unsigned grid = resident_grid(kernel, ceil_div(ceil_div(total, Vec16<T>::N), 2), kFmThreads);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kFmThreads), 0, stream, static_cast<const T*>(x),
                                   static_cast<const T*>(dphi), static_cast<T*>(out), total));
  };
  if (map == MESA_FEATURE_RELU) return go(elementwise_dense_kernel<T, MESA_FEATURE_RELU, kBackward>);
  return go(elementwise_dense_kernel<T, MESA_FEATURE_ELU1, kBackward>);
}

template <typename T>
MesaStatus feature_forward(const MesaFeatureArgs& a, void* stream) {
  const Dims n{a.batch, a.heads, a.len, a.in_dim, a.out_dim};
  const Tensor4 x = tensor4(a.x), phi = tensor4(a.phi);
  if ((a.map == MESA_FEATURE_RELU || a.map == MESA_FEATURE_ELU1) && dense4(a.x, n) && dense4(a.phi, n))
    return launch_elementwise_dense<T, false>(a.map, a.x.data, nullptr, a.phi.data, n.B * n.H * n.L * n.din, stream);
  switch (a.map) {
    case MESA_FEATURE_RELU:
      return status_from(MESA_LAUNCH((elementwise_forward_kernel<T, MESA_FEATURE_RELU>),
                                     dim3(fm_grid(ceil_div(n.B * n.H * n.L * n.din, kFmThreads), 8)),
                                     dim3(kFmThreads), 0, stream, x, phi, n));
    case MESA_FEATURE_ELU1:
      return status_from(MESA_LAUNCH((elementwise_forward_kernel<T, MESA_FEATURE_ELU1>),
                                     dim3(fm_grid(ceil_div(n.B * n.H * n.L * n.din, kFmThreads), 8)),
                                     dim3(kFmThreads), 0, stream, x, phi, n));
    case MESA_FEATURE_FAVOR: {
      const FavorParams fp{a.omega, favor_xscale(n.din), float(1.0 / std::sqrt(double(n.dout))), a.stabilizer, a.bound};
      if constexpr (kTensorCores<T>) {
        return launch_favor_forward_tc<T>(a, x, phi, n, fp, stream);
      } else {  // f32: the FP32 kernel
        const int64_t items =
            a.stabilizer == MESA_FAVOR_SEQUENCE_MAX ? n.B * n.H : ceil_div(n.B * n.H * n.L, kFavorWarps);
        return status_from(MESA_LAUNCH((favor_forward_kernel<T>), dim3(fm_grid(items, 8)), dim3(kFmThreads), 0,
                                       stream, x, phi, n, fp));
      }
    }
    default: return MESA_STATUS_INVALID_ARGUMENT;
  }
}

template <typename T>
MesaStatus feature_backward(const MesaFeatureBackwardArgs& a, void* stream) {
  const Dims n{a.batch, a.heads, a.len, a.in_dim, a.out_dim};
  const Tensor4 x = tensor4(a.x), dphi = tensor4(a.dphi), dx = tensor4(a.dx);
  if ((a.map == MESA_FEATURE_RELU || a.map == MESA_FEATURE_ELU1) && dense4(a.x, n) && dense4(a.dphi, n) &&
      dense4(a.dx, n))
    return launch_elementwise_dense<T, true>(a.map, a.x.data, a.dphi.data, a.dx.data, n.B * n.H * n.L * n.din,
                                             stream);
  const unsigned grid = fm_grid(ceil_div(n.B * n.H * n.L * n.din, kFmThreads), 8);
  switch (a.map) {
    case MESA_FEATURE_RELU:
      return status_from(MESA_LAUNCH((elementwise_backward_kernel<T, MESA_FEATURE_RELU>), dim3(grid), dim3(kFmThreads),
                                     0, stream, x, dphi, dx, n));
    case MESA_FEATURE_ELU1:
      return status_from(MESA_LAUNCH((elementwise_backward_kernel<T, MESA_FEATURE_ELU1>), dim3(grid), dim3(kFmThreads),
                                     0, stream, x, dphi, dx, n));
    case MESA_FEATURE_FAVOR:
      if constexpr (kTensorCores<T>) {
        return launch_favor_backward_tc<T>(a, x, dphi, dx, n, stream);
      } else {  // f32: the FP32 kernel
        return status_from(MESA_LAUNCH((favor_backward_kernel<T>), dim3(grid), dim3(kFmThreads), 0, stream, x,
                                       tensor4(a.phi), dphi, dx, n, a.omega, favor_xscale(n.din)));
      }
    default: return MESA_STATUS_INVALID_ARGUMENT;
  }
}

template <typename T> struct FeatureForwardOp { static MesaStatus run(const MesaFeatureArgs& a, void* s) { return feature_forward<T>(a, s); } };
template <typename T> struct FeatureBackwardOp { static MesaStatus run(const MesaFeatureBackwardArgs& a, void* s) { return feature_backward<T>(a, s); } };

template <template <typename> class F, typename Args>
MesaStatus dispatch_fm(MesaDType t, const Args& a, void* stream) {
  switch (t) {
    case MESA_DTYPE_F32: return F<float>::run(a, stream);
    case MESA_DTYPE_F16: return F<__half>::run(a, stream);
    case MESA_DTYPE_BF16: return F<__nv_bfloat16>::run(a, stream);
    default: return MESA_STATUS_UNSUPPORTED;
  }
}

inline bool dims_valid(int32_t map, int64_t B, int64_t H, int64_t L, int64_t din, int64_t dout) {
  if (B < 0 || H < 0 || L < 0 || din < 0 || dout < 0) return false;
  if (map == MESA_FEATURE_RELU || map == MESA_FEATURE_ELU1) return din == dout;
  if (map == MESA_FEATURE_FAVOR) return din <= kFavorMaxIn && dout <= kFavorMaxOut;
  return false;
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(feature_map_forward)(const MesaFeatureArgs* a, void* stream) {
  if (a == nullptr || !dims_valid(a->map, a->batch, a->heads, a->len, a->in_dim, a->out_dim))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->map == MESA_FEATURE_FAVOR && (a->stabilizer < MESA_FAVOR_NONE || a->stabilizer > MESA_FAVOR_SEQUENCE_MAX))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->batch * a->heads * a->len * a->out_dim == 0) return MESA_STATUS_OK;
  // with in_dim = 0, x (and FAVOR+'s ω) are empty and may be null pointers; phi is still written
  const bool x_empty = a->in_dim == 0;
  if ((a->x.data == nullptr && !x_empty) || a->phi.data == nullptr ||
      (a->map == MESA_FEATURE_FAVOR && a->omega == nullptr && !x_empty))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_fm<FeatureForwardOp>(a->dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(feature_map_backward)(const MesaFeatureBackwardArgs* a, void* stream) {
  if (a == nullptr || !dims_valid(a->map, a->batch, a->heads, a->len, a->in_dim, a->out_dim))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->batch * a->heads * a->len * a->in_dim == 0) return MESA_STATUS_OK;
  if (a->x.data == nullptr || a->dphi.data == nullptr || a->dx.data == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->map == MESA_FEATURE_FAVOR && (a->phi.data == nullptr || a->omega == nullptr)) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_fm<FeatureBackwardOp>(a->dtype, *a, stream);
}
