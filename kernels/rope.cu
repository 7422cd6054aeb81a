// rope.cu — rotary position embeddings (Su et al. 2021, RoFormer, §3.4.2, eq. 34): each pair
// of a query or key row is rotated by an angle that grows with the row's position. The
// rotation is orthogonal, so the backward rotates the gradient back by the same angle and the
// forward keeps nothing. The saving forward (issue 40) writes y = RoPE(x) AND the codes of y
// (Mesa §3: the Q and K that attention's backward reads) in one read of x.
//
// Math (f32), for a row at position p (position_offset + its index along the sequence axis)
// and pair i < R/2 of the R rotated dims (R even, R <= D):
//   inv_freq_i = base^(−2i/R),  θ = p·inv_freq_i,
//   y_a = x_a·cos θ − x_b·sin θ,  y_b = x_a·sin θ + x_b·cos θ        (inverse: θ → −θ)
//   (a, b) = (i, i + R/2): GPT-NeoX's halves (Llama, Hugging Face, candle's rope);
//   (a, b) = (2i, 2i + 1): GPT-J's interleaved pairs (candle's rope_i).
// Dims R..D pass through (bit copies). inv_freq and θ are rounded to f32 as Hugging Face's
// f32 cos/sin cache computes them (here θ/π, for sincospif), so the angle's error is about
// 20·2^-24·|θ| (θ up to the position): the outputs' error is |x|·|Δθ| plus a few roundings
// (tests/rope.rs). Every kernel here evaluates the same expressions (rope_inv_freq_over_pi,
// rope_first, rope_second), so the saving forward's y is rope_kernel's bit for bit.
// Codes of y: quant_common.cuh (the value encoded is the stored, dtype-rounded y, with the
// Quantizer's parameters; statistics of y reduced in the same pass for the running estimate),
// so they are mesa_quantize's codes of that y bit for bit.
//
// Kernels (n elements of T, b bits):
//   rope_kernel              reads n·sizeof(T), writes n·sizeof(T); one thread per pair (and
//                            one per passed-through element), grid-stride, any strides (the
//                            logical index gives the position and the dim)
//   rope_save_kernel         general saving forward: units of 8 logical elements, any strides;
//                            reads n·sizeof(T) (each element's partner again, from cache),
//                            writes n·sizeof(T) + n·b/8; y = NULL: the statistics pass of
//                            exact mode (reads n·sizeof(T), x rotated in registers)
//   rope_save_dense_kernel   x, y dense, rows of whole units, round to nearest: a work item is
//                            a unit and its partner unit (halves) or one unit of 4 pairs
//                            (interleaved), so each angle is computed once; 16-byte vectors;
//                            the same bytes moved as the general kernel's codes pass
// ~6 FLOP per element plus one sincospif per pair (~27 instructions on sm_90): bandwidth-bound,
// the dense kernel at 88 % of the instructions its bytes allow (docs/kernels.md).
// Reference: crates/mesa-kernels/src/reference/rope.rs. Bytes and floors: docs/fused.md.
#include "rows.cuh"  // unit words and dense16; quant_common.cuh: codes, statistics, dispatch

