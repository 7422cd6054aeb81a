// softmax.cu — softmax over the last axis fused with activation compression (Mesa §3; BRIEF
// §5.1): the forward writes y = softmax(x + mask) AND the codes of y — the only tensor its
// backward needs — in the same pass; the backward decodes y inside the kernel.
//
// Math (f32, per row of N):
//   v_j = x_j + mask_j,  m = max_j v_j,  e_j = exp(v_j − m),  s = Σ e_j,  y_j = e_j / s
//   a fully masked row (every v_j = −inf) gives y = 0 (no NaN; it attends to nothing).
//   backward: dx_j = y_j · (dy_j − Σ_k dy_k · y_k)
// Codes of y: y ∈ [0, 1], so the parameters are fixed: offset 0, scale 1 / (2^bits − 1) —
// no statistics pass, no running estimate, nothing ever clamps. The value encoded is the
// stored (dtype-rounded) output, so the codes are exactly Q(y) of the tensor the caller got.
// sink.map = MESA_CODE_MAP_SQRT (the crate's default) encodes √y instead and the backward
// decodes ŷ = q·q, q = code·scale (quant_common.cuh: code_domain/decode): steps ≈ 2√y/L in y,
// ~5× finer than 1/L where a long row's probabilities sit (≈ 1/N). One sqrt per element more.
//
// Kernels (R rows of N, T input, b bits):
//   softmax_forward_kernel    reads R·N·sizeof(T) (+ mask), writes R·N·sizeof(T) + R·N·b/8
//                             ~5 FLOP + 1 exp per element
//   softmax_backward_kernel   reads R·N·(sizeof(T) + b/8), writes R·N·sizeof(T); 4 FLOP/element
// Launch policy (row length N):
//   dense:      rows dense and 16-byte aligned, N % 8 == 0, N <= 1024, round to nearest (or
//               nothing saved): softmax_forward_dense_kernel, bits and code map fixed at
//               compile time, the same results bit for bit; grid from the occupancy API.
//   N <= 1024:  one warp per row, the row in registers (8, 16 or 32 values per lane), 8 rows
//               per 256-thread block: no shared memory, no __syncthreads, one read of x.
//   N <= 4096:  one 512-thread block per row, the row in registers (8 values per thread).
//   N >  4096:  one 512-thread block per row, streaming: max, sum and write passes re-read
//               the row (from L2 for rows up to a few MB), so any N works (rows of 32k+).
// Reference: crates/mesa-kernels/src/reference/fused.rs.  Bytes and floors: docs/fused.md.
#include "rows.cuh"

namespace MESA_NS {

constexpr int kRowBlock = 256;   // warp-per-row kernels: 8 rows in flight per block
constexpr int kLongBlock = 512;  // block-per-row kernels: 16 warps share a long row
constexpr float kNegInf = -__builtin_huge_valf();

// v = x + mask over one unit of a row (pad: −inf beyond the row).
template <typename T>
__device__ __forceinline__ void load_logits(const T* x, const T* mask, int64_t xs, int64_t ms, int live,
                                            float (&v)[kUnit]) {
  load_unit(x, xs, live, v, kNegInf);
  if (mask != nullptr) {
    float mv[kUnit];
    load_unit(mask, ms, live, mv, 0.0f);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) v[j] += mv[j];
  }
}

__device__ __forceinline__ float exp_shifted(float v, float m) {
  // −inf entries (masked, or padding) contribute 0; a fully masked row has m = −inf
  return (v == kNegInf) ? 0.0f : expf(v - m);
}

