// gelu.cu — GELU (Hendrycks & Gimpel 2016) fused with activation compression (Mesa §3):
// the forward writes y = gelu(x) AND the codes of x (what backward needs) in one read of x;
// the backward decodes x inside the kernel.
//
// Math (f32):
//   erf form:   gelu(x)  = x·Φ(x),  Φ(x) = erfc(−x/√2)/2,  gelu'(x) = Φ(x) + x·e^{−x²/2}/√(2π),
//               evaluated as max(x, 0) − |x|·erfc(|x|/√2)/2 with erfc from one exp and a
//               polynomial (erf_parts below: no erfcf call, ~18 instructions per value)
//   tanh form:  u = √(2/π)·(x + 0.044715·x³),  gelu(x) = x/2 · (1 + tanh u)  evaluated as  x·σ(2u)
//               gelu'(x) = σ(2u) · (1 + 2x·σ(−2u)·√(2/π)·(1 + 3·0.044715·x²))
//   σ(z) = 1/(1 + e^{−z}). `1 + erf` and `1 + tanh` cancel for x below about −5 (every digit
//   lost from −6 with erf, −5.5 with tanh); erfc(|x|/√2) and σ keep full relative accuracy down
//   to underflow: the relative error is that of the argument times its condition number,
//   ≈ x²·2⁻²³ (erf form) and 12·|u|·2⁻²⁴ (tanh form) — tests/fused.rs, gelu_tail_tol.
//   Sums of products are written with fmaf/__fmul_rn/__fadd_rn: no FMA contraction on either
//   build, so the only GPU-vs-emulator differences left are the hardware approximations
//   (ex2.approx and rcp.approx, erf form; expf, tanh form) against the emulator's correctly
//   rounded exp2f/division and glibc's expf (docs/design.md).
//   codes of x: quant_common.cuh (encode with the Quantizer's parameters; statistics reduced in
//   the same pass for the running estimate).
//
// Kernels (n elements of T, b bits):
//   gelu_forward_*_kernel   reads n·sizeof(T), writes n·sizeof(T) + n·b/8      ~25 FLOP/element
//   gelu_backward_*_kernel  reads n·sizeof(T) + n·b/8 (codes) [or n·sizeof(T) of plain x],
//                           writes n·sizeof(T)                                 ~30 FLOP/element
// The general kernels walk units of 8 logical elements (grid-stride), so a unit's code bytes
// have one writer; dense 16-byte aligned views use 16-byte vectors, any other view the strided
// path. The dense kernels (every view dense, round to nearest) fix form, bits and statistics
// at compile time. Reference: crates/mesa-kernels/src/reference/fused.rs. Bytes and floors:
// docs/fused.md; instructions per element against the issue budget: docs/kernels.md.
#include "rows.cuh"

