// review.cu — issue 43's checks against an adversarial review: broken kernels each check must
// report and correct ones (the patterns real kernels use: fence-and-flag handshakes, the
// threadFenceReduction, grid syncs, tiles of 8, 16 and 32, 8- and 16-bit outputs, loops with
// barriers) that must pass every check. tests/sanitizer.rs runs each over six seeds. Cases
// the checks miss or misjudge are listed in docs/emulator.md ("Limits"), not here.
// Entry points `mesa[_emu]_review_<case>(const BrokenArgs*)`.
#include "broken_case.cuh"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

namespace cg = cooperative_groups;

namespace MESA_NS {
namespace review {

constexpr int kB = 64;

__device__ void spin_until_nonzero(unsigned* flag) {
  while (atomicAdd(flag, 0u) == 0u) __nanosleep(100);
}

// ---------------------------------------------------------------------------------------
// Flag handshakes between block 0 (producer) and block 1 (consumer), cooperative launches of
// 2 blocks of 64. out[0..64): data; out[100]: flag; out[101]: flag2; out[128..192): result.
// kMode: 0 correct (fence, flag / flag, fence), 1 writer without fence, 2 reader without
// fence, 5 correct, every consumer thread polls and acquires itself, 6 correct,
// every producer thread publishes (fence + atomicAdd on a counter), 7 correct, the fence
// followed by two atomic stores, the consumer waits on the second, 8 correct with
// load_acquire_sys/store_release_sys (atomic_ref), every thread writes, thread 0 releases
// after a barrier.
template <int kMode>
__device__ void handshake(float* out, const float* in) {
  unsigned* flag = reinterpret_cast<unsigned*>(out + 100);
  unsigned* flag2 = reinterpret_cast<unsigned*>(out + 101);
  const int t = threadIdx.x;
  if (blockIdx.x == 0) {
    if (kMode == 8) {
      out[t] = in[t] * 2.0f;
      __syncthreads();
      if (t == 0) store_release_sys(flag, 1u);
    } else if (kMode == 6) {
      out[t] = in[t] * 2.0f;
      __threadfence();
      atomicAdd(flag, 1u);
    } else if (t == 0) {
      for (int i = 0; i < kB; ++i) out[i] = in[i] * 2.0f;
      if (kMode != 1) __threadfence();
      atomicExch(flag, 1u);
      if (kMode == 7) atomicExch(flag2, 1u);
    }
  } else {
    if (kMode == 5) {
      spin_until_nonzero(flag);
      __threadfence();
    } else if (kMode == 6) {
      if (t == 0) {
        while (atomicAdd(flag, 0u) != unsigned(kB)) __nanosleep(100);
        __threadfence();
      }
      __syncthreads();
    } else if (kMode == 8) {
      if (t == 0)
        while (load_acquire_sys(flag) == 0u) __nanosleep(100);
      __syncthreads();
    } else {
      if (t == 0) {
        spin_until_nonzero(kMode == 7 ? flag2 : flag);
        if (kMode != 2) __threadfence();
      }
      __syncthreads();
    }
    out[128 + t] = out[t] + 1.0f;
  }
}
__global__ void hs_correct(float* o, const float* i) { handshake<0>(o, i); }
__global__ void hs_writer_no_fence(float* o, const float* i) { handshake<1>(o, i); }
__global__ void hs_reader_no_fence(float* o, const float* i) { handshake<2>(o, i); }
__global__ void hs_every_reader_acquires(float* o, const float* i) { handshake<5>(o, i); }
__global__ void hs_every_writer_releases(float* o, const float* i) { handshake<6>(o, i); }
__global__ void hs_fence_two_flags(float* o, const float* i) { handshake<7>(o, i); }
__global__ void hs_atomic_ref(float* o, const float* i) { handshake<8>(o, i); }

// ---------------------------------------------------------------------------------------
// threadFenceReduction as in CUDA's sample, with the fence after the ticket too, and every
// thread of the last block reading the partials. 8 blocks of 64: out[0..8) partials, out[8]
// total, out[12] ticket counter.
__global__ void fence_reduction(float* out, const float* in) {
  __shared__ float s[kB];
  __shared__ bool am_last;
  unsigned* count = reinterpret_cast<unsigned*>(out + 12);
  const int t = threadIdx.x;
  s[t] = in[blockIdx.x * kB + t];
  __syncthreads();
  for (int o = kB / 2; o > 0; o /= 2) {
    if (t < o) s[t] += s[t + o];
    __syncthreads();
  }
  if (t == 0) {
    out[blockIdx.x] = s[0];
    __threadfence();
    const unsigned ticket = atomicInc(count, gridDim.x);
    __threadfence();
    am_last = ticket == gridDim.x - 1;
  }
  __syncthreads();
  if (am_last) {
    float v = t < int(gridDim.x) ? out[t] : 0.0f;
    v = cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), v, cg::plus<float>());
    if (t == 0) out[8] = v;
  }
}

