// quant_common.cuh — the reusable device pieces of activation compression (Mesa §3.2-3.3):
// group map, code parameters, encoding, per-group running statistics (RunStats / StatsSink)
// and packed code stores. kernels/quantize.cu (quantize-on-save) and the fused producers
// (gelu.cu, softmax.cu, layernorm.cu) include it, so a producer quantizes its saved tensor in
// the same pass with exactly the machinery of the Quantizer: the same codes for the same
// values and parameters, the same statistics for the running estimate, and quant_finalize
// (quantize.cu) turns those statistics into parameters afterwards.
//
// It also holds what producers and backward kernels share: CodeSink (where a producer writes
// codes: params, stats, seed, bits), CodeSource (codes read back inside a backward kernel)
// and the per-element random bits of stochastic rounding (Philox4x32-7 by logical index).
#pragma once

#include "common.cuh"

#include <type_traits>

namespace MESA_NS {

// Groups accumulated in shared memory before one global atomic per group and block;
// beyond this, threads flush straight to global memory.
constexpr int kSharedGroups = 1024;
constexpr int kUnit = 8;  // strided path: logical elements per step (one byte at 1 bit)

// What the kernels need to know about groups: g(i) = (i / run) % count for logical index i,
// with run = span * prod(shape[dim+1:]).
struct GroupMap {
  int64_t run;
  int64_t count;
  __device__ __forceinline__ int64_t group(int64_t i) const { return (i / run) % count; }
};

// The same map for dense hot loops (logical index below 2^31), by 32-bit fast division.
struct GroupMap32 {
  FastDiv run, count;
  __device__ __forceinline__ uint32_t group(uint32_t i) const { return count.mod(run.div(i)); }
};
inline bool group_map32_ok(const GroupMap& g, int64_t n) {
  return n < (int64_t(1) << 31) && g.run < (int64_t(1) << 31) && g.count < (int64_t(1) << 31);
}
inline GroupMap32 group_map32(const GroupMap& g) { return GroupMap32{fast_div(uint32_t(g.run)), fast_div(uint32_t(g.count))}; }

struct CodeParams {
  float offset;
  float inv_scale;  // ~1 / (scale * prescale); 0 for a zero or NaN scale
  float prescale;   // 2^64 for tiny scales, 2^-64 for huge ones, else 1
};
// Scales outside [2^-60, 2^60] are first multiplied by 2^±64 (exact), so that the step and
// its reciprocal are normal numbers; the difference x - offset gets the same factor.
constexpr float kTinyScale = 8.673617379884035e-19f;  // 2^-60
constexpr float kHugeScale = 1.152921504606846976e18f;  // 2^60
constexpr float kTwo64 = 18446744073709551616.0f;       // 2^64
constexpr int kSrBits = 16;                              // random bits per element (stochastic rounding)
constexpr float kSrOne = float(1u << kSrBits);           // 2^16: one code step in fixed point

// 1/s for a normal s in [2^-85, 2^110] by Newton's iteration r <- r + r(1 - s r) (fmaf),
// from a bit-pattern seed: only IEEE mul/fma, so both builds give the same bits, and no
// division slow-path call in the kernels (which would spill registers). Four steps take the
// ~4-bit seed past 24 bits: within an ulp of the correctly rounded reciprocal.
__device__ __forceinline__ float reciprocal(float s) {
  float r = __uint_as_float(0x7EF311C3u - __float_as_uint(s));
#pragma unroll
  for (int k = 0; k < 3; ++k) r = fmaf(r, fmaf(-s, r, 1.0f), r);
  return r;
}

__device__ __forceinline__ CodeParams code_params(MesaGroupParams p) {
  if (!(p.scale > 0.0f)) return CodeParams{p.offset, 0.0f, 1.0f};  // constant group, or NaN
  const float pre = p.scale < kTinyScale ? kTwo64 : (p.scale > kHugeScale ? 1.0f / kTwo64 : 1.0f);
  return CodeParams{p.offset, reciprocal(p.scale * pre), pre};
}

// t = (x - offset) / scale, evaluated so that it neither overflows nor loses the tiny scales:
//   * normal case: one subtraction and one multiplication by 1/scale;
//   * x - offset overflows f32 (range wider than FLT_MAX): halve both terms first (exact);
//   * tiny scale: difference and step both scaled by 2^64 (exact), see code_params.
// __fmul_rn is never contracted into an FMA with the `+ u` of stochastic rounding, so the
// GPU rounds t exactly as the emulation does.
__device__ __forceinline__ float code_position(float x, CodeParams p) {
  float d = x - p.offset;
  float twice = 1.0f;
  if (!is_finite(d) && is_finite(x)) {
    d = 0.5f * x - 0.5f * p.offset;
    twice = 2.0f;
  }
  return twice * __fmul_rn(d * p.prescale, p.inv_scale);
}

// The nearest code of position t: rint(t) clamped to [0, levels], NaN to 0. On the GPU one
// F2I.U32.RNE (a float-to-unsigned conversion saturates: negative and NaN give 0, PTX ISA
// `cvt`) and one integer min; the emulation spells the clamp out (its conversion of an
// out-of-range float would be undefined). The same code in both builds for every t.
__device__ __forceinline__ unsigned nearest_code(float t, unsigned levels) {
#ifdef MESA_EMU
  return t > 0.0f ? (t < float(levels) ? unsigned(rintf(t)) : levels) : 0u;
#else
  const unsigned c = __float2uint_rn(t);
  return c < levels ? c : levels;
#endif
}

// Stochastic rounding is done in fixed point: T = rint(t * 2^16) saturated to [0, L * 2^16]
// (t * 2^16 is exact in f32: a power of two), then code = (T + u) >> 16 with u the element's
// 16 random bits — floor(t' + u / 2^16) for t' = T / 2^16, t on the 2^-16 grid. Integer
// arithmetic: no rounding of t' + u, so an on-grid t (T = code << 16) never moves, and
// P(code = floor(t') + 1) = frac(t') exactly; |t' - t| <= 2^-17 of a step is the bias bound
// (docs/kernels.md, "Stochastic rounding"). The same code in both builds for every t.
// stochastic_code takes t16 = t * 2^16 (levels L = 2^bits - 1, u < 2^16); negative and NaN
// t16 give 0. After the F2I of nearest_code: IMNMX, the add of u, SHF.
__device__ __forceinline__ unsigned stochastic_code(float t16, unsigned levels, unsigned u) {
  return (nearest_code(t16, levels << kSrBits) + u) >> kSrBits;
}

// The code of position t, as encode() rounds it (u: the element's 16 random bits, unused when
// rounding to nearest). fmaxf(NaN, 0) = 0.
__device__ __forceinline__ unsigned round_code(float t, float levels, bool stochastic, unsigned u) {
  if (stochastic) return stochastic_code(t * kSrOne, unsigned(levels), u);
  return unsigned(fminf(fmaxf(rintf(t), 0.0f), levels));
}

__device__ __forceinline__ unsigned encode(float x, CodeParams p, float levels, bool stochastic, unsigned u) {
  return round_code(code_position(x, p), levels, stochastic, u);
}

// Companded codes (MESA_CODE_MAP_SQRT): the value encoded is u = sqrt(x) (IEEE sqrtf, the
// same bits in both builds; x < 0 gives NaN, which encodes to 0), and decoding squares
// q = fmaf(code, scale, offset) with one unfused multiply.
__device__ __forceinline__ float code_domain(float x, bool sqrt_map) { return sqrt_map ? sqrtf(x) : x; }
__device__ __forceinline__ float decode(unsigned code, MesaGroupParams p, bool sqrt_map) {
  const float q = fmaf(float(code), p.scale, p.offset);
  return sqrt_map ? __fmul_rn(q, q) : q;
}

inline bool code_map_valid(MesaCodeMap m) { return m == MESA_CODE_MAP_IDENTITY || m == MESA_CODE_MAP_SQRT; }

// ---------------------------------------------------------------------------------------
// The widening pass of the running estimate (mesa_quant.h, quant_finalize in RUNNING mode):
// flags[g] != 0 marks a group whose batch left the estimate by more than one step; those
// groups got the batch's exact range in their saved params and are encoded again, and
// flags[count] says how many there are (0 in the steady state: the pass then reads nothing
// else). A unit of 8 logical elements [i0, i0 + live) is encoded again when any of its
// elements is in a flagged group; the thread that owns the unit rewrites all its bytes (one
// writer), encoding the elements of flagged groups with their new params and keeping the
// codes of the others as the first pass wrote them, read back from the bytes (their saved
// params need not be the estimate that pass used: a non-finite group's scale is NaN).
struct WidenSet {
  const uint32_t* flags;  // [count + 1]
  int64_t count;
  __device__ __forceinline__ bool none() const { return flags[count] == 0u; }
  __device__ __forceinline__ bool unit(const GroupMap& m, int64_t i0, int live) const {
    if (m.run % kUnit == 0 && i0 % kUnit == 0) return flags[m.group(i0)] != 0u;
    bool any = false;
    for (int j = 0; j < live; ++j) any = any || flags[m.group(i0 + j)] != 0u;
    return any;
  }
  // codes[j] of an element of an unflagged group <- its code in the bytes at `dst` (the unit's,
  // i0 a multiple of 8); nothing to do for a unit inside one group (it is flagged).
  __device__ __forceinline__ void keep_unflagged(const GroupMap& m, int64_t i0, int live, const uint8_t* dst, int bits,
                                                 unsigned (&codes)[kUnit]) const {
    if (m.run % kUnit == 0 && i0 % kUnit == 0) return;
    const int nbytes = int(ceil_div(int64_t(live) * bits, 8));
    uint64_t packed = 0;
    for (int b = 0; b < nbytes; ++b) packed |= uint64_t(dst[b]) << (8 * b);
#pragma unroll
    for (int j = 0; j < kUnit; ++j)  // fixed trip count: codes[] stays in registers
      if (j < live && flags[m.group(i0 + j)] == 0u) codes[j] = unsigned(packed >> (j * bits)) & ((1u << bits) - 1u);
  }
};

// Whether a batch of finite range [lo, hi] escaped the estimate {o, s} (levels L) by more
// than one step: lo < o - s or hi > o + (L + 1) s, in f64 from the f32 values (IEEE, the
// same decision in both builds and in the reference). Inside that band a clamped element is
// at most one step from its code's value.
__device__ __forceinline__ bool escaped_estimate(MesaGroupParams est, float lo, float hi, float levels) {
  const double o = est.offset, s = est.scale;
  return double(lo) < o - s || double(hi) > o + (double(levels) + 1.0) * s;
}

// ---------------------------------------------------------------------------------------
// Per-group statistics: a thread keeps a run (group, min, max, nonfinite) while consecutive
// elements stay in one group and flushes it with atomics when the group changes.
struct RunStats {
  int64_t group = -1;
  unsigned min_key = 0xffffffffu;
  unsigned max_key = 0u;
  unsigned nonfinite = 0u;
};

__device__ __forceinline__ void flush(RunStats& r, MesaGroupStats* sink) {
  if (r.group < 0) return;
  MesaGroupStats* s = sink + r.group;
  if (r.min_key != 0xffffffffu) {
    atomicMin(&s->min_key, r.min_key);
    atomicMax(&s->max_key, r.max_key);
  }
  if (r.nonfinite != 0u) atomicAdd(&s->nonfinite, r.nonfinite);
  r = RunStats{};
}

__device__ __forceinline__ void accumulate(RunStats& r, int64_t g, float v, MesaGroupStats* sink) {
  if (g != r.group) {
    flush(r, sink);
    r.group = g;
  }
  if (is_finite(v)) {
    const unsigned k = float_key(v);
    r.min_key = k < r.min_key ? k : r.min_key;
    r.max_key = k > r.max_key ? k : r.max_key;
  } else {
    r.nonfinite += 1u;
  }
}

// Block-level staging of the per-group reduction (shared memory when the groups fit).
struct StatsSink {
  MesaGroupStats* global;
  MesaGroupStats* shared;  // null: flush straight to global
  int64_t count;