namespace MESA_NS {

// 256 threads: 8 warps per block, enough independent 16-byte loads in flight per SM with the
// grid sized to a few waves (grid_for_units); elementwise, so no shared-memory constraint.
constexpr int kGeluBlock = 256;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCoef = 0.044715f;
constexpr float kMinusHalfLog2e = -0.72134752044448170f;  // e^{-x²/2} = 2^{x²·(−log2(e)/2)}

// ---------------------------------------------------------------------------------------
// The erf form without a call to erfcf. For s = |x|:
//   erfc(s/√2) = e^{−x²/2} · R(r),   r = (s − 3)/(s + 3) = 1 − 6/(s + 3) ∈ [−1, 1],
// R = erfcx(s/√2) a degree-10 polynomial in r fitted for the largest relative error over
// s ∈ [0, ∞) (scripts/fit_gelu_erfc.py: 1.5·2⁻²⁴ for the fit; this f32 Horner scheme ≤ 10.3·2⁻²⁴,
// its largest near s = 14, where the argument's own rounding already costs 2x²·2⁻²⁴ ≈ 390·2⁻²⁴).
// e^{−x²/2} is one ex2.approx of x²·(−log2(e)/2), flushed to 0 past |x| ≈ 13.2, where
// gelu(x) < 1e-37. Then, with no cancellation anywhere:
//   gelu(x)  = max(x, 0) − s·erfc(s/√2)/2          (one fmaf; the −1/2 folded into R's coefficients)
//   gelu'(x) = Φ(x) + x·e^{−x²/2}/√(2π),  Φ = erfc(s/√2)/2 for x < 0, 1 − erfc(s/√2)/2 otherwise.
// Branch-free; two MUFU (rcp, ex2) and 16 more instructions per value (erfcf: ~48). The cap
// s ≤ 64 keeps s·(…) = 0 for x = ±∞ (gelu(+∞) = +∞, gelu(−∞) = 0; fminf(NaN, 64) = 64, the
// NaN comes through e). The error bound: tests/fused.rs, gelu_tail_tol.
struct ErfParts {
  float s;         // min(|x|, 64)
  float half_erfc;  // −erfc(s/√2)/2
  float gauss;      // e^{−x²/2}
};

__device__ __forceinline__ ErfParts erf_parts(float x) {
  const float s = fminf(fabsf(x), 64.0f);
  const float r = fmaf(-6.0f, rcp_approx(s + 3.0f), 1.0f);
  float R = 1.991988756e-05f;  // −R/2
  R = fmaf(R, r, -4.117703793e-05f);
  R = fmaf(R, r, -1.486758847e-04f);
  R = fmaf(R, r, 3.255088523e-04f);
  R = fmaf(R, r, 1.005461090e-03f);
  R = fmaf(R, r, -2.899860265e-03f);
  R = fmaf(R, r, -6.138352212e-03f);
  R = fmaf(R, r, 4.621289670e-02f);
  R = fmaf(R, r, -1.232243702e-01f);
  R = fmaf(R, r, 2.064026147e-01f);
  R = fmaf(R, r, -1.215139553e-01f);
  const float e = exp2_approx(__fmul_rn(__fmul_rn(x, x), kMinusHalfLog2e));
  return ErfParts{s, __fmul_rn(e, R), e};
}

// u = √(2/π)·(x + 0.044715·x³) of the tanh form
__device__ __forceinline__ float tanh_arg(float x) {
  return kSqrt2OverPi * __fadd_rn(x, __fmul_rn(kTanhCoef * x * x, x));
}

// gelu(x) and gelu'(x) of a form fixed at compile time.
// tanh: σ(2u) and σ(−2u) from one e = e^{−2|u|} ∈ (0, 1] (never overflows): r = 1/(1 + e) is
// the larger of the two, e·r the smaller. In the negative tail σ(2u) = e·r, and the factor e is
// applied last, so nothing underflows before the result does.
template <int kForm>
__device__ __forceinline__ float gelu_value(float x) {
  if (kForm == MESA_GELU_TANH) {
    const float u = tanh_arg(x);
    const float e = expf(-2.0f * fabsf(u));
    const float r = reciprocal(1.0f + e);  // 1 + e in [1, 2]: Newton, no division slow path
    return u >= 0.0f ? x * r : (x * r) * e;
  }
  const ErfParts p = erf_parts(x);
  return fmaf(p.s, p.half_erfc, fmaxf(x, 0.0f));
}

template <int kForm>
__device__ __forceinline__ float gelu_derivative(float x) {
  if (kForm == MESA_GELU_TANH) {
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
  const ErfParts p = erf_parts(x);  // gelu' = Φ + x·φ
  const float cdf = x < 0.0f ? -p.half_erfc : 1.0f + p.half_erfc;
  return fmaf(__fmul_rn(x, p.gauss), kInvSqrt2Pi, cdf);
}

// ---------------------------------------------------------------------------------------
// General kernels: any view (strided element by element, dense ones by 16-byte vectors), any
// code sink or source (kernels/quant_common.cuh: sink_unit, source_unit), the form decided at
// run time. The functions of the form are out of line here: inlined 8 times per unit next to
// the strided index arithmetic, they made these kernels spill on sm_90 and multiplied their
// compile time; the dense kernels below, where the time goes, inline them.
__device__ __noinline__ float gelu_value_of(float x, int form) {
  return form == MESA_GELU_TANH ? gelu_value<MESA_GELU_TANH>(x) : gelu_value<MESA_GELU_ERF>(x);
}
__device__ __noinline__ float gelu_derivative_of(float x, int form) {
  return form == MESA_GELU_TANH ? gelu_derivative<MESA_GELU_TANH>(x) : gelu_derivative<MESA_GELU_ERF>(x);
}

// Forward: y = gelu(x) (y == nullptr: statistics pass only), codes of x into the sink.
template <typename T>
__global__ void __launch_bounds__(kGeluBlock)
    gelu_forward_kernel(const T* __restrict__ x, Strided xv, bool x_dense, T* __restrict__ y, Strided yv,
                        bool y_dense, int64_t n, CodeSink sink, int form, int64_t first_unit) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  const bool with_stats = sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t u = first_unit + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += step) {
    const int64_t i0 = u * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    float v[kUnit];
    load_view_unit(x, xv, x_dense, i0, live, v);
    if (y != nullptr) {
      float out[kUnit];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) out[j] = gelu_value_of(v[j], form);
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
                         int form, int64_t first_unit) {
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t u = first_unit + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += step) {
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
    for (int j = 0; j < kUnit; ++j) g[j] = g[j] * gelu_derivative_of(xs[j], form);
    store_view_unit(dx, dxv, dx_dense, i0, live, g);
  }
}

