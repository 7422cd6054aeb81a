#!/usr/bin/env bash
# check-fast.sh — the daily loop, at most 5 minutes after a warm build (docs/ci.md says when the
# full `.ci/run` is needed instead): fmt, clippy, the tests of the crates a change touches with
# the emulator's checks on, and the SASS budget of the changed kernels.
#
#   scripts/check-fast.sh            # changes against the upstream branch (else: uncommitted ones)
#   scripts/check-fast.sh --all      # every crate's tests and every kernel's SASS
#   MESA_FAST_BASE=HEAD~3 scripts/check-fast.sh   # changes since a revision
#
# What a change touches (paths against the base, committed or not, and untracked files):
#   kernels/, build.rs, src/, Cargo.toml, Cargo.lock  -> every crate (all of them link the kernels)
#   crates/mesa-kernels/                              -> it, the root tests (tests/), mesa-candle
#   tests/, benches/, examples/, fixtures/            -> the root package's tests
#   crates/mesa-candle/                               -> mesa-candle
#   crates/mesa-burn/                                 -> mesa-burn (its own workspace)
#   README.md                                         -> mesa-kernels (its doctest)
# The tests run as the README's command does (cargo-nextest, release, the whole workspace
# built, the touched packages' tests run), on the emulator only (MESA_CUDA_DISABLE=1: no nvcc
# build in the loop). The SASS step compiles just the changed kernels/*.cu (a changed header:
# all of them) for sm_90 with scripts/check-resources.sh and counts their budget lines; it is
# skipped, and says so, where no nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-auto}
export MESA_KERNELS_BUILD_CACHE=${MESA_KERNELS_BUILD_CACHE:-$PWD/target/kernel-cache}
t_start=$SECONDS
phase() { printf '\n==== %s ==== (%ds)\n' "$*" "$((SECONDS - t_start))"; }

all=0
[[ "${1:-}" == "--all" ]] && all=1

# ---- what changed -------------------------------------------------------------------------
base=${MESA_FAST_BASE:-$(git rev-parse --abbrev-ref --symbolic-full-name '@{upstream}' 2>/dev/null || echo HEAD)}
git rev-parse --verify -q "$base^{commit}" >/dev/null || { echo "check-fast: no revision $base (MESA_FAST_BASE)" >&2; exit 2; }
# renames as delete + add (a file moved out of a crate still touches it), names unquoted
diff_names=$(git -c core.quotePath=false diff --name-only --no-renames "$base" --)
changed=$( { echo "$diff_names"; git -c core.quotePath=false ls-files --others --exclude-standard; } | sed '/^$/d' | sort -u)
root=0 candle=0 safe=0 burn=0
cu=()
while IFS= read -r f; do
  [[ -z "$f" ]] && continue
  case "$f" in
    kernels/*|build.rs|src/*|Cargo.toml|Cargo.lock) root=1; safe=1; candle=1 ;;
    crates/mesa-kernels/*) root=1; safe=1; candle=1 ;;
    README.md) safe=1 ;;  # the safe crate's docs include it: its example is a doctest
    tests/*|benches/*|examples/*|fixtures/*) root=1 ;;
    crates/mesa-candle/*) candle=1 ;;
    crates/mesa-burn/*) burn=1 ;;
  esac
  case "$f" in
    kernels/*.cu) [[ -f "$f" && "$f" != kernels/*/* ]] && cu+=("$f") ;;
    kernels/*.cuh|kernels/include/*.h) cu=(kernels/*.cu) ;;
  esac
done <<<"$changed"
if (( all )); then root=1 safe=1 candle=1 burn=1; cu=(kernels/*.cu); fi
echo "check-fast: changes against $base: $(grep -c . <<<"$changed" || true) paths"

phase "cargo fmt --check"
cargo fmt --all -- --check

phase "cargo clippy (warnings are errors; emulation only)"
MESA_CUDA_DISABLE=1 cargo clippy --workspace --all-targets -- -D warnings

# ---- tests --------------------------------------------------------------------------------
filters=()
(( root )) && filters+=("package(mesa-kernels-sys)")
(( safe )) && filters+=("package(mesa-kernels)")
(( candle )) && filters+=("package(mesa-candle)")
if (( ${#filters[@]} == 0 )); then
  phase "tests: no crate touched (docs or scripts only); --all runs them all"
else
  expr=$(IFS='|'; echo "${filters[*]}")
  phase "tests of the touched crates: $expr (emulator, every check on)"
  MESA_CUDA_DISABLE=1 cargo nextest run --workspace --release -E "$expr"
  if (( safe )); then
    MESA_CUDA_DISABLE=1 cargo test --workspace --release --doc
  fi
fi

# mesa-burn: its own workspace and lock (docs/burn.md); only when it changed (or --all): its
# first build compiles burn (about 4 minutes on 2 cores), later ones take seconds
if (( burn )); then
  phase "mesa-burn: fmt, clippy, tests (its own workspace)"
  cargo fmt --manifest-path crates/mesa-burn/Cargo.toml -- --check
  MESA_CUDA_DISABLE=1 cargo clippy --release --locked --all-targets --manifest-path crates/mesa-burn/Cargo.toml -- -D warnings
  MESA_CUDA_DISABLE=1 NEXTEST_PROFILE=default cargo nextest run --release --locked --manifest-path crates/mesa-burn/Cargo.toml
fi

# ---- SASS ---------------------------------------------------------------------------------
if (( ${#cu[@]} == 0 )); then
  phase "SASS budget: no kernel changed"
else
  mapfile -t cu < <(printf '%s\n' "${cu[@]}" | sort -u)
  nvcc=${NVCC:-}
  [[ -z "$nvcc" && -n "${CUDA_HOME:-}" ]] && nvcc=$CUDA_HOME/bin/nvcc
  [[ -z "$nvcc" && -n "${CUDA_PATH:-}" ]] && nvcc=$CUDA_PATH/bin/nvcc
  if [[ -z "$nvcc" && -x target/ci-venv/bin/python ]]; then
    # the pinned wheels .ci/run installs
    home=$(target/ci-venv/bin/python -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)
    [[ -n "$home" && -x "$home/bin/nvcc" ]] && nvcc=$home/bin/nvcc
  fi
  [[ -z "$nvcc" ]] && nvcc=$(command -v nvcc || true)
  if [[ -z "$nvcc" || ! -x "$nvcc" ]]; then
    phase "SASS budget: SKIPPED (no nvcc: set NVCC or CUDA_HOME, or run .ci/run once for target/ci-venv)"
  else
    phase "SASS budget of ${cu[*]} (sm_90)"
    NVCC=$nvcc MESA_RESOURCE_SOURCES="${cu[*]}" bash scripts/check-resources.sh 90
  fi
fi
phase "check-fast passed"
