#!/usr/bin/env bash
# The demo: installs dependencies, builds the release preset and runs sparse attention on the
# embedded default graph, checked against the float64 reference. CUDA code is compiled only where a
# GPU is there to run it (nvcc without a device would spend minutes on kernels the demo cannot use).
set -euo pipefail
cd "$(dirname "$0")/.."
TRISPARSE_DEPS=cpp bash scripts/deps.sh
cuda=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=AUTO; fi
cmake --preset release -DTRISPARSE_CUDA="$cuda" -DTRISPARSE_BUILD_TESTS=OFF \
  -DTRISPARSE_BUILD_BENCH=OFF >/dev/null
cmake --build build/release --target trisparse_cli
./build/release/trisparse run "$@"
