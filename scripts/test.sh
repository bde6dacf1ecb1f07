#!/usr/bin/env bash
# The test command: installs dependencies, builds (CUDA code compiled where nvcc exists; GPU tests
# skip without a device), runs every test (C++ with CTest, the Python package's with pytest through
# CTest), checks the installed C++ package with an example and `pip install .`, then builds the
# fuzz targets with ASan/UBSan and runs each for FUZZ_SECONDS (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bash scripts/deps.sh
jobs=$(nproc)

cmake --preset dev -DTRISPARSE_PYTHON=ON >/dev/null  # ON: a missing nanobind fails, not skips
cmake --build build/dev -j "$jobs"
(cd build/dev && ctest -j "$jobs" --output-on-failure --timeout 900)

# find_package(trisparse) from an installed copy.
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/dev --prefix "$prefix" >/dev/null
cmake -S examples/consumer -B "$prefix/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/consumer-build" >/dev/null
"$prefix/consumer-build/consumer"

# pip install . (scikit-build-core driving this CMake project; CPU kernels only here, to keep the
# run short: CUDA is compiled where nvcc exists unless told otherwise), then use the installed copy.
site="$prefix/site"
python3 -m pip install --quiet --no-build-isolation --no-deps --target "$site" \
  -C cmake.define.TRISPARSE_CUDA=OFF .
# The pytest suite again, against the installed copy (not the build tree's).
(cd "$prefix" && PYTHONPATH="$site" python3 -m pytest -q -p no:cacheprovider "$root/tests/python" |
  tail -1)
echo "pip install .: the pytest suite passes against the installed package"

# Fuzz every reader for a bounded time.
cmake --preset fuzz >/dev/null
cmake --build build/fuzz -j "$jobs"
fuzz_seconds=${FUZZ_SECONDS:-10}
fuzz_passed=0
fuzz_failed=0
for reader in edge_list matrix_market npy npz cache pattern; do
  work=$(mktemp -d)
  cp "$root/tests/fuzz/corpus/$reader/"* "$work/"
  if (cd "$work" && "$root/build/fuzz/tests/fuzz/fuzz_$reader" -max_total_time="$fuzz_seconds" \
        -rss_limit_mb=2048 -timeout=10 "$work" >"$work/log" 2>&1); then
    fuzz_passed=$((fuzz_passed + 1))
    echo "fuzz_$reader: ${fuzz_seconds} s, no finding"
  else
    fuzz_failed=$((fuzz_failed + 1))
    echo "fuzz_$reader: FINDING"
    tail -40 "$work/log"
  fi
  rm -rf "$work"
done
echo "fuzz: $fuzz_passed passed, $fuzz_failed failed"
[ "$fuzz_failed" -eq 0 ]
