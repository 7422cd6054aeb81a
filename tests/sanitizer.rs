//! The emulator as a sanitizer: each deliberately broken kernel of `kernels/broken/` is
//! reported by the check that exists to find it (docs/emulator.md).
//!
//! Checks that report an error assert the error: its check, its kernel, its seed. The
//! schedule and poison checks change what a racy or uninitialised read sees; their cases
//! assert the wrong result, which without the checks would be right.
use mesa_kernels::emulator::{self, Checks};
use mesa_kernels::{Buffer, Device};

/// The arguments of every broken case (`kernels/broken/broken.cu`).
#[repr(C)]
struct BrokenArgs {
    out: *mut f32,
    input: *const f32,
    n: i64,
}

type Case = unsafe extern "C" fn(*const BrokenArgs) -> i32;

extern "C" {
    fn mesa_emu_broken_broadcast_without_barrier(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_reductions_share_scratch(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_shuffle_half_warp(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_row_without_syncwarp(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_partial_barrier(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_barrier_per_branch(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_ballot_mask_mismatch(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_tail_unit_overrun(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_far_overrun(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_uninitialised_shared(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_bounded_128(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_unsynchronised_count(a: *const BrokenArgs) -> i32;
}

/// cudaErrorLaunchFailure: what a launch with a failed check returns.
const LAUNCH_FAILURE: i32 = 719;

/// One run of a case: its status, its report, its output.
struct Run {
    status: i32,
    report: Option<String>,
    out: Vec<f32>,
}

/// Runs `case` with `checks` and `seed` on `input` (an emulator allocation, so memcheck
/// guards it) and an output of `out_len` elements (`n` = `input.len()`).
///
/// The configuration is process-wide: the tests of this file hold one lock while they use it.
fn run(case: Case, checks: Checks, seed: u64, input: &[f32], out_len: usize) -> Run {
    let _guard = CONFIG.lock().unwrap_or_else(|e| e.into_inner());
    emulator::set_checks(checks, seed);
    let device = Device::emulator();
    let inp = device.upload(input).expect("upload");
    let mut out = device.upload(&vec![0.0f32; out_len]).expect("upload");
    let (Buffer::Host(i), Buffer::Host(o)) = (&inp, &mut out) else { panic!("emulator buffers are host buffers") };
    let args = BrokenArgs { out: o.as_mut_ptr(), input: i.as_ptr(), n: input.len() as i64 };
    // SAFETY: `out` holds `out_len` elements and `input` `n`; the cases write past `out` only
    // where the test says so, into the canaries or the guard page the memcheck set up.
    let status = unsafe { case(&args) };
    let report = emulator::take_report();
    Run { status, report, out: out.to_vec().expect("download") }
}

static CONFIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| 1.0 + i as f32).collect()
}

/// Asserts a reported failure of `check` naming `kernel`, with the seed.
fn assert_reported(r: &Run, check: &str, kernel: &str, seed: u64) {
    assert_reported_by(r, &[check], kernel, seed);
}

/// Asserts a reported failure of one of `checks` naming `kernel`, with the seed.
fn assert_reported_by(r: &Run, checks: &[&str], kernel: &str, seed: u64) {
    let report = r.report.as_deref().unwrap_or_else(|| panic!("no report (status {})", r.status));
    assert_eq!(r.status, LAUNCH_FAILURE, "{report}");
    assert!(checks.iter().any(|c| report.contains(&format!("mesa emulator {c}:"))), "{report}");
    assert!(report.contains(kernel), "{report}");
    assert!(report.contains(&format!("MESA_EMU_SEED={seed} ")), "{report}");
    eprintln!("reported: {report}");
}

/// The checks that change what a kernel sees without reporting: shuffled schedule, poison.
const SCHEDULE_AND_POISON: Checks = Checks::SCHEDULE.with(Checks::INIT);

/// Runs with the shuffled schedule and poison for `seeds` seeds; true when some run's output
/// differs from `good`.
fn wrong_under_some_seed(case: Case, input: &[f32], good: &[f32], seeds: u64) -> bool {
    (1..=seeds).any(|seed| {
        let r = run(case, SCHEDULE_AND_POISON, seed, input, good.len());
        assert!(r.report.is_none(), "{:?}", r.report);
        r.out != good
    })
}

#[test]
fn shuffle_reached_by_half_the_warp() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_shuffle_half_warp, Checks::ALL, 7, &x, 256);
    assert_reported(&r, "synccheck", "shuffle_half_warp", 7);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("mask 0xffffffff")));
}

#[test]
fn barrier_reached_by_part_of_the_block() {
    let x = ramp(256);
    // (with every check, racecheck or initcheck may see the threads that skip the barrier read
    // before their partners wrote: also a report, of the same bug)
    let r = run(mesa_emu_broken_partial_barrier, Checks::ALL, 3, &x, 256);
    assert_reported_by(&r, &["synccheck", "racecheck", "initcheck"], "partial_barrier", 3);
    let r = run(mesa_emu_broken_partial_barrier, Checks::SYNC, 3, &x, 256);
    assert_reported(&r, "synccheck", "partial_barrier", 3);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("reached by part of the block")));
    // without the check the launch "passes"
    let r = run(mesa_emu_broken_partial_barrier, Checks::NONE, 3, &x, 256);
    assert!(r.report.is_none() && r.status == 0);
}

#[test]
fn two_barriers_in_one_generation() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_barrier_per_branch, Checks::SYNC, 5, &x, 256);
    assert_reported(&r, "synccheck", "barrier_per_branch", 5);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("two different __syncthreads")));
}

