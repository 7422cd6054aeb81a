// swiglu.cu — the SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; the
// MLP of Llama, Mistral, Qwen) fused with activation compression (Mesa §3): the forward writes
// y = silu(g)·u AND the codes of one of its inputs in the same read; the backward decodes the
// codes of g and of u inside the kernel and writes both gradients.
//
// Math (f32):
//   σ(g) = 1/(1 + e^{−g}),  silu(g) = g·σ(g),  y = silu(g)·u
//   dy/du = silu(g),  dy/dg = u·silu'(g),  silu'(g) = σ(g)·(1 + g·σ(−g))
//   σ(g) and σ(−g) from one e = e^{−|g|} ∈ (0, 1] (never overflows): r = 1/(1 + e) is the
//   larger of the two, e·r the smaller; every factor keeps full relative accuracy down to
//   underflow (no 1 − σ cancellation), so silu and silu' are within a few ulp of f64 for all
//   finite g (tests/swiglu.rs: swiglu_tol).
//
// Kernels (n elements of T, b bits):
//   swiglu_forward_kernel   saving g: reads 2n·sizeof(T), writes n·sizeof(T) + n·b/8;
//                           saving u with y = NULL (the second pass): reads n·sizeof(T), writes n·b/8
//   swiglu_backward_kernel  reads n·sizeof(T) (dy) + 2n·b/8 (codes of g and u) [or 2n·sizeof(T)
//                           of plain g, u], writes 2n·sizeof(T)         ~20 FLOP/element
// Units of 8 logical elements, grid-stride, so a unit's code bytes have one writer; dense
// 16-byte aligned views by 16-byte vectors, any other view element by element. Reference:
// crates/mesa-kernels/src/reference/fused.rs (swiglu). Bytes and floors: docs/fused.md.
#include "rows.cuh"

namespace MESA_NS {

constexpr int kSwigluBlock = 256;

// σ(g) and σ(−g) (see the header).
struct Sigmoids {
  float pos;  // σ(g)
  float neg;  // σ(−g)
};
__device__ __forceinline__ Sigmoids sigmoids(float g) {
  const float e = expf(-fabsf(g));
  const float r = reciprocal(1.0f + e);  // 1 + e in [1, 2]: Newton, no division slow path
  const float small = e * r;
  return g >= 0.0f ? Sigmoids{r, small} : Sigmoids{small, r};
}

__device__ __forceinline__ float silu(float g) { return g * sigmoids(g).pos; }

// silu'(g) = σ(g)·(1 + g·σ(−g)), one fmaf, from the sigmoids of g
__device__ __forceinline__ float silu_derivative(float g, Sigmoids s) { return fmaf(__fmul_rn(g, s.neg), s.pos, s.pos); }

// Forward: y = silu(g)·u (y == nullptr: no output), codes of g (kSaveUp false) or of u into
// the sink. Without y and saving u, g is not read.
template <typename T>
__global__ void __launch_bounds__(kSwigluBlock)
    swiglu_forward_kernel(const T* __restrict__ g, Strided gv, bool g_dense, const T* __restrict__ u, Strided uv,
                          bool u_dense, T* __restrict__ y, Strided yv, bool y_dense, int64_t n, CodeSink sink,
                          bool save_up) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  const bool with_stats = sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const bool need_g = y != nullptr || !save_up;
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t unit = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; unit < nunits; unit += step) {
    const int64_t i0 = unit * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    float gs[kUnit], us[kUnit];
    if (need_g) load_view_unit(g, gv, g_dense, i0, live, gs);
    load_view_unit(u, uv, u_dense, i0, live, us);
    if (y != nullptr) {
      float out[kUnit];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) out[j] = silu(gs[j]) * us[j];
      store_view_unit(y, yv, y_dense, i0, live, out);
    }
    if (sink.codes != nullptr || with_stats) {
      // the saved input, copied by value: a reference chosen at run time would put both
      // arrays in local memory
      float saved[kUnit];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) saved[j] = save_up ? us[j] : gs[j];
      sink_unit(sink, i0, saved, live, run, stats.target());
    }
  }
  if (with_stats) {
    flush(run, stats.target());
    stats.end();
  }
}

// Backward: dg = dy·u·silu'(g), du = dy·silu(g), with g and u decoded from codes (kCodes) or
// read from plain tensors.
// (at most 64 registers: with more, sm_90's allocator spilled one value of the two decodes'
// 64-bit group divisions to the stack)
template <typename T, bool kCodes>
__global__ void __launch_bounds__(kSwigluBlock, 4)
    swiglu_backward_kernel(const T* __restrict__ dy, Strided dyv, bool dy_dense, const T* __restrict__ g, Strided gv,
                           bool g_dense, CodeSource g_src, const T* __restrict__ u, Strided uv, bool u_dense,
                           CodeSource u_src, T* __restrict__ dg, Strided dgv, bool dg_dense, T* __restrict__ du,
                           Strided duv, bool du_dense, int64_t n, int64_t first_unit) {
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t unit = first_unit + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; unit < nunits; unit += step) {
    const int64_t i0 = unit * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    // g and dy first: du is stored before u is decoded, so fewer values stay live across
    // the second decode's calls (the 64-bit group division)
    float gs[kUnit], d[kUnit];
    if (kCodes) {
      source_unit(g_src, i0, live, gs);
    } else {
      load_view_unit(g, gv, g_dense, i0, live, gs);
    }
    load_view_unit(dy, dyv, dy_dense, i0, live, d);
    float dus[kUnit], ds[kUnit];  // ds: dy·silu'(g)
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      const Sigmoids s = sigmoids(gs[j]);
      dus[j] = d[j] * (gs[j] * s.pos);
      ds[j] = d[j] * silu_derivative(gs[j], s);
    }
    store_view_unit(du, duv, du_dense, i0, live, dus);
    float us[kUnit];
    if (kCodes) {
      source_unit(u_src, i0, live, us);
    } else {
      load_view_unit(u, uv, u_dense, i0, live, us);
    }
