// hazards.cu — deliberately broken kernels for the checks of issue 43: races in global memory
// (within a block, across blocks, across the phases of a cooperative grid), warp-synchronous
// code without __syncwarp, a barrier met in different iterations of a loop, cooperative
// groups misused, a store into __constant__ memory, and write-write pairs of equal and of
// different values. Each broken case has a correct control that must pass every check.
// tests/sanitizer.rs asserts every verdict; docs/emulator.md describes the checks.
//
// Entry points `mesa[_emu]_hazard_<case>(const BrokenArgs*)`, as in broken.cu.
#include "broken_case.cuh"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

namespace cg = cooperative_groups;

namespace MESA_NS {
namespace hazards {

constexpr int kBlock = 64;
constexpr int kBlocks = 8;

// 1. The last block of the grid sums the blocks' partial sums (threadFenceReduction): in[0..512)
// in 8 blocks of 64; out[0..8) the partials, out[8] the total, out[12] the arrival counter
// (zero bits). With kFence the writer fences before its arrival and the last block after it
// (release and acquire); without, the last block's reads race with the other blocks' writes.
template <bool kFence>
__device__ void last_block_sum(float* out, const float* in) {
  __shared__ float s[kBlock];
  __shared__ unsigned last;
  unsigned* arrivals = reinterpret_cast<unsigned*>(out + 12);
  s[threadIdx.x] = in[blockIdx.x * kBlock + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < kBlock; ++i) sum += s[i];
    out[blockIdx.x] = sum;
    if (kFence) __threadfence();
    last = atomicAdd(arrivals, 1u) == gridDim.x - 1 ? 1u : 0u;
  }
  __syncthreads();
  if (last != 0u && threadIdx.x == 0) {
    if (kFence) __threadfence();
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += out[b];
    out[8] = total;
  }
}
__global__ void last_block_fenced(float* out, const float* in) { last_block_sum<true>(out, in); }
__global__ void last_block_unfenced(float* out, const float* in) { last_block_sum<false>(out, in); }

// 2. A plain read-modify-write of one global word by every thread of a block, where an atomic
// was meant (control: atomicAdd).
template <bool kAtomic>
__device__ void accumulate(float* out, const float* in) {
  if (kAtomic) atomicAdd(out, in[threadIdx.x]);
  else out[0] += in[threadIdx.x];
}
__global__ void accumulate_atomic(float* out, const float* in) { accumulate<true>(out, in); }
__global__ void accumulate_plain(float* out, const float* in) { accumulate<false>(out, in); }

// 3. An inclusive scan of one warp in shared memory, the pre-Volta idiom: lanes read their
// neighbour's entry and write their own in one step, trusting lockstep (control: __syncwarp
// between the read and the write, and after the write). Static shared memory, and dynamic.
template <bool kSyncwarp>
__device__ void warp_scan(float* out, const float* in, float* s) {
  const int lane = threadIdx.x;
  s[lane] = in[lane];
  if (kSyncwarp) __syncwarp();
  for (int o = 1; o < 32; o *= 2) {
    const float v = lane >= o ? s[lane - o] : 0.0f;
    if (kSyncwarp) __syncwarp();
    s[lane] += v;
    if (kSyncwarp) __syncwarp();
  }
  out[lane] = s[lane];
}
__global__ void warp_scan_synced(float* out, const float* in) {
  __shared__ float s[32];
  warp_scan<true>(out, in, s);
}
__global__ void warp_scan_lockstep(float* out, const float* in) {
  __shared__ float s[32];
  warp_scan<false>(out, in, s);
}
__global__ void warp_scan_lockstep_dynamic(float* out, const float* in) {
  extern __shared__ float dyn[];
  warp_scan<false>(out, in, dyn);
}

// 4. A barrier inside a loop that each warp enters in a different iteration: even warps in
// iteration 0, odd warps in iteration 1. Every thread passes the barrier once, at one call
// site, so the count and the site agree; the iterations do not.
__global__ void barrier_in_shifted_iteration(float* out, const float* in) {
  __shared__ float s[kBlock];
  const int warp = threadIdx.x / 32;
  for (int i = 0; i < 2; ++i) {
    if ((warp + i) % 2 == 0) {
      s[threadIdx.x] = in[threadIdx.x];
      __syncthreads();
    }
  }
  out[threadIdx.x] = s[threadIdx.x];
}

// 5. Cooperative groups. (control) each tile of 16 sums its values with cg::reduce; tile.sync
// and block.sync order the shared staging. Every thread writes its tile's sum (exact: small
// integers).
__global__ void tile_sums(float* out, const float* in) {
  __shared__ float s[kBlock];
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<16> tile = cg::tiled_partition<16>(block);
  s[block.thread_rank()] = in[block.thread_rank()];
  block.sync();
  const float mine = s[(tile.meta_group_rank() * 16 + (tile.thread_rank() + 1) % 16)];
  tile.sync();
  const float sum = cg::reduce(tile, mine, cg::plus<float>());
  out[block.thread_rank()] = sum + 0.0f * float(tile.ballot(mine > 0.0f));
}

// 5b. A tile's shuffle reached by half of the tile.
__global__ void tile_shuffle_half(float* out, const float* in) {
  cg::thread_block_tile<16> tile = cg::tiled_partition<16>(cg::this_thread_block());
  float v = in[threadIdx.x];
  if (tile.thread_rank() < 8) v += tile.shfl_xor(v, 1);
  out[threadIdx.x] = v;
}

// 5c. A grid sync in a launch that is not cooperative (on a GPU: undefined, usually a hang).
__global__ void grid_sync_plain_launch(float* out, const float* in) {
  out[blockIdx.x * kBlock + threadIdx.x] = in[blockIdx.x * kBlock + threadIdx.x];
  cg::this_grid().sync();
  out[blockIdx.x * kBlock + threadIdx.x] += 1.0f;
}

// 5d. Two phases of a cooperative launch: each block writes its slice, then reads its
// neighbour's. (control) a grid sync between; (broken) none.
template <bool kGridSync>
__device__ void neighbour_phases(float* out, const float* in) {
  const int i = blockIdx.x * kBlock + threadIdx.x;
  out[i] = in[i];
  if (kGridSync) cg::this_grid().sync();
  const int j = ((blockIdx.x + 1) % gridDim.x) * kBlock + threadIdx.x;
  out[kBlocks * kBlock + i] = out[j];
}
__global__ void grid_phases_synced(float* out, const float* in) { neighbour_phases<true>(out, in); }
__global__ void grid_phases_unsynced(float* out, const float* in) { neighbour_phases<false>(out, in); }

// 6. A store into __constant__ memory (through a cast pointer: nvcc refuses a direct one).
__constant__ float coefficients[4];
__global__ void constant_store(float* out, const float* in) {
  if (threadIdx.x == 0) *const_cast<float*>(&coefficients[1]) = in[0];
  out[threadIdx.x] = coefficients[threadIdx.x % 4];
}

// 7. Unordered stores of one word by every thread: all of the same value (benign: a flag
// every thread sets), or each its own (a race whose result depends on the schedule).
template <bool kSameValue>
__device__ void store_one_word(float* out, const float* in) {
  out[0] = kSameValue ? 1.0f : in[threadIdx.x];
}
__global__ void same_value_stores(float* out, const float* in) { store_one_word<true>(out, in); }
__global__ void different_value_stores(float* out, const float* in) { store_one_word<false>(out, in); }

}  // namespace hazards
}  // namespace MESA_NS

