// split_mma.cuh — f32-accurate products on bf16 tensor cores: the split-pair vocabulary shared
// by the tensor-core kernels (linear_attention.cu, feature_maps.cu).
//
// A value x enters the 16x16x16 bf16 MMAs (nvcuda::wmma, f32 accumulators) as a pair of bf16
// tiles, hi = bf16(x) and lo = bf16(x - hi):
//   * a bf16 value is exact in hi (lo = 0: a kernel skips its lo MMAs at compile time);
//   * an f16 value is exact in hi + lo (11 significant bits = 8 + 3, f16's range inside bf16's);
//   * an f32 value is within 2^-18 |x| (two round-to-nearest steps of 8 bits).
// A product of two pairs is hi*hi + hi*lo + lo*hi (lo*lo left out): each term of a sum is off
// by at most 3 * 2^-18 of its magnitude; the products of bf16 values are exact in f32 and the
// accumulators are f32 (docs/linear_attention.md, "Tensor cores").
#pragma once

#include "common.cuh"

namespace MESA_NS {

namespace wmma = nvcuda::wmma;
using Mma = __nv_bfloat16;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Mma, wmma::row_major>;
using FragAt = wmma::fragment<wmma::matrix_a, 16, 16, 16, Mma, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, Mma, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, Mma, wmma::col_major>;

template <typename T> constexpr bool kTensorCores = !std::is_same_v<T, float>;

template <int kRows, int kLd>
struct alignas(32) SplitTile {
  Mma hi[kRows * kLd];
  Mma lo[kRows * kLd];
};

// hi/lo of x0, x1 at i, i + 1 (one thread writes both halves of a 4-byte granule of each
// tile: racecheck's unit). A non-finite remainder (x infinite or NaN, or a finite |x| that
// rounds to infinity in bf16, past 3.39e38) leaves lo 0: hi carries it.
__device__ __forceinline__ void put_split(Mma* hi, Mma* lo, int i, float x0, float x1) {
  const Mma h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
  const float r0 = x0 - __bfloat162float(h0), r1 = x1 - __bfloat162float(h1);
  hi[i] = h0;
  hi[i + 1] = h1;
  lo[i] = __float2bfloat16_rn(r0 - r0 == 0.0f ? r0 : 0.0f);
  lo[i + 1] = __float2bfloat16_rn(r1 - r1 == 0.0f ? r1 : 0.0f);
}

// hi/lo of x[0..8) at i..i+8 as one 16-byte store into each tile (i a multiple of 8, the row
// 16-byte aligned: kLdAB and kLdC are multiples of 8).
__device__ __forceinline__ void put_split8(Mma* hi, Mma* lo, int i, const float (&x)[8]) {
  Vec16<Mma> h, l;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    h.v[j] = __float2bfloat16_rn(x[j]);
    const float r = x[j] - __bfloat162float(h.v[j]);
    l.v[j] = __float2bfloat16_rn(r - r == 0.0f ? r : 0.0f);
  }
  *reinterpret_cast<Vec16<Mma>*>(hi + i) = h;
  *reinterpret_cast<Vec16<Mma>*>(lo + i) = l;
}

// The value a split tile holds at i, hi + lo (an f16/bf16 input exactly).
template <int kRows, int kLd>
__device__ __forceinline__ float split_value(const SplitTile<kRows, kLd>& t, int i) {
  return __bfloat162float(t.hi[i]) + __bfloat162float(t.lo[i]);
}

// d += a b over the split pairs, lo*lo left out; a_lo/b_lo: whether those tiles are used.
template <typename FA, typename FB>
__device__ __forceinline__ void mma_split(FragAcc& d, const FA& ah, const FA& al, bool a_lo, const FB& bh,
                                          const FB& bl, bool b_lo) {
  wmma::mma_sync(d, ah, bh, d);
  if (b_lo) wmma::mma_sync(d, ah, bl, d);
  if (a_lo) wmma::mma_sync(d, al, bh, d);
}

// threadIdx.x, read again at each call (asm volatile): the shared-memory offsets derived from
// it are recomputed where they are used instead of held in registers through the whole kernel
// (the compiler hoists them out of the loops otherwise; the tensor-core kernels are at their
// bound of 128 registers: linear_attention.cu, gated_linear_attention.cu).
__device__ __forceinline__ int fresh_tid() {
#ifdef MESA_EMU
  return int(threadIdx.x);
#else
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#endif
}

// Host: rows of t readable as 16-byte runs of 16-bit elements (the tile loads' fast path):
// stride-1 features and every row start 16-byte aligned.
template <typename T>
inline bool rows_16b(const MesaLaTensor& t) {
  constexpr int64_t n = 16 / int64_t(sizeof(T));
  return sizeof(T) == 2 && t.strides[3] == 1 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0 &&
         t.strides[0] % n == 0 && t.strides[1] % n == 0 && t.strides[2] % n == 0;
}

}  // namespace MESA_NS
