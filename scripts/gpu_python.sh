#!/usr/bin/env bash
# On the GPU machine, in one call: builds the Python package there (its Python 3.12, torch and
# nvcc; sm_90 only, to keep the build short) and runs the pytest suite with CUDA, the GPU tests
# included. Call with carry = [data] for the dataset tests. Logs go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/trisparse-python}
site=/tmp/trisparse-site
mkdir -p "$out"
start=$SECONDS
python3 -m pip install --no-build-isolation --no-deps --target "$site" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build.verbose=false . > "$out/pip_install.log" 2>&1 ||
  { tail -30 "$out/pip_install.log"; exit 1; }
echo "pip install .: $((SECONDS - start)) s"
TRISPARSE_DATASETS=$PWD/data PYTHONPATH="$site" python3 -m pytest -q -p no:cacheprovider \
  tests/python > "$out/pytest.log" 2>&1
status=$?
tail -15 "$out/pytest.log"
exit $status
