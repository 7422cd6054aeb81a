// gelu.cu — GELU (Hendrycks & Gimpel 2016) fused with activation compression (Mesa §3):
// the forward writes y = gelu(x) AND the codes of x (what backward needs) in one read of x;
// the backward decodes x inside the kernel.
//
// Math (f32):
//   erf form:   gelu(x)  = x/2 · (1 + erf(x/√2))  evaluated as  x/2 · erfc(−x/√2)
//               gelu'(x) = erfc(−x/√2)/2 + x · exp(−x²/2)/√(2π)
//   tanh form:  u = √(2/π)·(x + 0.044715·x³),  gelu(x) = x/2 · (1 + tanh u)  evaluated as  x·σ(2u)
//               gelu'(x) = σ(2u) · (1 + 2x·σ(−2u)·√(2/π)·(1 + 3·0.044715·x²))
//   σ(z) = 1/(1 + e^{−z}). `1 + erf` and `1 + tanh` cancel for x below about −5 (every digit
//   lost from −6 with erf, −5.5 with tanh); erfc and σ keep full relative accuracy down to
//   underflow: the relative error is that of the argument times its condition number,
//   ≈ x²·2⁻²³ (erf form) and 12·|u|·2⁻²⁴ (tanh form) — tests/fused.rs, gelu_tail_tol.
//   Sums of products are written with __fmul_rn/__fadd_rn: no FMA contraction on either
//   build, so the only GPU-vs-emulator difference left is that of erfcf/expf (docs/design.md).
//   codes of x: quant_common.cuh (encode with the Quantizer's parameters; statistics reduced in
//   the same pass for the running estimate).
//
// Kernels (n elements of T, b bits):
//   gelu_forward_kernel   reads n·sizeof(T), writes n·sizeof(T) + n·b/8      ~25 FLOP/element
//   gelu_backward_kernel  reads n·sizeof(T) + n·b/8 (codes) [or n·sizeof(T) of plain x],
//                         writes n·sizeof(T)                                 ~30 FLOP/element
// Both walk units of 8 logical elements (grid-stride), so a unit's code bytes have one writer;
// dense 16-byte aligned views use 16-byte vectors, any other view the strided path.
// Reference: crates/mesa-kernels/src/reference/fused.rs.  Bytes and floors: docs/fused.md.
#include "rows.cuh"

namespace MESA_NS {

// 256 threads: 8 warps per block, enough independent 16-byte loads in flight per SM with the
// grid sized to a few waves (grid_for_units); elementwise, so no shared-memory constraint.
constexpr int kGeluBlock = 256;
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCoef = 0.044715f;

// u = √(2/π)·(x + 0.044715·x³) of the tanh form
__device__ __forceinline__ float tanh_arg(float x) {
  return kSqrt2OverPi * __fadd_rn(x, __fmul_rn(kTanhCoef * x * x, x));
}

// σ(2u) and σ(−2u) from one e = e^{−2|u|} ∈ (0, 1] (never overflows): r = 1/(1 + e) is the
// larger of the two, e·r the smaller. In the negative tail σ(2u) = e·r, and the factor e is
// applied last, so nothing underflows before the result does.
// Not inlined: inlined 8 times per unit next to the f16/bf16 conversions, erfcf made nvcc 13
// spill 4 bytes on sm_90 (scripts/check-resources.sh); the call costs a few instructions of an
// elementwise, memory-bound kernel.
__device__ __noinline__ float gelu_value(float x, int form) {
  if (form == MESA_GELU_TANH) {
    const float u = tanh_arg(x);
    const float e = expf(-2.0f * fabsf(u));
    const float r = reciprocal(1.0f + e);  // 1 + e in [1, 2]: Newton, no division slow path
    return u >= 0.0f ? x * r : (x * r) * e;
  }
  return 0.5f * x * erfcf(-x * kInvSqrt2);
}

__device__ __forceinline__ float gelu_derivative(float x, int form) {
  if (form == MESA_GELU_TANH) {
    const float u = tanh_arg(x);
    const float e = expf(-2.0f * fabsf(u));
    const float r = reciprocal(1.0f + e);  // 1 + e in [1, 2]: Newton, no division slow path
    const float sm = u >= 0.0f ? e * r : r;  // σ(−2u)
    const float du = kSqrt2OverPi * __fadd_rn(1.0f, __fmul_rn(3.0f * kTanhCoef * x, x));
    // a factor that underflowed to 0 makes its term exactly 0, even where du overflows (|x| > 1e19)
    const float g = __fadd_rn(1.0f, sm > 0.0f ? __fmul_rn(2.0f * x * sm, du) : 0.0f);
    if (u >= 0.0f) return r * g;
    return e == 0.0f ? 0.0f : (r * g) * e;  // NaN stays NaN
  }
  return __fadd_rn(0.5f * erfcf(-x * kInvSqrt2), __fmul_rn(x * kInvSqrt2Pi, expf(-0.5f * x * x)));
}

// Forward: y = gelu(x) (y == nullptr: statistics pass only), codes of x into the sink.
template <typename T>
__global__ void __launch_bounds__(kGeluBlock)
    gelu_forward_kernel(const T* __restrict__ x, Strided xv, bool x_dense, T* __restrict__ y, Strided yv,
                        bool y_dense, int64_t n, CodeSink sink, int form) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  const bool with_stats = sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += step) {
    const int64_t i0 = u * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    float v[kUnit];
    load_view_unit(x, xv, x_dense, i0, live, v);
    if (y != nullptr) {
      float out[kUnit];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) out[j] = gelu_value(v[j], form);
      store_view_unit(y, yv, y_dense, i0, live, out);
    }
    if (sink.codes != nullptr || with_stats) sink_unit(sink, i0, v, live, run, stats.target());
  }
  if (with_stats) {
    flush(run, stats.target());
    stats.end();
  }
}