// Writes one unit of y (and its codes); counts non-finite outputs and poisons their group
// whenever the output is saved (sink.params set) — also when the codes come from the separate
// pass over y (rows that do not start on a byte: sink.codes null here, quantize.cu after),
// so both passes give the same count and the same NaN group.
template <typename T>
__device__ __forceinline__ void emit_unit(T* y, int64_t ys, int live, float (&out)[kUnit], const CodeSink& sink,
                                          int64_t i0, unsigned* nonfinite) {
  store_unit(y, ys, live, out);
  if (sink.params == nullptr) return;  // plain softmax: nothing saved
  unsigned bad = 0u;
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    out[j] = to_float(from_float<T>(out[j]));  // encode what was stored
    if (j < live && !is_finite(out[j])) {
      bad += 1u;
      // the saved group must decode to NaN, never to finite stand-ins: poison its scale
      // (every writer stores the same NaN; the encoding of that group no longer matters)
      MesaGroupParams* params = const_cast<MesaGroupParams*>(sink.params);
      atomicExch(reinterpret_cast<unsigned*>(&params[sink.groups.group(i0 + j)].scale), 0x7fc00000u);
    }
  }
  if (sink.codes != nullptr) {
    RunStats unused;
    sink_unit(sink, i0, out, live, unused, nullptr, sink.sqrt_map);
  }
  if (bad != 0u && nonfinite != nullptr) atomicAdd(nonfinite, bad);
}

template <typename T, int kTeam, int kChunks>
// min 2 blocks per SM: lets nvcc use up to 128 registers (its own choice, 80, spilled the
// 4-chunk f32 variant's 32 row values)
__global__ void __launch_bounds__(kTeam == kWarpSize ? kRowBlock : kLongBlock, 2)
    softmax_forward_kernel(const T* __restrict__ x, RowView xr, const T* __restrict__ mask, RowView mr,
                           T* __restrict__ y, RowView yr, int64_t rows, int64_t cols, CodeSink sink,
                           unsigned* nonfinite) {
  __shared__ float scratch[kWarpSize];
  const int rank = team_rank<kTeam>();
  for (int64_t r = team_index<kTeam>(); r < rows; r += team_count<kTeam>()) {
    const T* xrow = x + xr.row(r);
    const T* mrow = mask != nullptr ? mask + mr.row(r) : nullptr;
    T* yrow = y + yr.row(r);
    float m = kNegInf;
    if (kChunks > 0) {
      constexpr int K = kChunks > 0 ? kChunks : 1;
      float v[K][kUnit];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
        const int live = int(c0 >= cols ? 0 : (cols - c0 < kUnit ? cols - c0 : kUnit));
        if (live > 0) {
          load_logits(xrow + c0 * xr.col_stride, mrow ? mrow + c0 * mr.col_stride : nullptr, xr.col_stride,
                      mr.col_stride, live, v[k]);
        } else {
#pragma unroll
          for (int j = 0; j < kUnit; ++j) v[k][j] = kNegInf;
        }
#pragma unroll
        for (int j = 0; j < kUnit; ++j) m = fmaxf(m, v[k][j]);
      }
      m = team_max<kTeam>(m, scratch);
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < kUnit; ++j) {
          v[k][j] = exp_shifted(v[k][j], m);
          s += v[k][j];
        }
      s = team_sum<kTeam>(s, scratch);
      // s >= 1 (the max term is exp(0)); s = 0: a fully masked row gives zeros; s = NaN (a NaN or
      // +inf logit) makes the whole row NaN, as in PyTorch
      const float inv = s > 0.0f ? reciprocal(s) : (s == 0.0f ? 0.0f : __uint_as_float(0x7fc00000u));
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
        const int live = int(c0 >= cols ? 0 : (cols - c0 < kUnit ? cols - c0 : kUnit));
        if (live <= 0) continue;
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[k][j] *= inv;
        emit_unit(yrow + c0 * yr.col_stride, yr.col_stride, live, v[k], sink, r * cols + c0, nonfinite);
      }
    } else {
      // streaming: pass 1 max, pass 2 sum, pass 3 write
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += int64_t(kTeam) * kUnit) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_logits(xrow + c0 * xr.col_stride, mrow ? mrow + c0 * mr.col_stride : nullptr, xr.col_stride,
                    mr.col_stride, live, v);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) m = fmaxf(m, v[j]);
      }
      m = team_max<kTeam>(m, scratch);
      float s = 0.0f;
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += int64_t(kTeam) * kUnit) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_logits(xrow + c0 * xr.col_stride, mrow ? mrow + c0 * mr.col_stride : nullptr, xr.col_stride,
                    mr.col_stride, live, v);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) s += exp_shifted(v[j], m);
      }
      s = team_sum<kTeam>(s, scratch);
      // s >= 1 (the max term is exp(0)); s = 0: a fully masked row gives zeros; s = NaN (a NaN or
      // +inf logit) makes the whole row NaN, as in PyTorch
      const float inv = s > 0.0f ? reciprocal(s) : (s == 0.0f ? 0.0f : __uint_as_float(0x7fc00000u));
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += int64_t(kTeam) * kUnit) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float v[kUnit];
        load_logits(xrow + c0 * xr.col_stride, mrow ? mrow + c0 * mr.col_stride : nullptr, xr.col_stride,
                    mr.col_stride, live, v);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[j] = exp_shifted(v[j], m) * inv;
        emit_unit(yrow + c0 * yr.col_stride, yr.col_stride, live, v, sink, r * cols + c0, nonfinite);
      }
    }
  }
}