#[test]
fn ballot_lanes_disagree_on_the_mask() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_ballot_mask_mismatch, Checks::ALL, 11, &x, 256);
    assert_reported(&r, "synccheck", "ballot_mask_mismatch", 11);
}

#[test]
fn tail_unit_written_past_the_end() {
    // 37 elements: the last unit of 4 stores 3 floats (12 bytes) past the end
    let x = ramp(37);
    let r = run(mesa_emu_broken_tail_unit_overrun, Checks::MEM, 13, &x, 37);
    assert_reported(&r, "memcheck", "tail_unit_overrun", 13);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("148-byte emulator allocation")));
    // the elements in range are right all the same: only the canaries see the bug
    assert!(r.out.iter().zip(&x).all(|(o, i)| *o == 2.0 * i));
}

#[test]
fn guard_page_touched() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_far_overrun, Checks::MEM, 17, &x, 256);
    assert_reported(&r, "memcheck", "far_overrun", 17);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("guard page")));
}

#[test]
fn launch_bounds_exceeded() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_bounded_128, Checks::BOUNDS, 19, &x, 256);
    assert_reported(&r, "bounds", "bounded_128", 19);
}

#[test]
fn uninitialised_shared_read() {
    // 200 of 256 entries written: the sum reads 56 poisoned ones
    let x = ramp(200);
    let good: f32 = x.iter().sum();
    for seed in [2u64, 3] {
        // both poisons: 0xff bytes (NaN) and 0x7f bytes (3.4e38)
        let r = run(mesa_emu_broken_uninitialised_shared, Checks::INIT, seed, &x, 1);
        assert!(r.report.is_none());
        assert_ne!(r.out[0], good, "seed {seed}: the poisoned entries went unnoticed");
    }
    // with racecheck's shadow, the first read of an unwritten entry is reported
    let r = run(mesa_emu_broken_uninitialised_shared, Checks::ALL, 23, &x, 1);
    assert_reported(&r, "initcheck", "uninitialised_shared", 23);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("__shared__ `s`")));
    // and a full array is fine
    let full = ramp(256);
    let r = run(mesa_emu_broken_uninitialised_shared, Checks::ALL, 23, &full, 1);
    assert!(r.report.is_none(), "{:?}", r.report);
    assert_eq!(r.out[0], full.iter().sum::<f32>());
}

#[test]
fn broadcast_without_barrier() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_broadcast_without_barrier, Checks::NONE, 1, &x, 256);
    assert_eq!(r.out, [1.0; 256], "the unchecked emulator runs thread 0 first, which hides the bug");
    assert!(wrong_under_some_seed(mesa_emu_broken_broadcast_without_barrier, &x, &[1.0; 256], 4));
    for seed in [1u64, 2, 3] {
        // thread 0's write before the read: a race; after it: an uninitialised read
        let r = run(mesa_emu_broken_broadcast_without_barrier, Checks::ALL, seed, &x, 256);
        assert_reported_by(&r, &["racecheck", "initcheck"], "broadcast_without_barrier", seed);
    }
}