  __device__ __forceinline__ MesaGroupStats* target() const { return shared != nullptr ? shared : global; }

  __device__ void begin() {
    if (shared == nullptr) return;
    for (int64_t g = threadIdx.x; g < count; g += blockDim.x) shared[g] = MesaGroupStats{0xffffffffu, 0u, 0u, 0u};
    __syncthreads();
  }
  __device__ void end() {
    if (shared == nullptr) return;
    __syncthreads();
    for (int64_t g = threadIdx.x; g < count; g += blockDim.x) {
      const MesaGroupStats s = shared[g];
      if (s.min_key != 0xffffffffu) {
        atomicMin(&global[g].min_key, s.min_key);
        atomicMax(&global[g].max_key, s.max_key);
      }
      if (s.nonfinite != 0u) atomicAdd(&global[g].nonfinite, s.nonfinite);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Packed code stores.
template <int kCodesPerCall>
__device__ __forceinline__ void store_codes(uint8_t* dst, const unsigned* codes, int bits) {
  // Packs kCodesPerCall codes (first in the low bits) and stores the bytes they fill.
  MESA_MEMORY_POINT();
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < kCodesPerCall; ++j) packed |= uint64_t(codes[j]) << (j * bits);
  const int nbytes = kCodesPerCall * bits / 8;
  if (nbytes == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(unsigned(packed), unsigned(packed >> 32));
  } else if (nbytes == 4) {
    *reinterpret_cast<unsigned*>(dst) = unsigned(packed);
  } else if (nbytes == 2) {
    *reinterpret_cast<unsigned short*>(dst) = (unsigned short)packed;
  } else {
    for (int b = 0; b < nbytes; ++b) dst[b] = uint8_t(packed >> (8 * b));
  }
}

// The 8 codes of a unit at a width fixed at compile time, packed into 32-bit words (no 64-bit
// shifts) and stored as kBits bytes: the bytes store_codes<8> writes.
template <int kBits>
__device__ __forceinline__ void store_unit_codes(uint8_t* dst, const unsigned (&codes)[kUnit]) {
  constexpr int kPerWord = 32 / kBits;
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < kUnit; ++j) w[j / kPerWord] += codes[j] << ((j % kPerWord) * kBits);  // disjoint bits: + is |, one LEA
  if (kBits == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  if (kBits == 4) *reinterpret_cast<unsigned*>(dst) = w[0];
  if (kBits == 2) *reinterpret_cast<unsigned short*>(dst) = (unsigned short)w[0];
}

// ---------------------------------------------------------------------------------------
// Host helpers of the launch policies.
inline bool grouping_valid(const MesaGrouping& g, const MesaTensorDesc& d) {
  if (g.count < 1 || g.span < 1) return false;
  if (g.dim == -1) return g.count == 1;
  if (g.dim < 0 || g.dim >= d.ndim) return false;
  return g.span * g.count == d.shape[g.dim];
}

inline GroupMap group_map(const MesaGrouping& g, const MesaTensorDesc& d) {
  if (g.dim < 0) return GroupMap{1, 1};
  int64_t inner = 1;
  for (int k = g.dim + 1; k < d.ndim; ++k) inner *= d.shape[k];
  const int64_t run = g.span * inner;
  return GroupMap{run > 0 ? run : 1, g.count};
}

inline bool bits_valid(int b) { return b == 8 || b == 4 || b == 2; }

// Dense and 16-byte aligned -> vector path.
inline bool vector_ok(const void* p, const MesaTensorDesc& d) {
  return is_dense(d) && (reinterpret_cast<uintptr_t>(p) % 16 == 0);
}


// Bits (8, 4, 2) and booleans as template arguments: F::template run<kBits, kA, kB>().
template <typename F>
MesaStatus dispatch_bits_flags(int bits, bool a, bool b, const F& f) {
  auto with_bits = [&](auto kb) {
    if (a) return b ? f.template run<decltype(kb)::value, true, true>() : f.template run<decltype(kb)::value, true, false>();
    return b ? f.template run<decltype(kb)::value, false, true>() : f.template run<decltype(kb)::value, false, false>();
  };
  switch (bits) {
    case 8: return with_bits(std::integral_constant<int, 8>{});
    case 4: return with_bits(std::integral_constant<int, 4>{});
    case 2: return with_bits(std::integral_constant<int, 2>{});
    default: return MESA_STATUS_INVALID_ARGUMENT;
  }
}

// One instantiation per dtype: F<T>::run(args, stream).
template <template <typename> class F, typename Args>
MesaStatus dispatch_dtype(MesaDType t, const Args& a, void* stream) {
  switch (t) {
    case MESA_DTYPE_F32: return F<float>::run(a, stream);
    case MESA_DTYPE_F16: return F<__half>::run(a, stream);
    case MESA_DTYPE_BF16: return F<__nv_bfloat16>::run(a, stream);
    default: return MESA_STATUS_UNSUPPORTED;
  }
}

// ---------------------------------------------------------------------------------------
// Producers: CodeSink, the device view of MesaCodeSink. A producer hands it units of up to
// 8 consecutive logical elements [i0, i0 + live) whose first code starts on a byte
// (i0 * bits % 8 == 0); sink_unit encodes them exactly as quantize_kernel does (same
// encode(), same Philox uniforms by logical index), reduces their statistics into `run`,
// and stores ceil(live * bits / 8) bytes — a unit's bytes have one writer.
struct CodeSink {
  uint8_t* codes;
  const MesaGroupParams* params;
  MesaGroupStats* stats;
  GroupMap groups;
  uint64_t seed;
  int bits;
  bool stochastic;
  bool sqrt_map;  // companded codes of sqrt(v): see sink_unit
};

inline CodeSink code_sink_from(const MesaCodeSink& s) {
  return CodeSink{s.codes, s.params, s.stats, GroupMap{s.group_run, s.group_count}, s.seed, s.bits,
                  s.rounding == MESA_ROUND_STOCHASTIC, s.map == MESA_CODE_MAP_SQRT};
}

inline bool code_sink_valid(const MesaCodeSink& s) {
  if (s.codes == nullptr && s.stats == nullptr) return true;  // nothing saved
  if (s.group_run < 1 || s.group_count < 1 || !bits_valid(s.bits)) return false;
  if (s.rounding != MESA_ROUND_NEAREST && s.rounding != MESA_ROUND_STOCHASTIC) return false;
  if (!code_map_valid(s.map) || (s.map != MESA_CODE_MAP_IDENTITY && s.stats != nullptr)) return false;
  return s.codes == nullptr || s.params != nullptr;
}

// The random bits of stochastic rounding (docs/kernels.md, "Stochastic rounding"): logical
// element i takes 16 bits, half i % 2 (low half first) of word (i % 8) / 2 of
// Philox4x32-7(counter i / 8, key), so one Philox call serves a unit of 8. The key is the
// call's (the safe crate: seed + call * 0x9E3779B97F4A7C15), so the bits depend on (seed,
// call, i) only: not on the grid, the path (dense, strided, tail) or the producer.
constexpr int kSrRounds = 7;
struct SrBits {
  Philox4 r;
  __device__ __forceinline__ unsigned operator[](int j) const {  // element j of the unit, j < 8
    const unsigned w = j / 2 == 0 ? r.x : (j / 2 == 1 ? r.y : (j / 2 == 2 ? r.z : r.w));
    return j % 2 ? w >> kSrBits : w & 0xffffu;
  }
};
__device__ __forceinline__ SrBits unit_random_bits(uint64_t key, int64_t i0) {  // i0: a multiple of 8
  return SrBits{philox4x32<kSrRounds>(uint64_t(i0) / kUnit, key)};
}
__device__ __forceinline__ unsigned element_random_bits(uint64_t key, int64_t i) {  // = unit_random_bits(i0)[i % 8]
  const Philox4 r = philox4x32<kSrRounds>(uint64_t(i) / kUnit, key);
  const int w = int(uint64_t(i) % kUnit) / 2;
  const unsigned word = w == 0 ? r.x : (w == 1 ? r.y : (w == 2 ? r.z : r.w));
  return (word >> (kSrBits * int(i & 1))) & 0xffffu;
}

// A group's params as sink_unit reads them to encode. In the softmax forward another thread of
// the launch may poison the group's scale meanwhile (emit_unit: atomicExch to NaN for a
// non-finite output); the group then never decodes to finite values, so the codes may use
// either value, and a 4-byte load sees one or the other. A race by design, declared to the
// emulator's racecheck as relaxed atomic loads (found by it: issue 43); plain loads on the GPU.
__device__ __forceinline__ MesaGroupParams sink_params(const MesaGroupParams* p) {
#ifdef MESA_EMU
  return MesaGroupParams{std::atomic_ref<float>(const_cast<float&>(p->offset)).load(std::memory_order_relaxed),
                         std::atomic_ref<float>(const_cast<float&>(p->scale)).load(std::memory_order_relaxed)};
#else
  return *p;
#endif
}

// sqrt_map: the companded codes of s.sqrt_map, passed by the one producer that uses them
// (softmax); the others leave it false, a constant that keeps the branch out of their loops.
// widen (the widening pass, stats NULL): the codes of unflagged groups' elements are kept.
__device__ __forceinline__ void sink_unit(const CodeSink& s, int64_t i0, const float (&v)[kUnit], int live,
                                          RunStats& run, MesaGroupStats* stats_target, bool sqrt_map = false,
                                          const WidenSet* widen = nullptr) {
  const int64_t g0 = s.groups.group(i0);
  const bool one_group = s.groups.run % kUnit == 0 && i0 % kUnit == 0;
  if (s.stats != nullptr) {
#pragma unroll
    for (int j = 0; j < kUnit; ++j)
      if (j < live) accumulate(run, one_group ? g0 : s.groups.group(i0 + j), v[j], stats_target);
  }
  if (s.codes == nullptr) return;
  const float levels = float((1u << s.bits) - 1u);
  unsigned codes[kUnit];
  const CodeParams p0 = code_params(sink_params(s.params + g0));
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    const bool on = j < live;
    const CodeParams p = (one_group || !on) ? p0 : code_params(sink_params(s.params + s.groups.group(i0 + j)));
    // one generator call per element, not per unit: the unit's bits held across the loop
    // spill gelu_forward_kernel<float> (sm_90, 16-byte stack frame)
    const unsigned u = (s.stochastic && on) ? element_random_bits(s.seed, i0 + j) : 0u;
    codes[j] = on ? encode(code_domain(v[j], sqrt_map), p, levels, s.stochastic, u) : 0u;
  }
  uint8_t* dst = s.codes + i0 * s.bits / 8;
  if (widen != nullptr) widen->keep_unflagged(s.groups, i0, live, dst, s.bits, codes);
  if (live == kUnit && i0 % kUnit == 0) {
    store_codes<kUnit>(dst, codes, s.bits);  // 8-code word, aligned like quantize_kernel's
  } else {
    uint64_t packed = 0;
#pragma unroll
    for (int j = 0; j < kUnit; ++j) packed |= uint64_t(codes[j]) << (j * s.bits);
    const int nbytes = int(ceil_div(int64_t(live) * s.bits, 8));
    for (int b = 0; b < nbytes; ++b) dst[b] = uint8_t(packed >> (8 * b));
  }
}

// ---------------------------------------------------------------------------------------
// Consumers: CodeSource, codes read back inside a backward kernel (never materialised).
struct CodeSource {
  const uint8_t* codes;
  const MesaGroupParams* params;
  GroupMap groups;
  int bits;
  bool sqrt_map;  // companded: decode squares
};

inline CodeSource code_source_from(const MesaCodeSource& s) {
  return CodeSource{s.codes, s.params, GroupMap{s.group_run, s.group_count}, s.bits, s.map == MESA_CODE_MAP_SQRT};
}

inline bool code_source_valid(const MesaCodeSource& s) {
  return s.codes == nullptr || (s.params != nullptr && s.group_run >= 1 && s.group_count >= 1 && bits_valid(s.bits) &&
                                code_map_valid(s.map));
}

// Decodes elements [i0, i0 + live), live <= 8, any bit position: one 8-byte word when the unit
// is a whole aligned 8-bit unit, else the (at most 5) bytes that hold the codes.
__device__ __forceinline__ void source_unit(const CodeSource& s, int64_t i0, int live, float (&out)[kUnit]) {
  MESA_MEMORY_POINT();
  const int64_t bit0 = i0 * s.bits;
  const uint8_t* src = s.codes + bit0 / 8;
  const int shift = int(bit0 % 8);
  uint64_t packed = 0;
  if (s.bits == 8 && live == kUnit && i0 % kUnit == 0) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    packed = uint64_t(w.x) | (uint64_t(w.y) << 32);
  } else {
    const int nbytes = int(ceil_div(shift + int64_t(live) * s.bits, 8));  // <= 8
#pragma unroll
    for (int b = 0; b < 8; ++b)
      if (b < nbytes) packed |= uint64_t(src[b]) << (8 * b);
    packed >>= shift;
  }
  const unsigned mask = (1u << s.bits) - 1u;
  const int64_t g0 = s.groups.group(i0);
  const bool one_group = s.groups.run % kUnit == 0 && i0 % kUnit == 0;
  const MesaGroupParams p0 = s.params[g0];
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    const MesaGroupParams p = (one_group || j >= live) ? p0 : s.params[s.groups.group(i0 + j)];
    out[j] = decode(unsigned(packed >> (j * s.bits)) & mask, p, s.sqrt_map);
  }
}

