// cuda_emu.h — the CUDA built-ins our kernels use, for a plain C++20 host compiler.
//
// The kernels under kernels/*.cu are compiled twice: by nvcc for the GPU, and by the
// system C++ compiler with this header force-included (`-include cuda_emu.h`) for the
// host emulation that CI and machines without a GPU run. No CUDA header is needed.
//
// Execution model (see emu_runtime.cpp):
//   * a launch hands blocks to a pool of OS worker threads (one block per worker at a time);
//   * inside a block every CUDA thread is a fiber on that worker, so `__syncthreads`,
//     warp shuffles and `__shared__` arrays behave as on the GPU;
//   * a cooperative launch (MESA_LAUNCH_COOPERATIVE) runs every block at once, each on its own
//     OS thread, so blocks that wait on each other through global memory make progress;
//   * launches are synchronous: the stream argument is ignored and the entry point returns
//     after the grid finished.
// Checks (docs/emulator.md): MESA_EMU_CHECK switches on, at run time, a shuffled schedule,
// poisoned shared memory and allocations, canaries and guard pages, barrier and shuffle
// checks and the __launch_bounds__ check; a failed check ends the launch with an error that
// names the kernel and the seed (mesa_emu_take_report, emu_checks.h).
// Only what the kernels use is provided; anything else fails to compile, which is the point.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>

#define MESA_EMU 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
// build.rs moves a kernel's bounds into its body (MESA_EMU_LAUNCH_BOUNDS), where the check
// sees the block size; a file compiled without that rewrite just loses the check.
#define __launch_bounds__(...)
#define __grid_constant__
// One block runs on one OS thread at a time, so per-thread storage is exactly "one copy per
// resident block". Kernels must not rely on its contents at block start (the GPU does not
// clear shared memory either). build.rs rewrites a `__shared__ T name[dims];` declaration into
// MESA_EMU_SHARED(T, name, [dims]): a reference to heap storage that a thread-local box
// allocates the first time the OS thread passes it (8 bytes of TLS per declaration, not the
// variable: glibc carves static TLS out of every thread's stack, whether or not it runs
// kernels). It follows every `__shared__` declaration with MESA_EMU_SHARED_POINT(name), which
// poisons the variable the first time a block passes it (initcheck). A declaration build.rs
// does not rewrite (several declarators, an initialiser) stays thread-local storage.
#define __shared__ static thread_local
// __constant__ variables share one section, which memcheck treats as read-only: a kernel's
// store into it fails the launch (on a GPU constant memory cannot be written by a kernel).
#define __constant__ __attribute__((section("mesa_emu_constant")))
#define __align__(n) alignas(n)