namespace MESA_NS {

constexpr int kRopeBlock = 256;
constexpr float kInvPi = 0.318309886183790672f;
// Pairs whose inv_freq/π the saving kernels keep in shared memory (R <= 512: every head dim
// in use is 64–256); past it the general kernel computes them per element.
constexpr int kRopeTablePairs = 256;

// inv_freq_i/π = base^(−2i/R)/π in f32 (θ/π, for sincospif: its reduction (mod 2) is exact,
// where sincosf's of a large angle needs a local-memory table, a stack frame on sm_90)
__device__ __forceinline__ float rope_inv_freq_over_pi(int64_t i, int64_t rotary, float base) {
  return powf(base, -float(2 * i) / float(rotary)) * kInvPi;
}
// out of line for the general saving kernel's rare wide heads: inlined 8 times per unit it
// would crowd that kernel's registers
__device__ __noinline__ float rope_inv_freq_over_pi_call(int64_t i, int64_t rotary, float base) {
  return rope_inv_freq_over_pi(i, rotary, base);
}

// The rotated pair: y_a and y_b from x_a, x_b and sin θ, cos θ (no FMA contraction: the
// products are fmaf's operands).
__device__ __forceinline__ float rope_first(float xa, float xb, float s, float c) { return fmaf(xa, c, -xb * s); }
__device__ __forceinline__ float rope_second(float xa, float xb, float s, float c) { return fmaf(xa, s, xb * c); }

// The rotated pair (a, b) of pair i, and whether a thread is on a pair or a passed-through dim.
__device__ __forceinline__ void rope_pair(int64_t i, int64_t half, bool interleaved, int64_t* a, int64_t* b) {
  *a = interleaved ? 2 * i : i;
  *b = interleaved ? 2 * i + 1 : i + half;
}

template <typename T>
__global__ void __launch_bounds__(kRopeBlock)
    rope_kernel(const T* __restrict__ x, Strided xv, T* __restrict__ y, Strided yv, int64_t rows, int64_t seq,
                int64_t dim, int64_t rotary, int64_t offset, float base, bool interleaved, bool inverse) {
  const int64_t half = rotary / 2;
  const int64_t pass = dim - rotary;
  const int64_t pairs = rows * half;  // rows: every [.., s, :] row of the tensor
  const int64_t work = pairs + rows * pass;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < work; w += step) {
    if (w >= pairs) {  // a passed-through dim
      const int64_t q = w - pairs;
      const int64_t e = (q / pass) * dim + rotary + q % pass;
      y[yv.offset(e)] = x[xv.offset(e)];
      continue;
    }
    const int64_t row = w / half, i = w % half;
    int64_t a, b;
    rope_pair(i, half, interleaved, &a, &b);
    const int64_t ea = row * dim + a, eb = row * dim + b;
    const float turns = float(offset + row % seq) * rope_inv_freq_over_pi(i, rotary, base);
    float s, c;
    sincospif(turns, &s, &c);
    if (inverse) s = -s;
    const float xa = to_float(x[xv.offset(ea)]), xb = to_float(x[xv.offset(eb)]);
    y[yv.offset(ea)] = from_float<T>(rope_first(xa, xb, s, c));
    y[yv.offset(eb)] = from_float<T>(rope_second(xa, xb, s, c));
  }
}

// ---------------------------------------------------------------------------------------
// The saving forward. Shared memory: the statistics staging of quant_common.cuh and the
// table of inv_freq/π. One __shared__ struct for every instance (a GPU gives each kernel its
// own; the emulator keeps one copy per declaration in every OS thread that runs it, so the 39
// instances with their own would take ~660 KiB per thread).
struct RopeShared {
  MesaGroupStats staged[kSharedGroups];
  alignas(16) float inv_freq_over_pi[kRopeTablePairs];
};
__device__ __forceinline__ RopeShared& rope_shared() {
  __shared__ RopeShared shared;
  return shared;
}

// Fills the table's first min(R/2, kRopeTablePairs) entries (every thread of the block calls it).
__device__ __forceinline__ void fill_rope_table(float* table, int64_t rotary, float base) {
  const int64_t pairs = rotary / 2 < kRopeTablePairs ? rotary / 2 : kRopeTablePairs;
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) table[i] = rope_inv_freq_over_pi(i, rotary, base);
  __syncthreads();
}

struct RopeGeometry {
  int64_t seq, dim, rotary, offset;
  float base;
  bool interleaved;
};

// A unit of 8 raw elements [i0, i0 + live) of a view (16-byte vectors when dense, whole and
// aligned; T(0) past `live`): raw, so passed-through dims are copied bit for bit.
template <typename T>
__device__ __forceinline__ void load_raw_unit(const T* base, const Strided& view, bool dense, int64_t i0, int live,
                                              T (&r)[kUnit]) {
  if (dense && unit_vector_ok(base + i0, 1, live)) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int h = 0; h < kUnit / V; ++h) {
      const Vec16<T> in = load16(base + i0 + h * V);
#pragma unroll
      for (int j = 0; j < V; ++j) r[h * V + j] = in.v[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) r[j] = j < live ? base[dense ? i0 + j : view.offset(i0 + j)] : from_float<T>(0.0f);
  }
}
template <typename T>
__device__ __forceinline__ void store_raw_unit(T* base, const Strided& view, bool dense, int64_t i0, int live,
                                               const T (&r)[kUnit]) {
  if (dense && unit_vector_ok(base + i0, 1, live)) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int h = 0; h < kUnit / V; ++h) {
      Vec16<T> o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = r[h * V + j];
      store16(base + i0 + h * V, o);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j)
      if (j < live) base[dense ? i0 + j : view.offset(i0 + j)] = r[j];
  }
}