// Atomics only: every thread of 8 blocks adds into 4 counters and takes a max. out[0..4)
// sums, out[4] (bits) max.
__global__ void atomics_only(float* out, const float* in) {
  const int i = blockIdx.x * kB + threadIdx.x;
  atomicAdd(out + (i % 4), in[i]);
  atomicMax(reinterpret_cast<unsigned*>(out + 4), unsigned(i));
}

// Cooperative ping-pong: 4 rounds of out[b][i] = out[a][neighbour] + 1 with a grid sync between.
// out[0..512) and out[512..1024), 8 blocks of 64.
__global__ void grid_ping_pong(float* out, const float* in) {
  cg::grid_group grid = cg::this_grid();
  const int n = 8 * kB;
  const int i = blockIdx.x * kB + threadIdx.x;
  out[i] = in[i];
  grid.sync();
  for (int r = 0; r < 4; ++r) {
    const float* src = out + (r % 2) * n;
    float* dst = out + ((r + 1) % 2) * n;
    dst[i] = src[(i + kB) % n] + 1.0f;
    grid.sync();
  }
}

// Tiles of 8 and 32: stage in shared memory, tile.sync, reduce, shfl_down, ballot/any/all.
// out[t] = sum of the tile of 8, out[64 + t] = sum of the warp, out[128 + t] = ballot bits.
__global__ void tiles_8_32(float* out, const float* in) {
  __shared__ float s[kB];
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<8> t8 = cg::tiled_partition<8>(block);
  cg::thread_block_tile<32> t32 = cg::tiled_partition<32>(block);
  const unsigned r = block.thread_rank();
  s[r] = in[r];
  t8.sync();
  const float mine = s[t8.meta_group_rank() * 8 + (t8.thread_rank() + 3) % 8];
  t8.sync();
  s[r] = mine * 2.0f;  // write after every lane of the tile read
  const float s8 = cg::reduce(t8, mine, cg::plus<float>());
  float d = mine;
  for (unsigned o = 4; o > 0; o /= 2) d += t8.shfl_down(d, o);
  d = t8.shfl(d, 0);
  t32.sync();
  const float w = s[t32.meta_group_rank() * 32 + (t32.thread_rank() + 5) % 32];
  const float s32 = cg::reduce(t32, w, cg::plus<float>());
  const unsigned bits = t8.ballot(mine > 4.0f);
  const bool any = t8.any(mine > 60.0f), all = t32.all(w > 0.0f);
  out[r] = s8 + (d - s8);
  out[64 + r] = s32 * 0.5f;
  out[128 + r] = float(bits) + (any ? 1000.0f : 0.0f) + (all ? 0.0f : 1e6f);
}

// A tile of 16 reduces, then the whole warp meets in a full-mask shuffle (legal: the
// second tile may reach the warp shuffle while the first still reduces).
__global__ void tile_reduce_then_warp_shuffle(float* out, const float* in) {
  cg::thread_block_tile<16> t16 = cg::tiled_partition<16>(cg::this_thread_block());
  const float v = cg::reduce(t16, in[threadIdx.x], cg::plus<float>());
  const float first = __shfl_sync(0xffffffffu, v, 0);
  out[threadIdx.x] = v + first;
}

