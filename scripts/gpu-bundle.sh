#!/usr/bin/env bash
# gpu-bundle.sh — build everything a GPU run needs on this (CPU) machine and put it in
# bundle/ (git-ignored), for a GPU machine that has no Rust toolchain (BRIEF §7).
#
#   scripts/gpu-bundle.sh            # build + assemble bundle/
#   then, on the GPU machine, from the repository root:   bash bundle/run.sh
#   (the device runner: carry ["bundle"], command "bash bundle/run.sh"; logs land in $OUT)
#
# What goes in (must stay under 64 MiB):
#   tests/<name>      every test executable of the workspace (cargo test --release --no-run)
#   benches/<name>    every criterion bench executable (cargo bench --no-run)
#   examples/compress_report   when the example exists and builds
#   fixtures/minilm_activations.safetensors   (tests find it through MESA_FIXTURE_DIR)
#   fixtures/minilm_block.safetensors         (tests/block.rs, the example's block section)
#   wheels/nvidia_cuda_sanitizer_api-*.whl    compute-sanitizer, unpacked by run.sh when the
#                                             GPU machine has no CUDA toolkit
#   run.sh, MANIFEST.txt
#
# Environment:
#   NVCC               nvcc to build with; default: the pinned 13.0 in /work/.venv-cuda, then
#                      CUDA_HOME/CUDA_PATH bin/nvcc, then PATH (as build.rs)
#   CARGO_TARGET_DIR   default /work/target-cuda (kept apart from the emulation-only builds)
#   MESA_CUDA_ARCHS    passed to build.rs (default there: 80,90)
#   MESA_BUNDLE_SANITIZER=0   do not add the compute-sanitizer wheel
#   MESA_BUNDLE_ALLOW_NO_CUDA=1   build a bundle without nvcc (for testing this script only)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUNDLE="$ROOT/bundle"
MAX_BYTES=$((64 * 1024 * 1024))
PINNED_NVCC=/work/.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc
PINNED_PIP=/work/.venv-cuda/bin/pip
SANITIZER_WHEEL_SPEC=nvidia-cuda-sanitizer-api==13.0.85   # matches the nvcc 13.0 toolkit
WHEEL_CACHE=${MESA_WHEEL_CACHE:-/work/.cache/mesa-wheels}

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v python3 >/dev/null || die "python3 is needed to read cargo's JSON output"

# ---- nvcc ------------------------------------------------------------------------------
find_nvcc() {
    if [[ -n "${NVCC:-}" && -f "$NVCC" ]]; then echo "$NVCC"; return; fi
    if [[ -f "$PINNED_NVCC" ]]; then echo "$PINNED_NVCC"; return; fi
    for v in CUDA_HOME CUDA_PATH; do
        if [[ -n "${!v:-}" && -f "${!v}/bin/nvcc" ]]; then echo "${!v}/bin/nvcc"; return; fi
    done
    command -v nvcc || true
}
NVCC_FOUND=$(find_nvcc)
if [[ -n "$NVCC_FOUND" ]]; then
    export NVCC="$NVCC_FOUND"
    unset MESA_CUDA_DISABLE
    log "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*' || echo 'unknown version'))"
elif [[ "${MESA_BUNDLE_ALLOW_NO_CUDA:-0}" == 1 ]]; then
    log "WARNING: no nvcc; building an emulation-only bundle (useless on a GPU; script test only)"
else
    die "no nvcc found (NVCC, $PINNED_NVCC, CUDA_HOME, CUDA_PATH, PATH); set NVCC"
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
# No debug info (size), keep symbols (readable panics/backtraces on the GPU machine).
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0
export CARGO_PROFILE_RELEASE_STRIP=debuginfo CARGO_PROFILE_BENCH_STRIP=debuginfo
log "target dir: $CARGO_TARGET_DIR"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# ---- build -----------------------------------------------------------------------------
log "building test executables (cargo test --workspace --release --no-run)"
cargo test --workspace --release --no-run --message-format=json-render-diagnostics >"$WORK/test.json" \
    || die "cargo test --no-run failed"
