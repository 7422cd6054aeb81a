#!/usr/bin/env bash
# check-resources.sh — the compiler's resource report for every kernel, without a GPU
# (docs/kernels.md): per kernel and architecture, registers, shared memory, stack frame,
# local memory and local-memory instructions (LDL/STL: register spills land there), read
# with `cuobjdump -res-usage` and `cuobjdump -sass` from the device code.
# Fails (exit 1) when any kernel has a stack frame, local memory or a local load/store
# (> 0), or when a file does not compile / has no device code for an architecture.
#
# Where the device code comes from:
#   --build [DIR]  the cargo build's own objects: the static libraries
#                  libmesa_kernels_cuda_<file>.a in mesa-kernels-sys's OUT_DIR (DIR, or the
#                  newest OUT_DIR under the target or profile dir DIR, by default target/, that
#                  holds one for every kernels/*.cu). What
#                  is checked is exactly what links into the binaries, and nothing is compiled
#                  again (CI: after the README step's CUDA build). Fails when a library is
#                  missing, older than a kernel source, or lacks an architecture asked for.
#   (default)      compiles each kernels/*.cu to a cubin per architecture with build.rs's
#                  device flags (-O3, -std=c++17, the two include dirs) and keeps ptxas's -v
#                  log (<file>.sm_<arch>.ptxas) beside it: for a quick look at one change
#                  without a cargo build.
#
# It also counts global loads and stores by width: LDG128/STG128 = 16-byte accesses
# (LDG.E.128 / STG.E.128), the widest load/store, so one can see that the dense paths use
# 16-byte vectors. On sm_90 it then counts the instructions each memory-bound kernel's dense
# hot path issues per element (scripts/sass_count.py: one line per kernel with the word
# `budget`) and fails when one is over its limit (the method: docs/kernels.md, "Static
# instruction budget"), and checks that the f16/bf16 linear-attention kernels (ungated and
# gated) issue tensor-core instructions within their register gates
# (scripts/sass_tensor_cores.py, per architecture).
#
#   scripts/check-resources.sh                  # compile, sm_90
#   scripts/check-resources.sh 80 90            # or MESA_RESOURCE_ARCHS="80 90"
#   scripts/check-resources.sh --build target/release 80 90  # the release build's objects (CI)
#
# Environment:
#   NVCC, CUDA_HOME/CUDA_PATH (bin/nvcc), PATH: which nvcc (as build.rs); cuobjdump is looked
#            for beside it
#   CUOBJDUMP: cuobjdump to use; default next to nvcc, then PATH. The PyPI wheels
#            nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (13.2.86) install both next to
#            the wheel's nvcc (.ci/run installs them)
#   MESA_RESOURCE_KEEP=DIR: keep the cubins, resource reports and SASS in DIR
#   MESA_RESOURCE_SOURCES="kernels/a.cu …": only these files (scripts/check-fast.sh: the changed
#            ones); the budget and tensor-core checks then cover the kernels of these files only
#   MESA_RESOURCE_JOBS: files compiled or dumped at a time (default: the cores)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

BUILD_MODE=0
BUILD_DIR=
TARGET_ROOT=target
if [[ "${1:-}" == "--build" ]]; then
    BUILD_MODE=1
    shift
    if [[ -n "${1:-}" && -d "$1" ]]; then
        # an OUT_DIR itself, or a target dir (or a profile dir in one) to look in
        if compgen -G "$1/libmesa_kernels_cuda_*.a" >/dev/null; then BUILD_DIR=$1; else TARGET_ROOT=$1; fi
        shift
    fi
fi

find_nvcc() {
    if [[ -n "${NVCC:-}" ]]; then
        if [[ -f "$NVCC" ]]; then echo "$NVCC"; return; fi
        echo "check-resources: NVCC=$NVCC is not a file; looking elsewhere" >&2
    fi
    for v in CUDA_HOME CUDA_PATH; do
        if [[ -n "${!v:-}" && -f "${!v}/bin/nvcc" ]]; then echo "${!v}/bin/nvcc"; return; fi
    done
    if command -v nvcc >/dev/null; then command -v nvcc; return; fi
}
NVCC_BIN=$(find_nvcc || true)
command -v python3 >/dev/null || { echo "check-resources: python3 is needed" >&2; exit 2; }