// ---------------------------------------------------------------------------------------
// Dense producers: the quantize pass's fast path (quantize_dense_kernel) and the fused
// producers' dense kernels (gelu.cu) encode a unit of 8 with the same code, so their codes and
// statistics are those of the general path bit for bit.
// A unit of 8 as loaded (one or two 16-byte vectors), converted to f32 where it is encoded.
template <typename T>
struct RawUnit {
  Vec16<T> v[kUnit / Vec16<T>::N];
  __device__ __forceinline__ void load(const T* x, uint32_t i0) {
#pragma unroll
    for (int h = 0; h < kUnit / Vec16<T>::N; ++h) v[h] = load16(x + i0 + h * Vec16<T>::N);
  }
  __device__ __forceinline__ void to_floats(float (&xs)[kUnit]) const {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int h = 0; h < kUnit / V; ++h)
#pragma unroll
      for (int j = 0; j < V; ++j) xs[h * V + j] = to_float(v[h].v[j]);
  }
};

// Stores the 8 values of a unit at p (dense, 16-byte aligned) as one or two 16-byte vectors.
template <typename T>
__device__ __forceinline__ void store_dense_unit(T* p, const float (&v)[kUnit]) {
  constexpr int V = Vec16<T>::N;
#pragma unroll
  for (int h = 0; h < kUnit / V; ++h) {
    Vec16<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(v[h * V + j]);
    store16(p + h * V, o);
  }
}