#[test]
fn row_read_without_syncwarp() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_row_without_syncwarp, Checks::ALL, 29, &x, 256);
    assert_reported_by(&r, &["racecheck", "initcheck"], "row_without_syncwarp", 29);
    let r = run(mesa_emu_broken_row_without_syncwarp, Checks::RACE, 29, &x, 256);
    assert_reported(&r, "racecheck", "row_without_syncwarp", 29);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("read-after-write race on __shared__ `row`")));
}

#[test]
fn shared_counter_without_atomics() {
    let x = ramp(256);
    let r = run(mesa_emu_broken_unsynchronised_count, Checks::RACE, 31, &x, 256);
    assert_reported(&r, "racecheck", "unsynchronised_count", 31);
}

#[test]
fn reductions_sharing_scratch() {
    let x = ramp(256);
    let sum: f32 = x.iter().sum();
    let sq: f32 = x.iter().map(|v| v * v).sum();
    let r = run(mesa_emu_broken_reductions_share_scratch, Checks::NONE, 1, &x, 2);
    assert_eq!(r.out, [sum, sq], "the unchecked emulator runs it in one fixed order, which hides the bug");
    // (the shuffled schedule alone seldom exposes it: a round runs every live thread of a
    // warp that is not lagging, so the readers are done before the next writes; racecheck sees it)
    let r = run(mesa_emu_broken_reductions_share_scratch, Checks::ALL, 37, &x, 2);
    assert_reported(&r, "racecheck", "reductions_share_scratch", 37);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("write-after-read race on __shared__ `scratch`")));
}

// Three more broken kernels, written fresh after the checks (kernels/broken/fresh.cu).
extern "C" {
    fn mesa_emu_fresh_tile_transpose(a: *const BrokenArgs) -> i32;
    fn mesa_emu_fresh_shifted_scan(a: *const BrokenArgs) -> i32;
    fn mesa_emu_fresh_shuffle_early_exit(a: *const BrokenArgs) -> i32;
}

#[test]
fn fresh_transpose_with_misplaced_barrier() {
    let x = ramp(256);
    let r = run(mesa_emu_fresh_tile_transpose, Checks::ALL, 41, &x, 256);
    assert_reported_by(&r, &["racecheck", "initcheck"], "tile_transpose_misplaced_barrier", 41);
}

#[test]
fn fresh_scan_writes_one_past_the_end() {
    let x = ramp(100);
    let r = run(mesa_emu_fresh_shifted_scan, Checks::ALL, 43, &x, 100);
    assert_reported(&r, "memcheck", "shifted_scan", 43);
    // the 100 elements in range are the right exclusive scan: only the canaries see it
    let mut acc = 0.0f32;
    for (i, o) in r.out.iter().enumerate() {
        assert_eq!(*o, acc, "element {i}");
        acc += x[i];
    }
}

#[test]
fn fresh_shuffle_loop_with_early_exit() {
    let x = ramp(64);
    let r = run(mesa_emu_fresh_shuffle_early_exit, Checks::ALL, 47, &x, 2);
    assert_reported(&r, "synccheck", "shuffle_loop_early_exit", 47);
}

// Tensor-core (WMMA) operations: warp-collective, aligned (kernels/broken/broken.cu, 13–16).
extern "C" {
    fn mesa_emu_broken_wmma_tile_product(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_wmma_half_warp(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_wmma_misaligned(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_wmma_meets_syncwarp(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_wmma_lane_pointers(a: *const BrokenArgs) -> i32;
    fn mesa_emu_broken_wmma_lane_null_pointer(a: *const BrokenArgs) -> i32;
}

/// A 16 × 16 tile of A (row-major) then one of B: small integers, exact in bf16, whose
/// products and sums are exact in f32 (|entries| ≤ 8, so |(A B)_ij| ≤ 16·64).
fn wmma_operands() -> Vec<f32> {
    (0..512).map(|i| ((i * 7 + i / 16) % 17) as f32 - 8.0).collect()
}

#[test]
fn wmma_tile_product_is_exact_and_passes_every_check() {
    let x = wmma_operands();
    for seed in [51, 52] {
        let r = run(mesa_emu_broken_wmma_tile_product, Checks::ALL, seed, &x, 256);
        assert_eq!((r.status, r.report.as_deref()), (0, None), "seed {seed}");
        for (e, o) in r.out.iter().enumerate() {
            let (i, j) = (e / 16, e % 16);
            let want: f64 = (0..16).map(|k| f64::from(x[i * 16 + k]) * f64::from(x[256 + k * 16 + j])).sum();
            assert_eq!(f64::from(*o), want, "element ({i}, {j}), seed {seed}");
        }
    }
}

#[test]
fn wmma_product_reached_by_half_the_warp() {
    let x = wmma_operands();
    let r = run(mesa_emu_broken_wmma_half_warp, Checks::ALL, 53, &x, 256);
    assert_reported(&r, "synccheck", "wmma_half_warp", 53);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("mma_sync")), "{:?}", r.report);
}

#[test]
fn wmma_load_from_a_misaligned_pointer() {
    let x = wmma_operands();
    let r = run(mesa_emu_broken_wmma_misaligned, Checks::ALL, 59, &x, 256);
    assert_reported(&r, "memcheck", "wmma_misaligned", 59);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("32-byte aligned")), "{:?}", r.report);
    let r = run(mesa_emu_broken_wmma_misaligned, Checks::SYNC, 59, &x, 256);
    assert_eq!((r.status, r.report.as_deref()), (0, None), "no memcheck: the misaligned load goes unseen");
}

