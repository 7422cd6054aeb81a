// stochastic.cu — stochastic rounding with its generator broken on purpose, for
// tests/stochastic_rounding.rs: the statistics that test shows unbiasedness and independence
// with must reject each break. Not part of the library (build.rs: emulator only, linked only
// into the test that declares the entry point).
//
// One thread per element i (8-bit-wide output, one byte per code at any width): the library's
// own encode() (quant_common.cuh) with the library's random bits, except as `fault` says:
//   0  none: element_random_bits(seed + call * 0x9E3779B97F4A7C15, i) — the Quantizer's codes
//   1  a constant uniform: bits 0x8000 for every element
//   2  a neighbour's bits reused: element i takes element (i & ~1)'s bits (pairs share them)
//   3  the call counter not advanced: key = seed for every call
//   4  a uniform in (0, 1] instead of [0, 1): bits + 1 (on-grid values move when the bits are 0xffff)
#include "quant_common.cuh"

extern "C" {
typedef struct BrokenRoundingArgs {
  uint8_t* codes;    // [n], one code per byte
  const float* x;    // [n]
  int64_t n;
  MesaGroupParams params;  // one group
  uint64_t seed;
  uint64_t call;     // the Quantizer's batch counter
  int32_t bits;
  int32_t fault;
} BrokenRoundingArgs;
}

namespace MESA_NS {
namespace broken {

constexpr uint64_t kCallStride = 0x9E3779B97F4A7C15ull;  // crates/mesa-kernels/src/quant.rs

__global__ void stochastic_rounding_with_fault(BrokenRoundingArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const uint64_t key = a.fault == 3 ? a.seed : a.seed + a.call * kCallStride;
  unsigned u = element_random_bits(key, a.fault == 2 ? (i & ~int64_t(1)) : i);
  if (a.fault == 1) u = 0x8000u;
  if (a.fault == 4) u += 1u;
  const float levels = float((1u << a.bits) - 1u);
  a.codes[i] = uint8_t(encode(a.x[i], code_params(a.params), levels, true, u));
}

}  // namespace broken
}  // namespace MESA_NS

extern "C" int MESA_ENTRY(broken_stochastic_rounding)(const BrokenRoundingArgs* a) {
  using namespace MESA_NS::broken;
  if (a->n <= 0) return 0;
  const unsigned blocks = unsigned((a->n + 255) / 256);
  return int(MESA_LAUNCH(stochastic_rounding_with_fault, dim3(blocks), dim3(256), 0, nullptr, *a));
}