// ---------------------------------------------------------------------------------------
// Index types
struct uint3 { unsigned int x, y, z; };
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace mesa_emu {
struct ThreadState;
// Per OS-thread (= per running block) state, set by the runtime.
extern thread_local uint3 tl_block_idx;
extern thread_local dim3 tl_block_dim;
extern thread_local dim3 tl_grid_dim;
extern thread_local ThreadState* tl_current;  // the fiber (CUDA thread) now running
const uint3& thread_idx();
void syncthreads(const char* file, int line);
void syncwarp(unsigned mask);
void warp_exchange(unsigned mask, const void* value, void* out, unsigned size, unsigned src_lane);
unsigned warp_ballot(unsigned mask, bool pred);
unsigned lane_id();
// What one lane brings to a WMMA operation: the call's pointer and leading dimension (every
// lane must pass the same) and its part of the fragments (mma_sync: its elements of A and B).
constexpr unsigned kWarpMatrixPartBytes = 64;
struct WarpMatrixSlot {
  uint64_t generation;  // of the rendezvous it was written for (an older one: stale)
  const char* op;
  const void* ptr;
  unsigned ldm;
  alignas(16) unsigned char part[kWarpMatrixPartBytes];
};
const WarpMatrixSlot* warp_matrix_op(const char* what, const void* ptr, unsigned ldm, unsigned ldm_unit,
                                     const void* part, unsigned part_bytes);
void warp_matrix_done(const char* what);
void yield_thread();
// __threadfence(): orders this thread's memory accesses; to racecheck, with a later atomic
// store it is a release, after an earlier atomic load an acquire (emu_runtime.cpp).
void threadfence();
// cooperative_groups' this_grid().sync(): every thread of every block of a cooperative launch.
void grid_sync(const char* file, int line);
bool launch_is_cooperative();
// Barrier divergence (synccheck): build.rs puts MESA_EMU_LOOP_POINT at the top of the body of
// every loop whose body holds a barrier; a barrier generation needs every thread in the same
// iteration of each such loop around it.
void loop_enter(const void* site);
void loop_leave();
unsigned char* dynamic_smem();
int worker_count();

// The checks of the running block (a bit set of MESA_EMU_CHECK_*, emu_checks.h), copied from
// the configuration at block start.
extern thread_local unsigned tl_checks;
constexpr unsigned kCheckSchedule = 1u, kCheckInit = 2u, kCheckMem = 4u, kCheckSync = 8u, kCheckRace = 16u,
                   kCheckBounds = 32u, kCheckBenign = 64u;
// One iteration of a loop that holds a barrier (MESA_EMU_LOOP_POINT): entered at the top of
// the body, left when the body's scope ends (also by `continue`, `break`, `return`).
struct LoopScope {
  bool on;
  explicit LoopScope(const void* site) : on((tl_checks & kCheckSync) != 0) {
    if (on) loop_enter(site);
  }
  ~LoopScope() {
    if (on) loop_leave();
  }
  LoopScope(const LoopScope&) = delete;
  LoopScope& operator=(const LoopScope&) = delete;
};
// A point where the shuffled schedule may switch threads (global loads and stores).
void memory_point_slow();
inline void memory_point() {
  if (tl_checks & kCheckSchedule) memory_point_slow();
}
// First pass of this block through a __shared__ declaration: poison it (initcheck), track
// its accesses (racecheck).
extern thread_local uint64_t tl_block_epoch;
void shared_first_pass(void* p, size_t bytes, const char* name);
inline void shared_point(void* p, size_t bytes, uint64_t* epoch, const char* name) {
  if (*epoch != tl_block_epoch) {
    *epoch = tl_block_epoch;
    shared_first_pass(p, bytes, name);
  }
}
// __launch_bounds__(max_threads, ...): a larger block fails the launch, as on a GPU.
void launch_bounds(unsigned max_threads, const char* kernel);

// A kernel launch: `body` runs once per CUDA thread. Returns a cudaError_t-like code
// (0 = success, 9 = invalid configuration, 719 = a check failed: mesa_emu_take_report).
int launch(const char* kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, bool cooperative,
           const std::function<void()>& body);
}  // namespace mesa_emu

namespace mesa_emu {
// The storage of one `__shared__` declaration for the OS thread that passes it (above).
template <typename T>
class SharedBox {
  struct Holder {
    T value;
  };
  Holder* p_ = nullptr;

 public:
  SharedBox() = default;
  SharedBox(const SharedBox&) = delete;
  SharedBox& operator=(const SharedBox&) = delete;
  ~SharedBox() { delete p_; }
  T& get() {
    if (p_ == nullptr) p_ = new Holder;
    return p_->value;
  }
};
}  // namespace mesa_emu
#define MESA_EMU_SHARED(type, name, dims)                                          \
  static thread_local ::mesa_emu::SharedBox<type dims> mesa_emu_box_##name##_;      \
  type(&name) dims = mesa_emu_box_##name##_.get()

