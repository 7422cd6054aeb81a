// common.cuh — the small shared vocabulary of every kernel file: build switches, launch
// macro, dtype conversion, 16-byte vector access, strided index arithmetic, warp/block
// reductions and the Philox counter-based generator. Defined once, used everywhere.
//
// Two builds include this file:
//   * nvcc (CUDA build):      __CUDACC__ defined, entry points named mesa_<op>;
//   * host C++ (emulation):   cuda_emu.h force-included, MESA_EMU defined, mesa_emu_<op>.
// Everything non-extern-"C" lives in namespace MESA_NS, distinct per build, so both static
// libraries link into one binary without their template instances colliding.
#pragma once

#include "mesa_kernels.h"

#ifdef MESA_EMU
#define MESA_NS mesa_emu_kernels
#define MESA_ENTRY(name) mesa_emu_##name
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <type_traits>
#include <cuda/atomic>
#include <cuda/ptx>
#include <mma.h>
#define MESA_NS mesa_cuda_kernels
#define MESA_ENTRY(name) mesa_##name
#endif

namespace MESA_NS {

constexpr int kWarpSize = 32;

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// Launching. Launchers are host code in the same .cu file as their kernels; they return a
// MesaStatus and never synchronise.
#ifdef MESA_EMU
#define MESA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::mesa_emu::launch(#kernel, (grid), (block), (smem), false, [&]() { kernel(__VA_ARGS__); })
#define MESA_LAUNCH_COOPERATIVE(kernel, grid, block, smem, stream, ...) \
  ::mesa_emu::launch(#kernel, (grid), (block), (smem), true, [&]() { kernel(__VA_ARGS__); })
#else
#define MESA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  (kernel<<<(grid), (block), (smem), (cudaStream_t)(stream)>>>(__VA_ARGS__), cudaGetLastError())
#define MESA_LAUNCH_COOPERATIVE(kernel, grid, block, smem, stream, ...) \
  ::MESA_NS::launch_cooperative((kernel), (grid), (block), (smem), (cudaStream_t)(stream), __VA_ARGS__)
#endif

inline MesaStatus status_from(cudaError_t e) {
  return e == cudaSuccess ? MESA_STATUS_OK : MesaStatus(MESA_STATUS_CUDA_ERROR_BASE + int(e));
}

// Number of multiprocessors of the current device (the emulation: its worker threads).
// Launch policies size grid-stride grids from it.
inline int sm_count() {
#ifdef MESA_EMU
  return ::mesa_emu::worker_count();
#else
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
#endif
}

// Grid of a grid-stride kernel: enough blocks for the work, at most as many as the device
// holds at once (the occupancy API, at this block size and dynamic shared memory, times the
// SM count), so a grid never runs in a second, partial wave. The emulation has no
// occupancy: its stand-in is 8 blocks per worker thread.
template <typename Kernel>
inline unsigned resident_grid(Kernel kernel, int64_t work_items, int block, size_t smem = 0) {
  int per_sm = 8;
#ifndef MESA_EMU
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem) != cudaSuccess || per_sm < 1)
    per_sm = 1;
#else
  (void)kernel;
  (void)smem;
#endif
  const int64_t want = ceil_div(work_items, block);
  const int64_t cap = int64_t(sm_count()) * per_sm;
  return unsigned(want < 1 ? 1 : (want < cap ? want : cap));
}

// ---------------------------------------------------------------------------------------
// Cooperative launch (CUDA build; the emulation runs every block of such a launch on its own
// OS thread). All blocks of the grid are guaranteed co-resident, so blocks may wait for each
// other. Fails with cudaErrorCooperativeLaunchTooLarge, before launching, when the device
// lacks cooperative launch or the grid exceeds what its multiprocessors can hold at once
// (occupancy of this kernel at this block size and shared memory x SM count).
#ifndef MESA_EMU
template <typename... KArgs, typename... Args>
cudaError_t launch_cooperative(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                               Args... args) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  int supported = 0;
  e = cudaDeviceGetAttribute(&supported, cudaDevAttrCooperativeLaunch, device);
  if (e != cudaSuccess) return e;
  if (!supported) return cudaErrorCooperativeLaunchTooLarge;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, int(block.x * block.y * block.z), smem);
  if (e != cudaSuccess) return e;
  const long long blocks = 1ll * grid.x * grid.y * grid.z;
  if (blocks > 1ll * per_sm * sm_count()) return cudaErrorCooperativeLaunchTooLarge;
  // the kernel's parameters, converted to its exact parameter types, addressed by the array
  auto params = [&](KArgs... typed) {
    void* argv[] = {static_cast<void*>(&typed)..., nullptr};
    return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, smem, stream);
  };
  return params(args...);
}
#endif

