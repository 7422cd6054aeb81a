// quantize.cu — activation compression (Mesa, Pan et al. 2021, §3.2-3.3), quantize-on-save
// and per-group dequantize.
//
// Math (per group g, levels L = 2^bits - 1, all f32):
//   scale_g  = range_g / L                      (range = max - min)
//   t        = (x - offset_g) * inv_scale_g     (inv_scale = 1/scale, 0 for a constant group)
//   nearest:    code = clamp(rint(t), 0, L)     (round half to even)
//   stochastic: code = (min(rint(t * 2^16), L * 2^16) + u) >> 16 in unsigned integers (negative t: 0),
//               u = 16 bits of Philox4x32-7(key, i / 8) for element i: floor(t' + u / 2^16) for t
//               on the 2^-16 grid (stochastic_code in quant_common.cuh; docs/kernels.md)
//   decode:     x^ = fmaf(code, scale_g, offset_g)
//   companded (MESA_CODE_MAP_SQRT, fixed parameters, no statistics): the same with x replaced
//   by sqrtf(x), and decode q = fmaf(code, scale_g, offset_g), x^ = q * q (__fmul_rn)
// A constant group (range 0) encodes to 0 and decodes to offset exactly. Values outside the
// group's range clamp to 0 or L (never wrap). Non-finite inputs are counted per group and
// poison that group's saved scale (NaN) so that it never decodes to finite numbers.
//
// Running estimate with a bounded error (one pass + the widening pass): batch k is encoded
// with the estimate {o, s} of batches < k while the same pass reduces its min/max; then
// quant_finalize flags each group whose batch escaped by more than one step,
//   min < o - s  or  max > o + (L + 1) s          (f64, escaped_estimate in quant_common.cuh)
// and saves for it the batch's exact range {min, (max - min) / L} instead; the widening pass
// (quantize_kernel<T, kDense, kWiden = true>) encodes those groups again with it. So every
// finite element of a group with finite input decodes within one step of the scale saved
// for its group: |x - x^| <= s for an unflagged group (inside the range s/2 nearest, < s
// stochastic; clamped only within the one-step band), <= s'/2 (nearest) or < s'
// (stochastic) for a widened one, plus the f32 rounding of t and of the decode. The EMA
// update uses the batch's statistics, never the widened params.
//
// Kernels (bytes moved per element, n elements of a T input, b bits):
//   quant_stats_kernel      reads sizeof(T)                        per-group min/max/nonfinite
//   quantize_kernel         reads sizeof(T), writes b/8 (+ optional stats in the same pass)
//   quant_finalize_kernel   per group: O(groups), one block; RUNNING mode also writes the
//                           widen flags (4 B per group + a 4-byte count). With a
//                           MesaFusedFinalize, the same work runs in the last block of the
//                           statistics or quantize pass instead (finalize_if_last)
//   quantize_kernel<.., kWiden>  the widening pass, for the elements of the k widened groups
//                           out of G: reads sizeof(T), writes b/8 (worst case k = G: the bytes of
//                           a quantize pass; steady state k = 0: one 4-byte count per thread,
//                           nothing else); every unit also reads its groups' flags (L1/L2)
//   dequantize_kernel       reads b/8, writes sizeof(T)
// Each has a dense path (16-byte vector loads/stores, grid-stride) and a strided path (any
// strides, 8 logical elements per step so that packed code bytes have one writer). The dense
// fast kernels (quant_stats_dense_kernel, quantize_dense_kernel, dequantize_dense_kernel) move
// the same bytes with what a call fixes as template arguments (bits, rounding, statistics, code
// map), 32-bit fast division for groups and two units in flight per thread; they take every
// dense tensor below 2^31 elements whose units of 8 each lie in one group. Instructions per
// element of their hot loops against the issue budget: docs/kernels.md.
// Reference: crates/mesa-kernels/src/reference/quant.rs.  Floor on an H200: docs/kernels.md.
#include "quant_common.cuh"