// Backward: dx = dy · gelu'(x̂), x̂ decoded from codes (kCodes) or read from a plain tensor.
template <typename T, bool kCodes>
__global__ void __launch_bounds__(kGeluBlock)
    gelu_backward_kernel(const T* __restrict__ dy, Strided dyv, bool dy_dense, const T* __restrict__ x, Strided xv,
                         bool x_dense, CodeSource src, T* __restrict__ dx, Strided dxv, bool dx_dense, int64_t n,
                         int form) {
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += step) {
    const int64_t i0 = u * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    float xs[kUnit], g[kUnit];
    if (kCodes) {
      source_unit(src, i0, live, xs);
    } else {
      load_view_unit(x, xv, x_dense, i0, live, xs);
    }
    load_view_unit(dy, dyv, dy_dense, i0, live, g);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) g[j] = g[j] * gelu_derivative(xs[j], form);
    store_view_unit(dx, dxv, dx_dense, i0, live, g);
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): grid-stride over units of 8, a few waves of the machine.
inline unsigned grid_for_units(int64_t n) {
  const int64_t want = ceil_div(ceil_div(n, kUnit), kGeluBlock);
  const int64_t cap = int64_t(sm_count()) * 8;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}

inline bool dense16(const void* p, const MesaTensorDesc& d) {
  return p != nullptr && is_dense(d) && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
struct GeluForwardOp {
  static MesaStatus run(const MesaGeluForwardArgs& a, void* stream) {
    const int64_t n = numel(a.x_desc);
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    return status_from(MESA_LAUNCH((gelu_forward_kernel<T>), dim3(grid_for_units(n)), dim3(kGeluBlock), 0, stream, x,
                                   strided_from(a.x_desc), dense16(a.x, a.x_desc), y, strided_from(a.y_desc),
                                   dense16(a.y, a.y_desc), n, code_sink_from(a.sink), int(a.form)));
  }
};

template <typename T>
struct GeluBackwardOp {
  static MesaStatus run(const MesaGeluBackwardArgs& a, void* stream) {
    const int64_t n = numel(a.dy_desc);
    const T* dy = static_cast<const T*>(a.dy);
    const T* x = static_cast<const T*>(a.x);
    T* dx = static_cast<T*>(a.dx);
    const dim3 grid(grid_for_units(n));
    const CodeSource src = code_source_from(a.source);
    if (a.source.codes != nullptr)
      return status_from(MESA_LAUNCH((gelu_backward_kernel<T, true>), grid, dim3(kGeluBlock), 0, stream, dy,
                                     strided_from(a.dy_desc), dense16(a.dy, a.dy_desc), x, Strided{}, false, src, dx,
                                     strided_from(a.dx_desc), dense16(a.dx, a.dx_desc), n, int(a.form)));
    return status_from(MESA_LAUNCH((gelu_backward_kernel<T, false>), grid, dim3(kGeluBlock), 0, stream, dy,
                                   strided_from(a.dy_desc), dense16(a.dy, a.dy_desc), x, strided_from(a.x_desc),
                                   dense16(a.x, a.x_desc), src, dx, strided_from(a.dx_desc), dense16(a.dx, a.dx_desc),
                                   n, int(a.form)));
  }
};

inline bool same_shape(const MesaTensorDesc& a, const MesaTensorDesc& b) { return numel(a) == numel(b); }

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(gelu_forward)(const MesaGeluForwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || !code_sink_valid(a->sink)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->form != MESA_GELU_ERF && a->form != MESA_GELU_TANH) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->y != nullptr && (!desc_valid(a->y_desc) || !same_shape(a->x_desc, a->y_desc) || a->y_desc.dtype != a->x_desc.dtype))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<GeluForwardOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(gelu_backward)(const MesaGeluBackwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->dy_desc) || !desc_valid(a->dx_desc) || !code_source_valid(a->source))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->form != MESA_GELU_ERF && a->form != MESA_GELU_TANH) return MESA_STATUS_INVALID_ARGUMENT;
  if (!same_shape(a->dy_desc, a->dx_desc) || a->dx_desc.dtype != a->dy_desc.dtype) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->source.codes == nullptr &&
      (!desc_valid(a->x_desc) || !same_shape(a->x_desc, a->dy_desc) || a->x_desc.dtype != a->dy_desc.dtype))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->dy_desc) == 0) return MESA_STATUS_OK;
  if (a->dy == nullptr || a->dx == nullptr || (a->source.codes == nullptr && a->x == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<GeluBackwardOp>(a->dy_desc.dtype, *a, stream);
}
