#!/usr/bin/env python3
"""sass_tensor_cores.py — the static targets of the tensor-core linear attention, read from the
SASS and resource report (cuobjdump -sass, -res-usage) that check-resources.sh leaves in DIR (docs/linear_attention.md,
"Tensor cores"):

  * every f16/bf16 instance of `la_product_kernel` issues tensor-core instructions (HMMA), the
    decayed ones of gated linear attention included, and so does every instance of FAVOR+'s
    projections on tensor cores (`favor_forward_tc_kernel`, `favor_backward_tc_kernel` in
    feature_maps.cu);
  * registers: at most 128 (two 256-thread blocks per SM) for every instance, f32 included.

    scripts/sass_tensor_cores.py DIR [--arch 90]   # DIR: {linear_attention,feature_maps}.sm_<arch>.{sass,res}

Exit status 1 when an instance misses a gate or is missing.
"""
import argparse
import os
import re
import sys

MODES = {0: "walk (kAccumulate)", 1: "per-chunk outputs (kReadChunk)", 2: "bidirectional (kBidir)",
         3: "chunk sums (kChunkSum)", 4: "state walk (kStateWalk)"}
TYPES = {"6__half": "f16", "13__nv_bfloat16": "bf16", "f": "f32"}
# operands whose tiles have a lo half (LoTiles in kernels/linear_attention.cu)
LO = {0: "none", 1: "c", 2: "b", 4: "a", 7: "all"}
MASKS = {0: "", 1: " LE", 2: " GE"}  # the direction (Mask)
# f32, f16: walk, per-chunk outputs and state walk x 2 directions + chunk sums + bidirectional;
# bf16: the lo patterns each of those meets (lo_used in the kernel): 2 + 3 + 2 + 3 + 1 + 3 + 3
# + 4; and per dtype the normalising instances of the forward (norm_used): walk LE, per-chunk
# outputs LE, chunk sums, state walk LE, bidirectional
UNGATED = 8 + 8 + 21 + 3 * 5
# decayed (gated linear attention, decay_used): no bidirectional, chunk sums per direction, only
# LE normalises. f32, f16: 4 modes x 2 directions + 4 normalising LE; bf16: the lo patterns
# (walk 2 + 3, per-chunk outputs 2 + 3, state walk 1 + 3, chunk sums 3 + 3) + 4 normalising
DECAYED = 12 + 12 + 20 + 4
EXPECTED = UNGATED + DECAYED
# FAVOR+: forward per dtype (f16, bf16) x stabiliser (4), backward per dtype
FAVOR_EXPECTED = 8 + 2
STABILIZERS = {0: "none", 1: "row max", 2: "bound", 3: "sequence max"}
MAX_REGS = 128


def instance(mangled):
    """(dtype, mode, mask, lo tiles, normalising, decayed) of a la_product_kernel instance, or None."""
    m = re.match(r"_ZN17mesa_cuda_kernels17la_product_kernelI(6__half|13__nv_bfloat16|f)Li(\d)ELi(\d)ELi(\d)ELb([01])ELb([01])EEEvNS_7ProductE$",
                 mangled)
    if not m:
        return None
    return (TYPES[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5) == "1",
            m.group(6) == "1")


def favor_instance(mangled):
    """Label of a FAVOR+ tensor-core instance, or None."""
    m = re.match(r"_ZN17mesa_cuda_kernels23favor_forward_tc_kernelI(6__half|13__nv_bfloat16)Li(\d)EEEv", mangled)
    if m:
        return f"favor_forward_tc_kernel<{TYPES[m.group(1)]}>, stabiliser {STABILIZERS[int(m.group(2))]}"
    m = re.match(r"_ZN17mesa_cuda_kernels24favor_backward_tc_kernelI(6__half|13__nv_bfloat16)EEv", mangled)
    if m:
        return f"favor_backward_tc_kernel<{TYPES[m.group(1)]}>"
    return None


def hmma_counts(sass):
    counts, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            counts[cur] = 0
        elif cur is not None and re.search(r"\bHMMA\.", line):
            counts[cur] += 1
    return counts


def registers(res):
    regs, cur = {}, None
    for line in res.splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            cur = m.group(1)
        m = re.search(r"\bREG:(\d+)", line)
        if m and cur is not None:
            regs[cur] = int(m.group(1))
            cur = None
    return regs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--present", action="store_true",
                    help="check only the files whose SASS is in the directory (scripts/check-fast.sh)")
    args = ap.parse_args()
    hmma, regs = {}, {}
    stems = [s for s in ("linear_attention", "feature_maps")
             if not args.present or os.path.exists(os.path.join(args.dir, f"{s}.sm_{args.arch}.sass"))]
    if not stems:
        print("tensor cores: no linear-attention or FAVOR+ SASS in this subset")
        return 0
    for stem in stems:
        base = os.path.join(args.dir, f"{stem}.sm_{args.arch}")
        try:
            hmma.update(hmma_counts(open(base + ".sass").read()))
            regs.update(registers(open(base + ".res").read()))
        except OSError as e:
            print(f"FAIL: tensor cores: {e}")
            return 1
    fails, seen, decayed, favor_seen = [], 0, 0, 0
    for name in sorted(regs):
        inst, favor = instance(name), favor_instance(name)
        if inst is not None:
            seen += 1
            t, mode, mask, lo, norm, decay = inst
            decayed += decay
            label = (f"la_product_kernel<{t}>, {MODES[mode]}{MASKS[mask]}" + (f", lo {LO[lo]}" if t != "f32" else "")
                     + (", normalising" if norm else "") + (", decayed" if decay else ""))
        elif favor is not None:
            favor_seen += 1
            t, label = "f16/bf16", favor
        else:
            continue
        n, r = hmma.get(name, 0), regs[name]
        verdict = []
        if n == 0 and t != "f32":
            fails.append(label + ": no HMMA")
            verdict.append("NO tensor-core instruction")
        if r > MAX_REGS:
            fails.append(f"{label}: {r} registers")
            verdict.append(f"OVER {MAX_REGS} registers")
        print(f"tensor cores  {label:<66} HMMA {n:4d}  registers {r:3d}  {'; '.join(verdict) or 'meets target'}")
    if "linear_attention" in stems and seen != EXPECTED:
        fails.append(f"{seen} instances of la_product_kernel found, {EXPECTED} expected")
    if "feature_maps" in stems and favor_seen != FAVOR_EXPECTED:
        fails.append(f"{favor_seen} FAVOR+ tensor-core instances found, {FAVOR_EXPECTED} expected")
    if "linear_attention" in stems and decayed != DECAYED:
        fails.append(f"{decayed} decayed instances of la_product_kernel found, {DECAYED} expected")
    if fails:
        print("FAIL: tensor cores: " + "; ".join(fails))
        return 1
    print(f"OK: {seen} linear-attention ({decayed} decayed: gated) and {favor_seen} FAVOR+ instances within "
          f"{MAX_REGS} registers, the f16/bf16 ones issue HMMA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