// √y for y in [2^-101, FLT_MAX], correctly rounded: the fast path of IEEE sqrtf (sqrt.rn.f32)
// as ptxas expands it for that range — r = MUFU.RSQ(y), s = y·r, s + (y − s²)·(r/2) — without
// the per-element branch to its slow path. Below the range it is not sqrtf, but its code is
// still 0, the code of sqrtf(y) there (√y · (2^bits − 1) < 2^-42): a y below 2^-126 (zero
// included) is flushed, so r = +inf and s = 0·inf = NaN, which code_below_top takes to 0; a
// normal y below 2^-101 gives √y within a few ulps. The emulation uses sqrtf.
__device__ __forceinline__ float sqrt_for_codes(float y) {
#ifdef MESA_EMU
  return sqrtf(y);
#else
  float out;
  asm("{\n\t.reg .f32 r, s, h, e;\n\t"
      "rsqrt.approx.ftz.f32 r, %1;\n\t"
      "mul.ftz.f32 s, %1, r;\n\t"
      "mul.ftz.f32 h, r, 0f3F000000;\n\t"
      "neg.f32 e, s;\n\t"
      "fma.rn.f32 e, e, s, %1;\n\t"
      "fma.rn.f32 %0, e, h, s;\n\t}"
      : "=f"(out)
      : "f"(y));
  return out;
#endif
}

// The code of position t = u · inv_scale for u in [0, 1.001] or NaN: t < levels + 1/2, so
// nearest_code's clamp never applies (the same code, one instruction fewer); NaN gives 0
// (cvt.rni.u32.f32, as fmaxf(NaN, 0) does in encode).
__device__ __forceinline__ unsigned code_below_top(float t) {
#ifdef MESA_EMU
  return t > 0.0f ? unsigned(rintf(t)) : 0u;
#else
  return __float2uint_rn(t);
#endif
}

// A unit of a NaN row of the dense kernel (a NaN or +inf logit makes the whole row NaN): its
// y (NaN) and codes (0: encode takes NaN to 0) are already written; this is emit_unit's
// accounting, the same count and the same poisoned groups.
__device__ __forceinline__ void count_nan_unit(const CodeSink& sink, int64_t i0, unsigned* nonfinite) {
  MesaGroupParams* params = const_cast<MesaGroupParams*>(sink.params);
#pragma unroll
  for (int j = 0; j < kUnit; ++j)
    atomicExch(reinterpret_cast<unsigned*>(&params[sink.groups.group(i0 + j)].scale), 0x7fc00000u);
  if (nonfinite != nullptr) atomicAdd(nonfinite, unsigned(kUnit));
}