// ---------------------------------------------------------------------------------------
// Dense kernels: every tensor dense and 16-byte aligned, n < 2^31, and codes (if any) with the
// identity map, round to nearest and units of 8 in one group — the conditions of
// quantize_dense_kernel. Form, bits (0: nothing saved / x read as T) and statistics are template
// arguments, two units in flight per thread, the group from 32-bit fast division. The codes and
// statistics are quantize_dense_unit's, so those of the general kernel and of the quantize pass
// bit for bit; y and dx are the same gelu_value / gelu_derivative as in the general kernels.
// They do the whole units only; the last partial unit (n % 8 elements) is a second launch, of
// the general kernel on that unit alone (first_unit).
template <typename T, int kForm, int kBits, bool kStats>
__global__ void __launch_bounds__(kGeluBlock)
    gelu_forward_dense_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, DenseQuantize q, CodeSink sink) {
  __shared__ MesaGroupStats staged[kStats ? kSharedGroups : 1];
  StatsSink stats{sink.stats, kStats && sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (kStats) stats.begin();
  RunStats run;
  uint32_t cached_group = 0xffffffffu;
  CodeParams p{0.0f, 0.0f, 1.0f};
  auto unit = [&](uint32_t i0, const RawUnit<T>& raw) {
    float xs[kUnit], out[kUnit];
    raw.to_floats(xs);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) out[j] = gelu_value<kForm>(xs[j]);
    store_dense_unit(y + i0, out);
    if constexpr (kBits != 0)
      quantize_dense_unit<kBits, false, kStats>(q, i0, xs, cached_group, p, run, stats.target());
  };
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < nunits; u += 2 * stride) {
    const bool second = u + stride < nunits;
    RawUnit<T> a, b;
    a.load(x, u * kUnit);
    if (second) b.load(x, (u + stride) * kUnit);
    unit(u * kUnit, a);
    if (second) unit((u + stride) * kUnit, b);
  }
  if (kStats) {
    flush(run, stats.target());
    stats.end();
  }
}