log "building bench executables (cargo bench --workspace --no-run)"
cargo bench --workspace --no-run --message-format=json-render-diagnostics >"$WORK/bench.json" \
    || die "cargo bench --no-run failed"

: >"$WORK/example.json"
if cargo metadata --no-deps --format-version 1 2>/dev/null | python3 -c '
import json, sys
m = json.load(sys.stdin)
sys.exit(0 if any(t["name"] == "compress_report" and "example" in t["kind"]
                  for p in m["packages"] for t in p["targets"]) else 1)'; then
    log "building example compress_report"
    if ! cargo build --release --example compress_report --message-format=json-render-diagnostics \
        >"$WORK/example.json"; then
        log "WARNING: example compress_report does not build; bundling without it"
        : >"$WORK/example.json"
    fi
else
    log "note: no example compress_report in the workspace (yet); bundling without it"
fi

# ---- assemble --------------------------------------------------------------------------
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/tests" "$BUNDLE/benches" "$BUNDLE/examples" "$BUNDLE/fixtures" "$BUNDLE/wheels"

# Executables from cargo's JSON: (kind, bundle name, source path), one per line.
python3 - "$WORK/test.json" "$WORK/bench.json" "$WORK/example.json" >"$WORK/artifacts.tsv" <<'PY'
import json, os, sys

