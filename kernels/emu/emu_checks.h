/* emu_checks.h — the C ABI of the emulator's checks (docs/emulator.md).
 *
 * The checks are off unless switched on, at run time: by MESA_EMU_CHECK (read at the first
 * launch or allocation: `1`/`all`, or a comma list of the names below, `0`/`off` for none)
 * and MESA_EMU_SEED (a decimal or 0x-hex integer), or by mesa_emu_set_checks, which
 * overrides the environment. A failed check ends its launch with status 719
 * (cudaErrorLaunchFailure) and leaves a report for the launching thread, taken (once) by
 * mesa_emu_take_report.
 *
 * Emulator allocations (mesa_emu_alloc) are what memcheck and initcheck guard: with memcheck
 * on, each lies at the end of its own mapping, followed by 16 to 31 canary bytes (the
 * alignment slack included, checked after every launch of the allocating thread) and a
 * no-access guard page (a touch ends the launch at once); with initcheck on, an allocation
 * that is not zeroed by contract is filled with the poison byte.
 */
#ifndef MESA_EMU_CHECKS_H
#define MESA_EMU_CHECKS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum MesaEmuCheck {
  /* threads of a block in a shuffled order at every scheduling point, switches at loads and
   * stores, blocks in a shuffled order */
  MESA_EMU_CHECK_SCHEDULE = 1,
  /* __shared__ poisoned at each block start, non-zeroed allocations poisoned */
  MESA_EMU_CHECK_INIT = 2,
  /* canaries and a guard page after every emulator allocation */
  MESA_EMU_CHECK_MEM = 4,
  /* partial barriers, two barriers in one generation, a barrier met in different iterations of
   * a loop around it, shuffle/ballot mask mismatch, grid syncs, deadlock */
  MESA_EMU_CHECK_SYNC = 8,
  /* conflicting accesses of two threads to __shared__ or global memory with nothing ordering
   * them (barrier, __syncwarp, grid sync, release/acquire); reads of shared bytes no thread
   * of the block wrote (with initcheck) */
  MESA_EMU_CHECK_RACE = 16,
  /* blocks larger than the kernel's __launch_bounds__ */
  MESA_EMU_CHECK_BOUNDS = 32,
  /* (with racecheck) unordered stores of two threads that wrote the same bytes */
  MESA_EMU_CHECK_BENIGN = 64,
  MESA_EMU_CHECK_ALL = 1 | 2 | 4 | 8 | 16 | 32 | 64
};

/* Replaces the configuration (checks: a set of MesaEmuCheck bits; seed: the base seed). */
void mesa_emu_set_checks(uint32_t checks, uint64_t seed);
/* The configuration in force (after reading the environment if nothing set it). */
void mesa_emu_get_checks(uint32_t* checks, uint64_t* seed);
/* Copies the calling thread's pending report (NUL-terminated, truncated to cap bytes) and
 * clears it; returns its full length, 0 when no check failed since the last take. */
size_t mesa_emu_take_report(char* out, size_t cap);

/* `bytes` (> 0) bytes aligned to 64 (to 16 under memcheck, where the end is fitted to the
 * canaries); zeroed if `zeroed`, otherwise poisoned under initcheck. NULL when out of memory. */
void* mesa_emu_alloc(size_t bytes, int zeroed);
/* Frees what mesa_emu_alloc returned (NULL is ignored). */
void mesa_emu_free(void* p);

#ifdef __cplusplus
}
#endif

#endif /* MESA_EMU_CHECKS_H */
