// layernorm.cu — LayerNorm over the last axis (Ba et al. 2016) fused with activation
// compression (Mesa §3): the forward writes y, the per-row mean and rstd, AND the codes of the
// normalized input x̂ (what backward needs besides rstd) in one read of x; the backward decodes
// x̂ inside its kernels; dweight/dbias are reduced deterministically.
//
// Math (f32, per row of C):
//   mean = Σ x / C,  var = Σ (x − mean)² / C  (two passes over the row held in registers),
//   rstd = 1 / sqrt(var + eps),  x̂ = (x − mean) · rstd,  y = x̂ · w + b
//   a constant row has var = 0: x̂ = 0, y = b (rstd = 1/sqrt(eps), finite for eps > 0).
//   backward, g = dy · w:  dx = rstd · (g − mean_row(g) − x̂ · mean_row(g · x̂))
//                          dw = Σ_rows dy · x̂,  db = Σ_rows dy
// Codes of x̂ use the Quantizer's parameters (running estimate, or exact with a statistics
// pass: the same kernel with y = NULL and only stats) — quant_common.cuh.
//
// Kernels (R rows of C, T input, b bits):
//   layernorm_forward_kernel     reads R·C·sizeof(T) + 2·C·sizeof(T), writes R·C·sizeof(T)
//                                + R·C·b/8 + 8·R; ~10 FLOP/element
//   layernorm_forward_dense_kernel  the same bytes and results for dense rows of C <= 1024
//                                (C % 8 == 0), codes rounded to nearest: units per lane, bits and
//                                statistics fixed at compile time (LayerNormDense picks it)
//   layernorm_codes_kernel       (only when C·b is not a multiple of 8, so that rows do not
//                                start on a byte) reads R·C·sizeof(T) + 8·R, writes R·C·b/8;
//                                kWiden: the running estimate's widening pass (quant_common.cuh,
//                                WidenSet), the same bytes for the elements of widened groups only
//                                (none in the steady state: one 4-byte load per thread)
//   layernorm_backward_fused_kernel (C <= 1024) dx and the dw/db partials in one pass over the
//                                rows: reads R·C·(sizeof(T) + b/8) + 4·R + C·sizeof(T) from
//                                memory (each row swept twice, the second time from L1),
//                                writes R·C·sizeof(T) + 2·P·C·4
//   layernorm_backward_dx_kernel (C > 1024) reads R·C·(sizeof(T) + b/8) + 4·R + C·sizeof(T), writes R·C·sizeof(T)
//   layernorm_backward_dwdb_kernel  (C > 1024) reads R·C·(sizeof(T) + b/8), writes 2·P·C·4 (P partial blocks)
//   layernorm_backward_final_kernel reads 2·P·C·4, writes 2·C·4
// Determinism: dw/db partials are sums over fixed row ranges (P = partial_blocks chosen by
// the caller from the shape only), then one ordered sum over P per column — no float
// atomics, bitwise reproducible run to run (and independent of the GPU's SM count).
// Launch policy: as softmax.cu (warp per row up to C = 1024 — the dense kernel when every
// tensor is dense and aligned, grid from the occupancy API —, a 512-thread block per row
// beyond, streaming re-reads of the row above 4096).
// Reference: crates/mesa-kernels/src/reference/fused.rs.  Bytes and floors: docs/fused.md.
#include "rows.cuh"

namespace MESA_NS {

constexpr int kRowBlock = 256;
constexpr int kLongBlock = 512;
constexpr int kColBlock = 256;  // dw/db: one column per thread, 256 columns per block

// Rows whose max|x| reaches 2^44 are normalised in a power-of-two scaled copy, x·2^-e with
// 2^e <= max|x| < 2^(e+1): (x − mean)² of a finite row near 1e20 would overflow f32 (its sum
// over C <= 2^31 elements can only overflow once max|x| > 2^47). The scaling is exact (up to
// parts below 2^-126·max|x|, which do not change any f32 result), so x̂ is the same number,
// and mean = mean_s·2^e, rstd = rstd_s·2^-e are exact too. Smaller rows take the plain
// formulas (sc = 1: bitwise the unscaled computation).
constexpr float kHugeRow = 17592186044416.0f;  // 2^44
struct RowScale {
  float sc;      // 2^-e (1 for ordinary rows)
  float inv_sc;  // 2^e
};
__device__ __forceinline__ RowScale row_scale(float max_abs) {
  if (!(max_abs >= kHugeRow) || !is_finite(max_abs)) return RowScale{1.0f, 1.0f};
  const unsigned e = (__float_as_uint(max_abs) >> 23) & 0xffu;  // biased exponent, 171..254
  return RowScale{__uint_as_float((254u - e) << 23), __uint_as_float(e << 23)};
}

// rstd_s = 1/sqrt(Σd²/C + eps·sc²), the sum of products written out (no FMA contraction).
__device__ __forceinline__ float row_rstd(float sum_sq, float inv_cols, float eps, RowScale rs) {
  return 1.0f / sqrtf(__fadd_rn(__fmul_rn(sum_sq, inv_cols), eps * rs.sc * rs.sc));
}

// A huge row held in registers (K units of 8 per thread): scaled in place by rsc.sc (exact),
// and its sum again, in the order of the first sum.
template <int kTeam, int K>
__device__ __forceinline__ float scale_row(float (&v)[K][kUnit], RowScale rsc, float* scratch) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      v[k][j] *= rsc.sc;
      s += v[k][j];
    }
  return team_sum<kTeam>(s, scratch);
}