// ---------------------------------------------------------------------------------------
// Cross-device synchronisation (collectives): acquire/release at system scope, so a flag
// written by a peer GPU over NVLink/PCIe orders the data written before it; and a wall
// clock in nanoseconds for bounded waits (%globaltimer through libcu++ on the GPU, the
// host's steady clock in the emulation).
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
#ifdef MESA_EMU
  return __mesa_load_acquire(p);
#else
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system> a(*const_cast<uint32_t*>(p));
  return a.load(cuda::memory_order_acquire);
#endif
}
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
#ifdef MESA_EMU
  __mesa_store_release(p, v);
#else
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system> a(*p);
  a.store(v, cuda::memory_order_release);
#endif
}
__device__ __forceinline__ uint64_t timer_ns() {
#ifdef MESA_EMU
  return uint64_t(::mesa_emu::steady_ns());
#else
  return cuda::ptx::get_sreg_globaltimer();
#endif
}
// Wrap-safe "counter a has reached b" for monotonic u32 epochs (valid while the two are
// within 2^31 of each other).
__device__ __forceinline__ bool epoch_reached(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// Neither infinite nor NaN (an exponent of all ones), whatever the compiler's float flags.
__device__ __forceinline__ bool is_finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// ---------------------------------------------------------------------------------------
// dtype conversion: all arithmetic is f32.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two values of a 16-bit T in one 32-bit word (the first in the low half), to and from f32:
// the same bits as from_float / to_float on each; packing is one paired conversion
// (F2FP.PACK_AB), bf16 unpacks by a shift and a mask (exact).
template <typename T>
__device__ __forceinline__ uint32_t pack2_word(float a, float b) {
  static_assert(sizeof(T) == 2, "16-bit types only");
#ifdef MESA_EMU
  return uint32_t(from_float<T>(a).__x) | (uint32_t(from_float<T>(b).__x) << 16);
#else
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&p);
  } else {
    const __half2 p = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
#endif
}
template <typename T>
__device__ __forceinline__ void unpack2_word(uint32_t w, float& a, float& b) {
  static_assert(sizeof(T) == 2, "16-bit types only");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
  } else {
#ifdef MESA_EMU
    a = __half2float(__half{static_cast<unsigned short>(w & 0xffffu)});
    b = __half2float(__half{static_cast<unsigned short>(w >> 16)});
#else
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    a = f.x;
    b = f.y;
#endif
  }
}

// The multifunction unit's approximations, one MUFU instruction each (PTX ISA, `ex2`, `rcp`):
// 2^a with subnormal results flushed to +0 (max relative error 2^-22 on sm_80/sm_90), and 1/a
// (within 1 ulp). The emulation computes them correctly rounded (exp2f, division) and flushes
// like the GPU, so the two builds may differ by those few ulps only (docs/design.md).
#ifdef MESA_EMU
__device__ __forceinline__ float exp2_approx(float a) {
  const float r = exp2f(a);
  return r < 1.17549435e-38f ? 0.0f : r;  // FLT_MIN: ftz of the result (NaN passes)
}
__device__ __forceinline__ float rcp_approx(float a) { return 1.0f / a; }
#else
__device__ __forceinline__ float exp2_approx(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ __forceinline__ float rcp_approx(float a) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
#endif

// A point where the emulator's shuffled schedule (MESA_EMU_CHECK=schedule) may switch to
// another thread of the block: every global load and store helper has one.
#ifdef MESA_EMU
#define MESA_MEMORY_POINT() ::mesa_emu::memory_point()
#else
#define MESA_MEMORY_POINT() ((void)0)
#endif

// 16 bytes of T: the unit of vectorised global memory access (LDG.128 / STG.128).
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int N = 16 / int(sizeof(T));
  T v[N];
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
  MESA_MEMORY_POINT();
  Vec16<T> r;
  *reinterpret_cast<int4*>(&r) = *reinterpret_cast<const int4*>(p);
  return r;
}
template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& r) {
  MESA_MEMORY_POINT();
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&r);
}
// The same 16 bytes as four 32-bit words (pack2_word / unpack2_word).
template <typename T>
__device__ __forceinline__ uint4 load16_words(const T* p) {
  MESA_MEMORY_POINT();
  return *reinterpret_cast<const uint4*>(p);
}
template <typename T>
__device__ __forceinline__ void store16_words(T* p, const uint4& w) {
  MESA_MEMORY_POINT();
  *reinterpret_cast<uint4*>(p) = w;
}