// Dense kernel (warp per row, rows of N <= 1024 columns with N % 8 == 0): x, mask and y dense
// and 16-byte aligned, R·N < 2^31; codes (kBits != 0) rounded to nearest into this call's fixed
// parameters (offset 0, scale 1/(2^bits − 1), the ones softmax_params_kernel writes). Bits and
// code map are template arguments; a lane holds units k·32 + lane (k < 4) of its row in
// registers, a unit past the row as −inf (it adds exactly +0 to the sum, as in the general
// kernel). Values and codes are softmax_forward_kernel's bit for bit: the same max and sum in
// the same order, the same expf and reciprocal, the codes of the stored y by the fast path of
// quantize_dense_unit (offset 0, prescale 1: t = fl(u · inv_scale), nearest). A NaN row also
// gets count_nan_unit; a fully masked row (max −inf) gives zeros, as there. The codes of the
// other rows of a group that a NaN row poisoned are left as encoded (the general kernel may
// encode them with the poisoned scale): the group decodes to NaN either way.
template <typename T, int kBits, bool kSqrt>
__global__ void __launch_bounds__(kRowBlock, 2)
    softmax_forward_dense_kernel(const T* __restrict__ x, const T* __restrict__ mask, T* __restrict__ y,
                                 uint32_t rows, uint32_t cols, CodeSink sink, unsigned* nonfinite) {
  constexpr int K = 4;
  constexpr unsigned kLevels = (1u << (kBits != 0 ? kBits : 1)) - 1u;
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint32_t teams = gridDim.x * (kRowBlock / kWarpSize);
  const CodeParams p = code_params(MesaGroupParams{0.0f, 1.0f / float(kLevels)});
  for (uint32_t r = blockIdx.x * (kRowBlock / kWarpSize) + threadIdx.x / kWarpSize; r < rows; r += teams) {
    const uint32_t row0 = r * cols;
    float v[K][kUnit];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t c0 = (uint32_t(k) * kWarpSize + lane) * kUnit;
      constexpr int W = kUnitWords<T>;
      uint4 xw[W], mw[W];  // past the row: −inf logits, 0 mask
#pragma unroll
      for (int h = 0; h < W; ++h) {
        const uint32_t ninf = splat_word<T>(kNegInf);
        xw[h] = make_uint4(ninf, ninf, ninf, ninf);
        mw[h] = make_uint4(0u, 0u, 0u, 0u);
      }
      if (c0 < cols) {
#pragma unroll
        for (int h = 0; h < W; ++h) {
          xw[h] = load16_words(x + row0 + c0 + h * Vec16<T>::N);
          if (mask != nullptr) mw[h] = load16_words(mask + row0 + c0 + h * Vec16<T>::N);
        }
      }
      unit_from_words<T>(xw, v[k]);
      if (mask != nullptr) {
        float mv[kUnit];
        unit_from_words<T>(mw, mv);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[k][j] += mv[j];
      }
    }
    float m = kNegInf;
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < kUnit; ++j) m = fmaxf(m, v[k][j]);
    m = warp_reduce_max(m);
    // exp(−inf − m) = +0 for a finite or +inf m; m = −inf (fully masked row): zeros
    const float shift = m == kNegInf ? 0.0f : m;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        v[k][j] = expf(v[k][j] - shift);
        s += v[k][j];
      }
    s = warp_reduce_sum(s);
    const float inv = s > 0.0f ? reciprocal(s) : (s == 0.0f ? 0.0f : __uint_as_float(0x7fc00000u));
    const bool nan_row = kBits != 0 && !is_finite(inv);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t c0 = (uint32_t(k) * kWarpSize + lane) * kUnit;
#pragma unroll
      for (int j = 0; j < kUnit; ++j) v[k][j] *= inv;
      uint4 out[kUnitWords<T>];
      float u[kUnit];
      unit_to_words<T>(v[k], out);
      unit_from_words<T>(out, u);  // encode what is stored
      unsigned codes[kUnit];
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        const float c = kSqrt ? sqrt_for_codes(u[j]) : u[j];
        codes[j] = code_below_top(__fmul_rn(c, p.inv_scale));
      }
      if (c0 < cols) {
#pragma unroll
        for (int h = 0; h < kUnitWords<T>; ++h) store16_words(y + row0 + c0 + h * Vec16<T>::N, out[h]);
        if constexpr (kBits != 0) store_unit_codes<kBits>(sink.codes + size_t(row0 + c0) * kBits / 8, codes);
        if (nan_row) count_nan_unit(sink, int64_t(row0) + c0, nonfinite);
      }
    }
  }
}