template <typename T, int kForm, int kBits>
__global__ void __launch_bounds__(kGeluBlock)
    gelu_backward_dense_kernel(const T* __restrict__ dy, const T* __restrict__ x, CodeSource src, GroupMap32 groups,
                               T* __restrict__ dx, int64_t n) {
  auto unit = [&](uint32_t i0, const RawUnit<T>& g_raw, const RawUnit<T>& x_raw, uint64_t packed) {
    float xs[kUnit], g[kUnit];
    if constexpr (kBits != 0) {
      const MesaGroupParams p = src.params[groups.group(i0)];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) xs[j] = decode(unsigned(packed >> (j * kBits)) & ((1u << kBits) - 1u), p, false);
    } else {
      x_raw.to_floats(xs);
    }
    g_raw.to_floats(g);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) g[j] = g[j] * gelu_derivative<kForm>(xs[j]);
    store_dense_unit(dx + i0, g);
  };
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < nunits; u += 2 * stride) {
    const bool second = u + stride < nunits;
    const uint32_t i0 = u * kUnit, i1 = (u + stride) * kUnit;
    RawUnit<T> ga, gb, xa, xb;
    uint64_t ca = 0u, cb = 0u;
    if constexpr (kBits != 0) {
      ca = load_unit_codes<kBits>(src.codes, i0);
      if (second) cb = load_unit_codes<kBits>(src.codes, i1);
    } else {
      xa.load(x, i0);
      if (second) xb.load(x, i1);
    }
    ga.load(dy, i0);
    if (second) gb.load(dy, i1);
    unit(i0, ga, xa, ca);
    if (second) unit(i1, gb, xb, cb);
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): the dense kernels when the views allow (one dispatch point per
// direction: form, then bits and flags), else the general grid-stride kernels.
inline unsigned grid_for_units(int64_t n) {
  const int64_t want = ceil_div(ceil_div(n, kUnit), kGeluBlock);
  const int64_t cap = int64_t(sm_count()) * 8;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}


// F::template with_form<kForm>()
template <typename F>
MesaStatus dispatch_form(MesaGeluForm form, const F& f) {
  return form == MESA_GELU_TANH ? f.template with_form<MESA_GELU_TANH>() : f.template with_form<MESA_GELU_ERF>();
}

// Codes a dense kernel can write or read: identity map, units of 8 in one group, 32-bit indices.
inline bool dense_codes_ok(const GroupMap& g, bool sqrt_map, int64_t n) {
  return !sqrt_map && g.run % kUnit == 0 && group_map32_ok(g, n);
}

template <typename T>
struct GeluForwardLaunch {
  const MesaGeluForwardArgs& a;
  int64_t n;
  CodeSink sink;
  void* stream;

  // Stochastic rounding takes the general kernel (Philox per element): its dense instances
  // would double this file's compile time.
  template <int kForm>
  MesaStatus with_form() const {
    const bool saving = sink.codes != nullptr || sink.stats != nullptr;
    if (a.y == nullptr || !dense16(a.x, a.x_desc) || !dense16(a.y, a.y_desc) || n >= (int64_t(1) << 31) ||
        (saving && (sink.codes == nullptr || sink.stochastic || !dense_codes_ok(sink.groups, sink.sqrt_map, n))))
      return general(grid_for_units(n), 0, kForm);
    MesaStatus s = MESA_STATUS_OK;
    if (n >= kUnit) {
      const bool stats = sink.stats != nullptr;
      switch (saving ? sink.bits : 0) {
        case 8: s = stats ? dense<kForm, 8, true>() : dense<kForm, 8, false>(); break;
        case 4: s = stats ? dense<kForm, 4, true>() : dense<kForm, 4, false>(); break;
        case 2: s = stats ? dense<kForm, 2, true>() : dense<kForm, 2, false>(); break;
        default: s = dense<kForm, 0, false>();
      }
    }
    if (s != MESA_STATUS_OK || n % kUnit == 0) return s;
    return general(1, n / kUnit, kForm);  // the last partial unit
  }

  template <int kForm, int kBits, bool kStats>
  MesaStatus dense() const {
    const auto kernel = gelu_forward_dense_kernel<T, kForm, kBits, kStats>;
    const DenseQuantize q{kBits != 0 ? group_map32(sink.groups) : GroupMap32{}, sink.params, sink.codes, sink.seed};
    const unsigned grid = resident_grid(kernel, ceil_div(n / kUnit, 2), kGeluBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kGeluBlock), 0, stream, static_cast<const T*>(a.x),
                                   static_cast<T*>(a.y), n, q, sink));
  }

  MesaStatus general(unsigned grid, int64_t first_unit, int form) const {
    return status_from(MESA_LAUNCH((gelu_forward_kernel<T>), dim3(grid), dim3(kGeluBlock), 0, stream,
                                   static_cast<const T*>(a.x), strided_from(a.x_desc), dense16(a.x, a.x_desc),
                                   static_cast<T*>(a.y), strided_from(a.y_desc), dense16(a.y, a.y_desc), n, sink,
                                   form, first_unit));
  }

  static MesaStatus run(const MesaGeluForwardArgs& a, void* stream) {
    const GeluForwardLaunch l{a, numel(a.x_desc), code_sink_from(a.sink), stream};
    return dispatch_form(a.form, l);
  }
};

