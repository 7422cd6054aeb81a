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

    python3 scripts/la_roofline.py      # prints the markdown table
"""
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


def forward(m, d):
    # the normaliser is a column of the output product (its denominators and z's chunk sums
    # are scalar work beside the MMAs, left out)
    w = d + 1
    flops = outputs(m, d) + chunk_sums(m, d)
    by = 2 * (2 * m + d) + 2 * d + 4 + 16 * m * w / C
    return flops, by


def backward(m, d):
    w = d + 1
    # dq: a = dO' (lo); dk: b = dO' (lo); dv: c = dout / den (lo)
    flops = (outputs(w, m, "a") + (outputs(w, m, "b") + chunk_sums(w, m, "b"))
             + (outputs(m, d, "c") + chunk_sums(m, d, "c")))
    by = 2 * (2 * m + 3 * d) + 4 + 2 * (2 * m + d) + 4 * m * w / C + 16 * w * m / C + 16 * m * d / C
    return flops, by


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
    main()