// The fixed code parameters of probabilities: offset 0, scale 1 / (2^bits − 1).
__global__ void __launch_bounds__(kRowBlock) softmax_params_kernel(MesaGroupParams* params, int64_t count, int bits) {
  const float scale = 1.0f / float((1u << bits) - 1u);
  for (int64_t g = threadIdx.x; g < count; g += blockDim.x) params[g] = MesaGroupParams{0.0f, scale};
}

// One unit of the saved output: decoded from codes, or read from a plain tensor.
template <typename T, bool kCodes>
__device__ __forceinline__ void load_saved(const T* y, const RowView& yr, const CodeSource& src, int64_t r,
                                           int64_t cols, int64_t c0, int live, float (&v)[kUnit]) {
  if (kCodes) {
    source_unit(src, r * cols + c0, live, v);
  } else {
    load_unit(y + yr.row(r) + c0 * yr.col_stride, yr.col_stride, live, v, 0.0f);
  }
}

// Backward: dx = y · (dy − Σ dy·y), y decoded from codes (kCodes) or read from a plain tensor.
template <typename T, int kTeam, int kChunks, bool kCodes>
// min 2 blocks per SM: lets nvcc use up to 128 registers (its own choice, 80, spilled the
// 4-chunk f32 variant's 32 row values)
__global__ void __launch_bounds__(kTeam == kWarpSize ? kRowBlock : kLongBlock, 2)
    softmax_backward_kernel(const T* __restrict__ dy, RowView gr, const T* __restrict__ y, RowView yr, CodeSource src,
                            T* __restrict__ dx, RowView dr, int64_t rows, int64_t cols) {
  __shared__ float scratch[kWarpSize];
  const int rank = team_rank<kTeam>();
  for (int64_t r = team_index<kTeam>(); r < rows; r += team_count<kTeam>()) {
    const T* grow = dy + gr.row(r);
    T* drow = dx + dr.row(r);
    float dot = 0.0f;
    if (kChunks > 0) {
      constexpr int K = kChunks > 0 ? kChunks : 1;
      float yv[K][kUnit], gv[K][kUnit];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
        const int live = int(c0 >= cols ? 0 : (cols - c0 < kUnit ? cols - c0 : kUnit));
#pragma unroll
        for (int j = 0; j < kUnit; ++j) yv[k][j] = gv[k][j] = 0.0f;
        if (live > 0) {
          load_saved<T, kCodes>(y, yr, src, r, cols, c0, live, yv[k]);
          load_unit(grow + c0 * gr.col_stride, gr.col_stride, live, gv[k], 0.0f);
        }
#pragma unroll
        for (int j = 0; j < kUnit; ++j) dot = fmaf(gv[k][j], yv[k][j], dot);
      }
      dot = team_sum<kTeam>(dot, scratch);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t c0 = (int64_t(k) * kTeam + rank) * kUnit;
        const int live = int(c0 >= cols ? 0 : (cols - c0 < kUnit ? cols - c0 : kUnit));
        if (live <= 0) continue;
#pragma unroll
        for (int j = 0; j < kUnit; ++j) gv[k][j] = yv[k][j] * (gv[k][j] - dot);
        store_unit(drow + c0 * dr.col_stride, dr.col_stride, live, gv[k]);
      }
    } else {
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += int64_t(kTeam) * kUnit) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float yv[kUnit], gv[kUnit];
        load_saved<T, kCodes>(y, yr, src, r, cols, c0, live, yv);
        load_unit(grow + c0 * gr.col_stride, gr.col_stride, live, gv, 0.0f);
#pragma unroll
        for (int j = 0; j < kUnit; ++j)
          if (j < live) dot = fmaf(gv[j], yv[j], dot);
      }
      dot = team_sum<kTeam>(dot, scratch);
      for (int64_t c0 = int64_t(rank) * kUnit; c0 < cols; c0 += int64_t(kTeam) * kUnit) {
        const int live = int(cols - c0 < kUnit ? cols - c0 : kUnit);
        float yv[kUnit], gv[kUnit];
        load_saved<T, kCodes>(y, yr, src, r, cols, c0, live, yv);
        load_unit(grow + c0 * gr.col_stride, gr.col_stride, live, gv, 0.0f);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) gv[j] = yv[j] * (gv[j] - dot);
        store_unit(drow + c0 * dr.col_stride, dr.col_stride, live, gv);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): see the header comment.