namespace MESA_NS {

constexpr int kBlock = 256;
// ---------------------------------------------------------------------------------------
// Finalize: per-group params and running estimate from the batch statistics, by one block
// (the groups are few next to the elements): the quant_finalize_kernel launch, or the last
// block of a statistics pass (finalize_if_last). `scratch`: kFinalizeScratch words of shared
// memory. Out of line: one copy for the ~40 kernels that may call it.
constexpr int kFinalizeScratch = kBlock / kWarpSize + 2;
__device__ __forceinline__ void finalize_batch(const MesaQuantFinalizeArgs& a, unsigned* scratch) {
  const float levels = float((1u << a.bits) - 1u);
  const float m = a.momentum;
  unsigned nonfinite = 0u;
  unsigned& widened = scratch[0];  // groups that escaped the estimate (RUNNING mode)
  unsigned* partial = scratch + 1;  // [kBlock / kWarpSize]
  if (threadIdx.x == 0) widened = 0u;
  __syncthreads();
  for (int64_t g = threadIdx.x; g < a.count; g += blockDim.x) {
    // other blocks' atomics wrote the statistics: read them from L2 (ld.cg), not from L1
    const MesaGroupStats s{__ldcg(&a.stats[g].min_key), __ldcg(&a.stats[g].max_key), __ldcg(&a.stats[g].nonfinite), 0u};
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
      // the estimate the one pass used, unless this batch left it by more than one step:
      // then the batch's exact range, and the widening pass encodes the group again
      used = a.running[g];
      const bool widen = any_finite && s.nonfinite == 0u &&
                         escaped_estimate(used, key_float(s.min_key), key_float(s.max_key), levels);
      if (widen) {
        used = batch;
        atomicAdd(&widened, 1u);
      }
      if (a.widen != nullptr) a.widen[g] = widen ? 1u : 0u;
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
  __syncthreads();
  if (a.mode == MESA_FINALIZE_RUNNING && a.widen != nullptr && threadIdx.x == 0) a.widen[a.count] = widened;
  if (a.nonfinite_total != nullptr) {
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

__global__ void __launch_bounds__(kBlock) quant_finalize_kernel(MesaQuantFinalizeArgs a) {
  __shared__ unsigned scratch[kFinalizeScratch];
  finalize_batch(a, scratch);
}

// The fused finalize of a statistics pass (MesaFusedFinalize): every thread of every block
// calls it after its block's statistics are in global memory (StatsSink::end or flush). The
// block fences its atomics, counts itself once, and the last block to arrive finalizes —
// the threadFenceReduction pattern of the CUDA samples; atomicInc wraps the counter back to
// 0 for the next launch.
__device__ __forceinline__ void finalize_if_last(const MesaFusedFinalize& f, unsigned* scratch) {
  if (f.arrivals == nullptr) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) scratch[kFinalizeScratch - 1] = atomicInc(f.arrivals, gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  if (scratch[kFinalizeScratch - 1] == 0u) return;
  __threadfence();
  finalize_batch(f.args, scratch);
}

// ---------------------------------------------------------------------------------------
// Statistics pass (exact mode).
template <typename T, bool kDense>
__global__ void __launch_bounds__(kBlock) quant_stats_kernel(const T* __restrict__ x, Strided view, int64_t n,
                                                             GroupMap groups, MesaGroupStats* stats,
                                                             MesaFusedFinalize fin) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  __shared__ unsigned fin_scratch[kFinalizeScratch];
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
  finalize_if_last(fin, fin_scratch);
}

// Dense fast path of the statistics pass: x dense and 16-byte aligned, n < 2^31, units of 8
// in one group; two units in flight per thread, the group by 32-bit fast division and the
// unit reduced by accumulate_unit. The tail (n % 8) by one thread, element by element.
template <typename T>
__global__ void __launch_bounds__(kBlock) quant_stats_dense_kernel(const T* __restrict__ x, int64_t n,
                                                                   GroupMap32 groups, GroupMap groups64,
                                                                   MesaGroupStats* stats, MesaFusedFinalize fin) {
  __shared__ MesaGroupStats staged[kSharedGroups];
  __shared__ unsigned fin_scratch[kFinalizeScratch];
  StatsSink sink{stats, groups64.count <= kSharedGroups ? staged : nullptr, groups64.count};
  sink.begin();
  RunStats run;
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  auto unit = [&](uint32_t i0, const RawUnit<T>& raw) {
    float xs[kUnit];
    raw.to_floats(xs);
    float probe = 0.0f;
#pragma unroll
    for (int j = 0; j < kUnit; ++j) probe = fmaf(xs[j], 0.0f, probe);
    const int64_t g = groups.group(i0);
    if (g != run.group) {
      flush(run, sink.target());
      run.group = g;
    }
    accumulate_unit(run, g, xs, probe == 0.0f, sink.target());
  };
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < nunits; u += 2 * stride) {
    const bool second = u + stride < nunits;
    RawUnit<T> a, b;
    a.load(x, u * kUnit);
    if (second) b.load(x, (u + stride) * kUnit);
    unit(u * kUnit, a);
    if (second) unit((u + stride) * kUnit, b);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int64_t i = int64_t(nunits) * kUnit; i < n; ++i) accumulate(run, groups64.group(i), to_float(x[i]), sink.target());
  flush(run, sink.target());
  sink.end();
  finalize_if_last(fin, fin_scratch);
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
  WidenSet widen;  // the widening pass (quantize_kernel<T, kDense, true>); flags NULL otherwise
};

// Tail of quantize_dense_kernel: the last n - i0 < 8 elements, one thread, one partial unit
// (the same code as quantize_kernel's tail).
template <typename T>
__device__ void quantize_tail(const T* x, int64_t n, int64_t i0, const QuantizeConfig& cfg, bool with_stats,
                              RunStats& run, MesaGroupStats* stats_target) {
  constexpr int N = kUnit;
  const float levels = float((1u << cfg.bits) - 1u);
  unsigned codes[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t i = i0 + j;
    codes[j] = 0u;
    if (i >= n) continue;
    const float xv = to_float(x[i]);
    // the same bits as the vector path: element_random_bits (no local array: selected)
    const unsigned u = cfg.stochastic ? element_random_bits(cfg.seed, i) : 0u;
    const int64_t g = cfg.groups.group(i);
    codes[j] = encode(code_domain(xv, cfg.sqrt_map), code_params(cfg.params[g]), levels, cfg.stochastic, u);
    if (with_stats) accumulate(run, g, xv, stats_target);
  }
  const int64_t nbytes = ceil_div((n - i0) * cfg.bits, 8);
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) packed |= uint64_t(codes[j]) << (j * cfg.bits);
  for (int64_t b = 0; b < nbytes; ++b) cfg.codes[i0 * cfg.bits / 8 + b] = uint8_t(packed >> (8 * b));
}

// kWiden: the widening pass (mesa_quant.h): no statistics, only the units that hold an
// element of a widened group, nothing at all when no group was widened.
template <typename T, bool kDense, bool kWiden>
__global__ void __launch_bounds__(kBlock) quantize_kernel(const T* __restrict__ x, Strided view, int64_t n,
                                                          QuantizeConfig cfg, MesaGroupStats* stats,
                                                          MesaFusedFinalize fin) {
  if (kWiden && cfg.widen.none()) return;  // the steady state: one load per thread
  __shared__ MesaGroupStats staged[kWiden ? 1 : kSharedGroups];
  __shared__ unsigned fin_scratch[kWiden ? 1 : kFinalizeScratch];
  const bool with_stats = !kWiden && stats != nullptr;
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
    if (kWiden && !cfg.widen.unit(cfg.groups, i0, int(n - i0 < N ? n - i0 : N))) continue;
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
    SrBits us{};  // one Philox4x32-7 call per unit of 8 (i0 is a multiple of 8)
    if (cfg.stochastic) us = unit_random_bits(cfg.seed, i0);
    unsigned codes[N];
    const int64_t g0 = cfg.groups.group(i0);
    const CodeParams p0 = code_params(cfg.params[g0]);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const bool live = kDense || i0 + j < n;
      const int64_t g = unit_in_one_group ? g0 : cfg.groups.group(i0 + j);
      const CodeParams p = unit_in_one_group ? p0 : code_params(cfg.params[live ? g : g0]);
      codes[j] = live ? encode(code_domain(xs[j], cfg.sqrt_map), p, levels, cfg.stochastic, cfg.stochastic ? us[j] : 0u) : 0u;
      if (with_stats && live) accumulate(run, g, xs[j], sink.target());
    }
    if (kWiden)
      cfg.widen.keep_unflagged(cfg.groups, i0, int(n - i0 < N ? n - i0 : N), cfg.codes + i0 * cfg.bits / 8, cfg.bits,
                               codes);
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
  if (kDense && blockIdx.x == 0 && threadIdx.x == 0 && nunits * N < n &&
      (!kWiden || cfg.widen.unit(cfg.groups, nunits * N, int(n - nunits * N)))) {
    // tail of fewer than 8 elements: one thread, one (partial) code unit (written out here,
    // not through quantize_tail: nvcc 13 then spills the f32 instance on sm_80)
    const int64_t i0 = nunits * N;
    unsigned codes[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t i = i0 + j;
      codes[j] = 0u;
      if (i >= n) continue;
      const float xv = to_float(x[i]);
      // the same bits as the vector path: element_random_bits (no local array: selected)
      const unsigned u = cfg.stochastic ? element_random_bits(cfg.seed, i) : 0u;
      const int64_t g = cfg.groups.group(i);
      codes[j] = encode(code_domain(xv, cfg.sqrt_map), code_params(cfg.params[g]), levels, cfg.stochastic, u);
      if (with_stats) accumulate(run, g, xv, sink.target());
    }
    if (kWiden) cfg.widen.keep_unflagged(cfg.groups, i0, int(n - i0), cfg.codes + i0 * cfg.bits / 8, cfg.bits, codes);
    const int64_t nbytes = ceil_div((n - i0) * cfg.bits, 8);
    uint64_t packed = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) packed |= uint64_t(codes[j]) << (j * cfg.bits);
    for (int64_t b = 0; b < nbytes; ++b) cfg.codes[i0 * cfg.bits / 8 + b] = uint8_t(packed >> (8 * b));
  }
  if (with_stats) {
    flush(run, sink.target());
    sink.end();
    if constexpr (!kWiden) finalize_if_last(fin, fin_scratch);
  }
}