struct LnParams {
  const void* weight;
  const void* bias;
  float* mean;
  float* rstd;
  float eps;
};

template <typename T>
__device__ __forceinline__ void affine_unit(const T* w, const T* b, int64_t c0, int live, const float (&xh)[kUnit],
                                            float (&y)[kUnit]) {
  float wv[kUnit], bv[kUnit];
  if (w != nullptr) {
    load_unit(w + c0, 1, live, wv, 0.0f);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) wv[j] = 1.0f;
  }
  if (b != nullptr) {
    load_unit(b + c0, 1, live, bv, 0.0f);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) bv[j] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kUnit; ++j) y[j] = fmaf(xh[j], wv[j], bv[j]);
}

template <typename T, int kTeam, int kChunks>
// min 2 blocks per SM: up to 128 registers (nvcc's own cap spilled the 2-chunk variant on sm_80)
__global__ void __launch_bounds__(kTeam == kWarpSize ? kRowBlock : kLongBlock, 2)
    layernorm_forward_kernel(const T* __restrict__ x, RowView xr, T* __restrict__ y, RowView yr, int64_t rows,
                             int64_t cols, LnParams p, CodeSink sink) {
  __shared__ float scratch[kWarpSize];
  __shared__ MesaGroupStats staged[kSharedGroups];
  const bool with_stats = sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  const int rank = team_rank<kTeam>();
  const float inv_cols = 1.0f / float(cols);
  const int64_t step = int64_t(kTeam) * kUnit;
  for (int64_t r = team_index<kTeam>(); r < rows; r += team_count<kTeam>()) {
    const T* xrow = x + xr.row(r);
    float mean, rstd;
    RowScale rsc;
    if (kChunks > 0) {
      constexpr int K = kChunks > 0 ? kChunks : 1;
      float v[K][kUnit];
      int live[K];
      float s = 0.0f, amax = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
        live[k] = int(c0 >= cols ? 0 : (cols - c0 < kUnit ? cols - c0 : kUnit));
        if (live[k] > 0) {
          load_unit(xrow + c0 * xr.col_stride, xr.col_stride, live[k], v[k], 0.0f);
        } else {
#pragma unroll
          for (int j = 0; j < kUnit; ++j) v[k][j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kUnit; ++j) {
          s += v[k][j];
          amax = fmaxf(amax, fabsf(v[k][j]));
        }
      }
      s = team_sum<kTeam>(s, scratch);
      rsc = row_scale(team_max<kTeam>(amax, scratch));
      if (rsc.sc != 1.0f) s = scale_row<kTeam>(v, rsc, scratch);  // huge row
      mean = s * inv_cols;  // of the scaled row; unscaled when stored
      float q = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < kUnit; ++j) {
          const float d = j < live[k] ? v[k][j] - mean : 0.0f;
          q = fmaf(d, d, q);
        }
      rstd = row_rstd(team_sum<kTeam>(q, scratch), inv_cols, p.eps, rsc);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (live[k] <= 0) continue;
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[k][j] = (v[k][j] - mean) * rstd;
        if (y != nullptr) {
          float out[kUnit];
          affine_unit(w, b, c0, live[k], v[k], out);
          store_unit(y + yr.row(r) + c0 * yr.col_stride, yr.col_stride, live[k], out);
        }
        if (sink.codes != nullptr || with_stats) sink_unit(sink, r * cols + c0, v[k], live[k], run, stats.target());
      }
    } else {
      float s = 0.0f, amax = 0.0f;
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_unit(xrow + c0 * xr.col_stride, xr.col_stride, live, v, 0.0f);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) {
          s += v[j];
          amax = fmaxf(amax, fabsf(v[j]));
        }
      }
      s = team_sum<kTeam>(s, scratch);
      rsc = row_scale(team_max<kTeam>(amax, scratch));
      if (rsc.sc != 1.0f) {  // huge row: one more read, summing the scaled values
        s = 0.0f;
        for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
          const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
          float v[kUnit];
          load_unit(xrow + c0 * xr.col_stride, xr.col_stride, live, v, 0.0f);
#pragma unroll
          for (int j = 0; j < kUnit; ++j) s += v[j] * rsc.sc;
        }
        s = team_sum<kTeam>(s, scratch);
      }
      mean = s * inv_cols;  // of the scaled row; unscaled when stored
      float q = 0.0f;
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_unit(xrow + c0 * xr.col_stride, xr.col_stride, live, v, 0.0f);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) {
          const float d = j < live ? v[j] * rsc.sc - mean : 0.0f;
          q = fmaf(d, d, q);
        }
      }
      rstd = row_rstd(team_sum<kTeam>(q, scratch), inv_cols, p.eps, rsc);
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_unit(xrow + c0 * xr.col_stride, xr.col_stride, live, v, 0.0f);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[j] = (v[j] * rsc.sc - mean) * rstd;
        if (y != nullptr) {
          float out[kUnit];
          affine_unit(w, b, c0, live, v, out);
          store_unit(y + yr.row(r) + c0 * yr.col_stride, yr.col_stride, live, out);
        }
        if (sink.codes != nullptr || with_stats) sink_unit(sink, r * cols + c0, v, live, run, stats.target());
      }
    }
    if (rank == 0) {  // back to the row's own scale (exact: powers of two)
      if (p.mean != nullptr) p.mean[r] = mean * rsc.inv_sc;
      if (p.rstd != nullptr) p.rstd[r] = rstd * rsc.sc;
    }
  }
  if (with_stats) {
    flush(run, stats.target());
    stats.end();
  }
}