// Unit statistics without a key per element: when every x of the unit is finite (`finite`:
// the probe sum of x * 0 stayed +-0) and neither its min nor its max is a zero (keys tell -0 from +0,
// fminf does not), the unit's min and max in f32 give the keys of its extremes; otherwise the
// per-element accumulate. `run` must already be on the unit's group.
__device__ __forceinline__ void accumulate_unit(RunStats& run, int64_t g, const float (&xs)[kUnit], bool finite,
                                                MesaGroupStats* stats_target) {
  float lo = xs[0], hi = xs[0];
#pragma unroll
  for (int j = 1; j < kUnit; ++j) {
    lo = fminf(lo, xs[j]);
    hi = fmaxf(hi, xs[j]);
  }
  if (finite && lo != 0.0f && hi != 0.0f) {
    const unsigned klo = float_key(lo), khi = float_key(hi);
    run.min_key = klo < run.min_key ? klo : run.min_key;
    run.max_key = khi > run.max_key ? khi : run.max_key;
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) accumulate(run, g, xs[j], stats_target);
  }
}

// Dense fast path of the quantize pass: x dense and 16-byte aligned, n < 2^31, every unit of 8
// in one group (run % 8 == 0), identity code map. Bits, rounding and statistics are fixed per
// launch (template parameters), the group of a unit comes from 32-bit fast division and its
// code parameters are reused while the group stays the same. Two units in flight per thread
// (both loads issued before either is encoded). A unit whose every x - offset is finite and
// whose scale needs no prescale (the common case) is encoded without the overflow guard of
// code_position, and its statistics are reduced in f32 (fminf/fmaxf, then one key each),
// unless its min or max is a zero (keys tell -0 from +0, fminf does not); any other unit
// takes the per-element code of quantize_kernel. Same codes, same statistics, bit for bit.
struct DenseQuantize {
  GroupMap32 groups;
  const MesaGroupParams* params;
  uint8_t* codes;
  uint64_t seed;
};

