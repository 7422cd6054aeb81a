#!/usr/bin/env bash
# run.sh — the GPU run of a mesa-kernels bundle (scripts/gpu-bundle.sh copies this file to
# bundle/run.sh). Needs bash, coreutils (timeout, sha256sum), tar and xz (or python3); no
# Rust toolchain.
#
#   bash bundle/run.sh                         # on the GPU machine
#   MESA_BUNDLE_DRY_RUN=1 bash bundle/run.sh   # on a CPU machine (CI): the emulator, tiny times
#
# The run is a list of named sections in two tiers (SECTIONS below). Each section has a time
# allowance; each step in it runs under `timeout` with the least of its own limit, what is left
# of its section and what is left of the run. Core sections must add up to CORE_LIMIT_S (5
# minutes); extended ones run in the written order while the run's budget lasts. A step that
# fails never stops the others, except the GPU check: without a usable GPU and a CUDA 13
# driver nothing else can mean anything, so the run stops there within seconds.
#
# A later issue that adds GPU work adds a line to SECTIONS and a sec_<name> function.
#
# Output: $OUT (the device runner collects it) or bundle/out: summary.txt (the table, also
# printed last whatever happened), run.log (every step's full output), gpu.txt (machine facts),
# compress_report.json. scripts/bundle-results.py turns these into a section of docs/results.md.
#
# Environment (all optional):
#   MESA_BUNDLE_DRY_RUN=1   no GPU check, the emulator backend, no MESA_REQUIRE_GPU, tiny bench
#                           times, sanitizer with --require-cuda-init no (flags and paths checked)
#   MESA_RUN_BUDGET_S       the run's total (default 540: a device command is limited to 600 s)
#   MESA_RUN_ONLY           space-separated section names to run (default: all)
#   MESA_RUN_TIER           core | all (default all)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUTDIR=${OUT:-$HERE/out}
mkdir -p "$OUTDIR"
DRY=${MESA_BUNDLE_DRY_RUN:-0}
BUDGET_S=${MESA_RUN_BUDGET_S:-540}
CORE_LIMIT_S=300
START=$(date +%s)
RUNLOG="$OUTDIR/run.log"
SUMMARY="$OUTDIR/summary.txt"
: >"$RUNLOG"

# ---- sections: name, tier, allowance in seconds (the order is the run's order) ------------
SECTIONS=(
    "gpu-check       core       15"   # driver and GPU, first: abort in seconds without them
    "unpack          core       15"   # payload.tar.xz into a scratch directory, checksums
    "parity-tests    core      100"   # every test executable, MESA_REQUIRE_GPU=1
    "sanitizer       core      100"   # compute-sanitizer, four tools on small cases
    "short-benches   core       70"   # criterion, warm-up 0.5 s, measurement 1 s
    "gpu-only-tests  extended   90"   # tests that only a GPU runs (cross-stream, graphs, >2^31)
    "example         extended   60"   # compress_report on the fixture, JSON kept
    "peer-baselines  extended  235"   # fla-core's chunk_linear_attn and chunk_simple_gla on the benches' shapes
    "full-benches    extended  300"   # criterion's default times (3 s warm-up, 5 s measurement)
)

# The tests the core tier leaves to gpu-only-tests ("binary test-name"): GPU-only, and slow
# or timing-sensitive. A name the binary does not have is a noted skip (issue not merged yet).
GPU_ONLY_TESTS=(
    "streams buffer_of_another_stream_is_ordered_and_dropped_safely"
    "quantize running_mode_quantize_replays_in_a_cuda_graph_with_fresh_input"
    "quantize more_than_2_pow_31_elements_on_the_gpu"
)

# Small cases for compute-sanitizer ("binary test-name"): every kernel file at odd sizes.
SANITIZER_CASES=(
    "quantize odd_and_small_sizes"
    "fused emulator_and_gpu_agree"
    "linear_attention any_length_and_chunk"
    "collectives element_counts_that_are_not_a_multiple_of_the_vector_width"
)
SANITIZER_TOOLS=(memcheck racecheck synccheck initcheck)   # each gets an equal share of the rest
# The emulator's broken-kernel suite (issue 9): run under every tool; errors are expected.
BROKEN_KERNELS=broken_kernels

# Tests run in the dry run (the suite itself runs in CI's `cargo test`): those that read the
# fixtures, plus one argument check per file — enough to see every binary start and find
# its files.
DRY_TEST_FILTER="fixture real_activations block_on bad_input bad_shapes every_kind_of_memory"

