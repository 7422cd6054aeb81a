// broken.cu — deliberately broken kernels: each one has exactly the bug one emulator check
// exists to find (tests/sanitizer.rs asserts every report; docs/emulator.md). Not part of the
// library: build.rs compiles this directory for the emulator into its own archive, which
// only tests/sanitizer.rs links, and scripts/gpu-bundle.sh builds it with nvcc for the GPU
// bundle, where compute-sanitizer runs the same cases (scripts/broken-main.cu).
//
// Every case has one entry point `mesa[_emu]_broken_<case>(const BrokenArgs*)`, returning the
// launch's cudaError_t: out[0..n) is written, in[0..n) read (n <= 1024 unless said).
#include "broken_case.cuh"

namespace MESA_NS {
namespace broken {

constexpr int kBlock = 256;

// 1. (issue) thread 0 writes a __shared__ value, the others read it, no __syncthreads.
__global__ void broadcast_without_barrier(float* out, const float* in) {
  __shared__ float s;
  if (threadIdx.x == 0) s = in[0];
  // missing: __syncthreads();
  out[threadIdx.x] = s;
}

// 2. (issue) two block reductions share one scratch array; the barrier between the second's
// writes and the first's reads is missing (kernels/rows.cuh, team_sum).
__device__ float block_sum(float v, float* scratch, bool leading_barrier) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (leading_barrier) __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < kBlock / 32; ++w) t += scratch[w];
  return t;
}
__global__ void reductions_share_scratch(float* out, const float* in) {
  __shared__ float scratch[kBlock / 32];
  const float x = in[threadIdx.x];
  const float sum = block_sum(x, scratch, true);
  const float sum_sq = block_sum(x * x, scratch, false);  // should be `true`
  if (threadIdx.x == 0) {
    out[0] = sum;
    out[1] = sum_sq;
  }
}