template <int kBits, bool kStochastic, bool kStats>
__device__ __forceinline__ void quantize_dense_unit(const DenseQuantize& q, uint32_t i0, const float (&xs)[kUnit],
                                                    uint32_t& cached_group, CodeParams& p, RunStats& run,
                                                    MesaGroupStats* stats_target) {
  constexpr float kLevels = float((1u << kBits) - 1u);
  const uint32_t g = q.groups.group(i0);
  if (g != cached_group) {  // a new group: its parameters, and the statistics of the last one out
    p = code_params(q.params[g]);
    cached_group = g;
    if (kStats && int64_t(g) != run.group) {
      flush(run, stats_target);
      run.group = g;
    }
  }
  SrBits us{};  // one Philox4x32-7 call per unit of 8: 16 bits per element
  if (kStochastic) us = unit_random_bits(q.seed, i0);
  float d[kUnit];
  float probe = 0.0f;  // +-0 while every x - offset is finite, NaN otherwise (x non-finite, or overflow)
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    d[j] = xs[j] - p.offset;
    probe = fmaf(d[j], 0.0f, probe);
  }
  unsigned codes[kUnit];
  if (probe == 0.0f && p.prescale == 1.0f) {
    // code_position's result exactly: d finite, prescale 1, so t = fl(d * inv_scale).
    // Stochastic: fl(d * inv16) = fl(d * inv_scale) * 2^16 (a power of two; both round to
    // fixed point 0 where the product underflows), so the codes of encode() below.
    const float inv16 = p.inv_scale * kSrOne;
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      codes[j] = kStochastic ? stochastic_code(__fmul_rn(d[j], inv16), (1u << kBits) - 1u, us[j])
                             : nearest_code(__fmul_rn(d[j], p.inv_scale), (1u << kBits) - 1u);
    }
    if (kStats) accumulate_unit(run, g, xs, true, stats_target);  // d, so x, all finite
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      codes[j] = encode(xs[j], p, kLevels, kStochastic, kStochastic ? us[j] : 0u);
      if (kStats) accumulate(run, g, xs[j], stats_target);
    }
  }
  store_unit_codes<kBits>(q.codes + size_t(i0) * kBits / 8, codes);
}


// The packed codes of the unit at logical index i0 (a multiple of 8) at a width fixed at
// compile time: one 8-, 4- or 2-byte load (dense consumers: dequantize_dense_kernel, gelu.cu).
template <int kBits>
__device__ __forceinline__ uint64_t load_unit_codes(const uint8_t* codes, uint32_t i0) {
  const uint8_t* src = codes + size_t(i0) * kBits / 8;
  if (kBits == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    return uint64_t(w.x) | (uint64_t(w.y) << 32);
  }
  if (kBits == 4) return *reinterpret_cast<const unsigned*>(src);
  return *reinterpret_cast<const unsigned short*>(src);
}

}  // namespace MESA_NS