// Stand-ins for an absent weight (1) or bias (0) of the dense kernel, up to 1024 columns of
// any dtype: device memory the loads read instead of branching per unit.
template <uint32_t kWord>
struct WordRow {
  uint32_t w[1024];
};
template <uint32_t kWord>
constexpr WordRow<kWord> word_row() {
  WordRow<kWord> r{};
  for (int i = 0; i < 1024; ++i) r.w[i] = kWord;
  return r;
}
__device__ const WordRow<0x3f800000u> kOnesF32 = word_row<0x3f800000u>();
__device__ const WordRow<0x3f803f80u> kOnesBF16 = word_row<0x3f803f80u>();
__device__ const WordRow<0x3c003c00u> kOnesF16 = word_row<0x3c003c00u>();
__device__ const WordRow<0u> kZeros = word_row<0u>();

template <typename T>
__device__ __forceinline__ const T* ones_row() {
  if constexpr (std::is_same<T, float>::value) return reinterpret_cast<const T*>(kOnesF32.w);
  if constexpr (std::is_same<T, __nv_bfloat16>::value) return reinterpret_cast<const T*>(kOnesBF16.w);
  if constexpr (std::is_same<T, __half>::value) return reinterpret_cast<const T*>(kOnesF16.w);
}

// Dense kernel (warp per row, C <= 1024 with C % 8 == 0, K = 1, 2 or 4 units of 8 per lane):
// x, y, weight and bias dense and 16-byte aligned, R·C < 2^31; codes (kBits != 0) rounded to
// nearest with the identity map, every unit of 8 in one group; kStats: the batch statistics
// too. Bits, statistics and the row's unit count are template arguments; the group of a unit
// comes from 32-bit fast division and its code parameters are reused while it stays the same
// (quantize_dense_unit, the quantize pass's own code). Values, codes and statistics are
// layernorm_forward_kernel's bit for bit: the same sums in the same order (a unit past the
// row adds +0 to Σx and nothing to Σd², as the general kernel's zero padding does), the same
// x̂ = (x − mean)·rstd and y = fmaf(x̂, w, b) (w = 1, b = 0 when absent), the codes of the
// same x̂. Loads and stores stay in 32-bit words (unit_from_words / unit_to_words).
template <typename T, int K, int kBits, bool kStats>
__global__ void __launch_bounds__(kRowBlock, 2)
    layernorm_forward_dense_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t rows, uint32_t cols, LnParams p,
                                   DenseQuantize q, CodeSink sink) {
  constexpr int W = kUnitWords<T>;
  __shared__ float scratch[1];  // team_sum's staging: unused by a warp team
  __shared__ MesaGroupStats staged[kStats ? kSharedGroups : 1];
  StatsSink stats{sink.stats, kStats && sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (kStats) stats.begin();
  RunStats run;
  uint32_t cached_group = 0xffffffffu;
  CodeParams cp{0.0f, 0.0f, 1.0f};
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint32_t teams = gridDim.x * (kRowBlock / kWarpSize);
  const float inv_cols = 1.0f / float(cols);
  const T* w = p.weight != nullptr ? static_cast<const T*>(p.weight) : ones_row<T>();
  const T* b = p.bias != nullptr ? static_cast<const T*>(p.bias) : reinterpret_cast<const T*>(kZeros.w);
  for (uint32_t r = blockIdx.x * (kRowBlock / kWarpSize) + threadIdx.x / kWarpSize; r < rows; r += teams) {
    const uint32_t row0 = r * cols;
    float v[K][kUnit];
    float s = 0.0f, amax = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t c0 = (uint32_t(k) * kWarpSize + lane) * kUnit;
      uint4 xw[W];
#pragma unroll
      for (int h = 0; h < W; ++h) xw[h] = c0 < cols ? load16_words(x + row0 + c0 + h * Vec16<T>::N) : make_uint4(0u, 0u, 0u, 0u);
      unit_from_words<T>(xw, v[k]);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        s += v[k][j];
        amax = fmaxf(amax, fabsf(v[k][j]));
      }
    }
    s = team_sum<kWarpSize>(s, scratch);
    const RowScale rsc = row_scale(team_max<kWarpSize>(amax, scratch));
    if (rsc.sc != 1.0f) s = scale_row<kWarpSize>(v, rsc, scratch);  // huge row
    const float mean = s * inv_cols;  // of the scaled row; unscaled when stored
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool live = (uint32_t(k) * kWarpSize + lane) * kUnit < cols;
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        v[k][j] -= mean;  // d, kept: x̂ = d·rstd
        if (live) sq = fmaf(v[k][j], v[k][j], sq);
      }
    }
    const float rstd = row_rstd(team_sum<kWarpSize>(sq, scratch), inv_cols, p.eps, rsc);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t c0 = (uint32_t(k) * kWarpSize + lane) * kUnit;
      if (c0 >= cols) continue;
      float wv[kUnit], bv[kUnit], out[kUnit];
      uint4 ww[W], bw[W];