#pragma unroll
    for (int j = 0; j < kUnit; ++j) ds[j] = ds[j] * us[j];
    store_view_unit(dg, dgv, dg_dense, i0, live, ds);
  }
}

// Dense backward: dy, dg, du dense and 16-byte aligned, n < 2^31, the codes of g and u of one
// width kBits with the identity map and units of 8 in one group (the conditions of
// gelu_backward_dense_kernel), the groups by 32-bit fast division. The same arithmetic as the
// general kernel, element for element. Whole units only: the last partial unit is the
// general kernel's (first_unit).
template <typename T, int kBits>
__global__ void __launch_bounds__(kSwigluBlock)
    swiglu_backward_dense_kernel(const T* __restrict__ dy, CodeSource g_src, GroupMap32 g_groups, CodeSource u_src,
                                 GroupMap32 u_groups, T* __restrict__ dg, T* __restrict__ du, int64_t n) {
  constexpr unsigned kMask = (1u << kBits) - 1u;
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t unit = blockIdx.x * blockDim.x + threadIdx.x; unit < nunits; unit += stride) {
    const uint32_t i0 = unit * kUnit;
    const uint64_t gc = load_unit_codes<kBits>(g_src.codes, i0);
    const uint64_t uc = load_unit_codes<kBits>(u_src.codes, i0);
    RawUnit<T> d_raw;
    d_raw.load(dy, i0);
    const MesaGroupParams gp = g_src.params[g_groups.group(i0)];
    const MesaGroupParams up = u_src.params[u_groups.group(i0)];
    float d[kUnit], dgs[kUnit], dus[kUnit];
    d_raw.to_floats(d);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      const float g = decode(unsigned(gc >> (j * kBits)) & kMask, gp, false);
      const float u = decode(unsigned(uc >> (j * kBits)) & kMask, up, false);
      const Sigmoids s = sigmoids(g);
      dus[j] = d[j] * (g * s.pos);
      dgs[j] = (d[j] * silu_derivative(g, s)) * u;
    }
    store_dense_unit(du + i0, dus);
    store_dense_unit(dg + i0, dgs);
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): one grid-stride launch of a few waves.
inline unsigned swiglu_grid(int64_t n) {
  const int64_t want = ceil_div(ceil_div(n, kUnit), kSwigluBlock);
  const int64_t cap = int64_t(sm_count()) * 8;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}

template <typename T>
struct SwigluForwardLaunch {
  static MesaStatus run(const MesaSwigluForwardArgs& a, void* stream) {
    const int64_t n = numel(a.u_desc);
    const bool need_g = a.y != nullptr || a.saved == MESA_SWIGLU_SAVE_GATE;
    return status_from(MESA_LAUNCH(
        (swiglu_forward_kernel<T>), dim3(swiglu_grid(n)), dim3(kSwigluBlock), 0, stream, static_cast<const T*>(a.g),
        need_g ? strided_from(a.g_desc) : Strided{}, need_g && dense16(a.g, a.g_desc), static_cast<const T*>(a.u),
        strided_from(a.u_desc), dense16(a.u, a.u_desc), static_cast<T*>(a.y),
        a.y != nullptr ? strided_from(a.y_desc) : Strided{}, a.y != nullptr && dense16(a.y, a.y_desc), n,
        code_sink_from(a.sink), a.saved == MESA_SWIGLU_SAVE_UP));
  }
};

// Codes a dense kernel can read: identity map, units of 8 in one group, 32-bit indices.
inline bool swiglu_dense_codes(const CodeSource& s, int64_t n) {
  return !s.sqrt_map && s.groups.run % kUnit == 0 && group_map32_ok(s.groups, n);
}