#[test]
fn wmma_load_with_a_pointer_per_half_warp() {
    // Lanes 16..32 pass another (aligned) tile: only lane 0's comparison of every lane sees it.
    let x = wmma_operands();
    let r = run(mesa_emu_broken_wmma_lane_pointers, Checks::ALL, 63, &x, 256);
    assert_reported(&r, "synccheck", "wmma_lane_pointers", 63);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("lane 16 passes pointer")), "{:?}", r.report);
    let r = run(mesa_emu_broken_wmma_lane_pointers, Checks::MEM, 63, &x, 256);
    assert_eq!((r.status, r.report.as_deref()), (0, None), "no synccheck: the second pointer goes unseen");
}

#[test]
fn wmma_load_with_a_null_pointer_in_one_lane() {
    // Whichever lane runs on first after the rendezvous, lane 31's pointer is reported before
    // lane 31 loads through it (a process-ending segfault otherwise).
    let x = wmma_operands();
    for seed in 1..=8 {
        for checks in [Checks::SYNC, Checks::ALL] {
            let r = run(mesa_emu_broken_wmma_lane_null_pointer, checks, seed, &x, 256);
            assert_reported(&r, "synccheck", "wmma_lane_null_pointer", seed);
            assert!(r.report.as_deref().is_some_and(|m| m.contains("lane 31 passes pointer 0x0")), "{:?}", r.report);
        }
    }
}

#[test]
fn wmma_product_meets_a_syncwarp() {
    let x = wmma_operands();
    let r = run(mesa_emu_broken_wmma_meets_syncwarp, Checks::ALL, 61, &x, 256);
    assert_reported(&r, "synccheck", "wmma_meets_syncwarp", 61);
    assert!(r.report.as_deref().is_some_and(|m| m.contains("another warp-wide operation")), "{:?}", r.report);
}