#pragma unroll
      for (int h = 0; h < W; ++h) {
        ww[h] = load16_words(w + c0 + h * Vec16<T>::N);
        bw[h] = load16_words(b + c0 + h * Vec16<T>::N);
      }
      unit_from_words<T>(ww, wv);
      unit_from_words<T>(bw, bv);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        v[k][j] *= rstd;
        out[j] = fmaf(v[k][j], wv[j], bv[j]);
      }
      uint4 yw[W];
      unit_to_words<T>(out, yw);
#pragma unroll
      for (int h = 0; h < W; ++h) store16_words(y + row0 + c0 + h * Vec16<T>::N, yw[h]);
      if constexpr (kBits != 0)
        quantize_dense_unit<kBits, false, kStats>(q, row0 + c0, v[k], cached_group, cp, run, stats.target());
    }
    if (lane == 0) {  // back to the row's own scale (exact: powers of two)
      if (p.mean != nullptr) p.mean[r] = mean * rsc.inv_sc;
      if (p.rstd != nullptr) p.rstd[r] = rstd * rsc.sc;
    }
  }
  if (kStats) {
    flush(run, stats.target());
    stats.end();
  }
}

// Codes of x̂ from x, mean and rstd, in units of 8 logical elements (any row length).
// kWiden: the widening pass of the running estimate (quant_common.cuh, WidenSet): only the
// units holding an element of a widened group, nothing when none was widened; no statistics.
template <typename T, bool kWiden>
__global__ void __launch_bounds__(kRowBlock)
    layernorm_codes_kernel(const T* __restrict__ x, RowView xr, int64_t n, int64_t cols, const float* __restrict__ mean,
                           const float* __restrict__ rstd, CodeSink sink, WidenSet widen) {
  if (kWiden && widen.none()) return;  // the steady state: one load per thread
  __shared__ MesaGroupStats staged[kWiden ? 1 : kSharedGroups];
  const bool with_stats = !kWiden && sink.stats != nullptr;
  StatsSink stats{sink.stats, sink.groups.count <= kSharedGroups ? staged : nullptr, sink.groups.count};
  if (with_stats) stats.begin();
  RunStats run;
  const int64_t nunits = ceil_div(n, kUnit);
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < nunits; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i0 = u * kUnit;
    const int live = int(n - i0 < kUnit ? n - i0 : kUnit);
    if (kWiden && !widen.unit(sink.groups, i0, live)) continue;
    float v[kUnit];
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      v[j] = 0.0f;
      if (j < live) {
        const int64_t i = i0 + j, r = i / cols, c = i - r * cols;
        v[j] = (to_float(x[xr.row(r) + c * xr.col_stride]) - mean[r]) * rstd[r];
      }
    }
    sink_unit(sink, i0, v, live, run, stats.target(), false, kWiden ? &widen : nullptr);
  }
  if (with_stats) {
    flush(run, stats.target());
    stats.end();
  }
}

// One unit of the saved x̂: decoded from codes, or read from a plain tensor.
template <typename T, bool kCodes>
__device__ __forceinline__ void load_xhat(const T* xh, const RowView& hr, const CodeSource& src, int64_t r,
                                          int64_t cols, int64_t c0, int live, float (&v)[kUnit]) {
  if (kCodes) {
    source_unit(src, r * cols + c0, live, v);
  } else {
    load_unit(xh + hr.row(r) + c0 * hr.col_stride, hr.col_stride, live, v, 0.0f);
  }
}

// What both backward kernels read per unit: dy, x̂ (decoded from codes or plain) and w (1 when
// absent) of columns [c0, c0 + live) of row r — dy pads with +0, so the padding adds +0 to
// the sums — and what they compute from it: the row sums Σ g and Σ g·x̂ (g = dy·w, unfused
// products), and dx = rstd·(g − a − x̂·bq).
template <typename T, bool kCodes>
struct BackwardRows {
  const T* dy;
  RowView gr;
  const T* xh;
  RowView hr;
  CodeSource src;
  const T* w;
  int64_t cols;

  // grow = dy + gr.row(r), computed once per row by the caller
  __device__ __forceinline__ void unit(const T* grow, int64_t r, int64_t c0, int live, float (&g)[kUnit],
                                       float (&xv)[kUnit], float (&wv)[kUnit]) const {
    load_unit(grow + c0 * gr.col_stride, gr.col_stride, live, g, 0.0f);
    load_xhat<T, kCodes>(xh, hr, src, r, cols, c0, live, xv);
    if (w != nullptr) {
      load_unit(w + c0, 1, live, wv, 0.0f);
    } else {
#pragma unroll
      for (int j = 0; j < kUnit; ++j) wv[j] = 1.0f;
    }
  }
};

__device__ __forceinline__ void add_row_sums(const float (&g)[kUnit], const float (&wv)[kUnit],
                                             const float (&xv)[kUnit], float& sg, float& sgx) {
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    const float gj = __fmul_rn(g[j], wv[j]);
    sg += gj;
    sgx = fmaf(gj, xv[j], sgx);
  }
}