// General: units of 8 logical elements, grid-stride, any strides, any R and D (a unit may
// straddle rows); each element reads its partner and computes its pair's angle (twice per
// pair). y == nullptr: the statistics pass (nothing stored but the sink's statistics).
template <typename T>
__global__ void __launch_bounds__(kRopeBlock)
    rope_save_kernel(const T* __restrict__ x, Strided xv, bool x_dense, T* __restrict__ y, Strided yv, bool y_dense,
                     int64_t n, RopeGeometry g, CodeSink sink) {
  RopeShared& sm = rope_shared();
  fill_rope_table(sm.inv_freq_over_pi, g.rotary, g.base);
  const bool with_stats = sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? sm.staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const int64_t half = g.rotary / 2;
  const int64_t nunits = ceil_div(n, kUnit);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t unit = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; unit < nunits; unit += step) {
    const int64_t i0 = unit * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    T in[kUnit], out[kUnit];
    load_raw_unit(x, xv, x_dense, i0, live, in);
    // the row of element i0 + j and its dim, advanced without a division per element
    int64_t row_start = (i0 / g.dim) * g.dim;
    int64_t d = i0 - row_start;
    int64_t s_idx = (i0 / g.dim) % g.seq;
    float v[kUnit];
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      T o = in[j];
      if (j < live && d < g.rotary) {
        const bool first = g.interleaved ? d % 2 == 0 : d < half;
        const int64_t i = g.interleaved ? d / 2 : (first ? d : d - half);
        const int64_t pe = row_start + (g.interleaved ? (d ^ 1) : (first ? d + half : d - half));
        const float xp = to_float(x[x_dense ? pe : xv.offset(pe)]);
        const float ifp = i < kRopeTablePairs ? sm.inv_freq_over_pi[i] : rope_inv_freq_over_pi_call(i, g.rotary, g.base);
        float s, c;
        sincospif(float(g.offset + s_idx) * ifp, &s, &c);
        const float xs = to_float(in[j]);
        o = from_float<T>(first ? rope_first(xs, xp, s, c) : rope_second(xp, xs, s, c));
      }
      out[j] = o;
      v[j] = to_float(o);  // the stored value is the one encoded
      if (++d == g.dim) {
        d = 0;
        row_start += g.dim;
        if (++s_idx == g.seq) s_idx = 0;
      }
    }
    if (y != nullptr) store_raw_unit(y, yv, y_dense, i0, live, out);
    if (sink.codes != nullptr || with_stats) sink_unit(sink, i0, v, live, run, stats.target());
  }
  if (with_stats) {
    flush(run, stats.target());
    stats.end();
  }
}

// Dense: x, y dense and 16-byte aligned, n and the positions below 2^31, D a multiple of 8,
// the rotated units whole (halves: R/2 a multiple of 8; interleaved: R), R/2 <= the table,
// codes with the identity map, round to nearest, units of 8 in one group (the conditions of
// quantize_dense_kernel). A row is R/16 items of two units — dims [8k, 8k + 8) and their
// partners R/2 further, the 8 angles computed once for both — (interleaved: R/8 items of one
// unit, 4 pairs) then (D − R)/8 passed-through units. The codes and statistics are
// quantize_dense_unit's of the stored words, so those of mesa_quantize of y bit for bit.
struct RopeDense {
  FastDiv per_row;     // work items per row
  FastDiv seq;         // S
  uint32_t dim;        // D
  uint32_t rotary;     // R
  uint32_t half;       // R/2
  uint32_t rot_items;  // the row's items that rotate
  uint32_t offset;     // position of s = 0
  uint32_t items;      // rows · per_row
};