# ---- bookkeeping -----------------------------------------------------------------------
STEP_NAMES=() STEP_SECTIONS=() STEP_STATUS=() STEP_SECS=() STEP_LIMITS=()
FAILED=0 ABORTED=""
CUR_SECTION="" CUR_TIER="" SECTION_END=0

now() { date +%s; }
elapsed() { echo $(($(now) - START)); }

write_summary() {
    {
        # columns split by " | " (scripts/bundle-results.py reads them)
        printf '%-64s | %-14s | %-26s | %7s | %5s\n' STEP SECTION STATUS SECONDS LIMIT
        local i
        for i in "${!STEP_NAMES[@]}"; do
            printf '%-64s | %-14s | %-26s | %7s | %5s\n' "${STEP_NAMES[$i]}" "${STEP_SECTIONS[$i]}" \
                "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}" "${STEP_LIMITS[$i]}"
        done
        printf '\nsections (used / allowance, seconds):'
        local line name tier allow used
        for line in "${SECTIONS[@]}"; do
            read -r name tier allow <<<"$line"
            used=0
            for i in "${!STEP_NAMES[@]}"; do
                [[ "${STEP_SECTIONS[$i]}" == "$name" ]] && used=$((used + STEP_SECS[i]))
            done
            printf ' %s %s/%s;' "$name" "$used" "$allow"
        done
        printf '\nmode: %s; total %ss of a %ss budget; result: %s\n' \
            "$([[ $DRY == 1 ]] && echo 'DRY RUN (emulator)' || echo GPU)" "$(elapsed)" "$BUDGET_S" \
            "$([[ -n $ABORTED ]] && echo "ABORTED ($ABORTED)" || { [[ $FAILED == 0 ]] && echo PASS || echo FAIL; })"
    } >"$SUMMARY"
}

record() {  # name status seconds limit failed(0/1)
    STEP_NAMES+=("$1") STEP_SECTIONS+=("$CUR_SECTION") STEP_STATUS+=("$2") STEP_SECS+=("$3") STEP_LIMITS+=("$4")
    if [[ "$5" == 1 ]]; then FAILED=1; fi
    printf '=== %-64s %s (%ss)\n' "$1" "$2" "$3"
    write_summary   # after every step: a run killed from outside still leaves its table
}

skip() {  # name reason
    printf '\n>>> %s: skipped (%s)\n' "$1" "$2" >>"$RUNLOG"
    record "$1" "skip: $2" 0 - 0
}

# step NAME LIMIT CMD... — CMD under timeout, its output appended to run.log; on failure
# the log's tail is printed. Never fails itself (the run goes on).
step() {
    local name=$1 limit=$2; shift 2
    local left_run=$((BUDGET_S - $(elapsed))) left_sec=$((SECTION_END - $(now)))
    ((limit > left_run)) && limit=$left_run
    ((limit > left_sec)) && limit=$left_sec
    if ((limit < 3)); then
        printf '\n>>> %s: not run, no time left\n' "$name" >>"$RUNLOG"
        # core steps must fit; an extended step without time is the plan working
        record "$name" "no time" 0 0 "$([[ $CUR_TIER == core ]] && echo 1 || echo 0)"
        return 0
    fi
    printf '\n>>> %s (timeout %ss): %s\n' "$name" "$limit" "$*" >>"$RUNLOG"
    echo ">>> $name"
    local t0 rc=0 mark
    t0=$(now)
    mark=$(wc -l <"$RUNLOG")
    timeout -k 5 "$limit" "$@" >>"$RUNLOG" 2>&1 </dev/null || rc=$?
    local secs=$(($(now) - t0))
    echo "<<< $name: exit status $rc after ${secs}s" >>"$RUNLOG"
    if ((rc == 0)); then
        record "$name" ok "$secs" "$limit" 0
    else
        tail -n +"$((mark + 1))" "$RUNLOG" | tail -n 15 | sed 's/^/    /'
        if ((rc == 124 || rc == 137)); then
            record "$name" "FAIL: timeout" "$secs" "$limit" 1
        else
            record "$name" "FAIL: exit $rc" "$secs" "$limit" 1
        fi
    fi
}

# has_test BIN NAME: the executable lists a test of exactly that name. (Not `| grep -q`:
# grep would stop reading, the binary get SIGPIPE, and pipefail call the test missing.)
has_test() {
    local listed
    listed=$("$1" --list --exact "$2" 2>/dev/null) || return 1
    [[ $'\n'"$listed"$'\n' == *$'\n'"$2: test"$'\n'* ]]
}