__device__ __forceinline__ float dx_value(float g, float wv, float xv, float rs, float a, float bq) {
  return rs * __fsub_rn(__fsub_rn(__fmul_rn(g, wv), a), __fmul_rn(xv, bq));
}

// dx = rstd · (g − mean(g) − x̂ · mean(g·x̂)), g = dy · w. Rows streamed twice from global
// memory (the row sums, then dx): the second read hits L1/L2 for the row lengths of
// transformers.
template <typename T, int kTeam, bool kCodes>
// min 2 blocks per SM: up to 128 registers (nvcc's own cap spilled the 2-chunk variant on sm_80)
__global__ void __launch_bounds__(kTeam == kWarpSize ? kRowBlock : kLongBlock, 2)
    layernorm_backward_dx_kernel(const T* __restrict__ dy, RowView gr, const T* __restrict__ xh, RowView hr,
                                 CodeSource src, const float* __restrict__ rstd, const T* __restrict__ w,
                                 T* __restrict__ dx, RowView dr, int64_t rows, int64_t cols) {
  __shared__ float scratch[kWarpSize];
  const BackwardRows<T, kCodes> in{dy, gr, xh, hr, src, w, cols};
  const int rank = team_rank<kTeam>();
  const float inv_cols = 1.0f / float(cols);
  const int64_t step = int64_t(kTeam) * kUnit;
  for (int64_t r = team_index<kTeam>(); r < rows; r += team_count<kTeam>()) {
    const T* grow = dy + gr.row(r);
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
      const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
      float g[kUnit], xv[kUnit], wv[kUnit];
      in.unit(grow, r, c0, live, g, xv, wv);
      add_row_sums(g, wv, xv, sg, sgx);
    }
    const float a = team_sum<kTeam>(sg, scratch) * inv_cols;
    const float bq = team_sum<kTeam>(sgx, scratch) * inv_cols;
    const float rs = rstd[r];
    for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += step) {
      const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
      float g[kUnit], xv[kUnit], wv[kUnit];
      in.unit(grow, r, c0, live, g, xv, wv);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) g[j] = dx_value(g[j], wv[j], xv[j], rs, a, bq);
      store_unit(dx + dr.row(r) + c0 * dr.col_stride, dr.col_stride, live, g);
    }
  }
}

// dx and the dw/db partials in one pass over the rows (C <= 1024, K = 1, 2, 4 units of 8 per
// lane): block p takes the rows [p·R/P, (p+1)·R/P) (P = gridDim.x = partial_blocks, from the
// shape only), its warp w the rows r0 + w, r0 + w + 8, …; per row the dx kernel's two sweeps
// (the row sums, then dx: the same operations in the same order, so the same dx bits), and in
// the second sweep each lane adds dy·x̂ and dy of its own columns into registers. At the end
// the block adds its 8 warps' sums in warp order through shared memory (one unit of columns
// at a time) and writes its partial row of dw and db; layernorm_backward_final_kernel then
// adds the P partials in order, as before. No float atomics: the same bits on every run and
// every device.
constexpr int kRowWarps = kRowBlock / kWarpSize;
using WarpColumns = float[kRowWarps][kWarpSize * kUnit];
// The fused backward's staging of its warps' column sums (8 KiB): one __shared__ array for
// every instance (a non-template function), which the emulator then keeps once in each
// OS thread instead of once per instance (docs/emulator.md, "Resources").
__device__ __forceinline__ WarpColumns& warp_columns() {
  __shared__ WarpColumns stage;
  return stage;
}

template <typename T, int K, bool kCodes>
__global__ void __launch_bounds__(kRowBlock, 2)
    layernorm_backward_fused_kernel(const T* __restrict__ dy, RowView gr, const T* __restrict__ xh, RowView hr,
                                    CodeSource src, const float* __restrict__ rstd, const T* __restrict__ w,
                                    T* __restrict__ dx, RowView dr, int64_t rows, int64_t cols,
                                    float* __restrict__ partials) {
  constexpr int kWarps = kRowWarps;
  WarpColumns& stage = warp_columns();
  const int lane = int(threadIdx.x % kWarpSize), warp = int(threadIdx.x / kWarpSize);
  const int64_t parts = gridDim.x, p = blockIdx.x;
  const int64_t r0 = p * rows / parts, r1 = (p + 1) * rows / parts;
  const float inv_cols = 1.0f / float(cols);
  float dw[K][kUnit], db[K][kUnit];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < kUnit; ++j) dw[k][j] = db[k][j] = 0.0f;
  const BackwardRows<T, kCodes> in{dy, gr, xh, hr, src, w, cols};
  for (int64_t r = r0 + warp; r < r1; r += kWarps) {
    const T* grow = dy + gr.row(r);
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c0 = (int64_t(k) * kWarpSize + lane) * kUnit;
      if (c0 >= cols) continue;
      const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
      float g[kUnit], xv[kUnit], wv[kUnit];
      in.unit(grow, r, c0, live, g, xv, wv);
      add_row_sums(g, wv, xv, sg, sgx);
    }
    const float a = team_sum<kWarpSize>(sg, nullptr) * inv_cols;
    const float bq = team_sum<kWarpSize>(sgx, nullptr) * inv_cols;
    const float rs = rstd[r];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c0 = (int64_t(k) * kWarpSize + lane) * kUnit;
      if (c0 >= cols) continue;
      const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
      float g[kUnit], xv[kUnit], wv[kUnit], out[kUnit];
      in.unit(grow, r, c0, live, g, xv, wv);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        out[j] = dx_value(g[j], wv[j], xv[j], rs, a, bq);
        dw[k][j] = fmaf(g[j], xv[j], dw[k][j]);
        db[k][j] += g[j];
      }
      store_unit(dx + dr.row(r) + c0 * dr.col_stride, dr.col_stride, live, out);
    }
  }
  // the block's partial: Σ over its warps in warp order, one unit of columns per round
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kUnit; ++j) stage[warp][lane * kUnit + j] = half == 0 ? dw[k][j] : db[k][j];
      __syncthreads();
      const int64_t c = int64_t(k) * kWarpSize * kUnit + threadIdx.x;
      if (c < cols) {
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) sum += stage[v][threadIdx.x];
        partials[(half * parts + p) * cols + c] = sum;
      }
    }
  }
}

