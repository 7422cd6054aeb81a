#!/usr/bin/env python3
"""fla_linear_attention.py — the GPU bundle's comparison of our chunked linear attention with
flash-linear-attention's `chunk_linear_attn` (fla-core 0.6, carried as its wheel beside this
script), on the same inputs and math (docs/linear_attention.md, "Comparison with fla-core").

Shapes: B = 4, H = 16, T in {8K, 4K, 16K}, M = D in {128, 64}, bf16, causal, normalised,
scale 1 (the feature map applied beforehand: q, k uniform in [0.05, 1], v in [-1, 1], as
benches/linear_attention.rs). fla takes [B, T, H, K]; ours [B, H, T, K] (both contiguous).
fla's Triton compilation and autotuning are excluded by warm-up; each shape's two timings
are CUDA-event means over at least 10 calls. Our side is the criterion bench of the same shape,
run here with short times (`MESA_BENCH_DIR/linear_attention`, boundary-states mode: the
default). Prints one line per shape with both times and the ratio fla / ours (> 1: ours is
faster), against issue 13's targets (forward 1.5x, forward + backward 1.2x), and beside them
our times with the state-walk and walk schedules and in SLiM mode (the schedule the policy
should pick).

    MESA_BENCH_DIR=DIR python3 fla_linear_attention.py [--deadline-s 100]

Without torch or a GPU (the bundle's dry run) it checks that the wheel unpacks and holds
`chunk_linear_attn`, and that the bench binary is there, says it skipped, and exits 0.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [(4, 16, t, d) for d in (128, 64) for t in (8192, 4096, 16384)]
TARGETS = {"fwd": 1.5, "fwd_bwd": 1.2}


def unpack_fla():
    """Unpacks the fla-core wheel (pure Python: unpacking is installing) and returns its path."""
    wheels = sorted(glob.glob(os.path.join(HERE, "fla_core-*.whl")))
    if len(wheels) != 1:
        raise SystemExit(f"fla: expected one fla_core wheel beside this script, found {wheels}")
    site = tempfile.mkdtemp(prefix="fla-site-")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(site)
    chunk = os.path.join(site, "fla", "ops", "linear_attn", "chunk.py")
    if not os.path.exists(chunk) or "def chunk_linear_attn(" not in open(chunk).read():
        raise SystemExit(f"fla: {wheels[0]} has no fla/ops/linear_attn/chunk.py with chunk_linear_attn")
    sys.path.insert(0, site)
    return wheels[0]


def ours(bench, t, d):
    """{name: median seconds} of our bench's eight cases of T, D (criterion, short times)."""
    out = subprocess.run(
        [bench, "--bench", "--noplot", "--warm-up-time", "0.3", "--measurement-time", "0.7", "--sample-size", "10",
         f"_T{t}_D{d}"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, MESA_REQUIRE_GPU="1", CRITERION_HOME=tempfile.mkdtemp(prefix="fla-criterion-")))
    if out.returncode != 0:
        raise RuntimeError(f"{bench} exited {out.returncode}: {out.stderr[-400:]}")
    units = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    found, ident = {}, None
    for line in out.stdout.splitlines():
        m = re.match(r"^(\S.*?)?\s*time:\s+\[(\S+) (\S+) (\S+) (\S+) (\S+) (\S+)\]", line)
        if m:
            ident = (m.group(1) or ident or "").strip()
            found[ident.rsplit("/", 1)[-1]] = float(m.group(4)) * units[m.group(5)]
        elif line and not line[0].isspace():
            ident = line.strip()
    if len(found) != 8:
        raise RuntimeError(f"expected 8 cases of T={t} D={d} in the bench output, found {sorted(found)}")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deadline-s", type=float, default=100.0, help="start no shape after this")
    args = ap.parse_args()
    start = time.monotonic()
    wheel = unpack_fla()
    bench = os.path.join(os.environ.get("MESA_BENCH_DIR", ""), "linear_attention")
    if not os.access(bench, os.X_OK):
        raise SystemExit(f"fla: no bench executable {bench} (MESA_BENCH_DIR)")
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no CUDA device")
    except ImportError as e:
        print(f"fla: SKIPPED ({e}); wheel {os.path.basename(wheel)} and {bench} checked")
        return 0
    from fla.ops.linear_attn import chunk_linear_attn

    def timed(fn, iters=10):
        fn()
        fn()
        fn()  # compile, autotune, warm
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / iters * 1e-3

    print(f"fla: {os.path.basename(wheel)}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    failed = 0
    for b, h, t, d in SHAPES:
        if time.monotonic() - start > args.deadline_s:
            print(f"fla: T={t} D={d}: not run (past the {args.deadline_s:.0f} s deadline)")
            continue
        gen = torch.Generator(device="cuda").manual_seed(t + d)
        uni = lambda lo, hi: (lo + (hi - lo) * torch.rand(b, t, h, d, device="cuda", generator=gen)).to(torch.bfloat16)
        q, k, v, do = uni(0.05, 1.0), uni(0.05, 1.0), uni(-1.0, 1.0), uni(-1.0, 1.0)
        for x in (q, k, v):
            x.requires_grad_(True)

        def fwd():
            with torch.no_grad():
                chunk_linear_attn(q, k, v, scale=1.0, normalize=True)

        def fwd_bwd():
            for x in (q, k, v):
                x.grad = None
            o, _ = chunk_linear_attn(q, k, v, scale=1.0, normalize=True)
            o.backward(do)

        fla = {"fwd": timed(fwd), "fwd_bwd": timed(fwd_bwd)}
        try:
            mine = ours(bench, t, d)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"fla: T={t} D={d}: our bench failed: {e}")
            failed = 1
            continue
        for kind in ("fwd", "fwd_bwd"):
            m = mine[f"{kind}_boundary_T{t}_D{d}"]
            ratio = fla[kind] / m
            verdict = "meets" if ratio >= TARGETS[kind] else "does NOT meet"
            print(f"fla: B={b} H={h} T={t} D={d} {kind:<7} fla {fla[kind] * 1e3:8.3f} ms  ours {m * 1e3:8.3f} ms  "
                  f"ratio {ratio:5.2f}x ({verdict} the {TARGETS[kind]}x target; ours state walk "
                  f"{mine[f'{kind}_statewalk_T{t}_D{d}'] * 1e3:.3f} ms, walk {mine[f'{kind}_walk_T{t}_D{d}'] * 1e3:.3f} ms, "
                  f"slim {mine[f'{kind}_slim_T{t}_D{d}'] * 1e3:.3f} ms)")
    return failed


if __name__ == "__main__":
    sys.exit(main())