#define MESA_EMU_SHARED_POINT(name)                                        \
  do {                                                                     \
    static thread_local uint64_t mesa_emu_epoch_ = 0;                      \
    ::mesa_emu::shared_point(&(name), sizeof(name), &mesa_emu_epoch_, #name); \
  } while (0)
#define MESA_EMU_LAUNCH_BOUNDS(max_threads, ...) ::mesa_emu::launch_bounds((max_threads), __func__)
#define MESA_EMU_LOOP_POINT                                    \
  static const char mesa_emu_loop_site_ = 0;                   \
  ::mesa_emu::LoopScope mesa_emu_loop_scope_(&mesa_emu_loop_site_)

#define threadIdx (::mesa_emu::thread_idx())
#define blockIdx (::mesa_emu::tl_block_idx)
#define blockDim (::mesa_emu::tl_block_dim)
#define gridDim (::mesa_emu::tl_grid_dim)
#define warpSize 32

// The call site (file, line) lets synccheck tell two different barriers apart.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::mesa_emu::syncthreads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::mesa_emu::syncwarp(mask); }
inline void __threadfence() { ::mesa_emu::threadfence(); }
inline void __threadfence_system() { ::mesa_emu::threadfence(); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { ::mesa_emu::yield_thread(); }

// ---------------------------------------------------------------------------------------
// Warp shuffles: a rendezvous of the lanes of `mask` (synccheck: the lanes that arrive must
// be exactly the mask's; without it, of the warp's live lanes).
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const unsigned lane = threadIdx.x % 32u;
  const unsigned base = lane - lane % unsigned(width);
  T out;
  ::mesa_emu::warp_exchange(mask, &v, &out, sizeof(T), base + unsigned(src_lane) % unsigned(width));
  return out;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const unsigned lane = threadIdx.x % 32u;
  const unsigned base = lane - lane % unsigned(width);
  const unsigned src = (lane ^ unsigned(lane_mask));
  T out;
  ::mesa_emu::warp_exchange(mask, &v, &out, sizeof(T), src < base + unsigned(width) ? src : lane);
  return out;
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = threadIdx.x % 32u;
  const unsigned base = lane - lane % unsigned(width);
  const unsigned src = lane + delta;
  T out;
  ::mesa_emu::warp_exchange(mask, &v, &out, sizeof(T), src < base + unsigned(width) ? src : lane);
  return out;
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = threadIdx.x % 32u;
  const unsigned base = lane - lane % unsigned(width);
  const unsigned src = (lane >= base + delta) ? lane - delta : lane;
  T out;
  ::mesa_emu::warp_exchange(mask, &v, &out, sizeof(T), src);
  return out;
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::mesa_emu::warp_ballot(mask, pred != 0); }
inline bool __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0u; }
inline bool __all_sync(unsigned m, int pred) { return (__ballot_sync(m, pred) & m) == m; }

// ---------------------------------------------------------------------------------------
// Atomics (device scope; blocks really run concurrently on the worker pool). Relaxed, as CUDA's
// atomicAdd & co. are: racecheck sees them as atomic accesses that order nothing by
// themselves; with a __threadfence before (release) or after (acquire) they do.
constexpr auto __mesa_relaxed = std::memory_order_relaxed;
template <typename T>
inline T __mesa_atomic_rmw(T* p, T v, int op) {
  std::atomic_ref<T> a(*p);
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case 0: return a.fetch_add(v, __mesa_relaxed);
      case 1: return a.fetch_or(v, __mesa_relaxed);
      case 2: return a.fetch_and(v, __mesa_relaxed);
      case 3: return a.exchange(v, __mesa_relaxed);
      default: break;
    }
  }
  T old = a.load(__mesa_relaxed);
  for (;;) {
    T next = old;
    switch (op) {
      case 0: next = old + v; break;
      case 3: next = v; break;
      case 4: next = std::min(old, v); break;
      case 5: next = std::max(old, v); break;
      default: break;
    }
    if (a.compare_exchange_weak(old, next, __mesa_relaxed, __mesa_relaxed)) return old;
  }
}
template <typename T> inline T atomicAdd(T* p, T v) { return __mesa_atomic_rmw(p, v, 0); }
template <typename T> inline T atomicOr(T* p, T v) { return __mesa_atomic_rmw(p, v, 1); }
template <typename T> inline T atomicAnd(T* p, T v) { return __mesa_atomic_rmw(p, v, 2); }
template <typename T> inline T atomicExch(T* p, T v) { return __mesa_atomic_rmw(p, v, 3); }
template <typename T> inline T atomicMin(T* p, T v) { return __mesa_atomic_rmw(p, v, 4); }
template <typename T> inline T atomicMax(T* p, T v) { return __mesa_atomic_rmw(p, v, 5); }
// CUDA's atomicInc: stores (old >= limit) ? 0 : old + 1, returns old.
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  std::atomic_ref<unsigned> a(*p);
  unsigned old = a.load(__mesa_relaxed);
  while (!a.compare_exchange_weak(old, old >= limit ? 0u : old + 1u, __mesa_relaxed, __mesa_relaxed)) {
  }
  return old;
}
template <typename T> inline T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T> a(*p);
  a.compare_exchange_strong(expected, desired, __mesa_relaxed, __mesa_relaxed);
  return expected;
}