// Partial dw/db of rows [p·R/P, (p+1)·R/P) for one column per thread, summed in row order.
template <typename T, bool kCodes>
__global__ void __launch_bounds__(kColBlock)
    layernorm_backward_dwdb_kernel(const T* __restrict__ dy, RowView gr, const T* __restrict__ xh, RowView hr,
                                   CodeSource src, int64_t rows, int64_t cols, float* __restrict__ partials) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t parts = gridDim.y, p = blockIdx.y;
  const int64_t r0 = p * rows / parts, r1 = (p + 1) * rows / parts;
  const unsigned mask = (1u << src.bits) - 1u;
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = to_float(dy[gr.row(r) + c * gr.col_stride]);
    float xv;
    if (kCodes) {
      const int64_t i = r * cols + c;
      const unsigned code = (unsigned(src.codes[i * src.bits / 8]) >> ((i * src.bits) % 8)) & mask;
      const MesaGroupParams q = src.params[src.groups.group(i)];
      xv = fmaf(float(code), q.scale, q.offset);
    } else {
      xv = to_float(xh[hr.row(r) + c * hr.col_stride]);
    }
    dw = fmaf(g, xv, dw);
    db += g;
  }
  partials[p * cols + c] = dw;
  partials[(parts + p) * cols + c] = db;
}

__global__ void __launch_bounds__(kColBlock)
    layernorm_backward_final_kernel(const float* __restrict__ partials, int64_t parts, int64_t cols,
                                    float* __restrict__ dw, float* __restrict__ db) {
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      sw += partials[p * cols + c];
      sb += partials[(parts + p) * cols + c];
    }
    dw[c] = sw;
    db[c] = sb;
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
template <typename T, int kTeam, int kChunks>
MesaStatus launch_fwd(const MesaLayerNormForwardArgs& a, int64_t rows, int64_t cols, int block, void* stream) {
  const LnParams p{a.weight, a.bias, a.mean, a.rstd, a.eps};
  T* y = static_cast<T*>(a.y);
  return status_from(MESA_LAUNCH((layernorm_forward_kernel<T, kTeam, kChunks>), dim3(team_grid(rows, kTeam, block)),
                                 dim3(block), 0, stream, static_cast<const T*>(a.x), row_view(a.x_desc), y,
                                 y != nullptr ? row_view(a.y_desc) : RowView{}, rows, cols, p, code_sink_from(a.sink)));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The dense kernel when the views and the codes allow: y written, rows of C <= 1024 with
// C % 8 == 0, every tensor dense and 16-byte aligned, R·C < 2^31, and either nothing saved or
// codes rounded to nearest with the identity map and units of 8 in one group (with or without
// the batch statistics). One dispatch point: units per lane, then bits and statistics. The
// statistics-only pass of exact mode (no codes, no y) and stochastic rounding take the
// general kernel.
template <typename T>
struct LayerNormDense {
  const MesaLayerNormForwardArgs& a;
  CodeSink sink;
  int64_t rows, cols;
  void* stream;

  bool ok() const {
    const bool saving = sink.codes != nullptr || sink.stats != nullptr;
    return cols % kUnit == 0 && cols <= int64_t(kWarpSize) * kUnit * 4 && rows * cols < (int64_t(1) << 31) &&
           dense16(a.x, a.x_desc) && dense16(a.y, a.y_desc) && aligned16(a.weight) && aligned16(a.bias) &&
           (!saving || (sink.codes != nullptr && !sink.stochastic && !sink.sqrt_map && sink.groups.run % kUnit == 0 &&
                        group_map32_ok(sink.groups, rows * cols)));
  }

  template <int K, int kBits, bool kStats>
  MesaStatus launch() const {
    const auto kernel = layernorm_forward_dense_kernel<T, K, kBits, kStats>;
    const DenseQuantize q{kBits != 0 ? group_map32(sink.groups) : GroupMap32{}, sink.params, sink.codes, sink.seed};
    const LnParams p{a.weight, a.bias, a.mean, a.rstd, a.eps};
    const unsigned grid = resident_grid(kernel, rows * kWarpSize, kRowBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kRowBlock), 0, stream, static_cast<const T*>(a.x),
                                   static_cast<T*>(a.y), uint32_t(rows), uint32_t(cols), p, q, sink));
  }

  template <int K>
  MesaStatus with_units() const {
    const bool stats = sink.stats != nullptr;
    switch (sink.codes != nullptr ? sink.bits : 0) {
      case 8: return stats ? launch<K, 8, true>() : launch<K, 8, false>();
      case 4: return stats ? launch<K, 4, true>() : launch<K, 4, false>();
      case 2: return stats ? launch<K, 2, true>() : launch<K, 2, false>();
      default: return launch<K, 0, false>();
    }
  }

  MesaStatus run() const {
    if (cols <= int64_t(kWarpSize) * kUnit) return with_units<1>();
    if (cols <= int64_t(kWarpSize) * kUnit * 2) return with_units<2>();
    return with_units<4>();
  }
};