// ---------------------------------------------------------------------------------------
// Dense fast path of the quantize pass: quantize_dense_unit (quant_common.cuh, shared with the
// fused producers) on two units in flight per thread.
template <typename T, int kBits, bool kStochastic, bool kStats>
__global__ void __launch_bounds__(kBlock, 2) quantize_dense_kernel(const T* __restrict__ x, int64_t n, DenseQuantize q,
                                                                QuantizeConfig cfg, MesaGroupStats* stats,
                                                                MesaFusedFinalize fin) {
  __shared__ MesaGroupStats staged[kStats ? kSharedGroups : 1];
  __shared__ unsigned fin_scratch[kStats ? kFinalizeScratch : 1];
  StatsSink sink{stats, kStats && cfg.groups.count <= kSharedGroups ? staged : nullptr, cfg.groups.count};
  if (kStats) sink.begin();
  RunStats run;
  uint32_t cached_group = 0xffffffffu;
  CodeParams p{0.0f, 0.0f, 1.0f};
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < nunits; u += 2 * stride) {
    const bool second = u + stride < nunits;
    RawUnit<T> a, b;
    a.load(x, u * kUnit);
    if (second) b.load(x, (u + stride) * kUnit);
    float xs[kUnit];
    a.to_floats(xs);
    quantize_dense_unit<kBits, kStochastic, kStats>(q, u * kUnit, xs, cached_group, p, run, sink.target());
    if (second) {
      b.to_floats(xs);
      quantize_dense_unit<kBits, kStochastic, kStats>(q, (u + stride) * kUnit, xs, cached_group, p, run,
                                                      sink.target());
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && int64_t(nunits) * kUnit < n)
    quantize_tail(x, n, int64_t(nunits) * kUnit, cfg, kStats, run, sink.target());
  if (kStats) {
    flush(run, sink.target());
    sink.end();
    finalize_if_last(fin, fin_scratch);
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
      store_dense_unit(y + i0, out);
    } else {
      for (int j = 0; j < N && i0 + j < n; ++j) y[kDense ? i0 + j : view.offset(i0 + j)] = from_float<T>(out[j]);
    }
  }
}