template <typename T, int kBits, bool kInterleaved, bool kStats>
__global__ void __launch_bounds__(kRopeBlock)
    rope_save_dense_kernel(const T* __restrict__ x, T* __restrict__ y, RopeDense g, float base, DenseQuantize q,
                           CodeSink sink) {
  constexpr int kWords = kUnitWords<T>;
  constexpr int kPerWord = 16 / int(sizeof(T));  // elements per 16-byte word
  RopeShared& sm = rope_shared();
  fill_rope_table(sm.inv_freq_over_pi, g.rotary, base);
  StatsSink stats{sink.stats, kStats && sink.groups.count <= kSharedGroups ? sm.staged : nullptr, sink.groups.count};
  if (kStats) stats.begin();
  RunStats run;
  uint32_t cached_group = 0xffffffffu;
  CodeParams p{0.0f, 0.0f, 1.0f};
  // stores a unit's words and encodes the values they hold
  auto emit = [&](uint32_t i0, const uint4 (&w)[kWords]) {
#pragma unroll
    for (int h = 0; h < kWords; ++h) store16_words(y + i0 + h * kPerWord, w[h]);
    float v[kUnit];
    unit_from_words<T>(w, v);
    quantize_dense_unit<kBits, false, kStats>(q, i0, v, cached_group, p, run, stats.target());
  };
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < g.items; w += stride) {
    const uint32_t row = g.per_row.div(w);
    const uint32_t k = w - row * g.per_row.d;
    const uint32_t row_start = row * g.dim;
    uint4 wa[kWords];
    if (k >= g.rot_items) {  // passed through
      const uint32_t i0 = row_start + g.rotary + (k - g.rot_items) * kUnit;
#pragma unroll
      for (int h = 0; h < kWords; ++h) wa[h] = load16_words(x + i0 + h * kPerWord);
      emit(i0, wa);
      continue;
    }
    const float pos = float(g.offset + g.seq.mod(row));
    const float* ifp = sm.inv_freq_over_pi + k * (kInterleaved ? kUnit / 2 : kUnit);
    const uint32_t ia = row_start + k * kUnit;
    float xa[kUnit], ya[kUnit];
#pragma unroll
    for (int h = 0; h < kWords; ++h) wa[h] = load16_words(x + ia + h * kPerWord);
    if constexpr (kInterleaved) {
      unit_from_words<T>(wa, xa);
#pragma unroll
      for (int j = 0; j < kUnit / 2; ++j) {
        float s, c;
        sincospif(pos * ifp[j], &s, &c);
        ya[2 * j] = rope_first(xa[2 * j], xa[2 * j + 1], s, c);
        ya[2 * j + 1] = rope_second(xa[2 * j], xa[2 * j + 1], s, c);
      }
      unit_to_words<T>(ya, wa);
      emit(ia, wa);
    } else {
      const uint32_t ib = ia + g.half;
      uint4 wb[kWords];
#pragma unroll
      for (int h = 0; h < kWords; ++h) wb[h] = load16_words(x + ib + h * kPerWord);
      float xb[kUnit], yb[kUnit];
      unit_from_words<T>(wa, xa);
      unit_from_words<T>(wb, xb);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        float s, c;
        sincospif(pos * ifp[j], &s, &c);
        ya[j] = rope_first(xa[j], xb[j], s, c);
        yb[j] = rope_second(xa[j], xb[j], s, c);
      }
      unit_to_words<T>(ya, wa);
      unit_to_words<T>(yb, wb);
      emit(ia, wa);
      emit(ib, wb);
    }
  }
  if (kStats) {
    flush(run, stats.target());
    stats.end();
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): one grid-stride launch of a few waves.
template <typename T>
struct RopeLaunch {
  static MesaStatus run(const MesaRopeArgs& a, void* stream) {
    const int64_t n = numel(a.x_desc);
    const int64_t rows = n / a.head_dim;
    const int64_t work = rows * (a.rotary_dims / 2) + rows * (a.head_dim - a.rotary_dims);
    const int64_t want = ceil_div(work, kRopeBlock);
    const int64_t cap = int64_t(sm_count()) * 8;
    const unsigned grid = unsigned(want < 1 ? 1 : (want < cap ? want : cap));
    return status_from(MESA_LAUNCH((rope_kernel<T>), dim3(grid), dim3(kRopeBlock), 0, stream,
                                   static_cast<const T*>(a.x), strided_from(a.x_desc), static_cast<T*>(a.y),
                                   strided_from(a.y_desc), rows, a.seq_len, a.head_dim, a.rotary_dims,
                                   a.position_offset, a.base, a.pairing == MESA_ROPE_INTERLEAVED, a.inverse != 0));
  }
};

// The saving forward: the dense kernel when the views and the codes allow (one dispatch point:
// bits, pairing, statistics), else the general kernel (strided views, rows of partial units,
// stochastic rounding, the statistics pass).
inline bool rope_save_dense_ok(const MesaRopeSaveArgs& a, const CodeSink& sink, int64_t n) {
  const MesaRopeArgs& r = a.rope;
  const int64_t half = r.rotary_dims / 2;
  const bool whole_units =
      r.head_dim % kUnit == 0 && (r.pairing == MESA_ROPE_INTERLEAVED ? r.rotary_dims % kUnit == 0 : half % kUnit == 0);
  return r.y != nullptr && sink.codes != nullptr && !sink.stochastic && !sink.sqrt_map && whole_units &&
         half <= kRopeTablePairs && dense16(r.x, r.x_desc) && dense16(r.y, r.y_desc) && n < (int64_t(1) << 31) &&
         r.position_offset + r.seq_len < (int64_t(1) << 31) && sink.groups.run % kUnit == 0 &&
         group_map32_ok(sink.groups, n);
}

template <typename T>
struct RopeSaveDenseLaunch {
  const MesaRopeSaveArgs& a;
  int64_t n;
  CodeSink sink;
  void* stream;

