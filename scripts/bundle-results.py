#!/usr/bin/env python3
"""Turn the output of one bundle run (bundle/run.sh) into a dated section of docs/results.md.

    python3 scripts/bundle-results.py OUTDIR [--results docs/results.md] [--command CMD]

OUTDIR holds what run.sh wrote to $OUT: gpu.txt (machine facts), summary.txt (the step
table), run.log (every step's output; the bundle's manifest head and the criterion results
are read from it). The section goes under "## GPU" in the results file, newest first; the
step table and every criterion result (median time and throughput) are copied, nothing else
is interpreted — what the numbers mean is written by hand below the generated section.
"""
import argparse
import datetime
import pathlib
import re
import sys


def facts(path):
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def steps(summary):
    """Rows of the step table, and its trailing lines (sections, mode, result)."""
    lines = summary.read_text().splitlines()
    rows, tail = [], []
    for line in lines[1:]:
        if not line.strip():
            continue
        if line.startswith(("sections ", "mode: ")):
            tail.append(line)
            continue
        cells = [c.strip() for c in line.split(" | ")]  # STEP SECTION STATUS SECONDS LIMIT
        if len(cells) == 5:
            rows.append(cells)
    return rows, tail


def benches(runlog):
    """(step, benchmark id, median time, median throughput) from criterion's output."""
    out, step, last_id = [], "", ""
    current = None
    for line in runlog.read_text(errors="replace").splitlines():
        m = re.match(r"^>>> (\S+)", line)
        if m:
            step = m.group(1)
            continue
        m = re.match(r"^(\S.*?)?\s*(time|thrpt):\s+\[(.+)\]", line)
        if m:
            ident, kind, values = m.groups()
            parts = values.split()
            median = " ".join(parts[2:4]) if len(parts) == 6 else values
            if kind == "time":
                current = [step, (ident or last_id).strip(), median, ""]
                out.append(current)
            elif current is not None:
                current[3] = median
            continue
        if line and not line[0].isspace() and not line.startswith(("<<<", "Benchmarking", "Found ", "Gnuplot")):
            last_id = line.strip()
    return out


def section(outdir, command, date):
    gpu = facts(outdir / "gpu.txt")
    rows, tail = steps(outdir / "summary.txt")
    log = outdir / "run.log"
    manifest = {}
    for line in log.read_text(errors="replace").splitlines()[:12]:
        key, sep, value = line.partition(":")
        if sep and key in ("built", "commit", "nvcc", "archs"):
            manifest[key] = value.strip()
    title = gpu.get("gpu", "unknown GPU")
    if "driver" in gpu:
        title += f", driver {gpu['driver']} (CUDA {gpu.get('driver cuda', '?')})"
    text = [f"## {date} — {title}", ""]
    text.append(
        f"Command: `{command}`; bundle from commit `{manifest.get('commit', '?')}` "
        f"(built {manifest.get('built', '?')}, nvcc {manifest.get('nvcc', '?')}, archs {manifest.get('archs', '?')})."
    )
    machine = ", ".join(f"{k} {gpu[k]}" for k in ("compute capability", "memory", "cpus", "host") if k in gpu)
    if machine:
        text.append(f"Machine: {machine}.")
    text += [f"Run: {line}" for line in tail if line.startswith("mode: ")]
    text += ["", "| step | section | status | seconds |", "|---|---|---|---|"]
    text += [f"| `{r[0]}` | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    found = benches(log)
    if found:
        text += ["", "| bench step | benchmark | time (median) | throughput (median) |", "|---|---|---|---|"]
        text += [f"| {s} | `{i}` | {t} | {p} |" for s, i, t, p in found]
    return "\n".join(text) + "\n"


def insert(results, new):
    """Put the section right under the "## GPU" heading's text, before older dated sections."""
    lines = results.read_text().splitlines(keepends=True)
    try:
        gpu = next(i for i, l in enumerate(lines) if l.strip() == "## GPU")
    except StopIteration:
        return "".join(lines).rstrip("\n") + "\n\n" + new
    at = next((i for i in range(gpu + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "".join(lines[:at]) + new + "\n" + "".join(lines[at:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=pathlib.Path)
    ap.add_argument("--results", type=pathlib.Path, default=pathlib.Path("docs/results.md"))
    ap.add_argument("--command", default='bash bundle/run.sh (device runner, carry ["bundle"])')
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    for name in ("gpu.txt", "summary.txt", "run.log"):
        if not (args.outdir / name).is_file():
            sys.exit(f"bundle-results: {args.outdir / name} is missing (is this the $OUT of a bundle run?)")
    new = section(args.outdir, args.command, args.date)
    args.results.write_text(insert(args.results, new))
    print(f"bundle-results: added a section to {args.results}:\n\n{new}")


if __name__ == "__main__":
    main()