template <typename T>
struct GeluBackwardLaunch {
  const MesaGeluBackwardArgs& a;
  int64_t n;
  CodeSource src;
  void* stream;

  template <int kForm>
  MesaStatus with_form() const {
    const bool codes = src.codes != nullptr;
    if (!dense16(a.dy, a.dy_desc) || !dense16(a.dx, a.dx_desc) || n >= (int64_t(1) << 31) ||
        !(codes ? dense_codes_ok(src.groups, src.sqrt_map, n) : dense16(a.x, a.x_desc)))
      return general(grid_for_units(n), 0, kForm);
    MesaStatus s = MESA_STATUS_OK;
    if (n >= kUnit) {
      switch (codes ? src.bits : 0) {
        case 8: s = dense<kForm, 8>(); break;
        case 4: s = dense<kForm, 4>(); break;
        case 2: s = dense<kForm, 2>(); break;
        default: s = dense<kForm, 0>();
      }
    }
    if (s != MESA_STATUS_OK || n % kUnit == 0) return s;
    return general(1, n / kUnit, kForm);  // the last partial unit
  }

  template <int kForm, int kBits>
  MesaStatus dense() const {
    const auto kernel = gelu_backward_dense_kernel<T, kForm, kBits>;
    const GroupMap32 groups = kBits != 0 ? group_map32(src.groups) : GroupMap32{};
    const unsigned grid = resident_grid(kernel, ceil_div(n / kUnit, 2), kGeluBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kGeluBlock), 0, stream, static_cast<const T*>(a.dy),
                                   static_cast<const T*>(a.x), src, groups, static_cast<T*>(a.dx), n));
  }

  MesaStatus general(unsigned grid, int64_t first_unit, int form) const {
    const T* dy = static_cast<const T*>(a.dy);
    const T* x = static_cast<const T*>(a.x);
    T* dx = static_cast<T*>(a.dx);
    if (src.codes != nullptr)
      return status_from(MESA_LAUNCH((gelu_backward_kernel<T, true>), dim3(grid), dim3(kGeluBlock), 0, stream, dy,
                                     strided_from(a.dy_desc), dense16(a.dy, a.dy_desc), x, Strided{}, false, src, dx,
                                     strided_from(a.dx_desc), dense16(a.dx, a.dx_desc), n, form, first_unit));
    return status_from(MESA_LAUNCH((gelu_backward_kernel<T, false>), dim3(grid), dim3(kGeluBlock), 0, stream, dy,
                                   strided_from(a.dy_desc), dense16(a.dy, a.dy_desc), x, strided_from(a.x_desc),
                                   dense16(a.x, a.x_desc), src, dx, strided_from(a.dx_desc),
                                   dense16(a.dx, a.dx_desc), n, form, first_unit));
  }

  static MesaStatus run(const MesaGeluBackwardArgs& a, void* stream) {
    const GeluBackwardLaunch l{a, numel(a.dy_desc), code_source_from(a.source), stream};
    return dispatch_form(a.form, l);
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
  return dispatch_dtype<GeluForwardLaunch>(a->x_desc.dtype, *a, stream);
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
  return dispatch_dtype<GeluBackwardLaunch>(a->dy_desc.dtype, *a, stream);
}
