#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: every test marked
# `#[ignore = "needs CUDA"]`, then the quick suite on the GPU with its JSON kept.
#
#   scripts/gpu-check.sh [OUT_DIR]     (OUT_DIR defaults to $OUT, else ./gpu-check-out)
#
# Exits non-zero if no GPU is visible, a test fails, or the suite fails. Needs the
# same setup as the README's commands (./libtorch-setup.sh installs libtorch; on a
# GPU machine PyPI's torch wheel carries CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"

command -v nvidia-smi >/dev/null && nvidia-smi -L | tee "$out/gpus.txt" || {
    echo "gpu-check: no NVIDIA GPU visible (nvidia-smi)" >&2
    exit 1
}
./libtorch-setup.sh

set -o pipefail
# Only the CUDA tests: every ignored test in this workspace is ignored for needing CUDA.
cargo test --workspace -- --ignored 2>&1 | tee "$out/ignored-tests.log"
cargo run --release -p memsave-bench --bin memsave -- bench suites/cuda.yaml --json "$out/cuda.json" 2>&1 |
    tee "$out/cuda-suite.log"
echo "gpu-check: all CUDA checks passed; results in $out"
