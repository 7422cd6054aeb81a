// rows.cuh — what the row ops (softmax.cu, layernorm.cu) and the elementwise fused ops
// (gelu.cu) share: 8-element unit loads/stores (16-byte vectors when the memory allows),
// row views over the last axis, and reductions over a "team" (one warp or one block) that
// owns a row.
#pragma once

#include "quant_common.cuh"

namespace MESA_NS {

// ---------------------------------------------------------------------------------------
// Unit access: `live` (<= 8) elements starting at p, `stride` elements apart. Contiguous,
// whole and 16-byte aligned units use 16-byte vectors (one for 16-bit types, two for f32).
template <typename T>
__device__ __forceinline__ bool unit_vector_ok(const T* p, int64_t stride, int live) {
  return stride == 1 && live == kUnit && (reinterpret_cast<uintptr_t>(p) % 16 == 0);
}

template <typename T>
__device__ __forceinline__ void load_unit(const T* p, int64_t stride, int live, float (&v)[kUnit], float pad) {
  if (unit_vector_ok(p, stride, live)) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int h = 0; h < kUnit / V; ++h) {
      const Vec16<T> in = load16(p + h * V);
#pragma unroll
      for (int j = 0; j < V; ++j) v[h * V + j] = to_float(in.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) v[j] = j < live ? to_float(p[j * stride]) : pad;
  }
}

template <typename T>
__device__ __forceinline__ void store_unit(T* p, int64_t stride, int live, const float (&v)[kUnit]) {
  if (unit_vector_ok(p, stride, live)) {
    store_dense_unit(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j)
      if (j < live) p[j * stride] = from_float<T>(v[j]);
  }
}

// A whole unit of 8 as 16-byte words (one for 16-bit types, two for f32), to and from f32,
// the same bits as to_float / from_float per element: the dense kernels keep loaded and
// packed values in 32-bit registers (no 16-bit element moves).
template <typename T>
constexpr int kUnitWords = kUnit * int(sizeof(T)) / 16;

template <typename T>
__device__ __forceinline__ void unit_from_words(const uint4 (&w)[kUnitWords<T>], float (&v)[kUnit]) {
#pragma unroll
  for (int h = 0; h < kUnitWords<T>; ++h) {
    const uint32_t q[4] = {w[h].x, w[h].y, w[h].z, w[h].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2) {
        unpack2_word<T>(q[i], v[h * 8 + 2 * i], v[h * 8 + 2 * i + 1]);
      } else {
        v[h * 4 + i] = __uint_as_float(q[i]);
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void unit_to_words(const float (&v)[kUnit], uint4 (&w)[kUnitWords<T>]) {
#pragma unroll
  for (int h = 0; h < kUnitWords<T>; ++h) {
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2) {
        q[i] = pack2_word<T>(v[h * 8 + 2 * i], v[h * 8 + 2 * i + 1]);
      } else {
        q[i] = __float_as_uint(v[h * 4 + i]);
      }
    }
    w[h] = make_uint4(q[0], q[1], q[2], q[3]);
  }
}

// The word of two T holding `v` each (f32: one).
template <typename T>
__device__ __forceinline__ uint32_t splat_word(float v) {
  if constexpr (sizeof(T) == 2) {
    return pack2_word<T>(v, v);
  } else {
    return __float_as_uint(v);
  }
}

// Host: a tensor the dense kernels may address directly (16-byte vectors): dense, 16-byte
// aligned, not null.
inline bool dense16(const void* p, const MesaTensorDesc& d) {
  return p != nullptr && is_dense(d) && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A 16-byte word of T all holding `v`.
template <typename T>
__device__ __forceinline__ uint4 splat4(float v) {
  const uint32_t w = splat_word<T>(v);
  return make_uint4(w, w, w, w);
}

// Elementwise ops: logical unit [i0, i0 + live) of a tensor view. Dense views address it
// directly (vector path); strided ones element by element.
template <typename T>
__device__ __forceinline__ void load_view_unit(const T* base, const Strided& view, bool dense, int64_t i0, int live,
                                               float (&v)[kUnit]) {
  if (dense) {
    load_unit(base + i0, 1, live, v, 0.0f);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) v[j] = j < live ? to_float(base[view.offset(i0 + j)]) : 0.0f;
  }
}
template <typename T>
__device__ __forceinline__ void store_view_unit(T* base, const Strided& view, bool dense, int64_t i0, int live,
                                                const float (&v)[kUnit]) {
  if (dense) {
    store_unit(base + i0, 1, live, v);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j)
      if (j < live) base[view.offset(i0 + j)] = from_float<T>(v[j]);
  }
}

// ---------------------------------------------------------------------------------------
// Rows along the last axis: row r starts at outer.offset(r); column c is col_stride apart.
struct RowView {
  Strided outer;  // the dimensions before the last (ndim - 1 of them)
  int64_t col_stride;
  __device__ __forceinline__ int64_t row(int64_t r) const { return outer.offset(r); }
};

inline RowView row_view(const MesaTensorDesc& d) {
  RowView v{strided_from(d), 0};
  v.outer.ndim = d.ndim - 1;
  v.outer.shape[d.ndim - 1] = 1;
  v.outer.strides[d.ndim - 1] = 0;
  v.col_stride = d.strides[d.ndim - 1];
  return v;
}

inline int64_t row_length(const MesaTensorDesc& d) { return d.ndim > 0 ? d.shape[d.ndim - 1] : 1; }

// ---------------------------------------------------------------------------------------
// Team reductions. A team is one warp (kTeam = 32) or a whole block (kTeam = blockDim.x).
// Every thread of the team gets the same result, summed in the same fixed order, so the
// results are deterministic. Block teams stage per-warp values in `scratch` (>= kTeam / 32
// floats of shared memory); the leading __syncthreads protects it from the previous use.
template <int kTeam>
__device__ __forceinline__ float team_sum(float v, float* scratch) {
  v = warp_reduce_sum(v);
  if (kTeam == kWarpSize) return v;
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < kTeam / kWarpSize; ++w) t += scratch[w];
  return t;
}
template <int kTeam>
__device__ __forceinline__ float team_max(float v, float* scratch) {
  v = warp_reduce_max(v);
  if (kTeam == kWarpSize) return v;
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float t = scratch[0];
  for (int w = 1; w < kTeam / kWarpSize; ++w) t = fmaxf(t, scratch[w]);
  return t;
}

// Index of this thread inside its team, the team's index in the grid, and the team count.
template <int kTeam>
__device__ __forceinline__ int team_rank() {
  return kTeam == kWarpSize ? int(threadIdx.x % kWarpSize) : int(threadIdx.x);
}
template <int kTeam>
__device__ __forceinline__ int64_t team_index() {
  return kTeam == kWarpSize ? int64_t(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize
                            : int64_t(blockIdx.x);
}
template <int kTeam>
__device__ __forceinline__ int64_t team_count() {
  return kTeam == kWarpSize ? int64_t(gridDim.x) * (blockDim.x / kWarpSize) : int64_t(gridDim.x);
}

// Grid of `block`-thread blocks for `teams` teams of kTeam threads, capped at a few waves of
// the machine (the kernels loop over teams).
inline unsigned team_grid(int64_t teams, int team, int block) {
  const int64_t per_block = block / team;
  const int64_t want = ceil_div(teams, per_block);
  const int64_t cap = int64_t(sm_count()) * 8;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}

}  // namespace MESA_NS