  template <int kBits, bool kInterleaved, bool kStats>
  MesaStatus run() const {
    const MesaRopeArgs& r = a.rope;
    const auto kernel = rope_save_dense_kernel<T, kBits, kInterleaved, kStats>;
    const uint32_t rot_items = uint32_t(kInterleaved ? r.rotary_dims / kUnit : r.rotary_dims / (2 * kUnit));
    const uint32_t per_row = rot_items + uint32_t((r.head_dim - r.rotary_dims) / kUnit);
    const uint32_t rows = uint32_t(n / r.head_dim);
    const RopeDense g{fast_div(per_row),
                      fast_div(uint32_t(r.seq_len)),
                      uint32_t(r.head_dim),
                      uint32_t(r.rotary_dims),
                      uint32_t(r.rotary_dims / 2),
                      rot_items,
                      uint32_t(r.position_offset),
                      rows * per_row};
    const DenseQuantize q{group_map32(sink.groups), sink.params, sink.codes, sink.seed};
    const unsigned grid = resident_grid(kernel, g.items, kRopeBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kRopeBlock), 0, stream, static_cast<const T*>(r.x),
                                   static_cast<T*>(r.y), g, r.base, q, sink));
  }
};

template <typename T>
struct RopeSaveLaunch {
  static MesaStatus run(const MesaRopeSaveArgs& a, void* stream) {
    const MesaRopeArgs& r = a.rope;
    const int64_t n = numel(r.x_desc);
    const CodeSink sink = code_sink_from(a.sink);
    if (rope_save_dense_ok(a, sink, n))
      return dispatch_bits_flags(sink.bits, r.pairing == MESA_ROPE_INTERLEAVED, sink.stats != nullptr,
                                 RopeSaveDenseLaunch<T>{a, n, sink, stream});
    const int64_t want = ceil_div(ceil_div(n, kUnit), kRopeBlock);
    const int64_t cap = int64_t(sm_count()) * 8;
    const unsigned grid = unsigned(want < 1 ? 1 : (want < cap ? want : cap));
    const RopeGeometry g{r.seq_len, r.head_dim, r.rotary_dims, r.position_offset, r.base,
                         r.pairing == MESA_ROPE_INTERLEAVED};
    return status_from(MESA_LAUNCH((rope_save_kernel<T>), dim3(grid), dim3(kRopeBlock), 0, stream,
                                   static_cast<const T*>(r.x), strided_from(r.x_desc), dense16(r.x, r.x_desc),
                                   static_cast<T*>(r.y), r.y != nullptr ? strided_from(r.y_desc) : Strided{},
                                   dense16(r.y, r.y_desc), n, g, sink));
  }
};

// The checks both entries share; `need_y`: y must be given (mesa_rope).
inline bool rope_args_valid(const MesaRopeArgs& a, bool need_y) {
  if (!desc_valid(a.x_desc)) return false;
  if (need_y || a.y != nullptr) {
    if (!desc_valid(a.y_desc) || numel(a.x_desc) != numel(a.y_desc) || a.x_desc.dtype != a.y_desc.dtype) return false;
  }
  if (a.pairing != MESA_ROPE_HALVES && a.pairing != MESA_ROPE_INTERLEAVED) return false;
  if (a.seq_len < 1 || a.head_dim < 2 || a.rotary_dims < 2 || a.rotary_dims % 2 != 0 || a.rotary_dims > a.head_dim ||
      a.position_offset < 0 || !(a.base > 1.0f) || !(a.base < 3.0e38f))
    return false;
  return numel(a.x_desc) % (a.seq_len * a.head_dim) == 0;
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(rope)(const MesaRopeArgs* a, void* stream) {
  if (a == nullptr || !rope_args_valid(*a, true)) return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t n = numel(a->x_desc);
  if (n == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->y == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<RopeLaunch>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(rope_save)(const MesaRopeSaveArgs* a, void* stream) {
  if (a == nullptr || !rope_args_valid(a->rope, false) || !code_sink_valid(a->sink)) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->rope.inverse != 0 || a->sink.map != MESA_CODE_MAP_IDENTITY) return MESA_STATUS_INVALID_ARGUMENT;
  // no output: only the statistics pass (codes are of the stored y)
  if (a->rope.y == nullptr && (a->sink.codes != nullptr || a->sink.stats == nullptr)) return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->rope.x_desc) == 0) return MESA_STATUS_OK;
  if (a->rope.x == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<RopeSaveLaunch>(a->rope.x_desc.dtype, *a, stream);
}
