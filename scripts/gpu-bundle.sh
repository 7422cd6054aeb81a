#!/usr/bin/env bash
# gpu-bundle.sh — build what a GPU run needs on this (CPU) machine into bundle/ (git-ignored),
# for a GPU machine that has no Rust toolchain. What bundle/run.sh does there, and
# how to carry it, is in README.md ("GPU runs").
#
#   scripts/gpu-bundle.sh          # build (reusing CI's CUDA build) + assemble bundle/
#
# bundle/ holds three files: run.sh (a copy of scripts/bundle-run.sh), MANIFEST.txt, and
# payload.tar.xz with
#   tests/<name>       every test executable of the workspace, unit tests as <crate>-lib
#   benches/<name>     the criterion benches
#   examples/compress_report        the main job (built by cargo test)
#   fixtures/*.safetensors          the fixtures the tests and the example read
#   sanitizer/{bin,lib}             compute-sanitizer from the nvidia-cuda-sanitizer-api wheel
#   peer/                           scripts/peer/*.py and the fla-core wheel (peer baselines)
#   SHA256SUMS
# Binaries lose their debug info (symbols stay, for readable backtraces); the fatbins inside
# are already compressed by nvcc (build.rs: -compress-mode=size); xz -9 with its 64 MiB window
# then shares what the binaries have in common.
#
# Size limit: a device run carries the whole working tree (tracked and untracked, not ignored,
# files) plus bundle/, 64 MiB in all; this script fails when the two together are above it.
#
# Environment:
#   NVCC / CUDA_HOME / CUDA_PATH   which nvcc (as build.rs); when none is set, the pinned
#                      wheels of .ci/run in ${MESA_CI_VENV:-target/ci-venv} (run .ci/run once,
#                      or install them the way it does); then nvcc on PATH. The same variables
#                      as CI's, so the CUDA build of `cargo test --workspace --release` is reused.
#   CARGO_TARGET_DIR   as cargo (default target/)
#   MESA_BUNDLE_CACHE  where the sanitizer and fla-core wheels are kept (default target/bundle-cache)
#   MESA_BUNDLE_ALLOW_NO_CUDA=1   bundle an emulation-only build (tests this script only)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUNDLE="$ROOT/bundle"
LIMIT_BYTES=$((64 * 1024 * 1024))
SANITIZER_WHEEL=nvidia-cuda-sanitizer-api==13.0.85   # the release of the pinned nvcc 13.0
FLA_WHEEL=fla-core==0.6.0   # flash-linear-attention, for the peer-baselines comparison (pure Python)
CACHE=${MESA_BUNDLE_CACHE:-$ROOT/target/bundle-cache}

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
command -v python3 >/dev/null || die "python3 is needed to read cargo's JSON output"

