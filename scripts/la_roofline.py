#!/usr/bin/env python3
"""la_roofline.py — the roofline of the tensor-core linear attention (kernels/linear_attention.cu)
at the bench's shapes, on an H200: the MMA work the kernels issue and the HBM bytes they must
move, each over its ceiling (docs/linear_attention.md, "Roofline"). Arithmetic only: nothing is
measured.

Work, per token and (b, h), for one product of width `ma` (a, b) and `dc` (c), chunk C = 64,
D-tiles of 32 columns, features padded to tiles of 32, bf16 inputs; a product of two bf16 pairs
is 1 + (one per operand with a lo tile) MMAs: the f32 tiles (the state S, P) always have one, a
bf16 operand only when its values are f32 (lo_mask in the kernel: dq's a, dk's b, dv's c when
normalised):
  per-chunk outputs  2 * (n*vis*C*ma*(1+a+b) + ndt*(32*ma*(2+a) + vis*C*32*(2+c)))  (P, A S, mask(P) C)
  chunk sums         ndt * 2 * 32*ma*(1+b+c)                                         (U = B^T C)
with ndt = ceil(dc/32), n = min(GROUPS, ndt) the times P is computed (once per block, for a
group of D-tiles: value_group in the kernel; at these shapes the policy gives one group, since
B*H*T/C >= 4096 work items fill an H200 four times already), vis = 10/16 (the share of P's
16x16 blocks a causal mask keeps) and a, b, c = 1 for an operand with a lo tile, else 0.
Bytes, per token and (b, h), reading every operand once from HBM (the re-reads per D-tile are
assumed to hit L2) and the f32 states of the decomposition (U written, the scan reading and
writing it, the outputs reading it): 16 * ma * dc / C per decomposed product, 4 * ma * dc / C
for dq's reads of the forward's states.

Schedules (--schedules): the HBM floor of the same passes when the f32 states move less:
`16` bytes per state element and chunk as above (the decomposition), `8` when one sequential
walk per (b, h, D-tile) writes the state entering each chunk and the outputs read it (no chunk
sums, no scan), `4` when that walk also computes the outputs (SLiM's walk writing the states
the backward's dq reads; dk's and dv's walks then write none: 0 for them).

    python3 scripts/la_roofline.py               # prints the markdown table
    python3 scripts/la_roofline.py --schedules   # the HBM floor per schedule at T = 16K
"""
import sys
import math

MMA_FLOPS = 790e12   # dense bf16 tensor-core rate of an H200 (KINDS.md: 769-798 measured through PyTorch)
HBM_BYTES = 4.3e12   # device-to-device copy, counting bytes read and written
C, TILE, VIS = 64, 32, 10 / 16
GROUPS = 1           # D-tile groups of the per-chunk outputs (value_group: B*H*T/C items >= 4 * 2 * 132)


def pad(n):
    return TILE * math.ceil(n / TILE)


def outputs(ma, dc, lo=""):
    a, b, c = ("a" in lo), ("b" in lo), ("c" in lo)
    ndt = math.ceil(dc / TILE)
    return 2 * (min(GROUPS, ndt) * VIS * C * pad(ma) * (1 + a + b)
                + ndt * (TILE * pad(ma) * (2 + a) + VIS * C * TILE * (2 + c)))


def chunk_sums(ma, dc, lo=""):
    b, c = ("b" in lo), ("c" in lo)
    return math.ceil(dc / TILE) * 2 * TILE * pad(ma) * (1 + b + c)


def forward(m, d, state=16):
    # the normaliser is a column of the output product (its denominators and z's chunk sums
    # are scalar work beside the MMAs, left out)
    w = d + 1
    flops = outputs(m, d) + chunk_sums(m, d)
    by = 2 * (2 * m + d) + 2 * d + 4 + state * m * w / C
    return flops, by


def backward(m, d, state=16):
    w = d + 1
    # dq: a = dO' (lo); dk: b = dO' (lo); dv: c = dout / den (lo)
    flops = (outputs(w, m, "a") + (outputs(w, m, "b") + chunk_sums(w, m, "b"))
             + (outputs(m, d, "c") + chunk_sums(m, d, "c")))
    by = 2 * (2 * m + 3 * d) + 4 + 2 * (2 * m + d) + 4 * m * w / C + state * w * m / C + state * m * d / C
    return flops, by


def schedules():
    print("| M = D | state bytes per element and chunk | forward HBM ms | forward + backward HBM ms |")
    print("|---:|---|---:|---:|")
    rows = 4 * 16 * 16384
    for d in (64, 128):
        for state, name in ((16, "16 (decomposition: chunk sums, scan, outputs)"),
                            (8, "8 (state walk, parallel outputs)"),
                            (4, "4 forward, 0 dk and dv (one walk, outputs too)")):
            fwd, bwd = forward(d, d, state)[1], backward(d, d, state if state > 4 else 0)[1]
            print(f"| {d} | {name} | {rows * fwd / HBM_BYTES * 1e3:.2f} | {rows * (fwd + bwd) / HBM_BYTES * 1e3:.2f} |")


def main():
    print("| T | M = D | pass | MMA GFLOP | MMA ms | HBM GB | HBM ms | bound |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    for d in (64, 128):
        for t in (4096, 8192, 16384):
            rows = 4 * 16 * t
            f_fwd, b_fwd = forward(d, d)
            f_bwd, b_bwd = backward(d, d)
            for name, f, by in (("forward", f_fwd, b_fwd), ("forward + backward", f_fwd + f_bwd, b_fwd + b_bwd)):
                ms_f, ms_b = rows * f / MMA_FLOPS * 1e3, rows * by / HBM_BYTES * 1e3
                print(f"| {t // 1024}K | {d} | {name} | {rows * f / 1e9:.0f} | {ms_f:.2f} | {rows * by / 1e9:.2f} "
                      f"| {ms_b:.2f} | {'memory' if ms_b > ms_f else 'tensor cores'} |")


if __name__ == "__main__":
    schedules() if "--schedules" in sys.argv[1:] else main()
