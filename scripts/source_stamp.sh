#!/usr/bin/env bash
# The stamp of the sources the C++ library is built from (src/, include/, cmake/, the top
# CMakeLists.txt): scripts/devpack.sh writes it beside the packed library, scripts/gpu_dev.sh
# compares it with its own copy's.
set -euo pipefail
cd "$(dirname "$0")/.."
find src include cmake CMakeLists.txt -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-64