// 8-bit and 16-bit outputs per thread, blocks of 33 threads (granules span two blocks);
// in-place updates of 16-bit and of 8-bit elements. in: ramp; 4 blocks of 33 = 132 elements.
__global__ void narrow_outputs(float* out, const float* in) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned char* b8 = reinterpret_cast<unsigned char*>(out);              // [0, 132)
  __half* h16 = reinterpret_cast<__half*>(out + 64);                     // [256, 520) bytes
  b8[i] = (unsigned char)(i & 0xff);
  h16[i] = __float2half_rn(in[i]);
}
__global__ void inplace_16(float* out, const float*) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  __half* h16 = reinterpret_cast<__half*>(out + 64);
  h16[i] = __float2half_rn(__half2float(h16[i]) + 1.0f);
}
__global__ void inplace_8(float* out, const float*) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned char* b8 = reinterpret_cast<unsigned char*>(out);
  b8[i] = (unsigned char)(b8[i] + 1);
}

// Barriers in uniform loops: a plain for, nested loops (inner count varies with the outer
// index, uniformly), continue/break on a uniform condition, a while on a shared value, a
// do-while, and a device function with a barrier loop called twice.
__device__ void smooth(float* s, int rounds) {
  for (int r = 0; r < rounds; ++r) {
    const float v = (s[threadIdx.x] + s[(threadIdx.x + 1) % kB]) * 0.5f;
    __syncthreads();
    s[threadIdx.x] = v;
    __syncthreads();
  }
}
__global__ void uniform_loops(float* out, const float* in) {
  __shared__ float s[kB];
  __shared__ int left;
  const int t = threadIdx.x;
  s[t] = in[t];
  if (t == 0) left = 3;
  __syncthreads();
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j <= i; ++j) {
      if (j == 1) continue;
      const float v = s[(t + j) % kB];
      __syncthreads();
      s[t] = v + 1.0f;
      __syncthreads();
    }
    if (i == 1) break;
  }
  while (left > 0) {
    const float v = s[(t + 2) % kB];
    __syncthreads();
    s[t] = v;
    if (t == 0) left -= 1;
    __syncthreads();
  }
  int k = 0;
  do {
    const float v = s[(t + 7) % kB];
    __syncthreads();
    s[t] = v;
    __syncthreads();
  } while (++k < 2);
  smooth(s, 2);
  smooth(s, 1);
  out[t] = s[t];
}

// ---------------------------------------------------------------------------------------
// Broken.

// Intra-warp shared race: lane 0 writes, every lane reads lane 0's entry, no __syncwarp.
__global__ void warp_broadcast_no_syncwarp(float* out, const float* in) {
  __shared__ float s[32];
  if (threadIdx.x == 0) s[0] = in[0];
  out[threadIdx.x] = s[0];
}

// Tile 1 (lanes 8..15) communicates through shared memory with no sync of its own; only tile
// 0 calls tile.sync(), between lane 8's write and lane 9's read (shared atomics, which order
// nothing, put the sync there).
__global__ void other_tile_sync(float* out, const float* in) {
  __shared__ float s[32];
  __shared__ unsigned written, synced;
  cg::thread_block_tile<8> t8 = cg::tiled_partition<8>(cg::this_thread_block());
  if (threadIdx.x == 0) {
    written = 0;
    synced = 0;
  }
  __syncthreads();
  const unsigned lane = threadIdx.x;
  if (t8.meta_group_rank() == 0) {
    while (atomicAdd(&written, 0u) == 0u) __nanosleep(10);
    t8.sync();
    if (lane == 0) atomicExch(&synced, 1u);
  } else if (lane == 8) {
    s[8] = in[8];
    atomicExch(&written, 1u);
  } else if (lane == 9) {
    while (atomicAdd(&synced, 0u) == 0u) __nanosleep(10);
    out[9] = s[8];
  }
}

// A shared counter set to 0 by thread 0 with no barrier before everyone's atomicAdd (a plain
// store racing with atomics).
__global__ void shared_count_no_init_barrier(float* out, const float*) {
  __shared__ unsigned count;
  if (threadIdx.x == 0) count = 0;
  atomicAdd(&count, 1u);
  __syncthreads();
  out[threadIdx.x] = float(count);
}

