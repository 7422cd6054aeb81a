#!/usr/bin/env bash
# check-resources.sh — the compiler's resource report for every kernel, without a GPU
# (docs/kernels.md): compiles each kernels/*.cu to a cubin per architecture with `-Xptxas -v` and
# prints, per kernel, registers, shared memory, stack frame, spills and local memory.
# Fails (exit 1) when any kernel has spill stores/loads, a stack frame or local memory
# (> 0 bytes), or when a file does not compile.
#
# When cuobjdump (+ nvdisasm) is available it also reads the SASS and counts global loads
# and stores by width: LDG128/STG128 = 16-byte accesses (LDG.E.128 / STG.E.128), the
# widest load/store, so one can see that the dense paths use 16-byte vectors. On sm_90 it
# then counts the instructions each memory-bound kernel's dense hot path issues per element
# (scripts/sass_count.py: one line per kernel with the word `budget`) and fails when one is
# over its limit (the method: docs/kernels.md, "Static instruction budget"), and checks that
# the f16/bf16 linear-attention kernels issue tensor-core instructions within their register
# gates (scripts/sass_tensor_cores.py, per architecture).
#
#   scripts/check-resources.sh              # sm_90
#   scripts/check-resources.sh 80 90        # or MESA_RESOURCE_ARCHS="80 90"
#
# Environment:
#   NVCC, CUDA_HOME/CUDA_PATH (bin/nvcc), PATH: which nvcc (as build.rs); last resort the
#            pinned 13.0 of /work/.venv-cuda
#   CUOBJDUMP: cuobjdump to use; default next to nvcc, then PATH. The PyPI wheels
#            nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (13.2.86) install both next to
#            the wheel's nvcc: /work/.venv-cuda/bin/pip install nvidia-cuda-cuobjdump==13.2.86
#            nvidia-cuda-nvdisasm==13.2.86
#   MESA_RESOURCE_KEEP=DIR: keep the cubins, ptxas logs and SASS in DIR
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PINNED_NVCC=/work/.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc

find_nvcc() {
    if [[ -n "${NVCC:-}" ]]; then
        if [[ -f "$NVCC" ]]; then echo "$NVCC"; return; fi
        echo "check-resources: NVCC=$NVCC is not a file; looking elsewhere" >&2
    fi
    for v in CUDA_HOME CUDA_PATH; do
        if [[ -n "${!v:-}" && -f "${!v}/bin/nvcc" ]]; then echo "${!v}/bin/nvcc"; return; fi
    done
    if command -v nvcc >/dev/null; then command -v nvcc; return; fi
    if [[ -f "$PINNED_NVCC" ]]; then echo "$PINNED_NVCC"; return; fi
}
NVCC_BIN=$(find_nvcc)
[[ -n "$NVCC_BIN" ]] || { echo "check-resources: no nvcc (NVCC, CUDA_HOME, CUDA_PATH, PATH)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "check-resources: python3 is needed" >&2; exit 2; }

if (( $# > 0 )); then ARCHS=("$@"); else read -r -a ARCHS <<<"${MESA_RESOURCE_ARCHS:-90}"; fi
for i in "${!ARCHS[@]}"; do
    a=${ARCHS[$i]#sm_}; a=${a#compute_}; a=${a/./}
    [[ "$a" =~ ^[0-9]+a?$ ]] || { echo "check-resources: bad architecture '${ARCHS[$i]}'" >&2; exit 2; }
    ARCHS[$i]=$a
done

CUOBJ=${CUOBJDUMP:-}
if [[ -z "$CUOBJ" ]]; then
    if [[ -x "$(dirname "$NVCC_BIN")/cuobjdump" ]]; then CUOBJ="$(dirname "$NVCC_BIN")/cuobjdump"
    else CUOBJ=$(command -v cuobjdump || true); fi
fi
if [[ -n "$CUOBJ" ]]; then
    # cuobjdump -sass runs nvdisasm: let it find the one installed beside it
    export PATH="$(dirname "$CUOBJ"):$PATH"
fi

if [[ -n "${MESA_RESOURCE_KEEP:-}" ]]; then WORK=$MESA_RESOURCE_KEEP; mkdir -p "$WORK"
else WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT; fi

echo "nvcc: $NVCC_BIN ($("$NVCC_BIN" --version | grep -o 'V[0-9.]*' | tail -n1)); archs: ${ARCHS[*]/#/sm_}"
compile_failed=0
shopt -s nullglob
SOURCES=(kernels/*.cu)
(( ${#SOURCES[@]} > 0 )) || { echo "check-resources: no kernels/*.cu" >&2; exit 2; }
for src in "${SOURCES[@]}"; do
    stem=$(basename "$src" .cu)
    for a in "${ARCHS[@]}"; do
        base="$WORK/$stem.sm_$a"
        # the device-code flags of build.rs: -O3, -std=c++17, the two include dirs
        if ! "$NVCC_BIN" -cubin -O3 -std=c++17 -I kernels/include -I kernels \
            "-gencode=arch=compute_$a,code=sm_$a" -Xptxas -v -Xptxas -warn-spills \
            -o "$base.cubin" "$src" 2>"$base.ptxas"; then
            echo "FAIL: $src does not compile for sm_$a:" >&2
            sed 's/^/    /' "$base.ptxas" >&2
            compile_failed=1
            continue
        fi
        if [[ -n "$CUOBJ" ]]; then
            "$CUOBJ" -sass "$base.cubin" >"$base.sass" 2>"$base.sass.err" || {
                echo "note: cuobjdump -sass failed for $base.cubin: $(head -n1 "$base.sass.err")" >&2
                rm -f "$base.sass"
            }
        fi
    done
done
[[ -z "$CUOBJ" ]] && echo "note: no cuobjdump (CUOBJDUMP, next to nvcc, PATH): SASS columns left empty"

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

def parse_ptxas(path):
    kernels, cur, props = {}, None, None
    for line in open(path):
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            cur = m.group(1)
            kernels[cur] = dict(entry=True, regs=0, smem=0, stack=0, spill_st=0, spill_ld=0, lmem=0)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)
            kernels.setdefault(props, dict(entry=False, regs=0, smem=0, stack=0, spill_st=0, spill_ld=0, lmem=0))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props:
            k = kernels[props]
            k["stack"], k["spill_st"], k["spill_ld"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            k = kernels[cur]
            k["regs"] = int(m.group(1))
            for field, key in (("smem", "smem"), ("lmem", "lmem")):
                mm = re.search(r"(\d+) bytes " + field, line)
                if mm: k[key] = int(mm.group(1))
    return kernels

WIDTH = {"128": 128, "64": 64, "U8": 8, "S8": 8, "U16": 16, "S16": 16}
def parse_sass(path):
    res, cur = {}, None
    if not os.path.exists(path):
        return res
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            res[cur] = {"LDG": {}, "STG": {}}
            continue
        if cur is None:
            continue
        m = re.search(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)\s", line)
        if m:
            mods = m.group(2).split(".")[1:]
            w = next((WIDTH[x] for x in mods if x in WIDTH), 32)
            d = res[cur][m.group(1)]
            d[w] = d.get(w, 0) + 1
    return res

rows, bad = [], []
for ptx in sorted(glob.glob(os.path.join(work, "*.ptxas"))):
    base = ptx[: -len(".ptxas")]
    stem, arch = os.path.basename(base).rsplit(".", 1)
    ks = parse_ptxas(ptx)
    sass = parse_sass(base + ".sass")
    names = demangle(list(ks))
    for mangled, k in ks.items():
        s = sass.get(mangled)
        def col(op, w):
            return "-" if s is None else str(s[op].get(w, 0))
        def widest(op):
            return "-" if s is None else (str(max(s[op])) if s[op] else "0")
        name = short(names[mangled]) + ("" if k["entry"] else " [device fn]")
        rows.append([f"{stem}.cu", arch, name, str(k["regs"]), str(k["smem"]), str(k["stack"]),
                     str(k["spill_st"]), str(k["spill_ld"]), str(k["lmem"]),
                     col("LDG", 128), widest("LDG"), col("STG", 128), widest("STG")])
        problems = [f"{k[f]} bytes {what}" for f, what in
                    (("spill_st", "spill stores"), ("spill_ld", "spill loads"),
                     ("stack", "stack frame"), ("lmem", "local memory")) if k[f] > 0]
        if problems:
            bad.append(f"{stem}.cu {arch} {name}: " + ", ".join(problems))

head = ["file", "arch", "kernel", "regs", "smem", "stack", "spill st", "spill ld", "lmem",
        "LDG128", "LDG max", "STG128", "STG max"]
widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
print()
print(fmt(head))
print(fmt(["-" * w for w in widths]))
for r in rows:
    print(fmt(r))
print("\nbytes: smem = static shared memory, stack = stack frame, lmem = local memory; "
      "LDG128/STG128 = number of 16-byte global load/store instructions in the SASS; "
      "max = widest global access in bits")
if bad:
    print("\nFAIL: spills, stack frames or local memory:")
    for b in bad:
        print("  " + b)
    sys.exit(1)
print(f"\nOK: {len(rows)} kernels, no spills, no stack frame, no local memory")
PY
status=$?
if [[ -n "$CUOBJ" && " ${ARCHS[*]} " == *" 90 "* ]]; then
    echo
    python3 scripts/sass_count.py "$WORK" || status=1
    echo
    for a in "${ARCHS[@]}"; do python3 scripts/sass_tensor_cores.py "$WORK" --arch "$a" || status=1; done
else
    echo "note: the instruction budget is counted on sm_90 SASS (cuobjdump and arch 90 needed)"
fi
set -e
if (( compile_failed )); then echo "FAIL: some kernel files did not compile" >&2; exit 1; fi
exit "$status"