if (( $# > 0 )); then ARCHS=("$@"); else read -r -a ARCHS <<<"${MESA_RESOURCE_ARCHS:-90}"; fi
for i in "${!ARCHS[@]}"; do
    a=${ARCHS[$i]#sm_}; a=${a#compute_}; a=${a/./}
    [[ "$a" =~ ^[0-9]+a?$ ]] || { echo "check-resources: bad architecture '${ARCHS[$i]}'" >&2; exit 2; }
    ARCHS[$i]=$a
done

CUOBJ=${CUOBJDUMP:-}
if [[ -z "$CUOBJ" ]]; then
    if [[ -n "$NVCC_BIN" && -x "$(dirname "$NVCC_BIN")/cuobjdump" ]]; then CUOBJ="$(dirname "$NVCC_BIN")/cuobjdump"
    else CUOBJ=$(command -v cuobjdump || true); fi
fi
[[ -n "$CUOBJ" ]] || { echo "check-resources: no cuobjdump (CUOBJDUMP, next to nvcc, PATH)" >&2; exit 2; }
# cuobjdump -sass runs nvdisasm: let it find the one installed beside it
export PATH="$(dirname "$CUOBJ"):$PATH"

if [[ -n "${MESA_RESOURCE_KEEP:-}" ]]; then WORK=$MESA_RESOURCE_KEEP; mkdir -p "$WORK"
else WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT; fi

shopt -s nullglob
SOURCES=(kernels/*.cu)
SUBSET=()
if [[ -n "${MESA_RESOURCE_SOURCES:-}" ]]; then
    read -r -a SOURCES <<<"$MESA_RESOURCE_SOURCES"
    SUBSET=(--present)
fi
(( ${#SOURCES[@]} > 0 )) || { echo "check-resources: no kernels/*.cu" >&2; exit 2; }
compile_failed=0

# Jobs over the files run MESA_RESOURCE_JOBS at a time (default: the cores); a job that fails
# leaves a mark, and finish_parallel fails when one did.
JOBS=${MESA_RESOURCE_JOBS:-$(nproc 2>/dev/null || echo 2)}
in_parallel() {
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
    ( "$@" || touch "$WORK/.failed.$BASHPID" ) &
}
finish_parallel() {
    wait
    ! compgen -G "$WORK/.failed.*" >/dev/null
}

# <stem>.sm_<a>.sass and .res (cuobjdump -sass / -res-usage) from the cubins of one arch
dump_cubins() {  # dump_cubins BASE CUBIN...
    local base=$1; shift
    : >"$base.sass"; : >"$base.res"
    local c
    for c in "$@"; do
        "$CUOBJ" -sass "$c" >>"$base.sass"
        "$CUOBJ" -res-usage "$c" >>"$base.res"
    done
}

if (( BUILD_MODE )); then
    if [[ -z "$BUILD_DIR" ]]; then
        # the newest OUT_DIR of mesa-kernels-sys under the profile dirs of $TARGET_ROOT that
        # holds a library for every kernel source: a build still running (CI's background
        # compatibility builds, in their own target dir) may hold only some of them
        BUILD_DIR=$(ls -dt "$TARGET_ROOT"/build/mesa-kernels-sys-*/out "$TARGET_ROOT"/*/build/mesa-kernels-sys-*/out \
                "$TARGET_ROOT"/*/*/build/mesa-kernels-sys-*/out 2>/dev/null \
            | while read -r d; do
                complete=1
                for src in kernels/*.cu; do
                    [[ -f "$d/libmesa_kernels_cuda_$(basename "$src" .cu).a" ]] || { complete=0; break; }
                done
                (( complete )) && { echo "$d"; break; }
            done || true)
        [[ -n "$BUILD_DIR" ]] || { echo "check-resources: --build: no complete CUDA build of mesa-kernels-sys under $TARGET_ROOT/ (cargo build --release with nvcc first)" >&2; exit 2; }
    fi
    echo "device code: the cargo build's libraries in $BUILD_DIR; cuobjdump: $CUOBJ; archs: ${ARCHS[*]/#/sm_}"
    from_library() {  # from_library SRC: its library's cubins dumped per architecture
        local src=$1 stem lib stale a
        stem=$(basename "$src" .cu)
        lib="$(cd "$BUILD_DIR" && pwd)/libmesa_kernels_cuda_$stem.a"
        if [[ ! -f "$lib" ]]; then echo "FAIL: $lib missing (no CUDA build of $src)" >&2; return 1; fi
        stale=$(find kernels -newer "$lib" \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) -print -quit)
        if [[ -n "$stale" ]]; then
            echo "FAIL: $lib is older than $stale: build again (cargo build --release)" >&2; return 1
        fi
        mkdir -p "$WORK/elf.$stem"
        (cd "$WORK/elf.$stem" && "$CUOBJ" -xelf all "$lib" >/dev/null)
        for a in "${ARCHS[@]}"; do
            cubins=("$WORK/elf.$stem"/*.sm_"$a".cubin)
            if (( ${#cubins[@]} == 0 )); then
                echo "FAIL: $lib has no sm_$a code (MESA_CUDA_ARCHS of that build?)" >&2; return 1
            fi
            dump_cubins "$WORK/$stem.sm_$a" "${cubins[@]}"
        done
    }
    for src in "${SOURCES[@]}"; do in_parallel from_library "$src"; done
    finish_parallel || compile_failed=1
else
    [[ -n "$NVCC_BIN" ]] || { echo "check-resources: no nvcc (NVCC, CUDA_HOME, CUDA_PATH, PATH)" >&2; exit 2; }
    echo "device code: nvcc $NVCC_BIN ($("$NVCC_BIN" --version | grep -o 'V[0-9.]*' | tail -n1)); archs: ${ARCHS[*]/#/sm_}"
    compile_one() {  # compile_one SRC ARCH
        local src=$1 a=$2 stem base
        stem=$(basename "$src" .cu)
        base="$WORK/$stem.sm_$a"
        # the device-code flags of build.rs: -O3, -std=c++17, the two include dirs
        if ! "$NVCC_BIN" -cubin -O3 -std=c++17 -I kernels/include -I kernels \
            "-gencode=arch=compute_$a,code=sm_$a" -Xptxas -v -Xptxas -warn-spills \
            -o "$base.cubin" "$src" 2>"$base.ptxas"; then
            echo "FAIL: $src does not compile for sm_$a:" >&2
            sed 's/^/    /' "$base.ptxas" >&2
            return 1
        fi
        dump_cubins "$base" "$base.cubin"
    }
    for src in "${SOURCES[@]}"; do
        for a in "${ARCHS[@]}"; do in_parallel compile_one "$src" "$a"; done
    done
    finish_parallel || compile_failed=1
fi

set +e
python3 - "$WORK" <<'PY'
import glob, os, re, shutil, subprocess, sys

work = sys.argv[1]

def demangle(names):
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}

def short(d):
    d = re.sub(r"^void ", "", d).replace("mesa_cuda_kernels::", "")
    depth = 0
    for i, c in enumerate(d):           # cut the parameter list after the template arguments
        if c == "<": depth += 1
        elif c == ">": depth -= 1
        elif c == "(" and depth == 0: return d[:i]
    return d

def parse_res(path):
    """{mangled: {regs, smem, stack, lmem}} from cuobjdump -res-usage (every function of the
    cubins: kernels and any device function ptxas kept out of line)."""
    res, cur = {}, None
    for line in open(path):
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and cur:
            regs, stack, smem, lmem = map(int, m.groups())
            res[cur] = dict(regs=regs, stack=stack, smem=smem, lmem=lmem)
            cur = None
    return res

WIDTH = {"128": 128, "64": 64, "U8": 8, "S8": 8, "U16": 16, "S16": 16}
def parse_sass(path):
    res, cur = {}, None
    if not os.path.exists(path):
        return res
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            res[cur] = {"LDG": {}, "STG": {}, "local": 0}
            continue
        if cur is None:
            continue
        m = re.search(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)\s", line)
        if m:
            mods = m.group(2).split(".")[1:]
            w = next((WIDTH[x] for x in mods if x in WIDTH), 32)
            d = res[cur][m.group(1)]
            d[w] = d.get(w, 0) + 1
        if re.search(r"\b(LDL|STL)(\.|\s)", line):
            res[cur]["local"] += 1
    return res

rows, bad = [], []
for path in sorted(glob.glob(os.path.join(work, "*.res"))):
    base = path[: -len(".res")]
    stem, arch = os.path.basename(base).rsplit(".", 1)
    ks = parse_res(path)
    sass = parse_sass(base + ".sass")
    names = demangle(list(ks))
    for mangled, k in ks.items():
        s = sass.get(mangled)
        def col(op, w):
            return "-" if s is None else str(s[op].get(w, 0))
        def widest(op):
            return "-" if s is None else (str(max(s[op])) if s[op] else "0")
        local = 0 if s is None else s["local"]
        name = short(names[mangled])
        rows.append([f"{stem}.cu", arch, name, str(k["regs"]), str(k["smem"]), str(k["stack"]), str(k["lmem"]),
                     "-" if s is None else str(local), col("LDG", 128), widest("LDG"), col("STG", 128), widest("STG")])
        problems = [f"{v} {what}" for v, what in
                    ((k["stack"], "bytes stack frame"), (k["lmem"], "bytes local memory"),
                     (local, "local loads/stores (LDL/STL: spills)")) if v > 0]
        if problems:
            bad.append(f"{stem}.cu {arch} {name}: " + ", ".join(problems))

head = ["file", "arch", "kernel", "regs", "smem", "stack", "lmem", "LDL/STL",
        "LDG128", "LDG max", "STG128", "STG max"]
widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
print()
print(fmt(head))
print(fmt(["-" * w for w in widths]))
for r in rows:
    print(fmt(r))
print("\nbytes: smem = static shared memory, stack = stack frame, lmem = local memory; LDL/STL = "
      "local-memory load/store instructions in the SASS (where spills go); LDG128/STG128 = number of 16-byte global load/store instructions in the SASS; "
      "max = widest global access in bits")
if bad:
    print("\nFAIL: spills, stack frames or local memory:")
    for b in bad:
        print("  " + b)
    sys.exit(1)
print(f"\nOK: {len(rows)} kernels, no spills, no stack frame, no local memory")
PY
status=$?
if [[ " ${ARCHS[*]} " == *" 90 "* ]]; then
    echo
    python3 scripts/sass_count.py "$WORK" "${SUBSET[@]}" || status=1
    echo
    for a in "${ARCHS[@]}"; do python3 scripts/sass_tensor_cores.py "$WORK" --arch "$a" "${SUBSET[@]}" || status=1; done
else
    echo "note: the instruction budget is counted on sm_90 SASS (arch 90 not asked for)"
fi
set -e
if (( compile_failed )); then echo "FAIL: device code missing for some kernel files (above)" >&2; exit 1; fi
exit "$status"