// ---------------------------------------------------------------------------------------
// Math and bit intrinsics (IEEE round-to-nearest; the host build uses -ffp-contract=off, so
// kernels that need an FMA write fmaf explicitly and get the same rounding on both builds).
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// __fmul_rn/__fadd_rn/__fsub_rn are never contracted into an FMA on the GPU. Here they are
// inlined, and a host compiler that contracts (-ffp-contract=fast: GCC fuses across
// statements and inlined calls) could fuse a*b with a later +c; an empty asm that "modifies"
// the value in its register is a barrier no optimiser looks through (no instruction emitted).
#if defined(__x86_64__) || defined(__i386__)
#define MESA_EMU_FP_BARRIER(v) asm("" : "+x"(v))
#elif defined(__aarch64__)
#define MESA_EMU_FP_BARRIER(v) asm("" : "+w"(v))
#else
#define MESA_EMU_FP_BARRIER(v) asm("" : "+m"(v))
#endif
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  MESA_EMU_FP_BARRIER(r);
  return r;
}
inline float __fadd_rn(float a, float b) {
  MESA_EMU_FP_BARRIER(a);
  MESA_EMU_FP_BARRIER(b);
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  MESA_EMU_FP_BARRIER(a);
  MESA_EMU_FP_BARRIER(b);
  return a - b;
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// sin(πx) and cos(πx): x reduced modulo 2 exactly in f32 (x − 2·rint(x/2)), then in f64.
inline void sincospif(float x, float* s, float* c) {
  const float r = x - 2.0f * std::nearbyint(0.5f * x);
  const double a = 3.14159265358979323846 * double(r);
  *s = float(std::sin(a));
  *c = float(std::cos(a));
}
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }
inline unsigned __float2uint_rn(float f) { return unsigned(std::nearbyint(f)); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }
template <typename T> inline T __ldg(const T* p) { return *p; }
// ld.global.cg (cached in L2 only): what another block wrote with atomics. An atomic load
// here, since other worker threads may still be writing the neighbouring words.
template <typename T> inline T __ldcg(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

// ---------------------------------------------------------------------------------------
// Vector types (16-byte loads/stores compile to plain copies here).
#define MESA_EMU_VEC2(T, N) struct alignas(2 * sizeof(T)) N { T x, y; };
#define MESA_EMU_VEC4(T, N) struct alignas(4 * sizeof(T)) N { T x, y, z, w; };
MESA_EMU_VEC2(int, int2)
MESA_EMU_VEC2(unsigned int, uint2)
MESA_EMU_VEC2(float, float2)
MESA_EMU_VEC4(int, int4)
MESA_EMU_VEC4(unsigned int, uint4)
MESA_EMU_VEC4(float, float4)
MESA_EMU_VEC4(unsigned char, uchar4)
MESA_EMU_VEC4(unsigned short, ushort4)
#undef MESA_EMU_VEC2
#undef MESA_EMU_VEC4
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// ---------------------------------------------------------------------------------------
// 16-bit floating point storage types, bit-compatible with cuda_fp16.h / cuda_bf16.h.
// Conversions round to nearest even, keep NaN a (quiet) NaN and handle subnormals, exactly
// as the device conversions do.
struct __half { unsigned short __x; };
struct __nv_bfloat16 { unsigned short __x; };

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.__x & 0x8000u) << 16;
  const uint32_t exp = (h.__x >> 10) & 0x1fu;
  const uint32_t man = h.__x & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while ((m & 0x400u) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  return __uint_as_float(bits);
}
inline __half __float2half_rn(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  __half h;
  if (ax >= 0x7f800000u) {  // inf or NaN
    h.__x = (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    return h;
  }
  if (ax >= 0x477ff000u) {  // rounds to >= 65520 -> inf
    h.__x = (unsigned short)(sign | 0x7c00u);
    return h;
  }
  if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (ax < 0x33000000u) {  // < 2^-25 rounds to zero (2^-25 itself is a tie -> even = 0)
      h.__x = (unsigned short)sign;
      return h;
    }
    const uint32_t e = ax >> 23;                 // 102..112
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;             // 14..24 : value = m * 2^(e-150), half unit 2^-24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    h.__x = (unsigned short)(sign | q);
    return h;
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  h.__x = (unsigned short)(sign | r);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(uint32_t(b.__x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t x = __float_as_uint(f);
  __nv_bfloat16 b;
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    b.__x = (unsigned short)((x >> 16) | 0x40u);
    return b;
  }
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  b.__x = (unsigned short)(x >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// ---------------------------------------------------------------------------------------
// Warp matrix operations (mma.h's nvcuda::wmma), m16n16k16 with f16 or bf16 operands and f32
// accumulators: what the kernels use. Every call is warp-collective (warp_matrix_op: all 32
// lanes; synccheck: the same pointer and ldm in every lane; memcheck: a 32-byte aligned
// pointer, ldm a multiple of 16 bytes). A fragment's element order is unspecified on the GPU;
// here lane l holds elements 8l..8l+7 of the 16 x 16 tile in row-major order (A: [m][k], B:
// [k][n], accumulator [m][n]), so only elementwise use of `x` is portable. mma_sync forms each
// product exactly (a 16-bit x 16-bit product fits f32) and adds them to the accumulator in k
// order, rounding each sum to nearest; the GPU's order and rounding of those sums are not
// specified, which the kernels' error bounds allow for (docs/emulator.md).
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation provides m16n16k16 fragments only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>),
                "operands f16 or bf16, accumulators f32");
  static constexpr int num_elements = 8;
  T x[8];
};

namespace detail {
inline float widen(__half v) { return __half2float(v); }
inline float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
// Element (r, c) of a tile at p with leading dimension ldm.
template <typename T>
inline const T& at(const T* p, unsigned ldm, bool row_major, int r, int c) {
  return row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r];
}
}  // namespace detail

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& v) {
  for (T& e : f.x) e = v;
}

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
  ::mesa_emu::warp_matrix_op("load_matrix_sync", p, ldm, sizeof(T), nullptr, 0);
  const unsigned lane = ::mesa_emu::lane_id();
  for (int i = 0; i < 8; ++i) {
    const int e = int(lane) * 8 + i;
    f.x[i] = detail::at(p, ldm, std::is_same_v<Layout, row_major>, e / 16, e % 16);
  }
  ::mesa_emu::warp_matrix_done("load_matrix_sync");
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  ::mesa_emu::warp_matrix_op("load_matrix_sync", p, ldm, sizeof(float), nullptr, 0);
  const unsigned lane = ::mesa_emu::lane_id();
  for (int i = 0; i < 8; ++i) {
    const int e = int(lane) * 8 + i;
    f.x[i] = detail::at(p, ldm, l == mem_row_major, e / 16, e % 16);
  }
  ::mesa_emu::warp_matrix_done("load_matrix_sync");
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  ::mesa_emu::warp_matrix_op("store_matrix_sync", p, ldm, sizeof(float), nullptr, 0);
  const unsigned lane = ::mesa_emu::lane_id();
  for (int i = 0; i < 8; ++i) {
    const int e = int(lane) * 8 + i;
    const_cast<float&>(detail::at<float>(p, ldm, l == mem_row_major, e / 16, e % 16)) = f.x[i];
  }
  ::mesa_emu::warp_matrix_done("store_matrix_sync");
}

