// quantize.cu — activation compression (Mesa, Pan et al. 2021, §3.2-3.3), quantize-on-save
// and per-group dequantize.
//
// Math (per group g, levels L = 2^bits - 1, all f32):
//   scale_g  = range_g / L                      (range = max - min)
//   t        = (x - offset_g) * inv_scale_g     (inv_scale = 1/scale, 0 for a constant group)
//   nearest:    code = clamp(rint(t), 0, L)     (round half to even)
//   stochastic: code = clamp(floor(t) + (u < t - floor(t)), 0, L),  u = Philox4x32-10(seed, i) in [0,1)
//               (= floor(t + u) without rounding t + u: see encode() in quant_common.cuh)
//   decode:     x^ = fmaf(code, scale_g, offset_g)
//   companded (MESA_CODE_MAP_SQRT, fixed parameters, no statistics): the same with x replaced
//   by sqrtf(x), and decode q = fmaf(code, scale_g, offset_g), x^ = q * q (__fmul_rn)
// A constant group (range 0) encodes to 0 and decodes to offset exactly. Values outside the
// group's range clamp to 0 or L (never wrap). Non-finite inputs are counted per group and
// poison that group's saved scale (NaN) so that it never decodes to finite numbers.
//
// Kernels (bytes moved per element, n elements of a T input, b bits):
//   quant_stats_kernel      reads sizeof(T)                        per-group min/max/nonfinite
//   quantize_kernel         reads sizeof(T), writes b/8 (+ optional stats in the same pass)
//   quant_finalize_kernel   per group: O(groups), one block
//   dequantize_kernel       reads b/8, writes sizeof(T)
// Each has a dense path (16-byte vector loads/stores, grid-stride) and a strided path (any
// strides, 8 logical elements per step so that packed code bytes have one writer).
// Reference: crates/mesa-kernels/src/reference/quant.rs.  Floor on an H200: docs/kernels.md.
#include "quant_common.cuh"

namespace MESA_NS {

constexpr int kBlock = 256;
// ---------------------------------------------------------------------------------------
// Statistics pass (exact mode).
template <typename T, bool kDense>
__global__ void __launch_bounds__(kBlock) quant_stats_kernel(const T* __restrict__ x, Strided view, int64_t n,
                                                             GroupMap groups, MesaGroupStats* stats) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  StatsSink sink{stats, groups.count <= kSharedGroups ? staged : nullptr, groups.count};
  sink.begin();
  RunStats run;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (kDense) {
    constexpr int N = Vec16<T>::N;
    const int64_t nvec = n / N;
    const bool vec_in_one_group = groups.run % N == 0;
    for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec; v += stride) {
      const Vec16<T> in = load16(x + v * N);
      const int64_t g0 = groups.group(v * N);
#pragma unroll
      for (int j = 0; j < N; ++j)
        accumulate(run, vec_in_one_group ? g0 : groups.group(v * N + j), to_float(in.v[j]), sink.target());
    }
    // tail: fewer than N elements, one thread
    if (blockIdx.x == 0 && threadIdx.x == 0)
      for (int64_t i = nvec * N; i < n; ++i) accumulate(run, groups.group(i), to_float(x[i]), sink.target());
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
      accumulate(run, groups.group(i), to_float(x[view.offset(i)]), sink.target());
  }
  flush(run, sink.target());
  sink.end();
}

// ---------------------------------------------------------------------------------------
// Quantize pass, optionally reducing the batch statistics in the same read of x.
struct QuantizeConfig {
  GroupMap groups;
  const MesaGroupParams* params;
  uint8_t* codes;
  uint64_t seed;
  int bits;
  bool stochastic;
  bool sqrt_map;  // companded codes of sqrt(x) (MESA_CODE_MAP_SQRT; no statistics then)
};