using namespace MESA_NS::hazards;

#define MESA_HAZARD_CASE(name, blocks, threads, smem, ...) \
  MESA_BROKEN_ENTRY(hazard_##name, name, blocks, threads, smem, __VA_ARGS__)
#define MESA_HAZARD_COOPERATIVE(name, blocks, threads, ...) \
  MESA_BROKEN_ENTRY_COOPERATIVE(hazard_##name, name, blocks, threads, __VA_ARGS__)

MESA_HAZARD_CASE(last_block_fenced, kBlocks, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(last_block_unfenced, kBlocks, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(accumulate_atomic, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(accumulate_plain, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(warp_scan_synced, 1, 32, 0, a->out, a->in)
MESA_HAZARD_CASE(warp_scan_lockstep, 1, 32, 0, a->out, a->in)
MESA_HAZARD_CASE(warp_scan_lockstep_dynamic, 1, 32, 32 * sizeof(float), a->out, a->in)
MESA_HAZARD_CASE(barrier_in_shifted_iteration, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(tile_sums, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(tile_shuffle_half, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(grid_sync_plain_launch, kBlocks, kBlock, 0, a->out, a->in)
MESA_HAZARD_COOPERATIVE(grid_phases_synced, kBlocks, kBlock, a->out, a->in)
MESA_HAZARD_COOPERATIVE(grid_phases_unsynced, kBlocks, kBlock, a->out, a->in)
MESA_HAZARD_CASE(constant_store, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(same_value_stores, 1, kBlock, 0, a->out, a->in)
MESA_HAZARD_CASE(different_value_stores, 1, kBlock, 0, a->out, a->in)