# ---- nvcc: the same lookup as build.rs, then the venv .ci/run installs ----------------
if [[ -z "${NVCC:-}${CUDA_HOME:-}${CUDA_PATH:-}" ]]; then
    venv=${MESA_CI_VENV:-$ROOT/target/ci-venv}
    if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c 'import nvidia' 2>/dev/null; then
        # exactly as .ci/run computes it, so that build.rs sees the same CUDA_HOME and NVCC
        CUDA_HOME=$("$venv/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
        export CUDA_HOME NVCC="$CUDA_HOME/bin/nvcc"
    fi
fi
nvcc=${NVCC:-}
[[ -z "$nvcc" && -n "${CUDA_HOME:-}" ]] && nvcc=$CUDA_HOME/bin/nvcc
[[ -z "$nvcc" && -n "${CUDA_PATH:-}" ]] && nvcc=$CUDA_PATH/bin/nvcc
[[ -z "$nvcc" ]] && nvcc=$(command -v nvcc || true)
if [[ -n "$nvcc" && -x "$nvcc" ]]; then
    log "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*'))"
elif [[ "${MESA_BUNDLE_ALLOW_NO_CUDA:-0}" == 1 ]]; then
    nvcc=""
    log "WARNING: no nvcc; bundling an emulation-only build (useless on a GPU; script test only)"
else
    die "no nvcc: set NVCC or CUDA_HOME, or install the pinned wheels as .ci/run does (into target/ci-venv)"
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# ---- build: the very commands CI runs, so that nothing is built twice ------------------
# No profile overrides here: any would be a second build of the whole workspace.
log "cargo test --workspace --release --no-run"
cargo test --workspace --release --no-run --message-format=json-render-diagnostics >"$WORK/test.json" \
    || die "cargo test --no-run failed"
# The benches in the release profile (`cargo bench` would use its own `bench` profile: the
# same settings, but every dependency compiled a second time); criterion's `--bench` argument,
# which `cargo bench` passes, is given by run.sh.
log "cargo build --release --benches"
cargo build --release --benches --message-format=json-render-diagnostics >"$WORK/bench.json" \
    || die "cargo build --release --benches failed"

# Executables from cargo's JSON, one "kind<TAB>name<TAB>path" per line.
python3 - "$WORK/test.json" "$WORK/bench.json" >"$WORK/artifacts.tsv" <<'PY'
import json, sys

rows, seen = [], set()
def add(kind, name, exe):
    if (kind, name) in seen:
        sys.exit(f"two {kind} executables named {name}")
    seen.add((kind, name))
    rows.append((kind, name, exe))

for path in sys.argv[1:]:
    for line in open(path):
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        t, test = msg["target"], msg["profile"]["test"]
        # mesa-candle's tests run on candle's CPU backend (its `cuda` feature needs candle's
        # CUDA libraries, which the bundle does not carry): nothing for the GPU to run
        if "mesa-candle" in msg.get("package_id", ""):
            continue
        if "bench" in t["kind"]:
            add("benches", t["name"], msg["executable"])
        elif "example" in t["kind"]:
            if t["name"] == "compress_report":  # the one the run uses
                add("examples", t["name"], msg["executable"])
        elif test and "test" in t["kind"]:
            add("tests", t["name"], msg["executable"])
        elif test:  # a library's unit tests
            add("tests", t["name"] + "-lib", msg["executable"])
for r in rows:
    print("\t".join(r))
PY

# ---- stage -----------------------------------------------------------------------------
STAGE="$WORK/stage"
mkdir -p "$STAGE"/{tests,benches,examples,fixtures,sanitizer,broken}
while IFS=$'\t' read -r kind name exe; do
    dest="$STAGE/$kind/$name"
    # debug info is most of a binary's size; the symbol table stays for backtraces
    strip --strip-debug -o "$dest" "$exe"
    # a binary links only the kernels it calls (the lib's unit tests may call none)
    if readelf -S "$dest" | grep -q '\.nv_fatbin'; then fatbins=$((${fatbins:-0} + 1)); fi
done <"$WORK/artifacts.tsv"
if [[ -n "$nvcc" && -z "${fatbins:-}" ]]; then
    die "no binary has a CUDA fatbin: the build is emulation-only (MESA_CUDA_DISABLE set? nvcc not seen by build.rs?)"
fi
[[ -n "$(ls "$STAGE/tests")" && -n "$(ls "$STAGE/benches")" ]] || die "no test or bench executables in cargo's output"
cp fixtures/*.safetensors "$STAGE/fixtures/"

# The deliberately broken kernels (kernels/broken/, issue 9) as a GPU executable, for the
# compute-sanitizer section: whether it reports what the emulator's checks report.
if [[ -n "$nvcc" ]]; then
    log "nvcc: kernels/broken -> broken/broken_kernels (not in tests/: it is no Rust test binary)"
    "$nvcc" -std=c++17 -O2 -lineinfo -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
        -Ikernels/include -Ikernels kernels/broken/*.cu scripts/broken-main.cu -cudart static \
        -L"$(dirname "$(dirname "$nvcc")")/lib" -L"$(dirname "$(dirname "$nvcc")")/lib64" \
        -o "$STAGE/broken/broken_kernels" || die "nvcc failed on kernels/broken"
fi

# A wheel from the cache, downloaded there first if missing: cached_wheel SPEC GLOB.
cached_wheel() {
    local found
    found=$(ls "$CACHE"/$2 2>/dev/null | head -n1 || true)
    if [[ -z "$found" ]]; then
        mkdir -p "$CACHE"
        local pip=(python3 -m pip) venv_pip=${MESA_CI_VENV:-$ROOT/target/ci-venv}/bin/pip
        [[ -x "$venv_pip" ]] && pip=("$venv_pip")
        log "downloading $1 into $CACHE"
        "${pip[@]}" download --quiet --disable-pip-version-check --no-deps -d "$CACHE" "$1" >&2 \
            || die "cannot download $1 (put the wheel into $CACHE)"
        found=$(ls "$CACHE"/$2 | head -n1)
    fi
    echo "$found"
}

# The peer baselines (bundle-run.sh, peer-baselines): scripts/peer/*.py and the wheels they
# read (fla-core: unpacked there, torch and triton are the GPU machine's).
mkdir -p "$STAGE/peer"
cp scripts/peer/*.py "$STAGE/peer/"
cp "$(cached_wheel "$FLA_WHEEL" 'fla_core-0.6.0-*.whl')" "$STAGE/peer/"

# compute-sanitizer: the wheel's bin/ and lib/ (not its headers), with its licence.
wheel=$(cached_wheel "$SANITIZER_WHEEL" 'nvidia_cuda_sanitizer_api-13.0.85-*.whl')
python3 - "$wheel" "$STAGE/sanitizer" <<'PY'
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        parts = info.filename.split("/")
        if info.filename.endswith("/"):
            continue
        if parts[:2] == ["nvidia", "cu13"] and parts[2] in ("bin", "lib"):
            target = os.path.join(dest, *parts[2:])
        elif parts[-1] == "License.txt":
            target = os.path.join(dest, "License.txt")
        else:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as out:
            out.write(src.read())
        os.chmod(target, 0o755)
PY
[[ -x "$STAGE/sanitizer/bin/compute-sanitizer" ]] || die "no bin/compute-sanitizer in $wheel"

(cd "$STAGE" && find . -type f | sort | xargs sha256sum >"$WORK/SHA256SUMS" && mv "$WORK/SHA256SUMS" .)

# ---- bundle/ ---------------------------------------------------------------------------
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
# two blocks compressed at once (each still shares its 64 MiB window across the binaries in it):
# half the wall time on 2 cores for about 1 MB more
log "compressing (xz -9, two threads)"
tar -C "$STAGE" -cf - . | xz -9 -T2 --block-size=80MiB >"$BUNDLE/payload.tar.xz"
cp scripts/bundle-run.sh "$BUNDLE/run.sh"
chmod 755 "$BUNDLE/run.sh"
{
    echo "mesa-kernels GPU bundle"
    echo "built:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit:  $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- . ':!bundle' || echo ' (+ uncommitted changes)')"
    echo "rustc:   $(rustc -V)"
    if [[ -n "$nvcc" ]]; then echo "nvcc:    $("$nvcc" --version | grep -o 'V[0-9.]*' | tail -n1)"; else echo "nvcc:    none (emulation only)"; fi
    echo "archs:   ${MESA_CUDA_ARCHS:-80,90 (build.rs default)}"
    echo "payload (uncompressed bytes):"
    (cd "$STAGE" && find . -type f ! -name SHA256SUMS | sort | while read -r f; do
        printf '  %10d  %s\n' "$(stat -c %s "$f")" "${f#./}"
    done)
} >"$BUNDLE/MANIFEST.txt"

# ---- size: the bundle plus the rest of what a device run carries -----------------------
bundle_bytes=$(du -sb "$BUNDLE" | cut -f1)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if os.path.isfile(p)))')
total=$((bundle_bytes + tree_bytes))
log "bundle/: $bundle_bytes bytes (payload $(stat -c %s "$BUNDLE/payload.tar.xz"), uncompressed $(du -sb "$STAGE" | cut -f1))"
log "working tree that travels with it: $tree_bytes bytes; together $total of $LIMIT_BYTES"
if (( total > LIMIT_BYTES )); then
    die "bundle/ + working tree = $total bytes, over the limit of $LIMIT_BYTES (what a device run carries)"
fi
log "done: run it with  bash bundle/run.sh  (device runner: carry [\"bundle\"])"