// Thread-dependent trip count around a barrier: warp 0 twice, warp 1 once, then warp 1
// passes a barrier at the same call site through a second iteration of an outer loop.
__global__ void trip_count_by_warp(float* out, const float* in) {
  __shared__ float s[kB];
  const int warp = threadIdx.x / 32;
  s[threadIdx.x] = in[threadIdx.x];
  for (int i = 0; i < 1 + (warp == 0 ? 1 : 0); ++i) {
    s[threadIdx.x] += 1.0f;
    __syncthreads();
  }
  out[threadIdx.x] = s[threadIdx.x];
}
__global__ void trip_count_balanced(float* out, const float* in) {
  __shared__ float s[kB];
  const int warp = threadIdx.x / 32;
  s[threadIdx.x] = in[threadIdx.x];
  for (int o = 0; o < 2; ++o) {
    const int trips = warp == 0 ? 2 - o : 1 + o;  // warp 0: 2 then 1; warp 1: 1 then 2
    for (int i = 0; i < trips; ++i) {
      s[threadIdx.x] += 1.0f;
      __syncthreads();
    }
  }
  out[threadIdx.x] = s[threadIdx.x];
}

// hazards.cu's shifted iterations, with the barrier as cg::sync(block).
__global__ void shifted_iteration_cg_sync(float* out, const float* in) {
  __shared__ float s[kB];
  cg::thread_block block = cg::this_thread_block();
  const int warp = threadIdx.x / 32;
  for (int i = 0; i < 2; ++i) {
    if ((warp + i) % 2 == 0) {
      s[threadIdx.x] = in[threadIdx.x];
      cg::sync(block);
    }
  }
  out[threadIdx.x] = s[threadIdx.x];
}

// Tile shuffles with wrong masks: (a) a tile of 8's shuffle with the full-warp mask; (b) a
// 16-lane mask for both halves of the warp; (c) a tile of 8 reading a lane of the next tile.
__global__ void tile_full_mask(float* out, const float* in) {
  cg::thread_block_tile<8> t8 = cg::tiled_partition<8>(cg::this_thread_block());
  float v = in[threadIdx.x];
  if (t8.meta_group_rank() == 0) v += __shfl_xor_sync(0xffffffffu, v, 1, 8);
  out[threadIdx.x] = v;
}
__global__ void tile_low_mask_everywhere(float* out, const float* in) {
  float v = in[threadIdx.x];
  v += __shfl_xor_sync(0x0000ffffu, v, 1, 16);
  out[threadIdx.x] = v;
}
__global__ void tile_reads_outside(float* out, const float* in) {
  float v = in[threadIdx.x];
  if (threadIdx.x < 8) v += __shfl_sync(0x000000ffu, v, 9);
  out[threadIdx.x] = v;
}

// __constant__ stores: through a pointer argument, by an atomic, and 16 bytes at once.
__constant__ float table[8];
__global__ void constant_store_via_arg(float* out, const float* in, float* c) {
  if (threadIdx.x == 0) c[2] = in[0];
  out[threadIdx.x] = table[threadIdx.x % 8];
}
__global__ void constant_atomic(float* out, const float* in) {
  if (threadIdx.x == 0) atomicAdd(const_cast<float*>(&table[3]), in[0]);
  out[threadIdx.x] = table[threadIdx.x % 8];
}
__global__ void constant_vector_store(float* out, const float* in) {
  if (threadIdx.x == 0) *reinterpret_cast<float4*>(const_cast<float*>(&table[4])) = make_float4(1, 2, 3, 4);
  out[threadIdx.x] = table[threadIdx.x % 8] + in[0];
}

// Cross-block race in a plain launch: each block writes its slice then reads the next block's
// slice (no fence, no flag).
__global__ void neighbour_read_plain(float* out, const float* in) {
  const int i = blockIdx.x * kB + threadIdx.x;
  out[i] = in[i];
  out[512 + i] = out[((blockIdx.x + 1) % gridDim.x) * kB + threadIdx.x];
}

// Lane 0 writes a global value, the warp passes exactly 256 __syncwarps, lane 1 reads it.
__global__ void warp_256_syncwarps(float* out, const float* in) {
  if (threadIdx.x == 0) out[0] = in[0];
  for (int i = 0; i < 256; ++i) __syncwarp();
  if (threadIdx.x == 1) out[1] = out[0];
}

// Block 0 writes, 256 grid syncs, block 1 reads (a persistent kernel's iterations).
__global__ void grid_256_syncs(float* out, const float* in) {
  cg::grid_group grid = cg::this_grid();
  if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = in[0];
  for (int i = 0; i < 256; ++i) {
    grid.sync();
  }
  if (blockIdx.x == 1 && threadIdx.x == 0) out[1] = out[0];
}

