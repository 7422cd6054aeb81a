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
// SEQUENCE_MAX: the maximum is taken in a first pass, the row recomputed in a second).
#include "common.cuh"

namespace MESA_NS {

constexpr int kFmThreads = 256;
constexpr int kFavorMaxIn = 1024;   // d: one row of x' in shared memory
constexpr int kFavorMaxOut = 4096;  // m: one row of g in shared memory (backward)

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

__device__ __forceinline__ float block_reduce(float v, float* scratch, bool is_max) {
  // every thread of the block calls it; result broadcast to all
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kFmThreads / kWarpSize; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
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
    const float v = to_float(px[x.off(b, h, l, f)]);
    const float y = kMap == MESA_FEATURE_RELU ? fmaxf(v, 0.0f) : (v > 0.0f ? v + 1.0f : expf(v));
    py[phi.off(b, h, l, f)] = from_float<T>(y);
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
    const float g = to_float(pg[dphi.off(b, h, l, f)]);
    const float slope = kMap == MESA_FEATURE_RELU ? (v > 0.0f ? 1.0f : 0.0f) : (v > 0.0f ? 1.0f : expf(v));
    pd[dx.off(b, h, l, f)] = from_float<T>(g * slope);
  }
}

// ---------------------------------------------------------------------------------------
// FAVOR+ forward. One block per row (or per (b,h) sequence for SEQUENCE_MAX), threads over
// the m features.
struct FavorParams {
  const float* omega;  // [m, d]
  float xscale;        // d^(-1/4)
  float inv_sqrt_m;
  int stabilizer;
  float bound;
};

// Loads x'_row into xs and returns |x'|^2 / 2.
template <typename T>
__device__ float load_xrow(const Tensor4& x, const Dims& n, int64_t b, int64_t h, int64_t l, float xscale, float* xs,
                           float* scratch) {
  const T* px = static_cast<const T*>(x.data);
  float sq = 0.0f;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < n.din; j += kFmThreads) {
    const float v = __fmul_rn(to_float(px[x.off(b, h, l, j)]), xscale);
    xs[j] = v;
    sq = fmaf(v, v, sq);
  }
  return 0.5f * block_reduce(sq, scratch, false);  // ends with the block synchronised
}

__device__ __forceinline__ float projection(const float* __restrict__ w_row, const float* xs, int64_t d, float half_sq) {
  float u = 0.0f;
  for (int64_t j = 0; j < d; ++j) u = fmaf(w_row[j], xs[j], u);
  return u - half_sq;
}

template <typename T>
__global__ void __launch_bounds__(kFmThreads, 2) favor_forward_kernel(Tensor4 x, Tensor4 phi, Dims n, FavorParams fp) {
  __shared__ float xs[kFavorMaxIn];
  __shared__ float scratch[kFmThreads / kWarpSize];
  T* py = static_cast<T*>(phi.data);
  const bool per_seq = fp.stabilizer == MESA_FAVOR_SEQUENCE_MAX;
  const int64_t items = per_seq ? n.B * n.H : n.B * n.H * n.L;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t bh = per_seq ? item : item / n.L;
    const int64_t b = bh / n.H, h = bh % n.H;
    const int64_t l_begin = per_seq ? 0 : item % n.L, l_end = per_seq ? n.L : l_begin + 1;
    float c = fp.stabilizer == MESA_FAVOR_BOUND ? fp.bound : 0.0f;
    if (per_seq || fp.stabilizer == MESA_FAVOR_ROW_MAX) {
      float mx = -INFINITY;
      for (int64_t l = l_begin; l < l_end; ++l) {
        const float half_sq = load_xrow<T>(x, n, b, h, l, fp.xscale, xs, scratch);
        for (int64_t i = threadIdx.x; i < n.dout; i += kFmThreads)
          mx = fmaxf(mx, projection(fp.omega + i * n.din, xs, n.din, half_sq));
      }
      c = block_reduce(mx, scratch, true);
      if (!(c > -INFINITY)) c = 0.0f;  // empty rows / m = 0
    }
    for (int64_t l = l_begin; l < l_end; ++l) {
      const float half_sq = load_xrow<T>(x, n, b, h, l, fp.xscale, xs, scratch);
      for (int64_t i = threadIdx.x; i < n.dout; i += kFmThreads) {
        const float u = projection(fp.omega + i * n.din, xs, n.din, half_sq);
        py[phi.off(b, h, l, i)] = from_float<T>(__fmul_rn(expf(u - c), fp.inv_sqrt_m));
      }
    }
  }
}

