#!/usr/bin/env bash
# Regenerates the training results from one run of train_shakespeare's CPU configuration:
# the section of docs/results.md between the markers "train_shakespeare: begin/end", the
# committed JSON docs/figures/train_shakespeare_cpu.json and the three figures beside it.
# Run it on an idle machine (the section states the machine and the wall time); the default
# set takes about an hour on 2 cores.
#
#   scripts/train-results.sh            # OUT=target/train-cpu by default
#
# TRAIN_ARGS (e.g. "--steps 2") is appended to the command, to try the script quickly; the
# committed section is made without it (and git shows what a try overwrote).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/train-cpu}
BEGIN="<!-- train_shakespeare: begin (scripts/train-results.sh writes this section) -->"
END="<!-- train_shakespeare: end -->"
# before an hour of training: the section must be there to be replaced
grep -qF "$BEGIN" docs/results.md && grep -qF "$END" docs/results.md ||
  { echo "docs/results.md: the markers are missing ($BEGIN … $END)"; exit 1; }
cargo build --release -p mesa-candle --example train_shakespeare
rm -rf "$OUT"
mkdir -p "$OUT"
ARGS=(--config cpu --out "$OUT" ${TRAIN_ARGS:-})
CMD="cargo run --release -p mesa-candle --example train_shakespeare -- ${ARGS[*]}"
commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates kernels build.rs src || echo ' with uncommitted changes')"
date=$(date -u '+%Y-%m-%d %H:%M UTC')
t0=$SECONDS
# the emulator's checks off, as in the timings the section reports
env -u MESA_EMU_CHECK -u MESA_EMU_SEED target/release/examples/train_shakespeare "${ARGS[@]}" >"$OUT/stdout.md"
wall=$((SECONDS - t0))
for f in loss.svg grad_parity.svg running_estimate.svg results.json results.md; do
  test -s "$OUT/$f" || { echo "$OUT/$f is missing (TRAIN_ARGS without runs a and c leave out a figure)"; exit 1; }
done
for f in loss.svg grad_parity.svg running_estimate.svg; do cp "$OUT/$f" "docs/figures/$f"; done
cp "$OUT/results.json" docs/figures/train_shakespeare_cpu.json
machine="$(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)), no GPU, commit $commit"
python3 - "$OUT/results.md" docs/results.md "$date" "$machine" "$CMD" "$wall" "$BEGIN" "$END" <<'PY'
import sys
section, results, date, machine, cmd, wall, begin, end = sys.argv[1:]
body = open(section).read().rstrip()
text = open(results).read()
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
echo "done in ${wall}s; review docs/results.md and commit docs/results.md docs/figures/"