// A plain read-after-write race in a kernel that also has a (uniform, correct) barrier loop.
__global__ void race_after_barrier_loop(float* out, const float* in) {
  __shared__ float s[kB];
  for (int i = 0; i < 2; ++i) {
    s[threadIdx.x] = in[threadIdx.x] + float(i);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = s[1];
  out[1 + threadIdx.x] = out[0];
}
// The same race without the loop.
__global__ void race_without_loop(float* out, const float* in) {
  __shared__ float s[kB];
  s[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s[1];
  out[1 + threadIdx.x] = out[0];
}
}  // namespace review
}  // namespace MESA_NS

using namespace MESA_NS::review;

#define R_CASE(name, blocks, threads, smem, ...) MESA_BROKEN_ENTRY(review_##name, name, blocks, threads, smem, __VA_ARGS__)
#define R_COOP(name, blocks, threads, ...) \
  MESA_BROKEN_ENTRY_COOPERATIVE(review_##name, name, blocks, threads, __VA_ARGS__)

R_COOP(hs_correct, 2, kB, a->out, a->in)
R_COOP(hs_writer_no_fence, 2, kB, a->out, a->in)
R_COOP(hs_reader_no_fence, 2, kB, a->out, a->in)
R_COOP(hs_every_reader_acquires, 2, kB, a->out, a->in)
R_COOP(hs_every_writer_releases, 2, kB, a->out, a->in)
R_COOP(hs_fence_two_flags, 2, kB, a->out, a->in)
R_COOP(hs_atomic_ref, 2, kB, a->out, a->in)
R_CASE(fence_reduction, 8, kB, 0, a->out, a->in)
R_CASE(atomics_only, 8, kB, 0, a->out, a->in)
R_COOP(grid_ping_pong, 8, kB, a->out, a->in)
R_CASE(tiles_8_32, 1, kB, 0, a->out, a->in)
R_CASE(tile_reduce_then_warp_shuffle, 1, 32, 0, a->out, a->in)
extern "C" int MESA_ENTRY(review_narrow)(const BrokenArgs* a) {
  int s = int(MESA_LAUNCH(narrow_outputs, dim3(4), dim3(33), 0, nullptr, a->out, a->in));
  if (s != 0) return s;
  return int(MESA_LAUNCH(inplace_16, dim3(4), dim3(33), 0, nullptr, a->out, a->in));
}
extern "C" int MESA_ENTRY(review_inplace_8)(const BrokenArgs* a) {
  int s = int(MESA_LAUNCH(narrow_outputs, dim3(4), dim3(33), 0, nullptr, a->out, a->in));
  if (s != 0) return s;
  return int(MESA_LAUNCH(inplace_8, dim3(4), dim3(33), 0, nullptr, a->out, a->in));
}
R_CASE(uniform_loops, 1, kB, 0, a->out, a->in)
R_CASE(warp_broadcast_no_syncwarp, 1, 32, 0, a->out, a->in)
R_CASE(other_tile_sync, 1, 32, 0, a->out, a->in)
R_CASE(shared_count_no_init_barrier, 1, kB, 0, a->out, a->in)
R_CASE(trip_count_by_warp, 1, kB, 0, a->out, a->in)
R_CASE(trip_count_balanced, 1, kB, 0, a->out, a->in)
R_CASE(shifted_iteration_cg_sync, 1, kB, 0, a->out, a->in)
R_CASE(tile_full_mask, 1, 32, 0, a->out, a->in)
R_CASE(tile_low_mask_everywhere, 1, 32, 0, a->out, a->in)
R_CASE(tile_reads_outside, 1, 32, 0, a->out, a->in)
R_CASE(constant_store_via_arg, 1, kB, 0, a->out, a->in, const_cast<float*>(&table[0]))
R_CASE(constant_atomic, 1, kB, 0, a->out, a->in)
R_CASE(constant_vector_store, 1, kB, 0, a->out, a->in)
R_CASE(neighbour_read_plain, 8, kB, 0, a->out, a->in)
R_CASE(warp_256_syncwarps, 1, 32, 0, a->out, a->in)
R_COOP(grid_256_syncs, 2, 32, a->out, a->in)
R_CASE(race_after_barrier_loop, 1, 64, 0, a->out, a->in)
R_CASE(race_without_loop, 1, 64, 0, a->out, a->in)
