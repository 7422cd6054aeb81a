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
// Launch policy (host).
inline unsigned fm_grid(int64_t items, int per_sm) {
  const int64_t cap = int64_t(sm_count()) * per_sm;
  return unsigned(items < 1 ? 1 : (items < cap ? items : cap));
}

inline float favor_xscale(int64_t d) { return float(1.0 / std::sqrt(std::sqrt(double(d)))); }

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
      const int64_t items =
          a.stabilizer == MESA_FAVOR_SEQUENCE_MAX ? n.B * n.H : ceil_div(n.B * n.H * n.L, kFavorWarps);
      return status_from(MESA_LAUNCH((favor_forward_kernel<T>), dim3(fm_grid(items, 8)), dim3(kFmThreads), 0, stream,
                                     x, phi, n, fp));
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
      return status_from(MESA_LAUNCH((favor_backward_kernel<T>), dim3(grid), dim3(kFmThreads),
                                     0, stream, x, tensor4(a.phi), dphi, dx, n, a.omega, favor_xscale(n.din)));
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