def artifacts(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
                yield msg

seen = {}
rows = []
def add(kind, msg, name):
    key = (kind, name)
    if key in seen:
        if seen[key] == msg["executable"]:
            return
        name = os.path.basename(os.path.dirname(msg["manifest_path"])) + "." + name
    seen[(kind, name)] = msg["executable"]
    rows.append((kind, name, msg["executable"]))

for msg in artifacts(sys.argv[1]):
    t = msg["target"]
    if not msg["profile"]["test"]:
        continue
    # unit tests of a library get "<crate>-lib"; integration tests keep their name
    name = t["name"] + "-lib" if "lib" in t["kind"] or "rlib" in t["kind"] else t["name"]
    add("tests", msg, name)
for msg in artifacts(sys.argv[2]):
    t = msg["target"]
    if "bench" in t["kind"]:            # criterion benches only, not libtest lib harnesses
        add("benches", msg, t["name"])
for msg in artifacts(sys.argv[3]):
    t = msg["target"]
    if "example" in t["kind"] and t["name"] == "compress_report":
        add("examples", msg, t["name"])
for kind, name, exe in rows:
    print(f"{kind}\t{name}\t{exe}")
PY

strip_bin() { if command -v strip >/dev/null; then strip --strip-debug "$1"; fi; }
while IFS=$'\t' read -r kind name exe; do
    cp "$exe" "$BUNDLE/$kind/$name"
    chmod 755 "$BUNDLE/$kind/$name"
    strip_bin "$BUNDLE/$kind/$name"
    log "  $kind/$name  <- ${exe#"$CARGO_TARGET_DIR"/}"
done <"$WORK/artifacts.tsv"
[[ -n "$(ls "$BUNDLE/tests")" ]] || die "no test executables found in cargo's output"
rmdir "$BUNDLE/examples" 2>/dev/null || true

cp fixtures/minilm_activations.safetensors "$BUNDLE/fixtures/"
cp fixtures/minilm_block.safetensors "$BUNDLE/fixtures/"

if [[ "${MESA_BUNDLE_SANITIZER:-1}" == 1 ]]; then
    mkdir -p "$WHEEL_CACHE"
    wheel=$(ls "$WHEEL_CACHE"/nvidia_cuda_sanitizer_api-13.0.85-*.whl 2>/dev/null | head -n1 || true)
    if [[ -z "$wheel" ]]; then
        pip=$PINNED_PIP
        [[ -x "$pip" ]] || pip="python3 -m pip"
        log "downloading $SANITIZER_WHEEL_SPEC (compute-sanitizer for GPU machines without a toolkit)"
        $pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_25_x86_64 \
            -d "$WHEEL_CACHE" "$SANITIZER_WHEEL_SPEC" >&2 || log "WARNING: wheel download failed"
        wheel=$(ls "$WHEEL_CACHE"/nvidia_cuda_sanitizer_api-13.0.85-*.whl 2>/dev/null | head -n1 || true)
    fi
    if [[ -n "$wheel" ]]; then
        cp "$wheel" "$BUNDLE/wheels/"
    else
        log "WARNING: bundling without compute-sanitizer (run.sh will use a system one if present)"
    fi
fi
rmdir "$BUNDLE/wheels" 2>/dev/null || true

# ---- run.sh ----------------------------------------------------------------------------
cat >"$BUNDLE/run.sh" <<'RUN'
#!/usr/bin/env bash
# run.sh — the GPU run of a mesa-kernels bundle (made by scripts/gpu-bundle.sh). Needs no
# Rust toolchain: bash, coreutils and python3 (to unpack the compute-sanitizer wheel).
#
#   bash bundle/run.sh            # from anywhere; logs go to $OUT (if set) or bundle/out
#
# Steps (each independent: a failure never stops the others; exit status 1 if any failed):
#   gpu            nvidia-smi (GPU, driver), toolchain facts
#   test:<t>       every test executable with MESA_REQUIRE_GPU=1 (a missing GPU fails)
#   bench:<b>      every criterion bench (its own short measurement settings)
#   example        examples/compress_report --json (stdout kept as compress_report.json)
#   memcheck:<t>   compute-sanitizer --tool memcheck on every test executable
#   racecheck:<t>  compute-sanitizer --tool racecheck (filter: MESA_RACECHECK_FILTER)
# The sanitizer steps come last because they are the slowest: with the total budget
# (MESA_RUN_BUDGET_S, default 480 s) a step that cannot start is recorded as failed
# ("no time"), never silently dropped. A missing compute-sanitizer is a noted skip.
#
# Environment (all optional):
#   OUT                      where logs/summary go (the device runner collects it)
#   MESA_RUN_BUDGET_S        total seconds for all steps (default 480)
#   MESA_TEST_TIMEOUT_S      per test executable (default 150)
#   MESA_BENCH_TIMEOUT_S     per bench executable (default 150)
#   MESA_SANITIZER_TIMEOUT_S per sanitizer run (default 150)
#   MESA_SANITIZER_TOOLS     default "memcheck racecheck" (also: initcheck synccheck)
#   MESA_RACECHECK_FILTER    test-name filter given to the test executables under racecheck
#   MESA_SANITIZER_FILTER    test-name filter for the other sanitizer tools
#   MESA_TEST_ARGS           extra arguments for the test executables (e.g. a name filter)
#   COMPUTE_SANITIZER        path of compute-sanitizer to use
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUTDIR=${OUT:-$HERE/out}
LOGS="$OUTDIR/logs"
mkdir -p "$LOGS"
BUDGET=${MESA_RUN_BUDGET_S:-480}
T_TEST=${MESA_TEST_TIMEOUT_S:-150}
T_BENCH=${MESA_BENCH_TIMEOUT_S:-150}
T_SAN=${MESA_SANITIZER_TIMEOUT_S:-150}
TOOLS=${MESA_SANITIZER_TOOLS:-memcheck racecheck}
START=$(date +%s)

export MESA_REQUIRE_GPU=1
export MESA_FIXTURE_DIR="$HERE/fixtures"
export RUST_BACKTRACE=1
export CRITERION_HOME="$OUTDIR/criterion"
cd "$HERE"   # fixtures/ is also reachable relative to the working directory

HAVE_TIMEOUT=0
command -v timeout >/dev/null && HAVE_TIMEOUT=1
NAMES=() STATUS=() SECS=() FAILED=0

record() {  # name status seconds failed(0/1)
    NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3")
    [[ "$4" == 1 ]] && FAILED=1
    printf '=== %-44s %s (%ss)\n' "$1" "$2" "$3"
}

# run_step NAME TIMEOUT STDOUT_FILE|- CMD... : runs CMD with a timeout, output to
# $LOGS/NAME.log (stdout to STDOUT_FILE instead when given), prints the log's tail.
run_step() {
    local name=$1 limit=$2 stdout_file=$3; shift 3
    local safe=${name//[^A-Za-z0-9._-]/_}
    local log="$LOGS/$safe.log"
    local now left t0 rc secs
    now=$(date +%s); left=$((BUDGET - (now - START)))
    if (( left < 15 )); then
        echo "not run: the total budget of ${BUDGET}s is spent" >"$log"
        record "$name" "FAIL(no time)" 0 1
        return
    fi
    (( limit > left )) && limit=$left
    echo ">>> $name: $* (timeout ${limit}s)"
    { echo "# $name"; echo "# cwd: $PWD"; echo "# cmd: $*"; echo "# timeout: ${limit}s"; } >"$log"
    t0=$(date +%s)
    local -a pre=()
    (( HAVE_TIMEOUT )) && pre=(timeout -k 10 "$limit")
    if [[ "$stdout_file" == - ]]; then
        ${pre[@]+"${pre[@]}"} "$@" >>"$log" 2>&1 </dev/null; rc=$?
    else
        ${pre[@]+"${pre[@]}"} "$@" >"$stdout_file" 2>>"$log" </dev/null; rc=$?
    fi
    secs=$(( $(date +%s) - t0 ))
    echo "# exit status: $rc" >>"$log"
    if (( rc == 0 )); then
        tail -n 6 "$log" | sed 's/^/    /'
        record "$name" "ok" "$secs" 0
    else
        tail -n 40 "$log" | sed 's/^/    /'
        if (( rc == 124 || rc == 137 )); then record "$name" "FAIL(timeout)" "$secs" 1
        else record "$name" "FAIL($rc)" "$secs" 1; fi
    fi
}

note_skip() {  # name reason
    echo "skipped: $2" >"$LOGS/${1//[^A-Za-z0-9._-]/_}.log"
    record "$1" "skip($2)" 0 0
}

# ---- gpu facts ---------------------------------------------------------------------------
gpu_facts() {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    echo "cargo on this machine: $(command -v cargo || echo none)"
    echo "bundle manifest:"; sed 's/^/  /' "$HERE/MANIFEST.txt" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.memory \
        --format=csv || return $?
    nvidia-smi
}
export HERE
export -f gpu_facts
run_step gpu 60 - bash -c gpu_facts
cp "$HERE/MANIFEST.txt" "$OUTDIR/" 2>/dev/null

# ---- tests -------------------------------------------------------------------------------
TESTS=()
for t in "$HERE"/tests/*; do [[ -x "$t" ]] && TESTS+=("$t"); done
# shellcheck disable=SC2086
for t in ${TESTS[@]+"${TESTS[@]}"}; do
    run_step "test:$(basename "$t")" "$T_TEST" - "$t" ${MESA_TEST_ARGS:-}
done

# ---- benches -----------------------------------------------------------------------------
for b in "$HERE"/benches/*; do
    [[ -x "$b" ]] || continue
    run_step "bench:$(basename "$b")" "$T_BENCH" - "$b" --bench --noplot
done

# ---- example -----------------------------------------------------------------------------
if [[ -x "$HERE/examples/compress_report" ]]; then
    run_step example 120 "$OUTDIR/compress_report.json" "$HERE/examples/compress_report" --json
else
    note_skip example "not in this bundle"
fi

# ---- compute-sanitizer -------------------------------------------------------------------
find_sanitizer() {
    if [[ -n "${COMPUTE_SANITIZER:-}" && -x "$COMPUTE_SANITIZER" ]]; then echo "$COMPUTE_SANITIZER"; return; fi
    # the bundled wheel first: its version matches the toolkit the kernels were built with
    local whl
    whl=$(ls "$HERE"/wheels/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | head -n1)
    if [[ -n "$whl" ]] && command -v python3 >/dev/null; then
        local dir="${TMPDIR:-/tmp}/mesa-sanitizer"
        if [[ ! -x "$dir/nvidia/cu13/bin/compute-sanitizer" ]]; then
            rm -rf "$dir"; mkdir -p "$dir"
            python3 - "$whl" "$dir" <<'PY' >&2
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.filename.endswith("/") or ".dist-info/" in info.filename or "/include/" in info.filename:
            continue
        path = z.extract(info, dest)
        os.chmod(path, 0o755)
PY
        fi
        if [[ -x "$dir/nvidia/cu13/bin/compute-sanitizer" ]]; then echo "$dir/nvidia/cu13/bin/compute-sanitizer"; return; fi
    fi
    local c
    for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
             /usr/local/cuda-*/bin/compute-sanitizer /opt/cuda/bin/compute-sanitizer \
             /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/lib/nvidia-cuda-toolkit/bin/compute-sanitizer; do
        [[ -n "$c" && -x "$c" ]] && { echo "$c"; return; }
    done
}
SAN=$(find_sanitizer)
if [[ -z "$SAN" ]]; then
    echo "note: compute-sanitizer not found (no bundled wheel, none on PATH or in /usr/local/cuda*/bin);" \
         "skipping the sanitizer steps"
    for tool in $TOOLS; do note_skip "$tool" "no compute-sanitizer"; done
else
    echo "compute-sanitizer: $SAN ($("$SAN" --version 2>/dev/null | grep -i version | head -n1))"
    for tool in $TOOLS; do
        filter=${MESA_SANITIZER_FILTER:-}
        extra=()
        case $tool in
            racecheck) filter=${MESA_RACECHECK_FILTER:-} ;;
            memcheck) extra=(--padding 32) ;;
        esac
        for t in ${TESTS[@]+"${TESTS[@]}"}; do
            # a binary that makes no CUDA call makes compute-sanitizer fail ("terminated
            # before first instrumented API call"): skip those without tests
            if [[ "$("$t" --list 2>/dev/null | grep -c ': test$')" == 0 ]]; then
                note_skip "$tool:$(basename "$t")" "no tests"
                continue
            fi
            # shellcheck disable=SC2086
            run_step "$tool:$(basename "$t")" "$T_SAN" - "$SAN" --tool "$tool" ${extra[@]+"${extra[@]}"} \
                --error-exitcode 86 --print-limit 50 --target-processes all "$t" $filter
        done
    done
