#!/usr/bin/env bash
# Here, before device calls (scripts/gpu_dev.sh): builds the GPU test binaries and the library in
# build/gpu (configured as gpu_dev.sh's header says) and packs them into .devpack: the tests as
# gpu_tests.tar.xz, and libtrisparse.a with the stamp of the sources it was built from, which
# gpu_dev.sh links its Python module against (it compiles only the module there) while the
# device's copy of src/, include/ and the CMake files has the same stamp. BENCH_BINS (e.g.
# "bench_layers") also packs those benchmark binaries as bench.tar.xz.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build/gpu}
ninja -C "$build" -j "${JOBS:-2}" src/libtrisparse.a gpu_tests op_gpu_tests large_gpu_tests
mkdir -p .devpack
# Stripped copies, one xz stream with a large window (the three binaries share the library's
# kernels): 15 MB where plain `tar -cJ` gave 36, leaving room in a call's 64 MiB carry for data/.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tests=(gpu_tests op_gpu_tests large_gpu_tests)
for t in "${tests[@]}"; do strip --strip-unneeded -o "$tmp/$t" "$build/tests/$t"; done
tar -cf - -C "$tmp" "${tests[@]}" | xz -9 -T0 > .devpack/gpu_tests.tar.xz
xz -T0 -c "$build/src/libtrisparse.a" > .devpack/libtrisparse.a.xz
scripts/source_stamp.sh > .devpack/libtrisparse.stamp
if [ -n "${BENCH_BINS:-}" ]; then
  # shellcheck disable=SC2086
  ninja -C "$build" -j "${JOBS:-2}" $BENCH_BINS
  # shellcheck disable=SC2086
  tar -cJf .devpack/bench.tar.xz -C "$build" $BENCH_BINS
fi
ls -la .devpack/*.tar.xz .devpack/libtrisparse.a.xz