template <typename T>
struct LayerNormForwardOp {
  static MesaStatus run(const MesaLayerNormForwardArgs& a, void* stream) {
    const int64_t cols = row_length(a.x_desc);
    const int64_t rows = numel(a.x_desc) / cols;
    if (a.codes_only) {
      const int64_t n = rows * cols;
      const int64_t want = ceil_div(ceil_div(n, kUnit), kRowBlock), cap = int64_t(sm_count()) * 8;
      const unsigned grid = unsigned(want < cap ? want : cap);  // the widening pass: sized for every group
      const CodeSink sink = code_sink_from(a.sink);
      const WidenSet widen{a.widen, a.sink.group_count};
      if (a.widen != nullptr)
        return status_from(MESA_LAUNCH((layernorm_codes_kernel<T, true>), dim3(grid), dim3(kRowBlock), 0, stream,
                                       static_cast<const T*>(a.x), row_view(a.x_desc), n, cols, a.mean, a.rstd, sink,
                                       widen));
      return status_from(MESA_LAUNCH((layernorm_codes_kernel<T, false>), dim3(grid), dim3(kRowBlock), 0, stream,
                                     static_cast<const T*>(a.x), row_view(a.x_desc), n, cols, a.mean, a.rstd, sink,
                                     widen));
    }
    const LayerNormDense<T> dense{a, code_sink_from(a.sink), rows, cols, stream};
    if (dense.ok()) return dense.run();
    if (cols <= 256) return launch_fwd<T, kWarpSize, 1>(a, rows, cols, kRowBlock, stream);
    if (cols <= 512) return launch_fwd<T, kWarpSize, 2>(a, rows, cols, kRowBlock, stream);
    if (cols <= 1024) return launch_fwd<T, kWarpSize, 4>(a, rows, cols, kRowBlock, stream);
    if (cols <= int64_t(kLongBlock) * kUnit) return launch_fwd<T, kLongBlock, 1>(a, rows, cols, kLongBlock, stream);
    return launch_fwd<T, kLongBlock, 0>(a, rows, cols, kLongBlock, stream);
  }
};

// dw, db = the ordered sums of the P partial rows.
inline MesaStatus final_sums(const MesaLayerNormBackwardArgs& a, int64_t cols, void* stream) {
  const int64_t col_blocks = ceil_div(cols, kColBlock), cap = int64_t(sm_count()) * 4;
  return status_from(MESA_LAUNCH(layernorm_backward_final_kernel, dim3(unsigned(col_blocks < cap ? col_blocks : cap)),
                                 dim3(kColBlock), 0, stream, a.partials, a.partial_blocks, cols, a.dweight, a.dbias));
}