template <typename T>
struct SwigluBackwardLaunch {
  template <int kBits>
  static MesaStatus dense(const MesaSwigluBackwardArgs& a, const CodeSource& gs, const CodeSource& us, int64_t n,
                          void* stream) {
    const auto kernel = swiglu_backward_dense_kernel<T, kBits>;
    const unsigned grid = resident_grid(kernel, n / kUnit, kSwigluBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kSwigluBlock), 0, stream, static_cast<const T*>(a.dy), gs,
                                   group_map32(gs.groups), us, group_map32(us.groups), static_cast<T*>(a.dg),
                                   static_cast<T*>(a.du), n));
  }

  static MesaStatus run(const MesaSwigluBackwardArgs& a, void* stream) {
    const int64_t n = numel(a.dy_desc);
    if (a.gate_source.codes != nullptr && n >= kUnit) {
      const CodeSource gs = code_source_from(a.gate_source), us = code_source_from(a.up_source);
      if (dense16(a.dy, a.dy_desc) && dense16(a.dg, a.dg_desc) && dense16(a.du, a.du_desc) &&
          n < (int64_t(1) << 31) && gs.bits == us.bits && swiglu_dense_codes(gs, n) && swiglu_dense_codes(us, n)) {
        MesaStatus s = MESA_STATUS_OK;
        switch (gs.bits) {
          case 8: s = dense<8>(a, gs, us, n, stream); break;
          case 4: s = dense<4>(a, gs, us, n, stream); break;
          default: s = dense<2>(a, gs, us, n, stream); break;
        }
        if (s != MESA_STATUS_OK || n % kUnit == 0) return s;
        return general(a, stream, 1, n / kUnit);  // the last partial unit
      }
    }
    return general(a, stream, swiglu_grid(n), 0);
  }

  static MesaStatus general(const MesaSwigluBackwardArgs& a, void* stream, unsigned grid, int64_t first_unit) {
    const int64_t n = numel(a.dy_desc);
    const T* dy = static_cast<const T*>(a.dy);
    T* dg = static_cast<T*>(a.dg);
    T* du = static_cast<T*>(a.du);
    const Strided dyv = strided_from(a.dy_desc), dgv = strided_from(a.dg_desc), duv = strided_from(a.du_desc);
    const bool dyd = dense16(a.dy, a.dy_desc), dgd = dense16(a.dg, a.dg_desc), dud = dense16(a.du, a.du_desc);
    if (a.gate_source.codes != nullptr)
      return status_from(MESA_LAUNCH((swiglu_backward_kernel<T, true>), dim3(grid), dim3(kSwigluBlock), 0, stream, dy,
                                     dyv, dyd, static_cast<const T*>(nullptr), Strided{}, false,
                                     code_source_from(a.gate_source), static_cast<const T*>(nullptr), Strided{},
                                     false, code_source_from(a.up_source), dg, dgv, dgd, du, duv, dud, n, first_unit));
    return status_from(MESA_LAUNCH((swiglu_backward_kernel<T, false>), dim3(grid), dim3(kSwigluBlock), 0, stream, dy,
                                   dyv, dyd, static_cast<const T*>(a.g), strided_from(a.g_desc),
                                   dense16(a.g, a.g_desc), CodeSource{}, static_cast<const T*>(a.u),
                                   strided_from(a.u_desc), dense16(a.u, a.u_desc), CodeSource{}, dg, dgv, dgd, du, duv,
                                   dud, n, first_unit));
  }
};

// Same element count and dtype.
inline bool same_elems(const MesaTensorDesc& a, const MesaTensorDesc& b) {
  return numel(a) == numel(b) && a.dtype == b.dtype;
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(swiglu_forward)(const MesaSwigluForwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->u_desc) || !code_sink_valid(a->sink)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->saved != MESA_SWIGLU_SAVE_GATE && a->saved != MESA_SWIGLU_SAVE_UP) return MESA_STATUS_INVALID_ARGUMENT;
  const bool need_g = a->y != nullptr || a->saved == MESA_SWIGLU_SAVE_GATE;
  if (need_g && (!desc_valid(a->g_desc) || !same_elems(a->g_desc, a->u_desc))) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->y != nullptr && (!desc_valid(a->y_desc) || !same_elems(a->y_desc, a->u_desc)))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->u_desc) == 0) return MESA_STATUS_OK;
  if (a->u == nullptr || (need_g && a->g == nullptr)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->y == nullptr && a->sink.codes == nullptr && a->sink.stats == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<SwigluForwardLaunch>(a->u_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(swiglu_backward)(const MesaSwigluBackwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->dy_desc) || !desc_valid(a->dg_desc) || !desc_valid(a->du_desc) ||
      !code_source_valid(a->gate_source) || !code_source_valid(a->up_source))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (!same_elems(a->dy_desc, a->dg_desc) || !same_elems(a->dy_desc, a->du_desc)) return MESA_STATUS_INVALID_ARGUMENT;
  const bool codes = a->gate_source.codes != nullptr;
  if (codes != (a->up_source.codes != nullptr)) return MESA_STATUS_INVALID_ARGUMENT;  // both saved, or neither
  if (!codes && (!desc_valid(a->g_desc) || !desc_valid(a->u_desc) || !same_elems(a->g_desc, a->dy_desc) ||
                 !same_elems(a->u_desc, a->dy_desc)))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->dy_desc) == 0) return MESA_STATUS_OK;
  if (a->dy == nullptr || a->dg == nullptr || a->du == nullptr || (!codes && (a->g == nullptr || a->u == nullptr)))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<SwigluBackwardLaunch>(a->dy_desc.dtype, *a, stream);
}
