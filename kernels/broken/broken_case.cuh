// broken_case.cuh — what the broken-kernel files share (kernels/broken/*.cu): the arguments
// of every case, and the entry point of a case, `mesa[_emu]_<entry>(const BrokenArgs*)`,
// returning the launch's cudaError_t (tests/sanitizer.rs, scripts/broken-main.cu).
#pragma once

#include "common.cuh"

extern "C" {
typedef struct BrokenArgs {
  float* out;
  const float* in;
  int64_t n;
} BrokenArgs;
}

// `entry`: one launch of `kernel` on `blocks` blocks of `threads` threads with `smem` bytes
// of dynamic shared memory, with the arguments given (of `a`, the case's BrokenArgs).
#define MESA_BROKEN_ENTRY(entry, kernel, blocks, threads, smem, ...)                              \
  extern "C" int MESA_ENTRY(entry)(const BrokenArgs* a) {                                         \
    return int(MESA_LAUNCH(kernel, dim3(blocks), dim3(threads), smem, nullptr, __VA_ARGS__));      \
  }
// The same as a cooperative launch (every block resident at once; grid syncs allowed).
#define MESA_BROKEN_ENTRY_COOPERATIVE(entry, kernel, blocks, threads, ...)                        \
  extern "C" int MESA_ENTRY(entry)(const BrokenArgs* a) {                                         \
    return int(MESA_LAUNCH_COOPERATIVE(kernel, dim3(blocks), dim3(threads), 0, nullptr, __VA_ARGS__)); \
  }