# ---- the sections ----------------------------------------------------------------------
# The facts go to gpu.txt (one "key: value" a line) for scripts/bundle-results.py.
gpu_check() {
    local facts=$1
    command -v nvidia-smi >/dev/null || { echo "ABORT: no nvidia-smi: no NVIDIA driver on this machine"; return 1; }
    local q name driver cc mem cuda
    q=$(nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader | head -n1) \
        || { echo "ABORT: nvidia-smi finds no GPU"; return 1; }
    IFS=, read -r name driver cc mem <<<"${q//, /,}"
    # the CUDA version the driver supports, from the header of plain nvidia-smi
    cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | grep -o '[0-9.]*$' || echo 0)
    printf 'gpu: %s\ndriver: %s\ndriver cuda: %s\ncompute capability: %s\nmemory: %s\nhost: %s\ncpus: %s\n' \
        "$name" "$driver" "$cuda" "$cc" "$mem" "$(uname -srm)" "$(nproc)" | tee "$facts"
    nvidia-smi
    # The kernels are built with CUDA 13.0 and its static runtime: an older driver refuses
    # them at the first call (error 35), and every later step would fail with a worse message.
    if ((${cuda%%.*} < 13)); then
        echo "ABORT: driver $driver supports CUDA $cuda; the bundle is built with CUDA 13.0, which needs driver 580 or newer"
        return 1
    fi
    # SASS for sm_80 and sm_90 (sm_80 code also runs on 8.6 and 8.9); bf16 needs 8.0
    if ((${cc%%.*} < 8)); then
        echo "ABORT: compute capability $cc; the kernels need 8.0 or newer"
        return 1
    fi
    echo "GPU check passed"
}
export -f gpu_check

sec_gpu_check() {
    if [[ $DRY == 1 ]]; then
        printf 'gpu: none (dry run on the emulator)\nhost: %s\ncpus: %s\n' "$(uname -srm)" "$(nproc)" >"$OUTDIR/gpu.txt"
        skip gpu-check "dry run"
        return
    fi
    step gpu-check 15 bash -c 'gpu_check "$1"' _ "$OUTDIR/gpu.txt"
    if [[ "${STEP_STATUS[-1]}" != ok ]]; then
        ABORTED="GPU check failed: $(grep -h '^ABORT' "$RUNLOG" | tail -n1 || echo 'see run.log')"
        echo "$ABORTED"
    fi
}

