#!/usr/bin/env bash
# Type-checks the build-compatibility crates named as arguments (default: all three checks),
# as .ci/run does: ci/compat/README.md says what each proves. `mesa-burn` (not a default)
# lints and tests crates/mesa-burn, its own workspace (docs/burn.md). Needs CUDA_HOME (the pinned
# nvcc wheels, see README.md); no GPU. Target dir: target/compat (or CARGO_TARGET_DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${CUDA_HOME:?set CUDA_HOME to the pinned CUDA 13.0 wheels (README.md)}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target/compat}
[ $# -gt 0 ] || set -- candle-cuda candle-tests cubecl-cuda
# candle-kernels' build script gets the check-only nvcc and a compute capability (candle-cuda, candle-tests)
candle_env=(PATH="$CUDA_HOME/bin:$PATH" NVCC=$PWD/ci/compat/nvcc-check-only CUDA_COMPUTE_CAP=80 MESA_CUDA_DISABLE=1)
for c in "$@"; do
  t0=$SECONDS
  case "$c" in
    # candle-kernels' build script compiles candle's kernels for CUDA_COMPUTE_CAP through
    # nvcc-check-only (PTX, device -O0: nothing is linked; its -O3 SASS build takes ~2-5 min
    # per file on 2 cores)
    candle-cuda) env "${candle_env[@]}" cargo check --release --locked --manifest-path ci/compat/candle-cuda/Cargo.toml ;;
    # mesa-candle's tests in the `cuda` configuration (they run on candle's CUDA device where
    # one is), with the NCCL backend of `parallel` (`nccl`): type-checked only. The
    # workspace's release profile without debuginfo, as the
    # compatibility crates' own, so candle-kernels and most of candle's graph are reused
    candle-tests) env "${candle_env[@]}" CARGO_PROFILE_RELEASE_DEBUG=0 \
      cargo check --release --locked --tests -p mesa-candle --features cuda,nccl ;;
    # cubecl-cuda pulls cubecl-llvm, whose tracel-llvm-bundler downloads a native LLVM in its
    # build script unless DOCS_RS is set (then it skips it, as on docs.rs): a type-check needs none
    cubecl-cuda) DOCS_RS=1 PATH="$CUDA_HOME/bin:$PATH" MESA_CUDA_DISABLE=1 \
      cargo check --release --locked --manifest-path ci/compat/cubecl-cuda/Cargo.toml ;;
    # mesa-burn: burn 0.22.1 on Flex (CPU), the kernels on the emulator; its own workspace and
    # lock (--locked), release profile; the default nextest profile (the workspace's `ci`
    # profile is not its own). Its lints and docs are burn-cuda's (below: every feature on)
    mesa-burn) MESA_CUDA_DISABLE=1 NEXTEST_PROFILE=default \
        cargo nextest run --release --locked --manifest-path crates/mesa-burn/Cargo.toml ;;
    # burn-cuda (in .ci/run's background job after mesa-burn; its cost in docs/burn.md): mesa-burn with `cuda`
    # and `fusion` type-checked in a graph with burn's CUDA backend and burn's `fusion`
    # (cubecl-cuda, DOCS_RS=1 as above): its CubeBackend code and its Fusion<CubeBackend> code in
    # one graph; then mesa-burn's own clippy and docs with `fusion` (= every feature: it implies
    # `cuda`; its lock resolves the same versions: the checked dependencies are reused, a few
    # seconds). The graph holds cubecl-cuda and mesa-kernels with one cudarc: what `cubecl-cuda`
    # checks, and more. One command a line: `set -e` stops at the first that fails (in an `&&`
    # chain a failure before the last command would not stop the script)
    burn-cuda)
      DOCS_RS=1 PATH="$CUDA_HOME/bin:$PATH" MESA_CUDA_DISABLE=1 \
        cargo check --release --locked --manifest-path ci/compat/burn-cuda/Cargo.toml
      DOCS_RS=1 PATH="$CUDA_HOME/bin:$PATH" MESA_CUDA_DISABLE=1 cargo clippy --release --locked \
        --all-targets --features fusion --manifest-path crates/mesa-burn/Cargo.toml -- -D warnings
      DOCS_RS=1 PATH="$CUDA_HOME/bin:$PATH" MESA_CUDA_DISABLE=1 RUSTDOCFLAGS="-D warnings" \
        cargo doc --release --locked --no-deps --features fusion --manifest-path crates/mesa-burn/Cargo.toml ;;
    *) echo "unknown compatibility check: $c (candle-cuda, candle-tests, cubecl-cuda, mesa-burn, burn-cuda)"; exit 2 ;;
  esac
  echo "compatibility check $c: $((SECONDS - t0))s"
done