fi

# ---- summary -----------------------------------------------------------------------------
{
    printf '\n%-46s %-22s %8s\n' STEP STATUS SECONDS
    printf '%-46s %-22s %8s\n' "----" "------" "-------"
    for i in "${!NAMES[@]}"; do printf '%-46s %-22s %8s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}"; done
    printf 'total %ss, logs in %s, result: %s\n' "$(( $(date +%s) - START ))" "$OUTDIR" \
        "$([[ $FAILED == 0 ]] && echo PASS || echo FAIL)"
} | tee "$OUTDIR/summary.txt"
exit "$FAILED"
RUN
chmod 755 "$BUNDLE/run.sh"

# ---- manifest + size -------------------------------------------------------------------
{
    echo "mesa-kernels GPU bundle"
    echo "built:   $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
    echo "commit:  $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "rustc:   $(rustc -V)"
    echo "nvcc:    ${NVCC:-none} $([[ -n "${NVCC:-}" ]] && "$NVCC" --version | grep -o 'V[0-9.]*' | tail -n1)"
    echo "archs:   ${MESA_CUDA_ARCHS:-default of build.rs (80,90)}"
    echo "files:"
    (cd "$BUNDLE" && find . -type f ! -name MANIFEST.txt | sort | while read -r f; do
        printf '  %10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "${f#./}"
    done)
} >"$BUNDLE/MANIFEST.txt"

size=$(du -sb "$BUNDLE" | cut -f1)
log "bundle: $BUNDLE, $size bytes ($((size / 1024 / 1024)) MiB)"
sed 's/^/    /' "$BUNDLE/MANIFEST.txt" >&2
if (( size > MAX_BYTES )); then
    die "bundle is $size bytes, over the 64 MiB limit"
fi
if [[ -z "${NVCC:-}" ]]; then
    log "WARNING: this bundle has no CUDA kernels"
fi
log "done. GPU machine: bash bundle/run.sh   (device runner: carry [\"bundle\"])"