sec_unpack() {
    SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/mesa-bundle.XXXXXX")
    # tar -J needs the xz program; python3's lzma module does the same where it is missing
    step unpack 15 bash -c '
        if command -v xz >/dev/null; then tar -C "$1" -xJf "$2"
        else python3 -c "import sys, tarfile; tarfile.open(sys.argv[2]).extractall(sys.argv[1])" "$1" "$2"; fi
        cd "$1" && sha256sum --quiet -c SHA256SUMS' _ "$SCRATCH" "$HERE/payload.tar.xz"
    if [[ "${STEP_STATUS[-1]}" != ok ]]; then
        ABORTED="the payload did not unpack"
        return
    fi
    export MESA_FIXTURE_DIR="$SCRATCH/fixtures"
    TESTS=() BENCHES=()
    local f
    for f in "$SCRATCH"/tests/*; do TESTS+=("$f"); done
    for f in "$SCRATCH"/benches/*; do BENCHES+=("$f"); done
}

# GPU-only tests are left to the extended tier; --skip takes a substring, --exact makes it whole.
core_skips() {
    local line bin name
    for line in "${GPU_ONLY_TESTS[@]}"; do
        read -r bin name <<<"$line"
        if [[ "$bin" == "$1" ]]; then printf -- '--skip\n%s\n' "$name"; fi
    done
}

sec_parity_tests() {
    local t name args
    for t in "${TESTS[@]}"; do
        name=$(basename "$t")
        mapfile -t args < <(core_skips "$name")
        if [[ $DRY == 1 ]]; then
            # shellcheck disable=SC2086 # the filter is a list of words
            step "test:$name" 90 "$t" $DRY_TEST_FILTER "${args[@]}"
        else
            step "test:$name" 90 env MESA_REQUIRE_GPU=1 "$t" "${args[@]}"
        fi
    done
}

sec_sanitizer() {
    local san="$SCRATCH/sanitizer/bin/compute-sanitizer"
    step sanitizer-version 10 "$san" --version
    local -a common=(--error-exitcode 86 --print-limit 50 --target-processes all)
    # Without a GPU the tests make no CUDA call; this keeps every flag checked (dry run).
    [[ $DRY == 1 ]] && common+=(--require-cuda-init no)
    local tool line bin test extra tools_left=${#SANITIZER_TOOLS[@]} section_end=$SECTION_END
    for tool in "${SANITIZER_TOOLS[@]}"; do
        # a slow tool must not take the others' time: each its share of what is left
        SECTION_END=$(($(now) + (section_end - $(now)) / tools_left))
        tools_left=$((tools_left - 1))
        extra=()
        # padding: an overrun past the end of a buffer lands in checked bytes, not a neighbour
        [[ $tool == memcheck ]] && extra=(--padding 32)
        for line in "${SANITIZER_CASES[@]}"; do
            read -r bin test <<<"$line"
            if ! has_test "$SCRATCH/tests/$bin" "$test"; then
                # a renamed test must not turn into a sanitizer run of nothing
                record "$tool:$bin:$test" "FAIL: no such test" 0 - 1
                continue
            fi
            if [[ $DRY == 1 ]]; then
                step "$tool:$bin:$test" 60 "$san" --tool "$tool" "${common[@]}" "${extra[@]}" \
                    "$SCRATCH/tests/$bin" --exact "$test"
            else
                step "$tool:$bin:$test" 60 env MESA_REQUIRE_GPU=1 "$san" --tool "$tool" "${common[@]}" \
                    "${extra[@]}" "$SCRATCH/tests/$bin" --exact "$test"
            fi
        done
    done
    local bk="$SCRATCH/broken/$BROKEN_KERNELS" case want
    if [[ -x "$bk" ]]; then
        # each case under the tool meant to report it: exit status 86 (an error reported) is
        # the pass here; "launch" cases must fail their launch without any tool (exit 3);
        # "tool?" cases (what the emulator reports and compute-sanitizer may not) pass either
        # way, and the step's output says which
        while read -r case want; do
            if [[ $want == *\? ]]; then
                want=${want%\?}
                if [[ $DRY == 1 ]]; then
                    step "$want:broken:$case (no GPU)" 30 bash -c '"$@"; rc=$?; [[ $rc == 0 || $rc == 2 ]]' _ \
                        "$san" --tool "$want" "${common[@]}" "$bk" "$case"
                else
                    step "$want:broken:$case (observed)" 30 bash -c \
                        '"$@"; rc=$?; [[ $rc == 86 ]] && echo "compute-sanitizer: reported" || echo "compute-sanitizer: NOT reported (exit $rc)"; exit 0' \
                        _ "$san" --tool "$want" "${common[@]}" "$bk" "$case"
                fi
                continue
            fi
            if [[ $DRY == 1 ]]; then
                # no GPU: the case must start and say so (exit 2); under the tool's flags
                # compute-sanitizer, finding no CUDA call to instrument, exits 0
                if [[ $want == launch ]]; then
                    step "broken:$case (no GPU)" 30 bash -c '"$@"; [[ $? == 2 ]]' _ "$bk" "$case"
                else
                    step "$want:broken:$case (no GPU)" 30 bash -c '"$@"; rc=$?; [[ $rc == 0 || $rc == 2 ]]' _ \
                        "$san" --tool "$want" "${common[@]}" "$bk" "$case"
                fi
            elif [[ $want == launch ]]; then
                step "broken:$case (launch must fail)" 30 bash -c \
                    '"$@"; rc=$?; [[ $rc == 3 ]] && { echo "launch failed, as expected"; exit 0; }; echo "launch NOT refused (exit $rc)"; exit 1' \
                    _ "$bk" "$case"
            else
                step "$want:broken:$case (error expected)" 30 bash -c \
                    '"$@"; rc=$?; [[ $rc == 86 ]] && { echo "reported, as expected"; exit 0; }; echo "NOT reported (exit $rc)"; exit 1' \
                    _ "$san" --tool "$want" "${common[@]}" "$bk" "$case"
            fi
        done < <("$bk" --list)
    else
        skip "sanitizer:$BROKEN_KERNELS" "not in this bundle (built without nvcc)"
    fi
    SECTION_END=$section_end
}

# criterion's own flags (a group's settings in the bench source win over them); the dry run
# passes the same flags with tiny values, so a wrong one fails there too
bench_times() {
    local warm measure
    case "$DRY:$1" in
        1:*) warm=0.05 measure=0.1 ;;
        0:short) warm=0.5 measure=1 ;;
        *) return 0 ;;   # full: criterion's defaults
    esac
    echo --warm-up-time "$warm" --measurement-time "$measure" --sample-size 10
}

# Short tier subsets (criterion's name filter), GPU only: one sequence length of each bench's three.
declare -A SHORT_BENCH_FILTER=([linear_attention]=_T8192_ [gated_linear_attention]=_T8192_)

sec_short_benches() {
    local b name filter
    for b in "${BENCHES[@]}"; do
        name=$(basename "$b")
        filter=()
        if [[ $DRY != 1 && -n "${SHORT_BENCH_FILTER[$name]:-}" ]]; then filter=("${SHORT_BENCH_FILTER[$name]}"); fi
        # shellcheck disable=SC2046
        step "bench-short:$name" 45 env MESA_REQUIRE_GPU="$((1 - DRY))" CRITERION_HOME="$SCRATCH/criterion" \
            "$b" --bench --noplot $(bench_times short) "${filter[@]}"
    done
}

sec_gpu_only_tests() {
    local line bin test
    for line in "${GPU_ONLY_TESTS[@]}"; do
        read -r bin test <<<"$line"
        if ! has_test "$SCRATCH/tests/$bin" "$test"; then
            skip "gpu-only:$bin:$test" "no such test in this bundle"
            continue
        fi
        # without a GPU (dry run) these tests skip themselves
        step "gpu-only:$bin:$test" 60 env MESA_REQUIRE_GPU="$((1 - DRY))" "$SCRATCH/tests/$bin" --exact "$test"
    done
}

sec_example() {
    local ex="$SCRATCH/examples/compress_report"
    if [[ ! -x "$ex" ]]; then skip example "compress_report not in this bundle"; return; fi
    step example:compress_report 60 bash -c '"$1" --json >"$2"' _ "$ex" "$OUTDIR/compress_report.json"
}

sec_peer_baselines() {
    # PyTorch is on the GPU machine; other Python packages travel as wheels (README.md).
    if [[ ! -d "$SCRATCH/peer" ]]; then skip peer-baselines "none in this bundle yet"; return; fi
    local p
    for p in "$SCRATCH"/peer/*.py; do
        # a peer script times its side and runs our bench of the same shapes (MESA_BENCH_DIR);
        # it starts no shape past its deadline (Triton's compilation and autotuning included)
        step "peer:$(basename "$p" .py)" 115 env PYTHONUNBUFFERED=1 MESA_BENCH_DIR="$SCRATCH/benches" \
            python3 "$p" --deadline-s 70
    done
}

sec_full_benches() {
    local b
    for b in "${BENCHES[@]}"; do
        # shellcheck disable=SC2046
        step "bench-full:$(basename "$b")" 240 env MESA_REQUIRE_GPU="$((1 - DRY))" CRITERION_HOME="$SCRATCH/criterion" \
            "$b" --bench --noplot $(bench_times full)
    done
}

# ---- main ------------------------------------------------------------------------------
finish() {
    write_summary
    echo
    cat "$SUMMARY"
    if [[ -n "${SCRATCH:-}" ]]; then rm -rf "$SCRATCH"; fi
}
trap finish EXIT

core_total=0
for line in "${SECTIONS[@]}"; do
    read -r name tier allow <<<"$line"
    if [[ $tier == core ]]; then core_total=$((core_total + allow)); fi
done
if ((core_total > CORE_LIMIT_S)); then
    echo "run.sh: the core sections' allowances add up to ${core_total}s, over ${CORE_LIMIT_S}s" | tee -a "$RUNLOG"
    FAILED=1 ABORTED="core allowances over ${CORE_LIMIT_S}s"
    exit 2
fi
echo "mesa-kernels bundle run: $([[ $DRY == 1 ]] && echo 'DRY RUN on the emulator' || echo GPU), budget ${BUDGET_S}s (core ${core_total}s)"
sed -n '1,6p' "$HERE/MANIFEST.txt" 2>/dev/null | tee -a "$RUNLOG" || true

for line in "${SECTIONS[@]}"; do
    read -r name tier allow <<<"$line"
    CUR_SECTION=$name CUR_TIER=$tier SECTION_END=$(($(now) + allow))
    if [[ -n $ABORTED ]]; then
        record "$name" "not run: aborted" 0 - 0
        continue
    fi
    if [[ -n "${MESA_RUN_ONLY:-}" && " $MESA_RUN_ONLY " != *" $name "* && $name != unpack ]] ||
        [[ "${MESA_RUN_TIER:-all}" == core && $tier != core ]]; then
        record "$name" "not selected" 0 - 0
        continue
    fi
    "sec_${name//-/_}"
done
[[ -n $ABORTED ]] && exit 2
exit "$FAILED"