template <template <typename, int, int> class Launch, typename T, typename Args>
MesaStatus by_row_length(int64_t rows, int64_t cols, const Args& a, void* stream) {
  if (cols <= 256) return Launch<T, kWarpSize, 1>::run(a, rows, cols, team_grid(rows, kWarpSize, kRowBlock), kRowBlock, stream);
  if (cols <= 512) return Launch<T, kWarpSize, 2>::run(a, rows, cols, team_grid(rows, kWarpSize, kRowBlock), kRowBlock, stream);
  if (cols <= 1024) return Launch<T, kWarpSize, 4>::run(a, rows, cols, team_grid(rows, kWarpSize, kRowBlock), kRowBlock, stream);
  if (cols <= int64_t(kLongBlock) * kUnit)
    return Launch<T, kLongBlock, 1>::run(a, rows, cols, team_grid(rows, kLongBlock, kLongBlock), kLongBlock, stream);
  return Launch<T, kLongBlock, 0>::run(a, rows, cols, team_grid(rows, kLongBlock, kLongBlock), kLongBlock, stream);
}

template <typename T, int kTeam, int kChunks>
struct SoftmaxForwardLaunch {
  static MesaStatus run(const MesaSoftmaxForwardArgs& a, int64_t rows, int64_t cols, unsigned grid, int block,
                        void* stream) {
    const T* mask = static_cast<const T*>(a.mask);
    return status_from(MESA_LAUNCH((softmax_forward_kernel<T, kTeam, kChunks>), dim3(grid), dim3(block), 0, stream,
                                   static_cast<const T*>(a.x), row_view(a.x_desc), mask,
                                   mask != nullptr ? row_view(a.mask_desc) : RowView{}, static_cast<T*>(a.y),
                                   row_view(a.y_desc), rows, cols, code_sink_from(a.sink),
                                   reinterpret_cast<unsigned*>(a.nonfinite)));
  }
};


// The dense kernel when the views and the codes allow (one dispatch point: bits, then map),
// else the general kernels by row length.
template <typename T>
struct SoftmaxForwardOp {
  const MesaSoftmaxForwardArgs& a;
  CodeSink sink;
  int64_t rows, cols;
  void* stream;

  bool dense_ok() const {
    const int64_t n = rows * cols;
    const bool saving = sink.params != nullptr;
    return cols % kUnit == 0 && cols <= int64_t(kWarpSize) * kUnit * 4 && n < (int64_t(1) << 31) &&
           dense16(a.x, a.x_desc) && dense16(a.y, a.y_desc) && (a.mask == nullptr || dense16(a.mask, a.mask_desc)) &&
           (sink.codes != nullptr) == saving &&
           (!saving || (!sink.stochastic && sink.params == a.params_out && a.params_count == sink.groups.count));
  }

  template <int kBits, bool kSqrt>
  MesaStatus dense() const {
    const auto kernel = softmax_forward_dense_kernel<T, kBits, kSqrt>;
    const unsigned grid = resident_grid(kernel, rows * kWarpSize, kRowBlock);
    return status_from(MESA_LAUNCH(kernel, dim3(grid), dim3(kRowBlock), 0, stream, static_cast<const T*>(a.x),
                                   static_cast<const T*>(a.mask), static_cast<T*>(a.y), uint32_t(rows),
                                   uint32_t(cols), sink, reinterpret_cast<unsigned*>(a.nonfinite)));
  }

  template <int kBits>
  MesaStatus with_bits() const {
    return sink.sqrt_map ? dense<kBits, true>() : dense<kBits, false>();
  }