// Dense fast path of dequantize: y dense and 16-byte aligned, n < 2^31, every unit of 8 in one
// group. Bits and code map fixed per launch; the unit's codes in one load (8, 4 or 2 bytes),
// its group by 32-bit fast division, two units in flight per thread. The last partial unit
// (n % 8 elements) is decoded by one thread as dequantize_kernel does.
template <typename T, int kBits, bool kSqrt>
__device__ __forceinline__ void dequantize_dense_unit(const uint8_t* codes, const MesaGroupParams* params,
                                                      const GroupMap32& groups, uint32_t i0, uint64_t packed,
                                                      T* y) {
  const MesaGroupParams p = params[groups.group(i0)];
  float out[kUnit];
#pragma unroll
  for (int j = 0; j < kUnit; ++j) out[j] = decode(unsigned(packed >> (j * kBits)) & ((1u << kBits) - 1u), p, kSqrt);
  store_dense_unit(y + i0, out);
}

template <typename T, int kBits, bool kSqrt>
__global__ void __launch_bounds__(kBlock) dequantize_dense_kernel(const uint8_t* __restrict__ codes,
                                                                  const MesaGroupParams* __restrict__ params,
                                                                  GroupMap32 groups, GroupMap groups64,
                                                                  T* __restrict__ y, int64_t n) {
  const uint32_t nunits = uint32_t(n / kUnit);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < nunits; u += 2 * stride) {
    const bool second = u + stride < nunits;
    const uint64_t a = load_unit_codes<kBits>(codes, u * kUnit);
    const uint64_t b = second ? load_unit_codes<kBits>(codes, (u + stride) * kUnit) : 0u;
    dequantize_dense_unit<T, kBits, kSqrt>(codes, params, groups, u * kUnit, a, y);
    if (second) dequantize_dense_unit<T, kBits, kSqrt>(codes, params, groups, (u + stride) * kUnit, b, y);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && int64_t(nunits) * kUnit < n) {
    const int64_t i0 = int64_t(nunits) * kUnit;
    const uint8_t* src = codes + i0 * kBits / 8;
    const int64_t nbytes = ceil_div((n - i0) * kBits, 8);
    uint64_t packed = 0;
    for (int64_t b = 0; b < nbytes; ++b) packed |= uint64_t(src[b]) << (8 * b);
    for (int j = 0; i0 + j < n; ++j)
      y[i0 + j] = from_float<T>(
          decode(unsigned(packed >> (j * kBits)) & ((1u << kBits) - 1u), params[groups64.group(i0 + j)], kSqrt));
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
  if (vector_ok(a.x, a.x_desc) && gm.run % kUnit == 0 && group_map32_ok(gm, n)) {
    const auto kernel = quant_stats_dense_kernel<T>;
    return status_from(MESA_LAUNCH(kernel, dim3(resident_grid(kernel, ceil_div(ceil_div(n, kUnit), 2), kBlock)),
                                   dim3(kBlock), 0, stream, x, n, group_map32(gm), gm, a.stats, a.finalize));
  }
  if (vector_ok(a.x, a.x_desc))
    return status_from(MESA_LAUNCH((quant_stats_kernel<T, true>), dim3(grid_for(n / Vec16<T>::N + 1)), dim3(kBlock),
                                   0, stream, x, view, n, gm, a.stats, a.finalize));
  return status_from(MESA_LAUNCH((quant_stats_kernel<T, false>), dim3(grid_for(n)), dim3(kBlock), 0, stream, x, view,
                                 n, gm, a.stats, a.finalize));
}