template <typename T, bool kDense>
__global__ void __launch_bounds__(kBlock) quantize_kernel(const T* __restrict__ x, Strided view, int64_t n,
                                                          QuantizeConfig cfg, MesaGroupStats* stats) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  const bool with_stats = stats != nullptr;
  StatsSink sink{stats, cfg.groups.count <= kSharedGroups ? staged : nullptr, cfg.groups.count};
  if (with_stats) sink.begin();
  RunStats run;
  const float levels = float((1u << cfg.bits) - 1u);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  // Both paths handle 8 logical elements per step (two 16-byte loads of f32, one of 16-bit
  // types), so a step's codes are whole bytes at every width: 8 * bits / 8 = bits bytes.
  constexpr int N = kUnit;
  const int64_t nunits = kDense ? n / N : ceil_div(n, N);
  const bool unit_in_one_group = cfg.groups.run % N == 0;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += stride) {
    const int64_t i0 = u * N;
    float xs[N];
    if (kDense) {
      constexpr int V = Vec16<T>::N;
#pragma unroll
      for (int h = 0; h < N / V; ++h) {
        const Vec16<T> in = load16(x + i0 + h * V);
#pragma unroll
        for (int j = 0; j < V; ++j) xs[h * V + j] = to_float(in.v[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) xs[j] = i0 + j < n ? to_float(x[view.offset(i0 + j)]) : 0.0f;
    }
    float us[N];
    if (cfg.stochastic) {
      const Philox4 a = philox4x32_10(uint64_t(i0) / 4, cfg.seed);
      const Philox4 b = philox4x32_10(uint64_t(i0) / 4 + 1, cfg.seed);
      us[0] = uniform01(a.x); us[1] = uniform01(a.y); us[2] = uniform01(a.z); us[3] = uniform01(a.w);
      us[4] = uniform01(b.x); us[5] = uniform01(b.y); us[6] = uniform01(b.z); us[7] = uniform01(b.w);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) us[j] = 0.0f;
    }
    unsigned codes[N];
    const int64_t g0 = cfg.groups.group(i0);
    const CodeParams p0 = code_params(cfg.params[g0]);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const bool live = kDense || i0 + j < n;
      const int64_t g = unit_in_one_group ? g0 : cfg.groups.group(i0 + j);
      const CodeParams p = unit_in_one_group ? p0 : code_params(cfg.params[live ? g : g0]);
      codes[j] = live ? encode(code_domain(xs[j], cfg.sqrt_map), p, levels, cfg.stochastic, us[j]) : 0u;
      if (with_stats && live) accumulate(run, g, xs[j], sink.target());
    }
    if (kDense || i0 + N <= n) {
      store_codes<N>(cfg.codes + i0 * cfg.bits / 8, codes, cfg.bits);
    } else {
      // the strided path's last, partial unit: only the bytes its codes fill (a whole unit
      // would write up to `bits` bytes past the end of the codes)
      uint64_t packed = 0;
#pragma unroll
      for (int j = 0; j < N; ++j) packed |= uint64_t(codes[j]) << (j * cfg.bits);
      const int64_t nbytes = ceil_div((n - i0) * cfg.bits, 8);
      for (int64_t b = 0; b < nbytes; ++b) cfg.codes[i0 * cfg.bits / 8 + b] = uint8_t(packed >> (8 * b));
    }
  }
  if (kDense && blockIdx.x == 0 && threadIdx.x == 0 && nunits * N < n) {
    // tail of fewer than 8 elements: one thread, one (partial) code unit
    const int64_t i0 = nunits * N;
    unsigned codes[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t i = i0 + j;
      codes[j] = 0u;
      if (i >= n) continue;
      const float xv = to_float(x[i]);
      // the same u as the vector path: word i % 4 of Philox(i / 4) (no local array: selected)
      const float u = cfg.stochastic ? element_uniform(cfg.seed, i) : 0.0f;
      const int64_t g = cfg.groups.group(i);
      codes[j] = encode(code_domain(xv, cfg.sqrt_map), code_params(cfg.params[g]), levels, cfg.stochastic, u);
      if (with_stats) accumulate(run, g, xv, sink.target());
    }
    const int64_t nbytes = ceil_div((n - i0) * cfg.bits, 8);
    uint64_t packed = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) packed |= uint64_t(codes[j]) << (j * cfg.bits);
    for (int64_t b = 0; b < nbytes; ++b) cfg.codes[i0 * cfg.bits / 8 + b] = uint8_t(packed >> (8 * b));
  }
  if (with_stats) {
    flush(run, sink.target());
    sink.end();
  }
}

