// broken-main.cu — runs the deliberately broken kernels of kernels/broken/ on a GPU, for the
// bundle's compute-sanitizer section (scripts/bundle-run.sh): whether compute-sanitizer
// reports what the emulator's checks report (tests/sanitizer.rs, docs/emulator.md).
//
//   broken_kernels --list        one line per case: name, the compute-sanitizer tool meant to
//                                report it ("launch": the launch itself must fail; "tool?": the
//                                emulator reports it, whether compute-sanitizer does is what the
//                                run records — issue 43's global races, warp hazards, loop
//                                barriers, tiles, __constant__ stores. Not listed: the grid sync
//                                in a plain launch, which may hang a GPU)
//   broken_kernels CASE          runs one case on device 0 with buffers of exactly its size
//                                (cudaMalloc, so memcheck sees any byte past them); exit 0
//                                when the launch and the synchronisation succeed, 3 when
//                                either fails, 2 without a usable GPU
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "broken/broken_case.cuh"  // BrokenArgs

extern "C" {
#define BROKEN_CASES(X)                                     \
  X(broken_broadcast_without_barrier, 256, 256, racecheck)  \
  X(broken_reductions_share_scratch, 256, 2, racecheck)     \
  X(broken_shuffle_half_warp, 256, 256, synccheck)          \
  X(broken_row_without_syncwarp, 256, 256, racecheck)       \
  X(broken_partial_barrier, 256, 256, synccheck)            \
  X(broken_barrier_per_branch, 256, 256, synccheck)         \
  X(broken_ballot_mask_mismatch, 256, 256, synccheck)       \
  X(broken_tail_unit_overrun, 37, 37, memcheck)             \
  X(broken_far_overrun, 256, 256, memcheck)                 \
  X(broken_uninitialised_shared, 200, 1, initcheck)         \
  X(broken_bounded_128, 256, 256, launch)                   \
  X(broken_unsynchronised_count, 256, 256, racecheck)       \
  X(broken_wmma_half_warp, 512, 256, synccheck)             \
  X(broken_wmma_misaligned, 512, 256, memcheck)             \
  X(broken_wmma_meets_syncwarp, 512, 256, synccheck)        \
  X(broken_wmma_lane_pointers, 512, 256, synccheck)         \
  X(broken_wmma_lane_null_pointer, 512, 256, memcheck)      \
  X(fresh_tile_transpose, 256, 256, racecheck)              \
  X(fresh_shifted_scan, 100, 100, memcheck)                 \
  X(fresh_shuffle_early_exit, 64, 2, synccheck)                    \
  X(hazard_last_block_unfenced, 512, 16, racecheck?)                \
  X(hazard_accumulate_plain, 64, 1, racecheck?)                     \
  X(hazard_warp_scan_lockstep, 32, 32, racecheck?)                  \
  X(hazard_warp_scan_lockstep_dynamic, 32, 32, racecheck?)          \
  X(hazard_barrier_in_shifted_iteration, 64, 64, synccheck?)        \
  X(hazard_tile_shuffle_half, 64, 64, synccheck?)                   \
  X(hazard_grid_phases_unsynced, 512, 1024, racecheck?)             \
  X(hazard_constant_store, 64, 64, memcheck?)                       \
  X(hazard_different_value_stores, 64, 1, racecheck?)
#define DECLARE(name, n, out, tool) int mesa_##name(const BrokenArgs* a);
BROKEN_CASES(DECLARE)
}

struct Case {
  const char* name;
  int (*fn)(const BrokenArgs*);
  int64_t n, out;
  const char* tool;
};
#define ENTRY(name, n, out, tool) {#name, mesa_##name, n, out, #tool},
static const Case kCases[] = {BROKEN_CASES(ENTRY)};

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const Case& c : kCases) std::printf("%s %s\n", c.name, c.tool);
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s --list | CASE\n", argv[0]);
    return 1;
  }
  for (const Case& c : kCases) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    float *in = nullptr, *out = nullptr;
    if (cudaMalloc(&in, c.n * sizeof(float)) != cudaSuccess || cudaMalloc(&out, c.out * sizeof(float)) != cudaSuccess) {
      std::fprintf(stderr, "%s: no usable GPU (%s)\n", c.name, cudaGetErrorString(cudaGetLastError()));
      return 2;
    }
    std::vector<float> host(c.n);
    for (int64_t i = 0; i < c.n; ++i) host[i] = 1.0f + float(i);
    cudaMemcpy(in, host.data(), c.n * sizeof(float), cudaMemcpyHostToDevice);
    const BrokenArgs a{out, in, c.n};
    const int launch = c.fn(&a);
    const cudaError_t sync = cudaDeviceSynchronize();
    std::printf("%s: launch %d (%s), synchronize %d (%s)\n", c.name, launch,
                cudaGetErrorString(cudaError_t(launch)), int(sync), cudaGetErrorString(sync));
    cudaFree(in);
    cudaFree(out);
    return launch == 0 && sync == cudaSuccess ? 0 : 3;
  }
  std::fprintf(stderr, "no case `%s` (--list)\n", argv[1]);
  return 1;
}