template <typename T, bool kCodes>
MesaStatus launch_bwd(const MesaLayerNormBackwardArgs& a, int64_t rows, int64_t cols, void* stream) {
  const T* dy = static_cast<const T*>(a.dy);
  const T* xh = static_cast<const T*>(a.xhat);
  const RowView gr = row_view(a.dy_desc);
  const RowView hr = kCodes ? RowView{} : row_view(a.xhat_desc);
  const CodeSource src = code_source_from(a.source);
  const T* w = static_cast<const T*>(a.weight);
  if (a.dx != nullptr && a.dweight != nullptr && cols <= int64_t(kWarpSize) * kUnit * 4) {
    // rows of up to 1024: dx and the dw/db partials in one pass over the rows
    T* dx = static_cast<T*>(a.dx);
    const RowView dr = row_view(a.dx_desc);
    const dim3 grid(unsigned(a.partial_blocks)), block(kRowBlock);
    MesaStatus s;
    if (cols <= int64_t(kWarpSize) * kUnit)
      s = status_from(MESA_LAUNCH((layernorm_backward_fused_kernel<T, 1, kCodes>), grid, block, 0, stream, dy, gr, xh,
                                  hr, src, a.rstd, w, dx, dr, rows, cols, a.partials));
    else if (cols <= int64_t(kWarpSize) * kUnit * 2)
      s = status_from(MESA_LAUNCH((layernorm_backward_fused_kernel<T, 2, kCodes>), grid, block, 0, stream, dy, gr, xh,
                                  hr, src, a.rstd, w, dx, dr, rows, cols, a.partials));
    else
      s = status_from(MESA_LAUNCH((layernorm_backward_fused_kernel<T, 4, kCodes>), grid, block, 0, stream, dy, gr, xh,
                                  hr, src, a.rstd, w, dx, dr, rows, cols, a.partials));
    if (s != MESA_STATUS_OK) return s;
    return final_sums(a, cols, stream);
  }
  if (a.dx != nullptr) {
    T* dx = static_cast<T*>(a.dx);
    const RowView dr = row_view(a.dx_desc);
    const MesaStatus s =
        cols <= 1024
            ? status_from(MESA_LAUNCH((layernorm_backward_dx_kernel<T, kWarpSize, kCodes>),
                                      dim3(team_grid(rows, kWarpSize, kRowBlock)), dim3(kRowBlock), 0, stream, dy, gr,
                                      xh, hr, src, a.rstd, w, dx, dr, rows, cols))
            : status_from(MESA_LAUNCH((layernorm_backward_dx_kernel<T, kLongBlock, kCodes>),
                                      dim3(team_grid(rows, kLongBlock, kLongBlock)), dim3(kLongBlock), 0, stream, dy,
                                      gr, xh, hr, src, a.rstd, w, dx, dr, rows, cols));
    if (s != MESA_STATUS_OK) return s;
  }
  if (a.dweight == nullptr) return MESA_STATUS_OK;
  const int64_t col_blocks = ceil_div(cols, kColBlock);
  const MesaStatus s = status_from(MESA_LAUNCH((layernorm_backward_dwdb_kernel<T, kCodes>),
                                               dim3(unsigned(col_blocks), unsigned(a.partial_blocks)), dim3(kColBlock),
                                               0, stream, dy, gr, xh, hr, src, rows, cols, a.partials));
  if (s != MESA_STATUS_OK) return s;
  return final_sums(a, cols, stream);
}

template <typename T>
struct LayerNormBackwardOp {
  static MesaStatus run(const MesaLayerNormBackwardArgs& a, void* stream) {
    const int64_t cols = row_length(a.dy_desc);
    const int64_t rows = numel(a.dy_desc) / cols;
    return a.source.codes != nullptr ? launch_bwd<T, true>(a, rows, cols, stream)
                                     : launch_bwd<T, false>(a, rows, cols, stream);
  }
};

inline bool same_rows(const MesaTensorDesc& a, const MesaTensorDesc& b) {
  return a.ndim >= 1 && b.ndim >= 1 && numel(a) == numel(b) && row_length(a) == row_length(b) && a.dtype == b.dtype;
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(layernorm_forward)(const MesaLayerNormForwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || a->x_desc.ndim < 1 || !code_sink_valid(a->sink))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->y != nullptr && (!desc_valid(a->y_desc) || !same_rows(a->x_desc, a->y_desc))) return MESA_STATUS_INVALID_ARGUMENT;
  if (!(a->eps > 0.0f) || !(a->eps < 3.402823466e38f)) return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t cols = row_length(a->x_desc);
  if (a->widen != nullptr && (!a->codes_only || a->sink.codes == nullptr || a->sink.stats != nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;  // the widening pass: codes from saved params only
  if (a->codes_only) {
    if (a->mean == nullptr || a->rstd == nullptr || (a->sink.codes == nullptr && a->sink.stats == nullptr))
      return MESA_STATUS_INVALID_ARGUMENT;
  } else if (a->sink.codes != nullptr && (cols * a->sink.bits) % 8 != 0) {
    return MESA_STATUS_UNSUPPORTED;  // rows must start on a byte: use codes_only after this pass
  }
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<LayerNormForwardOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(layernorm_backward)(const MesaLayerNormBackwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->dy_desc) || a->dy_desc.ndim < 1 || !code_source_valid(a->source))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->dx != nullptr && (!desc_valid(a->dx_desc) || !same_rows(a->dy_desc, a->dx_desc))) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->source.codes == nullptr && (!desc_valid(a->xhat_desc) || !same_rows(a->dy_desc, a->xhat_desc)))
    return MESA_STATUS_INVALID_ARGUMENT;
  if ((a->dweight == nullptr) != (a->dbias == nullptr)) return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t cols = row_length(a->dy_desc);
  if (numel(a->dy_desc) == 0) {
    // no rows: dweight = dbias = 0 (the final kernel over zero partial ranges)
    if (a->dweight == nullptr || cols == 0) return MESA_STATUS_OK;
    const int64_t blocks = ceil_div(cols, kColBlock), cap = int64_t(sm_count()) * 4;
    return status_from(MESA_LAUNCH(layernorm_backward_final_kernel, dim3(unsigned(blocks < cap ? blocks : cap)),
                                   dim3(kColBlock), 0, stream, a->partials, int64_t(0), cols, a->dweight, a->dbias));
  }
  if (a->dweight != nullptr && (a->partials == nullptr || a->partial_blocks < 1 || a->partial_blocks > 65535))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->dy == nullptr || a->rstd == nullptr || (a->source.codes == nullptr && a->xhat == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (ceil_div(row_length(a->dy_desc), kColBlock) > 2147483647LL) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<LayerNormBackwardOp>(a->dy_desc.dtype, *a, stream);
}