// Issue 43's classes (kernels/broken/hazards.cu): races in global memory, warp-synchronous
// code, barriers in loops, cooperative groups, __constant__ stores, benign write-write pairs.
// Each broken case is reported by its check; each control passes every check with the right
// result.
extern "C" {
    fn mesa_emu_hazard_last_block_fenced(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_last_block_unfenced(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_accumulate_atomic(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_accumulate_plain(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_warp_scan_synced(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_warp_scan_lockstep(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_warp_scan_lockstep_dynamic(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_barrier_in_shifted_iteration(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_tile_sums(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_tile_shuffle_half(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_grid_sync_plain_launch(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_grid_phases_synced(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_grid_phases_unsynced(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_constant_store(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_same_value_stores(a: *const BrokenArgs) -> i32;
    fn mesa_emu_hazard_different_value_stores(a: *const BrokenArgs) -> i32;
}

/// Every check but racecheck (and its benign pairs).
const ALL_BUT_RACE: Checks =
    Checks::SCHEDULE.with(Checks::INIT).with(Checks::MEM).with(Checks::SYNC).with(Checks::BOUNDS);

fn assert_clean(r: &Run, what: &str) {
    assert_eq!((r.status, r.report.as_deref()), (0, None), "{what}");
}

fn assert_mentions(r: &Run, text: &str) {
    assert!(r.report.as_deref().is_some_and(|m| m.contains(text)), "`{text}` not in {:?}", r.report);
}

#[test]
fn last_block_reduction_needs_its_fences() {
    // integers: every partial and the total are exact in f32, in any order
    let x = ramp(512);
    let total: f32 = x.iter().sum();
    for seed in [71, 72, 73] {
        let r = run(mesa_emu_hazard_last_block_fenced, Checks::ALL, seed, &x, 16);
        assert_clean(&r, "fence before the arrival, fence after it");
        assert_eq!(r.out[8], total, "seed {seed}");
        let r = run(mesa_emu_hazard_last_block_unfenced, Checks::ALL, seed, &x, 16);
        assert_reported(&r, "racecheck", "last_block_unfenced", seed);
        assert_mentions(&r, "read-after-write race on global memory");
        assert_mentions(&r, "of block (");
        // both source lines, from the kernels' line tables
        assert_mentions(&r, "reads at kernels/broken/hazards.cu:");
        assert_mentions(&r, "wrote it at kernels/broken/hazards.cu:");
        // the emulator's strong ordering gives the right total: only racecheck sees the bug
        let r = run(mesa_emu_hazard_last_block_unfenced, ALL_BUT_RACE, seed, &x, 16);
        assert_clean(&r, "without racecheck");
        assert_eq!(r.out[8], total);
    }
}

#[test]
fn plain_accumulation_where_an_atomic_was_meant() {
    let x = ramp(64);
    let r = run(mesa_emu_hazard_accumulate_atomic, Checks::ALL, 73, &x, 1);
    assert_clean(&r, "atomicAdd");
    assert_eq!(r.out[0], x.iter().sum::<f32>());
    let r = run(mesa_emu_hazard_accumulate_plain, Checks::ALL, 73, &x, 1);
    assert_reported(&r, "racecheck", "accumulate_plain", 73);
    assert_mentions(&r, "on global memory (byte 0 of a 4-byte emulator allocation");
}

#[test]
fn warp_scan_trusting_lockstep() {
    let x = ramp(32);
    let scan: Vec<f32> = x
        .iter()
        .scan(0.0f32, |acc, v| {
            *acc += v;
            Some(*acc)
        })
        .collect();
    for seed in [75, 76] {
        let r = run(mesa_emu_hazard_warp_scan_synced, Checks::ALL, seed, &x, 32);
        assert_clean(&r, "__syncwarp between read and write");
        assert_eq!(r.out, scan);
    }
    // (with every check, initcheck may see a lane read its neighbour's entry before the write)
    let r = run(mesa_emu_hazard_warp_scan_lockstep, Checks::ALL, 75, &x, 32);
    assert_reported_by(&r, &["racecheck", "initcheck"], "warp_scan_lockstep", 75);
    let r = run(mesa_emu_hazard_warp_scan_lockstep, Checks::RACE, 75, &x, 32);
    assert_reported(&r, "racecheck", "warp_scan_lockstep", 75);
    assert_mentions(&r, "race on __shared__ `s`");
    // the same kernel on dynamic shared memory (`extern __shared__`), tracked since issue 43
    let r = run(mesa_emu_hazard_warp_scan_lockstep_dynamic, Checks::RACE, 75, &x, 32);
    assert_reported(&r, "racecheck", "warp_scan_lockstep_dynamic", 75);
    assert_mentions(&r, "race on __shared__ `extern __shared__ (dynamic)`");
    // without racecheck the shuffled schedule changes the result, and nothing says why
    assert!(wrong_under_some_seed(mesa_emu_hazard_warp_scan_lockstep, &x, &scan, 8));
}

#[test]
fn barrier_met_in_different_iterations_of_its_loop() {
    let x = ramp(64);
    // every thread passes the one barrier once: count and call site agree
    let r = run(mesa_emu_hazard_barrier_in_shifted_iteration, Checks::SYNC, 77, &x, 64);
    assert_reported(&r, "synccheck", "barrier_in_shifted_iteration", 77);
    assert_mentions(&r, "reached in different iterations of an enclosing loop");
}

#[test]
fn cooperative_groups_tiles() {
    let x = ramp(64);
    for seed in [79, 80] {
        let r = run(mesa_emu_hazard_tile_sums, Checks::ALL, seed, &x, 64);
        assert_clean(&r, "tiles of 16 with cg::reduce");
        for (i, o) in r.out.iter().enumerate() {
            let tile = &x[i / 16 * 16..i / 16 * 16 + 16];
            assert_eq!(*o, tile.iter().sum::<f32>(), "thread {i}");
        }
    }
    let r = run(mesa_emu_hazard_tile_shuffle_half, Checks::ALL, 81, &x, 64);
    assert_reported(&r, "synccheck", "tile_shuffle_half", 81);
    assert_mentions(&r, "mask 0x0000ffff");
}

#[test]
fn cooperative_groups_grid_sync() {
    let x = ramp(512);
    let r = run(mesa_emu_hazard_grid_sync_plain_launch, Checks::SYNC, 83, &x, 512);
    assert_reported(&r, "synccheck", "grid_sync_plain_launch", 83);
    assert_mentions(&r, "not cooperative");
    for seed in [83, 84] {
        let r = run(mesa_emu_hazard_grid_phases_synced, Checks::ALL, seed, &x, 1024);
        assert_clean(&r, "a grid sync between the phases");
        for (i, o) in r.out[512..].iter().enumerate() {
            assert_eq!(*o, x[(i / 64 + 1) % 8 * 64 + i % 64], "element {i}");
        }
        let r = run(mesa_emu_hazard_grid_phases_unsynced, Checks::ALL, seed, &x, 1024);
        assert_reported(&r, "racecheck", "grid_phases_unsynced", seed);
        assert_mentions(&r, "race on global memory");
    }
}

#[test]
fn store_into_constant_memory() {
    let x = ramp(64);
    let r = run(mesa_emu_hazard_constant_store, Checks::MEM, 85, &x, 64);
    assert_reported(&r, "memcheck", "constant_store", 85);
    assert_mentions(&r, "stores into __constant__ memory");
    let r = run(mesa_emu_hazard_constant_store, Checks::NONE, 85, &x, 64);
    assert_clean(&r, "unchecked, the store goes unseen");
}

#[test]
fn write_write_pairs_benign_and_not() {
    let x = ramp(64);
    // every thread stores 1.0: a benign pair, reported only under its own name
    let r = run(mesa_emu_hazard_same_value_stores, Checks::RACE, 87, &x, 1);
    assert_clean(&r, "racecheck without `benign`");
    assert_eq!(r.out[0], 1.0);
    let r = run(mesa_emu_hazard_same_value_stores, Checks::RACE.with(Checks::BENIGN), 87, &x, 1);
    assert_reported(&r, "benign", "same_value_stores", 87);
    assert_mentions(&r, "benign write-write race (both stores wrote the same bytes)");
    // each thread its own value: a race whatever `benign` says
    let r = run(mesa_emu_hazard_different_value_stores, Checks::RACE, 87, &x, 1);
    assert_reported(&r, "racecheck", "different_value_stores", 87);
    assert_mentions(&r, "write-after-write race on global memory");
}

// An adversarial review's cases (kernels/broken/review.cu): the broken ones reported by their
// check, the correct ones clean, each under every check over six seeds.
const SEEDS: [u64; 6] = [1, 2, 3, 17, 101, 9999];

/// Runs over SEEDS with every check; returns the reports (None = clean) per seed.
fn verdicts(case: Case, n_in: usize, out_len: usize) -> Vec<(u64, i32, Option<String>, Vec<f32>)> {
    let x = ramp(n_in);
    SEEDS
        .iter()
        .map(|&s| {
            let r = run(case, Checks::ALL, s, &x, out_len);
            eprintln!("seed {s}: status {} report {:?}", r.status, r.report);
            (s, r.status, r.report, r.out)
        })
        .collect()
}

fn expect_clean(name: &str, case: Case, n_in: usize, out_len: usize) -> Vec<Vec<f32>> {
    let v = verdicts(case, n_in, out_len);
    let bad: Vec<_> = v.iter().filter(|r| r.1 != 0 || r.2.is_some()).map(|r| (r.0, r.2.clone())).collect();
    assert!(bad.is_empty(), "{name}: correct kernel reported: {bad:#?}");
    v.into_iter().map(|r| r.3).collect()
}

fn expect_reported(name: &str, case: Case, n_in: usize, out_len: usize, check: &str) {
    let v = verdicts(case, n_in, out_len);
    let missed: Vec<u64> = v.iter().filter(|r| r.1 != 719 || r.2.is_none()).map(|r| r.0).collect();
    assert!(missed.is_empty(), "{name}: broken kernel not reported under seeds {missed:?}");
    for r in &v {
        let rep = r.2.as_deref().unwrap_or_default();
        assert!(rep.contains(&format!("mesa emulator {check}")), "{name}: seed {}: other check: {rep}", r.0);
    }
}

macro_rules! cases {
    ($($f:ident),*) => { extern "C" { $(fn $f(a: *const BrokenArgs) -> i32;)* } };
}
cases!(
    mesa_emu_review_hs_correct,
    mesa_emu_review_hs_writer_no_fence,
    mesa_emu_review_hs_reader_no_fence,
    mesa_emu_review_hs_every_reader_acquires,
    mesa_emu_review_hs_every_writer_releases,
    mesa_emu_review_hs_fence_two_flags,
    mesa_emu_review_hs_atomic_ref,
    mesa_emu_review_fence_reduction,
    mesa_emu_review_atomics_only,
    mesa_emu_review_grid_ping_pong,
    mesa_emu_review_tiles_8_32,
    mesa_emu_review_tile_reduce_then_warp_shuffle,
    mesa_emu_review_narrow,
    mesa_emu_review_inplace_8,
    mesa_emu_review_uniform_loops,
    mesa_emu_review_warp_broadcast_no_syncwarp,
    mesa_emu_review_other_tile_sync,
    mesa_emu_review_trip_count_by_warp,
    mesa_emu_review_trip_count_balanced,
    mesa_emu_review_shifted_iteration_cg_sync,
    mesa_emu_review_tile_full_mask,
    mesa_emu_review_tile_low_mask_everywhere,
    mesa_emu_review_tile_reads_outside,
    mesa_emu_review_constant_store_via_arg,
    mesa_emu_review_constant_atomic,
    mesa_emu_review_constant_vector_store,
    mesa_emu_review_neighbour_read_plain,
    mesa_emu_review_warp_256_syncwarps,
    mesa_emu_review_grid_256_syncs,
    mesa_emu_review_shared_count_no_init_barrier,
    mesa_emu_review_race_after_barrier_loop,
    mesa_emu_review_race_without_loop
);

// ---- correct kernels: must pass ------------------------------------------------------
#[test]
fn ok_hs_correct() {
    for o in expect_clean("hs_correct", mesa_emu_review_hs_correct, 64, 256) {
        assert_eq!(o[128], 3.0);
    }
}
#[test]
fn ok_hs_every_reader_acquires() {
    expect_clean("hs_every_reader_acquires", mesa_emu_review_hs_every_reader_acquires, 64, 256);
}
#[test]
fn ok_hs_every_writer_releases() {
    expect_clean("hs_every_writer_releases", mesa_emu_review_hs_every_writer_releases, 64, 256);
}
#[test]
fn ok_hs_fence_two_flags() {
    expect_clean("hs_fence_two_flags", mesa_emu_review_hs_fence_two_flags, 64, 256);
}
#[test]
fn ok_hs_atomic_ref() {
    expect_clean("hs_atomic_ref", mesa_emu_review_hs_atomic_ref, 64, 256);
}
#[test]
fn ok_fence_reduction() {
    let total: f32 = ramp(512).iter().sum();
    for o in expect_clean("fence_reduction", mesa_emu_review_fence_reduction, 512, 16) {
        assert_eq!(o[8], total);
    }
}
#[test]
fn ok_atomics_only() {
    expect_clean("atomics_only", mesa_emu_review_atomics_only, 512, 8);
}
#[test]
fn ok_grid_ping_pong() {
    expect_clean("grid_ping_pong", mesa_emu_review_grid_ping_pong, 512, 1024);
}
#[test]
fn ok_tiles_8_32() {
    let x = ramp(64);
    for o in expect_clean("tiles_8_32", mesa_emu_review_tiles_8_32, 64, 192) {
        for t in 0..64 {
            assert_eq!(o[t], x[t / 8 * 8..t / 8 * 8 + 8].iter().sum::<f32>(), "t8 {t}");
        }
    }
}
#[test]
fn ok_tile_reduce_then_warp_shuffle() {
    expect_clean("tile_reduce_then_warp_shuffle", mesa_emu_review_tile_reduce_then_warp_shuffle, 32, 32);
}
#[test]
fn ok_narrow_8_16_and_inplace_16() {
    expect_clean("narrow", mesa_emu_review_narrow, 132, 160);
}
#[test]
fn ok_inplace_8() {
    expect_clean("inplace_8", mesa_emu_review_inplace_8, 132, 160);
}
#[test]
fn ok_uniform_loops() {
    expect_clean("uniform_loops", mesa_emu_review_uniform_loops, 64, 64);
}

// ---- broken kernels: must be reported -------------------------------------------------
#[test]
fn bad_hs_writer_no_fence() {
    expect_reported("hs_writer_no_fence", mesa_emu_review_hs_writer_no_fence, 64, 256, "racecheck");
}
#[test]
fn bad_hs_reader_no_fence() {
    expect_reported("hs_reader_no_fence", mesa_emu_review_hs_reader_no_fence, 64, 256, "racecheck");
}
#[test]
fn bad_neighbour_read_plain() {
    expect_reported("neighbour_read_plain", mesa_emu_review_neighbour_read_plain, 512, 1024, "racecheck");
}
#[test]
fn bad_warp_broadcast_no_syncwarp() {
    expect_reported("warp_broadcast", mesa_emu_review_warp_broadcast_no_syncwarp, 32, 32, "");
}
#[test]
fn bad_other_tile_sync() {
    expect_reported("other_tile_sync", mesa_emu_review_other_tile_sync, 32, 32, "racecheck");
}
#[test]
fn bad_trip_count_by_warp() {
    expect_reported("trip_count_by_warp", mesa_emu_review_trip_count_by_warp, 64, 64, "synccheck");
}
#[test]
fn bad_trip_count_balanced() {
    expect_reported("trip_count_balanced", mesa_emu_review_trip_count_balanced, 64, 64, "synccheck");
}
#[test]
fn bad_shifted_iteration_cg_sync() {
    expect_reported("shifted_iteration_cg_sync", mesa_emu_review_shifted_iteration_cg_sync, 64, 64, "synccheck");
}
#[test]
fn bad_tile_full_mask() {
    expect_reported("tile_full_mask", mesa_emu_review_tile_full_mask, 32, 32, "synccheck");
}
#[test]
fn bad_tile_low_mask_everywhere() {
    expect_reported("tile_low_mask", mesa_emu_review_tile_low_mask_everywhere, 32, 32, "synccheck");
}
#[test]
fn bad_tile_reads_outside() {
    expect_reported("tile_reads_outside", mesa_emu_review_tile_reads_outside, 32, 32, "synccheck");
}
#[test]
fn bad_constant_store_via_arg() {
    expect_reported("constant_store_via_arg", mesa_emu_review_constant_store_via_arg, 64, 64, "memcheck");
}
#[test]
fn bad_constant_atomic() {
    expect_reported("constant_atomic", mesa_emu_review_constant_atomic, 64, 64, "memcheck");
}
#[test]
fn bad_constant_vector_store() {
    expect_reported("constant_vector_store", mesa_emu_review_constant_vector_store, 64, 64, "memcheck");
}

#[test]
fn ok_warp_256_syncwarps() {
    expect_clean("warp_256_syncwarps", mesa_emu_review_warp_256_syncwarps, 32, 32);
}
#[test]
fn ok_grid_256_syncs() {
    expect_clean("grid_256_syncs", mesa_emu_review_grid_256_syncs, 64, 64);
}
#[test]
fn ok_warp_broadcast_race_only() {
    // racecheck alone must see the broken broadcast
    let x = ramp(32);
    for s in SEEDS {
        let r = run(mesa_emu_review_warp_broadcast_no_syncwarp, Checks::RACE, s, &x, 32);
        eprintln!("seed {s}: {:?}", r.report);
        assert!(r.report.is_some_and(|m| m.contains("racecheck")));
    }
}

#[test]
fn bad_race_after_barrier_loop() {
    // a report from a kernel with a barrier loop (a LoopScope to unwind) ended the process
    // (SIGABRT): the failure now leaves its fiber without an exception
    expect_reported("race_after_barrier_loop", mesa_emu_review_race_after_barrier_loop, 64, 65, "racecheck");
}
#[test]
fn bad_race_without_loop() {
    expect_reported("race_without_loop", mesa_emu_review_race_without_loop, 64, 65, "racecheck");
}
#[test]
fn bad_shared_count_no_init_barrier() {
    // a plain store racing with shared-memory atomics (atomics were not tracked before)
    expect_reported("shared_count_no_init_barrier", mesa_emu_review_shared_count_no_init_barrier, 64, 64, "racecheck");
}
