#!/usr/bin/env bash
# On the GPU machine, in one call: an A/B of a Python benchmark between this tree ("new") and the
# base packed by scripts/ab_pack.sh ("base"): both Python modules built here side by side (sm_90,
# Release), TESTS (pytest arguments, optional) run on the new one, then AB_CMD (a command reading
# the module from PYTHONPATH, printing JSON lines) run new, base, base, new; each line gets a
# "label" field. Results in $OUT/ab.jsonl. Call with carry = [.devpack, .devlibs, data]:
#   AB_CMD="python3 bench/python/block_sparse_training.py --no-flex --importance" \
#     TESTS="tests/python/test_block_sparse.py -k 'importance or mass'" bash scripts/gpu_ab_python.sh
# (TESTS and AB_CMD are read by bash -c: quote inside them as on a command line.) PY_ONLY=1 where
# the two differ only in python/trisparse/*.py: one build, the base's files copied beside it.
set -uo pipefail
out=${OUT:-/tmp/trisparse-ab}
mkdir -p "$out"
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
base=/tmp/ab-base
mkdir -p "$base"
tar -c --exclude=./data --exclude=./.devpack --exclude=./build --exclude=./.git . | tar -x -C "$base"
cp -r .devpack/ab_base/. "$base/"
while read -r path; do [ -n "$path" ] && rm -f "$base/$path"; done < .devpack/ab_base.added
build() {  # $1: the tree, $2: its label
  cmake -S "$1" -B "$1/build/device" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRISPARSE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTRISPARSE_PYTHON=ON -DTRISPARSE_IO=OFF \
    -DTRISPARSE_BUILD_TESTS=OFF -DTRISPARSE_BUILD_CLI=OFF -DTRISPARSE_BUILD_BENCH=OFF \
    > "$out/build_$2.log" 2>&1 &&
    cmake --build "$1/build/device" -j "$(($(nproc) / 2))" --target trisparse_python \
      trisparse_python_files >> "$out/build_$2.log" 2>&1 ||
    { echo "$2: build failed"; grep -B2 -A8 error "$out/build_$2.log" | head -30; return 1; }
}
if [ "${PY_ONLY:-0}" = 1 ]; then
  # Only Python files differ: one build; the base module is its copy with the base's files.
  if [ -n "$(cd .devpack/ab_base && find . -type f ! -path './python/trisparse/*.py')" ] ||
    grep -qv '^python/trisparse/.*\.py$' .devpack/ab_base.added; then
    echo "PY_ONLY: the base differs outside python/trisparse/*.py"
    exit 1
  fi
  build "$PWD" new || exit 1
  mkdir -p "$base/build/device"
  cp -r build/device/python "$base/build/device/"
  (cd .devpack/ab_base/python && find . -type f) |
    while read -r f; do cp ".devpack/ab_base/python/$f" "$base/build/device/python/$f"; done
  while read -r path; do [ -n "$path" ] && rm -f "$base/build/device/${path}"; done \
    < .devpack/ab_base.added
else
  build "$PWD" new & pid_new=$!
  build "$base" base & pid_base=$!
  wait $pid_new || exit 1
  wait $pid_base || exit 1
fi
echo "builds: $((SECONDS - start)) s"
export TRISPARSE_DATASETS=$PWD/data
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH=build/device/python timeout "${TESTS_TIMEOUT:-300}" \
    bash -c "python3 -m pytest -q -p no:cacheprovider $TESTS" 2>&1 | tail -8
  echo "tests: $((SECONDS - start)) s"
fi
for label in new base base new; do
  root=$PWD
  [ "$label" = base ] && root=$base
  PYTHONPATH=$root/build/device/python bash -c "$AB_CMD" |
    sed "s/^{/{\"label\": \"$label\", /" >> "$out/ab.jsonl"
  echo "$label: $((SECONDS - start)) s"
done
