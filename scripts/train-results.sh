#!/usr/bin/env bash
# Regenerates the training results from one run of train_shakespeare's CPU configuration:
# the section of docs/results.md between the markers "train_shakespeare: begin/end", the
# committed JSON docs/figures/train_shakespeare_cpu.json and the three figures beside it.
# Run it on an idle machine (the section states the machine and the wall time; the CPU
# configuration's aim is 20 minutes on 2 cores).
#
#   scripts/train-results.sh            # OUT=target/train-cpu by default
#
# TRAIN_ARGS (e.g. "--steps 2") is appended to the command, to try the script quickly; the
# committed section is made without it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/train-cpu}
cargo build --release -p mesa-candle --example train_shakespeare
rm -rf "$OUT"
mkdir -p "$OUT"
ARGS=(--config cpu --out "$OUT" ${TRAIN_ARGS:-})
CMD="cargo run --release -p mesa-candle --example train_shakespeare -- ${ARGS[*]}"
date=$(date -u '+%Y-%m-%d %H:%M UTC')
t0=$SECONDS
target/release/examples/train_shakespeare "${ARGS[@]}" >"$OUT/stdout.md"
wall=$((SECONDS - t0))
for f in loss.svg grad_parity.svg running_estimate.svg; do cp "$OUT/$f" docs/figures/$f; done
cp "$OUT/results.json" docs/figures/train_shakespeare_cpu.json
machine="$(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)), no GPU, commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo ' with uncommitted changes')"
python3 - "$OUT/results.md" docs/results.md "$date" "$machine" "$CMD" "$wall" <<'PY'
import sys
section, results, date, machine, cmd, wall = sys.argv[1:]
begin = "<!-- train_shakespeare: begin (scripts/train-results.sh writes this section) -->"
end = "<!-- train_shakespeare: end -->"
body = open(section).read().rstrip()
text = open(results).read()
if begin not in text or end not in text:
    sys.exit(f"{results}: the markers are missing")
head, rest = text.split(begin, 1)
_, tail = rest.split(end, 1)
new = (f"{begin}\n## {date} — training on real text (`--config cpu`)\n\n"
       f"`{cmd}` on {machine}: {int(wall)} s wall ({int(wall) / 60:.1f} min) for the whole command, "
       "emulator checks off. Figures and JSON: `docs/figures/` (`loss.svg`, `grad_parity.svg`, "
       "`running_estimate.svg`, `train_shakespeare_cpu.json`). How the bytes are counted and "
       "what the planner models: `docs/plan.md`.\n\n"
       f"{body}\n\n![loss curves](figures/loss.svg)\n\n![gradient parity](figures/grad_parity.svg)\n\n"
       f"![running estimate](figures/running_estimate.svg)\n{end}")
open(results, "w").write(head + new + tail)
print(f"{results}: section replaced ({len(body)} characters)")
PY
python3 scripts/train-json-shape.py docs/figures/train_shakespeare_cpu.json "$OUT/results.json" >/dev/null
echo "done in ${wall}s; review docs/results.md and commit docs/results.md docs/figures/"
