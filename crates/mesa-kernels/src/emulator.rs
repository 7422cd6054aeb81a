//! The host emulation's checks: a sanitizer for the kernels while no GPU is at hand.
//!
//! With checks on, every emulator launch runs its blocks in a schedule shuffled from a seed,
//! poisons shared memory and non-zeroed allocations, guards every emulator allocation with
//! canaries and a no-access page, and checks barriers, shuffle masks and `__launch_bounds__`.
//! A failed check ends the launch with [`Error::EmulatorCheck`](crate::Error::EmulatorCheck),
//! whose report names the kernel and the seed that replays it. What each check sees and what
//! it cannot: `docs/emulator.md`.
//!
//! The checks are off unless switched on: by the environment (`MESA_EMU_CHECK=1` or a list
//! such as `schedule,memcheck`; `MESA_EMU_SEED=<n>`), or by [`set_checks`], which overrides
//! it. The test suite turns them all on ([`enable_for_tests`]).
use std::ffi::c_char;

use mesa_kernels_sys::emu as sys;

/// A set of emulator checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checks(u32);

impl Checks {
    /// No check: the emulator as fast as it goes.
    pub const NONE: Checks = Checks(0);
    /// Threads of a block shuffled at every scheduling point (barriers, warp exchanges, global
    /// loads and stores), blocks in a shuffled order.
    pub const SCHEDULE: Checks = Checks(sys::MESA_EMU_CHECK_SCHEDULE);
    /// `__shared__` memory poisoned at every block start; allocations that are not zeroed by
    /// contract poisoned.
    pub const INIT: Checks = Checks(sys::MESA_EMU_CHECK_INIT);
    /// Canary bytes after every emulator allocation, checked after each launch, and a guard
    /// page beyond them; a kernel's store into `__constant__` memory.
    pub const MEM: Checks = Checks(sys::MESA_EMU_CHECK_MEM);
    /// `__syncthreads` reached by part of a block, from two call sites in one generation, or
    /// in different iterations of a loop around it; shuffles, ballots and `__syncwarp` whose
    /// arriving lanes differ from their mask; grid syncs outside cooperative launches or
    /// reached by part of the grid.
    pub const SYNC: Checks = Checks(sys::MESA_EMU_CHECK_SYNC);
    /// Conflicting accesses of two threads (read-after-write, write-after-read,
    /// write-after-write) with nothing ordering them: to `__shared__` memory of a block
    /// (barrier, `__syncwarp`), and to global memory of a launch (also grid syncs and
    /// release/acquire pairs across blocks). With [`INIT`](Checks::INIT), reads of shared bytes
    /// no thread of the block wrote.
    pub const RACE: Checks = Checks(sys::MESA_EMU_CHECK_RACE);
    /// A block larger than the kernel's `__launch_bounds__`.
    pub const BOUNDS: Checks = Checks(sys::MESA_EMU_CHECK_BOUNDS);
    /// With [`RACE`](Checks::RACE): unordered stores of two threads that wrote the same bytes
    /// ("benign" write-write pairs), reported under their own name; without it they pass.
    pub const BENIGN: Checks = Checks(sys::MESA_EMU_CHECK_BENIGN);
    /// Every check.
    pub const ALL: Checks = Checks(sys::MESA_EMU_CHECK_ALL);

    /// The union of two sets.
    #[must_use]
    pub const fn with(self, other: Checks) -> Checks {
        Checks(self.0 | other.0)
    }

    /// True when every check of `other` is in `self`.
    #[must_use]
    pub const fn contains(self, other: Checks) -> bool {
        self.0 & other.0 == other.0
    }

    /// The bit set of `kernels/emu/emu_checks.h`.
    #[must_use]
    pub const fn bits(self) -> u32 {
        self.0
    }
}

/// Switches the checks of every later emulator launch and allocation in this process, with
/// `seed` as the base of every schedule and poison choice. Overrides `MESA_EMU_CHECK` and
/// `MESA_EMU_SEED`.
pub fn set_checks(checks: Checks, seed: u64) {
    // SAFETY: plain values; the emulator stores them atomically.
    unsafe { sys::mesa_emu_set_checks(checks.0, seed) }
}

/// The checks in force and the base seed.
#[must_use]
pub fn checks() -> (Checks, u64) {
    let (mut bits, mut seed) = (0u32, 0u64);
    // SAFETY: both pointers are valid for one write.
    unsafe { sys::mesa_emu_get_checks(&mut bits, &mut seed) };
    (Checks(bits), seed)
}

/// The test suite's setting: every check, unless `MESA_EMU_CHECK` chose otherwise; the seed
/// from `MESA_EMU_SEED`, else a fresh one (each report prints it).
pub fn enable_for_tests() {
    if std::env::var_os("MESA_EMU_CHECK").is_some() {
        return; // the environment's choice, already read by the emulator
    }
    let (_, seed) = checks();
    set_checks(Checks::ALL, seed);
}

/// The report of the last failed check of an emulator launch on this thread, if any (taken:
/// a second call returns `None`).
#[must_use]
pub fn take_report() -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let n = unsafe { sys::mesa_emu_take_report(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    if n == 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}