namespace detail {
// mma_sync's arithmetic for one lane: its 8 elements of A B + c from every lane's published
// part (its 8 elements of A, then of B, widened to f32: exact). Lane l holds row l / 2,
// columns 8 (l % 2) ... + 7: A's row is the parts of lanes 2r and 2r + 1, and row k of those
// columns of B the part of lane 2k + l % 2. It reads only emulator state and this lane's
// registers, never kernel memory, so racecheck's instrumentation (a callback per read) is
// left out; the builtin fmaf is inlined where an instrumented std::fma could not be.
__attribute__((no_sanitize_thread)) inline void mma_lane(const ::mesa_emu::WarpMatrixSlot* lanes, unsigned lane,
                                                         const float (&c)[8], float (&out)[8]) {
  float a[16], b[16][8];
  std::memcpy(a, lanes[lane & ~1u].part, sizeof(float[8]));
  std::memcpy(a + 8, lanes[lane | 1u].part, sizeof(float[8]));
  for (unsigned k = 0; k < 16; ++k) std::memcpy(b[k], lanes[2 * k + lane % 2].part + sizeof(float[8]), sizeof(float[8]));
  for (int i = 0; i < 8; ++i) {
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc = __builtin_fmaf(a[k], b[k][i], acc);
    out[i] = acc;
  }
}
}  // namespace detail

