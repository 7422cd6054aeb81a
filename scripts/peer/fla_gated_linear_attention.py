#!/usr/bin/env python3
"""fla_gated_linear_attention.py — the GPU bundle's comparison of our gated linear attention
(issue 41) with flash-linear-attention's `chunk_simple_gla` (fla-core 0.6.0, carried as its
wheel beside this script), on the same shapes, math and input distributions
(docs/linear_attention.md, "Gated linear attention: comparison with fla-core").

Shapes: B = 8, H = 32 (as many KV heads), M = D = 128, T in {4K, 8K, 16K}, bf16; a log-decay
per step and head (fla's `g`, f32 [B, T, H]; ours `a`, f32 [B, H_kv, T]) uniform in
[-0.2, -0.001]; q, k, v uniform in [-1, 1]; not normalised; scale 1 (fla's default would be
1/sqrt(K); ours has none); no initial or final state. fla takes [B, T, H, K], ours [B, H, T, K]
(both contiguous). The math is the same: S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = q_t^T S_t.
fla's Triton compilation and autotuning are excluded by three warm-up calls; each timing is a
CUDA-event mean over 10 calls. Our side is the criterion bench of the same shapes
(`MESA_BENCH_DIR/gated_linear_attention`, short times, one run for every shape fla reached).
Prints one line per shape and kind with both times and fla / ours (> 1: ours is faster), against
issue 41's target (forward + backward >= 1.2x; the forward has no target and is printed beside).

    MESA_BENCH_DIR=DIR python3 fla_gated_linear_attention.py [--deadline-s 70]

Without torch or a GPU (the bundle's dry run) it checks that the wheel unpacks and holds
`chunk_simple_gla`, and that the bench binary is there, says it skipped, and exits 0.
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
B, H, D = 8, 32, 128
LENGTHS = (4096, 8192, 16384)
TARGETS = {"fwd_bwd": 1.2}


def unpack_fla():
    """Unpacks the fla-core wheel (pure Python: unpacking is installing) and returns its path."""
    wheels = sorted(glob.glob(os.path.join(HERE, "fla_core-*.whl")))
    if len(wheels) != 1:
        raise SystemExit(f"fla-gla: expected one fla_core wheel beside this script, found {wheels}")
    site = tempfile.mkdtemp(prefix="fla-gla-site-")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(site)
    chunk = os.path.join(site, "fla", "ops", "simple_gla", "chunk.py")
    if not os.path.exists(chunk) or "def chunk_simple_gla(" not in open(chunk).read():
        raise SystemExit(f"fla-gla: {wheels[0]} has no fla/ops/simple_gla/chunk.py with chunk_simple_gla")
    sys.path.insert(0, site)
    return wheels[0]


def ours(bench, lengths, timeout):
    """{case name: mean seconds} of our bench's forward and forward + backward at `lengths`."""
    # the boundary-state cases (fwd_…, fwd_bwd_…), not the SLiM ones (slim_…)
    pattern = "/fwd(_bwd)?_T(" + "|".join(str(t) for t in lengths) + f")_D{D}$"
    out = subprocess.run(
        [bench, "--bench", "--noplot", "--warm-up-time", "0.3", "--measurement-time", "0.7", "--sample-size", "10",
         pattern],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, MESA_REQUIRE_GPU="1", CRITERION_HOME=tempfile.mkdtemp(prefix="fla-gla-criterion-")))
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
    want = {f"{kind}_T{t}_D{D}" for t in lengths for kind in ("fwd", "fwd_bwd")}
    if not want <= set(found):
        raise RuntimeError(f"expected the cases {sorted(want)} in the bench output, found {sorted(found)}")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deadline-s", type=float, default=70.0, help="start no fla shape after this")
    args = ap.parse_args()
    start = time.monotonic()
    wheel = unpack_fla()
    bench = os.path.join(os.environ.get("MESA_BENCH_DIR", ""), "gated_linear_attention")
    if not os.access(bench, os.X_OK):
        raise SystemExit(f"fla-gla: no bench executable {bench} (MESA_BENCH_DIR)")
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no CUDA device")
    except ImportError as e:
        print(f"fla-gla: SKIPPED ({e}); wheel {os.path.basename(wheel)} and {bench} checked")
        return 0
    from fla.ops.simple_gla import chunk_simple_gla

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

    print(f"fla-gla: {os.path.basename(wheel)}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    fla, reached, failed = {}, [], 0
    for t in LENGTHS:
        if time.monotonic() - start > args.deadline_s:
            print(f"fla-gla: T={t}: not run (past the {args.deadline_s:.0f} s deadline)")
            continue
        gen = torch.Generator(device="cuda").manual_seed(t)
        uni = lambda lo, hi, *shape: lo + (hi - lo) * torch.rand(*shape, device="cuda", generator=gen)
        q, k, v, do = (uni(-1.0, 1.0, B, t, H, D).to(torch.bfloat16) for _ in range(4))
        g = uni(-0.2, -0.001, B, t, H)  # f32, as ours
        for x in (q, k, v, g):
            x.requires_grad_(True)

        def fwd():
            with torch.no_grad():
                chunk_simple_gla(q, k, v, g=g, scale=1.0)

        def fwd_bwd():
            for x in (q, k, v, g):
                x.grad = None
            o, _ = chunk_simple_gla(q, k, v, g=g, scale=1.0)
            o.backward(do)

        reached.append(t)
        try:
            fla[t] = {"fwd": timed(fwd), "fwd_bwd": timed(fwd_bwd)}
        except Exception as e:  # a Triton or CUDA error of fla's: our side is still timed
            print(f"fla-gla: T={t}: chunk_simple_gla failed: {type(e).__name__}: {str(e)[:300]}")
            failed = 1
        del q, k, v, g, do
        torch.cuda.empty_cache()  # our bench runs next, in another process on the same GPU
    if not reached:
        return 1
    try:
        # what is left of the step's 115 s, and at least a minute
        mine = ours(bench, reached, timeout=max(60.0, 110.0 - (time.monotonic() - start)))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"fla-gla: our bench failed: {e}")
        return 1
    for t in reached:
        for kind in ("fwd", "fwd_bwd"):
            m = mine[f"{kind}_T{t}_D{D}"]
            if t not in fla:
                print(f"fla-gla: B={B} H={H} T={t} D={D} {kind:<7} ours {m * 1e3:8.3f} ms (no fla time)")
                continue
            ratio = fla[t][kind] / m
            if kind in TARGETS:
                verdict = f"{'meets' if ratio >= TARGETS[kind] else 'does NOT meet'} the {TARGETS[kind]}x target"
            else:
                verdict = "no target"
            print(f"fla-gla: B={B} H={H} T={t} D={D} {kind:<7} chunk_simple_gla {fla[t][kind] * 1e3:8.3f} ms  "
                  f"ours {m * 1e3:8.3f} ms  ratio {ratio:5.2f}x ({verdict})")
    return failed


if __name__ == "__main__":
    sys.exit(main())