template <typename T>
struct QuantizeDenseLaunch {
  const T* x;
  int64_t n;
  DenseQuantize q;
  QuantizeConfig cfg;
  MesaGroupStats* stats;
  MesaFusedFinalize fin;
  void* stream;
  template <int kBits, bool kStochastic, bool kStats>
  MesaStatus run() const {
    const auto kernel = quantize_dense_kernel<T, kBits, kStochastic, kStats>;
    const unsigned grid = resident_grid(kernel, ceil_div(ceil_div(n, kUnit), 2), kBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kBlock), 0, stream, x, n, q, cfg, stats, fin));
  }
};

template <typename T>
MesaStatus launch_quantize(const MesaQuantizeArgs& a, void* stream) {
  const int64_t n = numel(a.x_desc);
  const QuantizeConfig cfg{group_map(a.grouping, a.x_desc), a.params, a.codes, a.seed, a.bits,
                           a.rounding == MESA_ROUND_STOCHASTIC, a.map == MESA_CODE_MAP_SQRT,
                           WidenSet{a.widen, a.grouping.count}};
  const T* x = static_cast<const T*>(a.x);
  const Strided view = strided_from(a.x_desc);
  const bool dense = vector_ok(a.x, a.x_desc);
  if (a.widen != nullptr) {
    // the widening pass: a grid for the worst case (every group widened), no host
    // synchronisation; every thread returns after one load when no group was widened
    const unsigned grid = grid_for(ceil_div(n, kUnit));
    const MesaFusedFinalize none{};
    if (dense)
      return status_from(MESA_LAUNCH((quantize_kernel<T, true, true>), dim3(grid), dim3(kBlock), 0, stream, x, view, n,
                                     cfg, nullptr, none));
    return status_from(MESA_LAUNCH((quantize_kernel<T, false, true>), dim3(grid), dim3(kBlock), 0, stream, x, view, n,
                                   cfg, nullptr, none));
  }
  // the fast path: dense, identity codes, units in one group, 32-bit indices
  if (dense && !cfg.sqrt_map && cfg.groups.run % kUnit == 0 && group_map32_ok(cfg.groups, n)) {
    const QuantizeDenseLaunch<T> l{x, n, DenseQuantize{group_map32(cfg.groups), a.params, a.codes, a.seed}, cfg,
                                   a.stats, a.finalize, stream};
    return dispatch_bits_flags(a.bits, cfg.stochastic, a.stats != nullptr, l);
  }
  const unsigned grid = grid_for(ceil_div(n, kUnit));
  if (dense)
    return status_from(MESA_LAUNCH((quantize_kernel<T, true, false>), dim3(grid), dim3(kBlock), 0, stream, x, view, n,
                                   cfg, a.stats, a.finalize));
  return status_from(MESA_LAUNCH((quantize_kernel<T, false, false>), dim3(grid), dim3(kBlock), 0, stream, x, view, n,
                                 cfg, a.stats, a.finalize));
}