  static MesaStatus run(const MesaSoftmaxForwardArgs& a, void* stream) {
    const int64_t cols = row_length(a.x_desc);
    const SoftmaxForwardOp op{a, code_sink_from(a.sink), numel(a.x_desc) / cols, cols, stream};
    if (!op.dense_ok()) return by_row_length<SoftmaxForwardLaunch, T>(op.rows, cols, a, stream);
    switch (op.sink.params != nullptr ? op.sink.bits : 0) {
      case 8: return op.template with_bits<8>();
      case 4: return op.template with_bits<4>();
      case 2: return op.template with_bits<2>();
      default: return op.template dense<0, false>();
    }
  }
};

template <typename T, int kTeam, int kChunks>
struct SoftmaxBackwardLaunch {
  static MesaStatus run(const MesaSoftmaxBackwardArgs& a, int64_t rows, int64_t cols, unsigned grid, int block,
                        void* stream) {
    const T* y = static_cast<const T*>(a.y);
    const RowView yr = a.source.codes == nullptr ? row_view(a.y_desc) : RowView{};
    if (a.source.codes != nullptr)
      return status_from(MESA_LAUNCH((softmax_backward_kernel<T, kTeam, kChunks, true>), dim3(grid), dim3(block), 0,
                                     stream, static_cast<const T*>(a.dy), row_view(a.dy_desc), y, yr,
                                     code_source_from(a.source), static_cast<T*>(a.dx), row_view(a.dx_desc), rows,
                                     cols));
    return status_from(MESA_LAUNCH((softmax_backward_kernel<T, kTeam, kChunks, false>), dim3(grid), dim3(block), 0,
                                   stream, static_cast<const T*>(a.dy), row_view(a.dy_desc), y, yr,
                                   code_source_from(a.source), static_cast<T*>(a.dx), row_view(a.dx_desc), rows, cols));
  }
};

template <typename T>
struct SoftmaxBackwardOp {
  static MesaStatus run(const MesaSoftmaxBackwardArgs& a, void* stream) {
    const int64_t cols = row_length(a.dy_desc);
    return by_row_length<SoftmaxBackwardLaunch, T>(numel(a.dy_desc) / cols, cols, a, stream);
  }
};

inline bool same_rows(const MesaTensorDesc& a, const MesaTensorDesc& b) {
  return a.ndim >= 1 && b.ndim >= 1 && numel(a) == numel(b) && row_length(a) == row_length(b) && a.dtype == b.dtype;
}

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(softmax_forward)(const MesaSoftmaxForwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || !desc_valid(a->y_desc) || !same_rows(a->x_desc, a->y_desc))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->mask != nullptr && (!desc_valid(a->mask_desc) || !same_rows(a->x_desc, a->mask_desc)))
    return MESA_STATUS_INVALID_ARGUMENT;
  // softmax codes carry fixed parameters: no statistics
  // (code_sink_valid also checks sink.map)
  if (!code_sink_valid(a->sink) || a->sink.stats != nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->params_out != nullptr && (a->params_count < 1 || !bits_valid(a->sink.bits))) return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t cols = row_length(a->x_desc);
  // fused codes: every row must start on a byte
  if (a->sink.codes != nullptr && (cols * a->sink.bits) % 8 != 0) return MESA_STATUS_UNSUPPORTED;
  if (a->params_out != nullptr) {
    const MesaStatus s = status_from(MESA_LAUNCH(softmax_params_kernel, dim3(1), dim3(kRowBlock), 0, stream,
                                                 a->params_out, a->params_count, int(a->sink.bits)));
    if (s != MESA_STATUS_OK) return s;
  }
  if (numel(a->x_desc) == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->y == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<SoftmaxForwardOp>(a->x_desc.dtype, *a, stream);
}

extern "C" MesaStatus MESA_ENTRY(softmax_backward)(const MesaSoftmaxBackwardArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->dy_desc) || !desc_valid(a->dx_desc) || !same_rows(a->dy_desc, a->dx_desc) ||
      !code_source_valid(a->source))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->source.codes == nullptr && (!desc_valid(a->y_desc) || !same_rows(a->dy_desc, a->y_desc)))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->dy_desc) == 0) return MESA_STATUS_OK;
  if (a->dy == nullptr || a->dx == nullptr || (a->source.codes == nullptr && a->y == nullptr))
    return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<SoftmaxBackwardOp>(a->dy_desc.dtype, *a, stream);
}
