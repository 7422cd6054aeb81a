/* mesa_kernels.h — the one C ABI of mesa-kernels.
 *
 * Every kernel family exposes plain-C entry points of the form
 *
 *     MesaStatus mesa_<op>(const Mesa<Op>Args* args, void* stream);      CUDA build
 *     MesaStatus mesa_emu_<op>(const Mesa<Op>Args* args, void* stream);  host emulation
 *
 * `args` points to one struct per op (read during the call only; nothing is retained).
 * `stream` is a cudaStream_t / CUstream (NULL = legacy default stream); the emulation
 * ignores it and runs synchronously. All pointers inside `args` are device pointers for
 * the CUDA build and host pointers for the emulation. Sizes and strides are in elements
 * unless a field says bytes, and are 64-bit. Enums cross as fixed-width integers.
 *
 * This header is plain C (C99), is the input to bindgen (src/bindings.rs), and is
 * included by every kernels/*.cu file.
 */
#ifndef MESA_KERNELS_H
#define MESA_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ------------------------------------------------------------------------ */
typedef int32_t MesaStatus;
enum MesaStatusCode {
  MESA_STATUS_OK = 0,
  /* an argument failed the entry point's own checks (null pointer, bad size, bad enum) */
  MESA_STATUS_INVALID_ARGUMENT = 1,
  /* the library was built without nvcc: CUDA entry points are stubs */
  MESA_STATUS_CUDA_NOT_BUILT = 2,
  /* a valid request the kernels do not implement (dtype, bit width, shape class) */
  MESA_STATUS_UNSUPPORTED = 3,
  /* a bounded wait expired (collectives) */
  MESA_STATUS_TIMEOUT = 4,
  /* MESA_STATUS_CUDA_ERROR_BASE + cudaError_t: the CUDA runtime reported an error */
  MESA_STATUS_CUDA_ERROR_BASE = 1000
};

/* ---- dtypes ------------------------------------------------------------------------ */
typedef int32_t MesaDType;
enum MesaDTypeCode {
  MESA_DTYPE_F32 = 0,
  MESA_DTYPE_F16 = 1,
  MESA_DTYPE_BF16 = 2
};

/* ---- strided tensor view ------------------------------------------------------------
 * Element (i_0, ..., i_{ndim-1}) lives at data + sum_d i_d * strides[d] elements.
 * Logical (row-major) order over `shape` is the order codes are stored in. */
#define MESA_MAX_DIMS 6
typedef struct MesaTensorDesc {
  int64_t shape[MESA_MAX_DIMS];
  int64_t strides[MESA_MAX_DIMS];
  int32_t ndim;
  MesaDType dtype;
} MesaTensorDesc;

/* One entry point per op, declared for both builds from one list, so the names of the
 * two libraries cannot drift apart. */
#define MESA_DECLARE_ENTRY(name, Args)                            \
  MesaStatus mesa_##name(const Args* args, void* stream);         \
  MesaStatus mesa_emu_##name(const Args* args, void* stream);

#ifdef __cplusplus
}
#endif

#include "mesa_quant.h"
#include "mesa_collectives.h"
#include "mesa_fused.h"
#include "mesa_linear_attention.h"
#include "mesa_gated_linear_attention.h"

#endif /* MESA_KERNELS_H */