// d = a b + c (d may be c).
template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float part[16];  // this lane's elements of A, then of B
  static_assert(sizeof part == ::mesa_emu::kWarpMatrixPartBytes, "a lane's part: its 8 elements of A and of B");
  for (int i = 0; i < 8; ++i) {
    part[i] = detail::widen(a.x[i]);
    part[8 + i] = detail::widen(b.x[i]);
  }
  const ::mesa_emu::WarpMatrixSlot* lanes = ::mesa_emu::warp_matrix_op("mma_sync", nullptr, 0, 1, part, sizeof part);
  float out[8];
  detail::mma_lane(lanes, ::mesa_emu::lane_id(), c.x, out);
  std::memcpy(d.x, out, sizeof out);
  ::mesa_emu::warp_matrix_done("mma_sync");
}
}  // namespace wmma
}  // namespace nvcuda

// ---------------------------------------------------------------------------------------
// Clocks and system-scope atomics (used by the collectives' bounded cross-rank waits).
// clock64(): a monotonic tick count (nanoseconds of the host's steady clock here, SM cycles
// on the GPU); mesa_emu::steady_ns() stands in for the GPU's %globaltimer (nanoseconds).
// Acquire/release loads and stores go through std::atomic_ref: blocks of a cooperative launch
// are real OS threads, so the orderings are those a GPU gives at system scope.
namespace mesa_emu {
long long steady_ns();
}
inline long long clock64() { return ::mesa_emu::steady_ns(); }
template <typename T>
inline T __mesa_load_acquire(const T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_acquire);
}
template <typename T>
inline void __mesa_store_release(T* p, T v) {
  std::atomic_ref<T>(*p).store(v, std::memory_order_release);
}

// ---------------------------------------------------------------------------------------
// Runtime API subset used by the launchers.
typedef int cudaError_t;
typedef void* cudaStream_t;
enum : int {
  cudaSuccess = 0,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorCooperativeLaunchTooLarge = 720
};