// FAVOR+ backward, one block per row: g_i = dphi_i phi_i into shared memory, then thread j
// forms dx'_j = sum_i g_i w_ij - x'_j sum_i g_i (w read column-wise: coalesced over j).
template <typename T>
__global__ void __launch_bounds__(kFmThreads) favor_backward_kernel(Tensor4 x, Tensor4 phi, Tensor4 dphi, Tensor4 dx,
                                                                    Dims n, const float* omega, float xscale) {
  __shared__ float g[kFavorMaxOut];
  __shared__ float scratch[kFmThreads / kWarpSize];
  const T* px = static_cast<const T*>(x.data);
  const T* pp = static_cast<const T*>(phi.data);
  const T* pg = static_cast<const T*>(dphi.data);
  T* pd = static_cast<T*>(dx.data);
  const int64_t rows = n.B * n.H * n.L;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t l = row % n.L, bh = row / n.L, b = bh / n.H, h = bh % n.H;
    float gs = 0.0f;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n.dout; i += kFmThreads) {
      const float gi = to_float(pg[dphi.off(b, h, l, i)]) * to_float(pp[phi.off(b, h, l, i)]);
      g[i] = gi;
      gs += gi;
    }
    const float gsum = block_reduce(gs, scratch, false);
    for (int64_t j = threadIdx.x; j < n.din; j += kFmThreads) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n.dout; ++i) acc = fmaf(g[i], omega[i * n.din + j], acc);
      const float xp = __fmul_rn(to_float(px[x.off(b, h, l, j)]), xscale);
      const float dxp = fmaf(-xp, gsum, acc);
      pd[dx.off(b, h, l, j)] = from_float<T>(__fmul_rn(dxp, xscale));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
inline unsigned fm_grid(int64_t items, int per_sm) {
  const int64_t cap = int64_t(sm_count()) * per_sm;
  return unsigned(items < 1 ? 1 : (items < cap ? items : cap));
}

inline float favor_xscale(int64_t d) { return float(1.0 / std::sqrt(std::sqrt(double(d)))); }

template <typename T>
MesaStatus feature_forward(const MesaFeatureArgs& a, void* stream) {
  const Dims n{a.batch, a.heads, a.len, a.in_dim, a.out_dim};
  const Tensor4 x = tensor4(a.x), phi = tensor4(a.phi);
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
      const int64_t items = a.stabilizer == MESA_FAVOR_SEQUENCE_MAX ? n.B * n.H : n.B * n.H * n.L;
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
  const unsigned grid = fm_grid(ceil_div(n.B * n.H * n.L * n.din, kFmThreads), 8);
  switch (a.map) {
    case MESA_FEATURE_RELU:
      return status_from(MESA_LAUNCH((elementwise_backward_kernel<T, MESA_FEATURE_RELU>), dim3(grid), dim3(kFmThreads),
                                     0, stream, x, dphi, dx, n));
    case MESA_FEATURE_ELU1:
      return status_from(MESA_LAUNCH((elementwise_backward_kernel<T, MESA_FEATURE_ELU1>), dim3(grid), dim3(kFmThreads),
                                     0, stream, x, dphi, dx, n));
    case MESA_FEATURE_FAVOR:
      return status_from(MESA_LAUNCH((favor_backward_kernel<T>), dim3(fm_grid(n.B * n.H * n.L, 8)), dim3(kFmThreads),
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
  if (a->x.data == nullptr || a->phi.data == nullptr || (a->map == MESA_FEATURE_FAVOR && a->omega == nullptr))
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