// ---------------------------------------------------------------------------------------
// Finalize: per-group params and running estimate from the batch statistics. One block;
// the groups are few (heads, channel groups) next to the elements.
__global__ void __launch_bounds__(kBlock) quant_finalize_kernel(MesaQuantFinalizeArgs a) {
  const float levels = float((1u << a.bits) - 1u);
  const float m = a.momentum;
  unsigned nonfinite = 0u;
  for (int64_t g = threadIdx.x; g < a.count; g += blockDim.x) {
    const MesaGroupStats s = a.stats[g];
    const bool any_finite = s.min_key != 0xffffffffu;
    MesaGroupParams batch{0.0f, 0.0f};
    if (any_finite) {
      const float lo = key_float(s.min_key);
      const float hi = key_float(s.max_key);
      batch.offset = lo;
      // In f64: hi - lo may exceed FLT_MAX (the quotient never does). Rounded UP to f32, so
      // that the whole range fits in the codes even when the step is a handful of subnormal
      // ulps (range < levels * 2^-149 gets the smallest subnormal step, not 0). IEEE f64
      // arithmetic and one conversion: identical on both builds.
      const double step = (double(hi) - double(lo)) / double(levels);
      float scale = float(step);
      if (double(scale) < step) scale = __uint_as_float(__float_as_uint(scale) + 1u);
      batch.scale = scale;
    }
    MesaGroupParams used;
    MesaGroupParams next = a.running[g];
    if (a.mode == MESA_FINALIZE_EXACT) {
      used = batch;
      if (!a.running_initialized) {
        next = batch;
      }
    } else {
      used = a.running[g];
    }
    if (any_finite && (a.running_initialized || a.mode == MESA_FINALIZE_RUNNING)) {
      next.offset = fmaf(m, next.offset, (1.0f - m) * batch.offset);
      next.scale = fmaf(m, next.scale, (1.0f - m) * batch.scale);
    }
    if (s.nonfinite != 0u) used.scale = __uint_as_float(0x7fc00000u);  // NaN: never decode finite
    a.params[g] = used;
    a.running[g] = next;
    a.stats[g] = MesaGroupStats{0xffffffffu, 0u, 0u, 0u};
    nonfinite += s.nonfinite;
  }
  if (a.nonfinite_total != nullptr) {
    __shared__ unsigned partial[kBlock / kWarpSize];
    for (int o = kWarpSize / 2; o > 0; o /= 2) nonfinite += __shfl_xor_sync(0xffffffffu, nonfinite, o);
    if (threadIdx.x % kWarpSize == 0) partial[threadIdx.x / kWarpSize] = nonfinite;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned total = 0u;
      for (int w = 0; w < kBlock / kWarpSize; ++w) total += partial[w];
      *a.nonfinite_total = total;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dequantize into any strided destination.
template <typename T, bool kDense>
__global__ void __launch_bounds__(kBlock) dequantize_kernel(const uint8_t* __restrict__ codes,
                                                            const MesaGroupParams* __restrict__ params,
                                                            GroupMap groups, int bits, bool sqrt_map,
                                                            T* __restrict__ y, Strided view, int64_t n) {
  constexpr int N = kUnit;
  const unsigned mask = (1u << bits) - 1u;
  const int64_t nunits = ceil_div(n, N);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool unit_in_one_group = groups.run % N == 0;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += stride) {
    const int64_t i0 = u * N;
    const uint8_t* src = codes + i0 * bits / 8;
    const bool full = i0 + N <= n;
    uint64_t packed = 0;
    if (full && bits == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(src);
      packed = uint64_t(w.x) | (uint64_t(w.y) << 32);
    } else if (full && bits == 4) {
      packed = *reinterpret_cast<const unsigned*>(src);
    } else {
      const int64_t nbytes = ceil_div((full ? N : n - i0) * bits, 8);
      for (int64_t b = 0; b < nbytes; ++b) packed |= uint64_t(src[b]) << (8 * b);
    }
    const MesaGroupParams p0 = params[groups.group(i0)];
    float out[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const unsigned c = unsigned(packed >> (j * bits)) & mask;
      const MesaGroupParams p =
          (unit_in_one_group || i0 + j >= n) ? p0 : params[groups.group(i0 + j)];
      out[j] = decode(c, p, sqrt_map);
    }
    if (kDense && full) {
      constexpr int V = Vec16<T>::N;
#pragma unroll
      for (int h = 0; h < N / V; ++h) {
        Vec16<T> o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(out[h * V + j]);
        store16(y + i0 + h * V, o);
      }
    } else {
      for (int j = 0; j < N && i0 + j < n; ++j) y[kDense ? i0 + j : view.offset(i0 + j)] = from_float<T>(out[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
// Grid-stride grid: enough blocks to fill the machine, no more. 8 blocks of 256 threads per
// SM is the most an SM can hold (2048 threads); with one 16-byte load in flight per thread
// that is ~32 KB per SM, above the ~20 KB Little's law asks for at 4.3 TB/s and ~600 ns.
inline unsigned grid_for(int64_t work_items) {
  const int64_t want = ceil_div(work_items, kBlock);
  const int64_t cap = int64_t(sm_count()) * 8;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}

template <typename T>
MesaStatus launch_stats(const MesaQuantStatsArgs& a, void* stream) {
  const int64_t n = numel(a.x_desc);
  const GroupMap gm = group_map(a.grouping, a.x_desc);
  const T* x = static_cast<const T*>(a.x);
  const Strided view = strided_from(a.x_desc);
  if (vector_ok(a.x, a.x_desc))
    return status_from(MESA_LAUNCH((quant_stats_kernel<T, true>), dim3(grid_for(n / Vec16<T>::N + 1)), dim3(kBlock),
                                   0, stream, x, view, n, gm, a.stats));
  return status_from(MESA_LAUNCH((quant_stats_kernel<T, false>), dim3(grid_for(n)), dim3(kBlock), 0, stream, x, view,
                                 n, gm, a.stats));
}

template <typename T>
MesaStatus launch_quantize(const MesaQuantizeArgs& a, void* stream) {
  const int64_t n = numel(a.x_desc);
  const QuantizeConfig cfg{group_map(a.grouping, a.x_desc), a.params, a.codes, a.seed, a.bits,
                           a.rounding == MESA_ROUND_STOCHASTIC, a.map == MESA_CODE_MAP_SQRT};
  const T* x = static_cast<const T*>(a.x);
  const Strided view = strided_from(a.x_desc);
  const unsigned grid = grid_for(ceil_div(n, kUnit));
  if (vector_ok(a.x, a.x_desc))
    return status_from(
        MESA_LAUNCH((quantize_kernel<T, true>), dim3(grid), dim3(kBlock), 0, stream, x, view, n, cfg, a.stats));
  return status_from(
      MESA_LAUNCH((quantize_kernel<T, false>), dim3(grid), dim3(kBlock), 0, stream, x, view, n, cfg, a.stats));
}

template <typename T>
MesaStatus launch_dequantize(const MesaDequantizeArgs& a, void* stream) {
  const int64_t n = numel(a.y_desc);
  const GroupMap gm = group_map(a.grouping, a.y_desc);
  T* y = static_cast<T*>(a.y);
  const Strided view = strided_from(a.y_desc);
  const unsigned grid = grid_for(ceil_div(n, kUnit));
  const bool sqrt_map = a.map == MESA_CODE_MAP_SQRT;
  if (vector_ok(a.y, a.y_desc))
    return status_from(MESA_LAUNCH((dequantize_kernel<T, true>), dim3(grid), dim3(kBlock), 0, stream, a.codes,
                                   a.params, gm, a.bits, sqrt_map, y, view, n));
  return status_from(MESA_LAUNCH((dequantize_kernel<T, false>), dim3(grid), dim3(kBlock), 0, stream, a.codes,
                                 a.params, gm, a.bits, sqrt_map, y, view, n));
}

template <typename T> struct StatsOp { static MesaStatus run(const MesaQuantStatsArgs& a, void* s) { return launch_stats<T>(a, s); } };
template <typename T> struct QuantizeOp { static MesaStatus run(const MesaQuantizeArgs& a, void* s) { return launch_quantize<T>(a, s); } };
template <typename T> struct DequantizeOp { static MesaStatus run(const MesaDequantizeArgs& a, void* s) { return launch_dequantize<T>(a, s); } };

}  // namespace MESA_NS

using namespace MESA_NS;

// ---------------------------------------------------------------------------------------
// C entry points. They re-check what would make a kernel touch memory it should not
// (the safe crate checks everything first and gives better messages).
extern "C" MesaStatus MESA_ENTRY(quant_stats)(const MesaQuantStatsArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || !grouping_valid(a->grouping, a->x_desc)) return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->stats == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<StatsOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(quantize)(const MesaQuantizeArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || !grouping_valid(a->grouping, a->x_desc) || !bits_valid(a->bits))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->rounding != MESA_ROUND_NEAREST && a->rounding != MESA_ROUND_STOCHASTIC) return MESA_STATUS_INVALID_ARGUMENT;
  // statistics are of x itself: companded codes take fixed parameters
  if (!code_map_valid(a->map) || (a->map != MESA_CODE_MAP_IDENTITY && a->stats != nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->params == nullptr || a->codes == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<QuantizeOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(quant_finalize)(const MesaQuantFinalizeArgs* a, void* stream) {
  if (a == nullptr || a->count < 0 || !bits_valid(a->bits)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->mode != MESA_FINALIZE_EXACT && a->mode != MESA_FINALIZE_RUNNING) return MESA_STATUS_INVALID_ARGUMENT;
  if (!(a->momentum >= 0.0f && a->momentum <= 1.0f)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->count > 0 && (a->stats == nullptr || a->running == nullptr || a->params == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return status_from(MESA_LAUNCH(quant_finalize_kernel, dim3(1), dim3(kBlock), 0, stream, *a));
}

extern "C" MesaStatus MESA_ENTRY(dequantize)(const MesaDequantizeArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->y_desc) || !grouping_valid(a->grouping, a->y_desc) || !bits_valid(a->bits) ||
      !code_map_valid(a->map))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->y_desc) == 0) return MESA_STATUS_OK;
  if (a->y == nullptr || a->params == nullptr || a->codes == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<DequantizeOp>(a->y_desc.dtype, *a, stream);
}
