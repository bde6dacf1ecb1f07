#!/usr/bin/env bash
# The demo: installs dependencies, builds the release preset (with CUDA where nvcc exists) and runs
# sparse attention on the embedded default graph, checked against the float64 reference.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake --preset release -DTRISPARSE_BUILD_TESTS=OFF -DTRISPARSE_BUILD_BENCH=OFF >/dev/null
cmake --build build/release --target trisparse_cli
./build/release/trisparse run "$@"