template <typename T>
struct DequantizeDenseLaunch {
  const MesaDequantizeArgs& a;
  GroupMap gm;
  int64_t n;
  void* stream;
  template <int kBits, bool kSqrt, bool>
  MesaStatus run() const {
    const auto kernel = dequantize_dense_kernel<T, kBits, kSqrt>;
    const unsigned grid = resident_grid(kernel, ceil_div(ceil_div(n, kUnit), 2), kBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kBlock), 0, stream, a.codes, a.params, group_map32(gm),
                                   gm, static_cast<T*>(a.y), n));
  }
};

template <typename T>
MesaStatus launch_dequantize(const MesaDequantizeArgs& a, void* stream) {
  const int64_t n = numel(a.y_desc);
  const GroupMap gm = group_map(a.grouping, a.y_desc);
  T* y = static_cast<T*>(a.y);
  const Strided view = strided_from(a.y_desc);
  const unsigned grid = grid_for(ceil_div(n, kUnit));
  const bool sqrt_map = a.map == MESA_CODE_MAP_SQRT;
  if (vector_ok(a.y, a.y_desc) && gm.run % kUnit == 0 && group_map32_ok(gm, n))
    return dispatch_bits_flags(a.bits, sqrt_map, false, DequantizeDenseLaunch<T>{a, gm, n, stream});
  if (vector_ok(a.y, a.y_desc))
    return status_from(MESA_LAUNCH((dequantize_kernel<T, true>), dim3(grid), dim3(kBlock), 0, stream, a.codes,
                                   a.params, gm, a.bits, sqrt_map, y, view, n));
  return status_from(MESA_LAUNCH((dequantize_kernel<T, false>), dim3(grid), dim3(kBlock), 0, stream, a.codes,
                                 a.params, gm, a.bits, sqrt_map, y, view, n));
}

inline bool finalize_args_valid(const MesaQuantFinalizeArgs& a) {
  if (a.count < 0 || !bits_valid(a.bits)) return false;
  if (a.mode != MESA_FINALIZE_EXACT && a.mode != MESA_FINALIZE_RUNNING) return false;
  if (!(a.momentum >= 0.0f && a.momentum <= 1.0f)) return false;
  return a.count == 0 || (a.stats != nullptr && a.running != nullptr && a.params != nullptr);
}

// A fused finalize (arrivals not NULL) finalizes the statistics this pass reduces.
inline bool fused_finalize_valid(const MesaFusedFinalize& f, const MesaGroupStats* stats, const MesaGrouping& g) {
  if (f.arrivals == nullptr) return true;
  return stats != nullptr && f.args.stats == stats && f.args.count == g.count && finalize_args_valid(f.args);
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
  if (!fused_finalize_valid(a->finalize, a->stats, a->grouping)) return MESA_STATUS_INVALID_ARGUMENT;
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
  // the widening pass re-encodes with saved params: no statistics, linear codes
  if (a->widen != nullptr && (a->stats != nullptr || a->map != MESA_CODE_MAP_IDENTITY)) return MESA_STATUS_INVALID_ARGUMENT;
  if (!fused_finalize_valid(a->finalize, a->stats, a->grouping)) return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->params == nullptr || a->codes == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<QuantizeOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(quant_finalize)(const MesaQuantFinalizeArgs* a, void* stream) {
  if (a == nullptr || !finalize_args_valid(*a)) return MESA_STATUS_INVALID_ARGUMENT;
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