// 3. (issue) a full-mask shuffle that only half of the warp reaches.
__global__ void shuffle_half_warp(float* out, const float* in) {
  float v = in[threadIdx.x];
  if (threadIdx.x % 32 < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// 4. (issue) the __syncwarp between a warp's shared row stores and its lanes' reads of each
// other's entries removed (kernels/feature_maps.cu, warp_load_xrow); the shuffles of the
// reduction in between order no memory.
__global__ void row_without_syncwarp(float* out, const float* in) {
  __shared__ float row[kBlock];
  const int lane = threadIdx.x % 32, base = threadIdx.x - lane;
  row[threadIdx.x] = in[threadIdx.x];
  // missing: __syncwarp();
  float sq = in[threadIdx.x] * in[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  out[threadIdx.x] = row[base + (lane + 1) % 32] + 0.0f * sq;
}

// 5. synccheck: a __syncthreads reached by part of the block.
__global__ void partial_barrier(float* out, const float* in) {
  __shared__ float s[kBlock];
  s[threadIdx.x] = in[threadIdx.x];
  if (threadIdx.x < 64) __syncthreads();  // the other 192 threads never arrive
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

// 6. synccheck: the two branches of a divergent if each have their own __syncthreads.
__global__ void barrier_per_branch(float* out, const float* in) {
  __shared__ float s[kBlock];
  if (threadIdx.x % 2 == 0) {
    s[threadIdx.x] = in[threadIdx.x];
    __syncthreads();
  } else {
    s[threadIdx.x] = -in[threadIdx.x];
    __syncthreads();
  }
  out[threadIdx.x] = s[kBlock - 1 - threadIdx.x];
}

// 7. synccheck: lanes of one ballot give different masks.
__global__ void ballot_mask_mismatch(float* out, const float* in) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffffffffu;
  const unsigned bits = __ballot_sync(mask, in[threadIdx.x] > 0.0f);
  out[threadIdx.x] = float(__popc(bits));
}

// 8. memcheck: the tail of a strided loop stores a whole 4-element unit (the strided-quantize
// class): up to 12 bytes past the end of out when n % 4 != 0.
__global__ void tail_unit_overrun(float* out, const float* in, int64_t n) {
  for (int64_t u = threadIdx.x; u * 4 < n; u += blockDim.x) {
    float v[4];
    for (int j = 0; j < 4; ++j) v[j] = u * 4 + j < n ? in[u * 4 + j] : 0.0f;
    for (int j = 0; j < 4; ++j) out[u * 4 + j] = 2.0f * v[j];  // should stop at n
  }
}

// 9. memcheck: an index one page past the end (the guard page).
__global__ void far_overrun(float* out, const float* in, int64_t n) {
  if (threadIdx.x == 0) out[n + 1024] = in[0];
  out[threadIdx.x] = in[threadIdx.x];
}

// 10. initcheck: a tree reduction over a shared array of which only n < kBlock entries were
// written.
__global__ void uninitialised_shared(float* out, const float* in, int64_t n) {
  __shared__ float s[kBlock];
  if (threadIdx.x < n) s[threadIdx.x] = in[threadIdx.x];  // entries n.. are never written
  __syncthreads();
  for (int half = kBlock / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = s[0];
}

// 11. bounds: a kernel compiled for at most 128 threads, launched with 256.
__global__ void __launch_bounds__(128) bounded_128(float* out, const float* in) {
  out[threadIdx.x] = in[threadIdx.x] + 1.0f;
}

// 12. schedule: a read-modify-write of a shared counter by every thread, no atomic.
__global__ void unsynchronised_count(float* out, const float* in) {
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.0f;
  __syncthreads();
  const float v = in[threadIdx.x];
  const float seen = total;  // every thread reads, then writes: updates are lost
  out[threadIdx.x] = seen;
  total = seen + v;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = total;
}

// 13. (control, not broken) one warp multiplies two 16 x 16 bf16 tiles on the tensor cores:
// in[0..256) is A row-major, in[256..512) B row-major (values exact in bf16), out = A B. It
// must pass every check: the WMMA cases below differ from it in one place each.
template <int kVariant>
__device__ void wmma_tile(float* out, const float* in) {
  __align__(32) __shared__ __nv_bfloat16 ab[2][256];
  __align__(32) __shared__ float c[256];
  // pairs per thread: racecheck's granule is 4 bytes (docs/emulator.md)
  for (int i = 2 * threadIdx.x; i < 512; i += 64) {
    ab[i / 256][i % 256] = __float2bfloat16(in[i]);
    ab[i / 256][i % 256 + 1] = __float2bfloat16(in[i + 1]);
  }
  __syncwarp();
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> fa;
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> fb;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  nvcuda::wmma::fill_fragment(acc, 0.0f);
  // 15: B read from 8 elements (16 bytes) past the tile: not 32-byte aligned
  // 17: the upper half of the warp loads A from B's tile (aligned, but not lane 0's pointer)
  nvcuda::wmma::load_matrix_sync(fa, kVariant == 17 && threadIdx.x >= 16 ? ab[1] : ab[0], 16);
  // 18: lane 31 loads A from a null pointer (the last lane to arrive may be the first to load)
  if (kVariant == 18) nvcuda::wmma::load_matrix_sync(fa, threadIdx.x == 31 ? nullptr : ab[0], 16);
  nvcuda::wmma::load_matrix_sync(fb, kVariant == 15 ? ab[0] + 8 : ab[1], 16);
  // 14: only half of the warp reaches the product; 16: the other half waits in __syncwarp
  if ((kVariant != 14 && kVariant != 16) || threadIdx.x < 16) {
    nvcuda::wmma::mma_sync(acc, fa, fb, acc);
  } else if (kVariant == 16) {
    __syncwarp();
  }
  nvcuda::wmma::store_matrix_sync(c, acc, 16, nvcuda::wmma::mem_row_major);
  __syncwarp();
  for (int i = threadIdx.x; i < 256; i += 32) out[i] = c[i];
}
__global__ void wmma_tile_product(float* out, const float* in) { wmma_tile<13>(out, in); }

// 14. (issue) a tensor-core product reached by half of the warp (the whole warp must execute it).
__global__ void wmma_half_warp(float* out, const float* in) { wmma_tile<14>(out, in); }

// 15. a tensor-core tile loaded from a pointer that is not 32-byte aligned.
__global__ void wmma_misaligned(float* out, const float* in) { wmma_tile<15>(out, in); }

// 16. half of the warp in the tensor-core product, the other half in __syncwarp.
__global__ void wmma_meets_syncwarp(float* out, const float* in) { wmma_tile<16>(out, in); }

// 17. lanes of one warp pass different tile pointers to one load_matrix_sync (it takes one).
__global__ void wmma_lane_pointers(float* out, const float* in) { wmma_tile<17>(out, in); }

// 18. one lane of a warp passes a null tile pointer to load_matrix_sync.
__global__ void wmma_lane_null_pointer(float* out, const float* in) { wmma_tile<18>(out, in); }

}  // namespace broken
}  // namespace MESA_NS

using namespace MESA_NS::broken;

#define MESA_BROKEN_CASE(name, threads, ...) MESA_BROKEN_ENTRY(broken_##name, name, 1, threads, 0, __VA_ARGS__)

MESA_BROKEN_CASE(broadcast_without_barrier, kBlock, a->out, a->in)
MESA_BROKEN_CASE(reductions_share_scratch, kBlock, a->out, a->in)
MESA_BROKEN_CASE(shuffle_half_warp, kBlock, a->out, a->in)
MESA_BROKEN_CASE(row_without_syncwarp, kBlock, a->out, a->in)
MESA_BROKEN_CASE(partial_barrier, kBlock, a->out, a->in)
MESA_BROKEN_CASE(barrier_per_branch, kBlock, a->out, a->in)
MESA_BROKEN_CASE(ballot_mask_mismatch, kBlock, a->out, a->in)
MESA_BROKEN_CASE(tail_unit_overrun, 64, a->out, a->in, a->n)
MESA_BROKEN_CASE(far_overrun, kBlock, a->out, a->in, a->n)
MESA_BROKEN_CASE(uninitialised_shared, kBlock, a->out, a->in, a->n)
MESA_BROKEN_CASE(bounded_128, 256, a->out, a->in)
MESA_BROKEN_CASE(unsynchronised_count, kBlock, a->out, a->in)
MESA_BROKEN_CASE(wmma_tile_product, 32, a->out, a->in)
MESA_BROKEN_CASE(wmma_half_warp, 32, a->out, a->in)
MESA_BROKEN_CASE(wmma_misaligned, 32, a->out, a->in)
MESA_BROKEN_CASE(wmma_meets_syncwarp, 32, a->out, a->in)
MESA_BROKEN_CASE(wmma_lane_pointers, 32, a->out, a->in)
MESA_BROKEN_CASE(wmma_lane_null_pointer, 32, a->out, a->in)