// ---------------------------------------------------------------------------------------
// Strided index arithmetic. Logical index i (row-major over shape) -> element offset.
struct Strided {
  int64_t shape[MESA_MAX_DIMS];
  int64_t strides[MESA_MAX_DIMS];
  int32_t ndim;

  __device__ __forceinline__ int64_t offset(int64_t i) const {
    int64_t off = 0;
    // fully unrolled over the fixed maximum rank: shape/strides stay in registers
#pragma unroll
    for (int d = MESA_MAX_DIMS - 1; d >= 0; --d) {
      if (d >= ndim) continue;
      const int64_t n = shape[d];
      const int64_t q = i / n;
      off += (i - q * n) * strides[d];
      i = q;
    }
    return off;
  }
};

inline Strided strided_from(const MesaTensorDesc& d) {
  Strided s{};
  s.ndim = d.ndim;
  for (int k = 0; k < MESA_MAX_DIMS; ++k) {
    s.shape[k] = k < d.ndim ? d.shape[k] : 1;
    s.strides[k] = k < d.ndim ? d.strides[k] : 0;
  }
  return s;
}

inline int64_t numel(const MesaTensorDesc& d) {
  int64_t n = 1;
  for (int k = 0; k < d.ndim; ++k) n *= d.shape[k];
  return n;
}

// True when logical index i lives at element offset i (dense row-major).
inline bool is_dense(const MesaTensorDesc& d) {
  int64_t expect = 1;
  for (int k = d.ndim - 1; k >= 0; --k) {
    if (d.shape[k] != 1 && d.strides[k] != expect) return false;
    expect *= d.shape[k];
  }
  return true;
}

inline bool desc_valid(const MesaTensorDesc& d) {
  if (d.ndim < 0 || d.ndim > MESA_MAX_DIMS) return false;
  if (d.dtype != MESA_DTYPE_F32 && d.dtype != MESA_DTYPE_F16 && d.dtype != MESA_DTYPE_BF16) return false;
  for (int k = 0; k < d.ndim; ++k)
    if (d.shape[k] < 0) return false;
  return true;
}

inline int dtype_size(MesaDType t) { return t == MESA_DTYPE_F32 ? 4 : 2; }

// ---------------------------------------------------------------------------------------
// Division by a divisor fixed for a launch, for dividends below 2^31 (dense hot loops index
// in 32 bits): q = (umulhi(n, m) + n) >> s with s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1
// (Granlund & Montgomery, PLDI 1994, §4, with N = 32); n + umulhi(n, m) < 2^32 because
// n < 2^31, so nothing overflows. Exact for every n < 2^31 and 1 <= d < 2^31; integer
// arithmetic only, the same in both builds, and the group of every element in the parity and
// digest tests (tests/quantize.rs, tests/digests.rs) goes through it.
struct FastDiv {
  uint32_t d, m, s;
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
  __device__ __forceinline__ uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

inline FastDiv fast_div(uint32_t d) {
  uint32_t s = 0;
  while ((uint64_t(1) << s) < d) ++s;
  const uint64_t m = ((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1;
  return FastDiv{d, uint32_t(m), s};
}

// ---------------------------------------------------------------------------------------
// Reductions.
__device__ __forceinline__ float warp_reduce_sum(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_reduce_max(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ unsigned warp_reduce_min_u32(unsigned v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    const unsigned w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w < v ? w : v;
  }
  return v;
}
__device__ __forceinline__ unsigned warp_reduce_max_u32(unsigned v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    const unsigned w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Order-preserving f32 <-> u32 key: a < b  <=>  key(a) < key(b) for finite a, b.
__device__ __forceinline__ unsigned float_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// ---------------------------------------------------------------------------------------
// Philox4x32-R (Salmon et al., SC'11): counter-based, so element i's random number depends
// only on (key, i) — the same on the GPU and the emulation, whatever the launch shape. One
// round: two 32x32 -> 64-bit products (one IMAD.WIDE.U32 each) and two three-way XORs (LOP3);
// the round keys are launch constants. R = 10 is the paper's default (dropout, host side);
// stochastic rounding uses R = 7, the paper's Crush-resistant count (docs/kernels.md).
struct Philox4 { unsigned x, y, z, w; };

template <int kRounds>
__device__ __forceinline__ Philox4 philox4x32(uint64_t counter, uint64_t key) {
  unsigned c0 = unsigned(counter), c1 = unsigned(counter >> 32), c2 = 0u, c3 = 0u;
  unsigned k0 = unsigned(key), k1 = unsigned(key >> 32);
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const unsigned n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{c0, c1, c2, c3};
}
__device__ __forceinline__ Philox4 philox4x32_10(uint64_t counter, uint64_t key) { return philox4x32<10>(counter, key); }

}  // namespace MESA_NS
