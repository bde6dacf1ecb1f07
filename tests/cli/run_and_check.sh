#!/usr/bin/env bash
# `trisparse run` on the embedded default passes its own check, and its --save output is verified
# independently with NumPy (when NumPy is installed).
set -eu
cli=$1
checker=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$cli" -q run --repeat 2 --check-rows 64
"$cli" -q run --repeat 1 --dtype f16 --out-dtype f16 --heads 2 --dim 32 --check-rows 64
"$cli" -q generate er "$dir/er.mtx" --n 500 --avg-degree 6
"$cli" -q run "$dir/er.mtx" --repeat 1 --heads 2 --dim 16 --save "$dir/saved" --json > "$dir/run.json"
grep -q '"check": "pass"' "$dir/run.json"
if python3 -c "import numpy" 2>/dev/null; then
  python3 "$checker" "$dir/saved"
else
  echo "numpy not installed: skipping the independent check of --save"
fi
