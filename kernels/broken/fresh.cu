// fresh.cu — three more broken kernels, written after the checks were (docs/emulator.md):
// ordinary kernels with one plausible mistake each, not variants of broken.cu's cases.
// tests/sanitizer.rs asserts that each is reported. Entry points as in broken.cu.
#include "broken_case.cuh"

namespace MESA_NS {
namespace fresh {

constexpr int kTile = 16;

// A 16x16 tile transpose through shared memory whose barrier sits before the stores
// instead of between the stores and the loads. in, out: 16x16 row-major.
__global__ void tile_transpose_misplaced_barrier(float* out, const float* in) {
  __shared__ float tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  __syncthreads();
  tile[ty][tx] = in[ty * kTile + tx];
  out[ty * kTile + tx] = tile[tx][ty];
}

// An exclusive scan of in[0..n) into out[0..n), written as "out[i + 1] = inclusive sum up
// to i" with out[0] = 0: the last thread stores out[n], one element past the end.
__global__ void shifted_scan(float* out, const float* in, int64_t n) {
  __shared__ float part[256];
  const int t = threadIdx.x;
  part[t] = t < n ? in[t] : 0.0f;
  __syncthreads();
  for (int d = 1; d < 256; d *= 2) {
    const float add = t >= d ? part[t - d] : 0.0f;
    __syncthreads();
    part[t] += add;
    __syncthreads();
  }
  if (t == 0) out[0] = 0.0f;
  if (t < n) out[t + 1] = part[t];
}

// A warp sum with __shfl_down_sync in which lanes leave the loop once their partner would be
// out of range — at different iterations, while the mask still names the whole warp.
__global__ void shuffle_loop_early_exit(float* out, const float* in) {
  const int lane = threadIdx.x % 32;
  float v = in[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) {
    if (lane + o >= 32) break;
    v += __shfl_down_sync(0xffffffffu, v, o);
  }
  if (lane == 0) out[threadIdx.x / 32] = v;
}

}  // namespace fresh
}  // namespace MESA_NS

using namespace MESA_NS::fresh;

extern "C" int MESA_ENTRY(fresh_tile_transpose)(const BrokenArgs* a) {
  return int(MESA_LAUNCH(tile_transpose_misplaced_barrier, dim3(1), dim3(kTile, kTile), 0, nullptr, a->out, a->in));
}
extern "C" int MESA_ENTRY(fresh_shifted_scan)(const BrokenArgs* a) {
  return int(MESA_LAUNCH(shifted_scan, dim3(1), dim3(256), 0, nullptr, a->out, a->in, a->n));
}
extern "C" int MESA_ENTRY(fresh_shuffle_early_exit)(const BrokenArgs* a) {
  return int(MESA_LAUNCH(shuffle_loop_early_exit, dim3(1), dim3(64), 0, nullptr, a->out, a->in));
}
