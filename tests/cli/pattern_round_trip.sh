#!/usr/bin/env bash
# `trisparse pattern`: init from a generated graph and from a layout, learn from saved queries and
# keys (.npy) with a planted pattern, show as text, JSON and PNG; a damaged pattern or .npy file
# exits non-zero with one line naming the file and the problem.
set -u
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
expect() {  # description, command status (0 = ok)
  if [ "$2" -ne 0 ]; then echo "FAIL $1"; fail=1; else echo "ok   $1"; fi
}
expect_error() {  # description, what the one line must hold, command...
  local what=$1 holds=$2 out rc
  shift 2
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 0 ] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && grep -qF "$holds" <<<"$out"; then
    echo "ok   $out"
  else
    echo "FAIL $what: rc=$rc output: $out"
    fail=1
  fi
}
"$cli" -q generate er "$dir/g.tsc" --n 3000 --avg-degree 6 --seed 3
"$cli" -q pattern init "$dir/g.tsc" --method community --block 64 --heads 2 -o "$dir/c.tsbp"
expect "init community" $?
"$cli" -q pattern init --method bigbird --n 5000 --block 128 --heads 3 -o "$dir/b.tsbp"
expect "init bigbird" $?
json=$("$cli" -q pattern show "$dir/c.tsbp" --json --png "$dir/c.png")
expect "show --json --png" $?
python3 - "$json" "$dir/c.png" <<'PY'
import json, struct, sys
j = json.loads(sys.argv[1])
assert j["heads"] == 2 and j["rows"] == 3000 and j["block_rows"] == 47 and j["node_order"], j
assert "community" in j["made_by"] and 0 < j["density"][0] <= 1, j
png = open(sys.argv[2], "rb").read()
assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
width, height = struct.unpack(">II", png[16:24])
assert (width, height) == (2 * 47 * 5 + 4, 47 * 5), (width, height)  # 256 // 47 = 5 px a block
PY
expect "JSON fields and PNG size" $?
"$cli" -q pattern show "$dir/b.tsbp" | grep -q "3 heads"
expect "show text" $?
# Queries of block row r point at the keys of key block (3 r + 1) mod 8 (2 heads, 512 tokens,
# blocks of 64): `learn` at one block a row keeps exactly those (diagonal not forced).
python3 - "$dir" <<'PY'
import sys
import numpy as np
g = np.random.default_rng(5)
basis = np.eye(64, dtype=np.float32)[:8]
k = np.repeat(basis, 64, axis=0)[None].repeat(2, 0) + 0.05 * g.standard_normal((2, 512, 64))
q = 30 * np.repeat(basis[[(3 * r + 1) % 8 for r in range(8)]], 64, axis=0)[None].repeat(2, 0)
np.save(sys.argv[1] + "/q.npy", q.astype(np.float32))
np.save(sys.argv[1] + "/k.npy", k)  # float64
# values that differ by key block: the output choice keeps the planted blocks too
v = np.repeat(3 * g.standard_normal((2, 8, 1, 16)), 64, axis=2).reshape(2, 512, 16)
np.save(sys.argv[1] + "/v.npy", (v + 0.1 * g.standard_normal((2, 512, 16))).astype(np.float32))
np.save(sys.argv[1] + "/shortv.npy", v[:, :500])
open(sys.argv[1] + "/cut.npy", "wb").write(open(sys.argv[1] + "/q.npy", "rb").read()[:500])
PY
"$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --block 64 --sparsity 0.875 \
  --method topk --no-diagonal -o "$dir/l.tsbp"
expect "learn" $?
json=$("$cli" -q pattern show "$dir/l.tsbp" --json)
python3 - "$json" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
assert j["heads"] == 2 and j["rows"] == 512 and j["block"] == 64, j
assert j["density"] == [0.125, 0.125] and "learned" in j["made_by"], j
PY
expect "learned pattern's fields" $?
"$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --v "$dir/v.npy" --block 64 \
  --sparsity 0.875 --method output --no-diagonal -o "$dir/o.tsbp"
expect "learn --method output" $?
json=$("$cli" -q pattern show "$dir/o.tsbp" --json)
python3 - "$json" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
assert j["density"] == [0.125, 0.125] and "mass and values" in j["made_by"], j
PY
expect "output pattern's fields" $?
python3 - "$dir/l.tsbp" "$dir/o.tsbp" <<'PY'
import sys
try:
    import trisparse
except ImportError:
    sys.exit(0)  # the Python package is tested on its own; here only where it is installed
for path in sys.argv[1:]:
    blocks = trisparse.BlockPattern.load(path).blocks()
    for h in range(2):
        for r in range(8):
            assert blocks[h, r].nonzero().flatten().tolist() == [(3 * r + 1) % 8], (path, h, r)
PY
expect "learned blocks are the planted ones" $?
expect_error "output without values" "needs the values: --v" \
  "$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --method output -o "$dir/x.tsbp"
expect_error "values of other keys" "shortv.npy: values" \
  "$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --v "$dir/shortv.npy" --method output \
  -o "$dir/x.tsbp"
expect_error "truncated .npy" "cut.npy: truncated" \
  "$cli" -q pattern learn --q "$dir/cut.npy" --k "$dir/k.npy" -o "$dir/x.tsbp"
expect_bad_flag() {  # description, what the output must hold, command... (an exit, not a signal)
  local what=$1 holds=$2 out rc
  shift 2
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ] && grep -qF -- "$holds" <<<"$out"; then
    echo "ok   $(head -1 <<<"$out")"
  else
    echo "FAIL $what: rc=$rc output: $out"
    fail=1
  fi
}
expect_bad_flag "learn --block 0" "--block: must be a whole number >= 1" \
  "$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --block 0 -o "$dir/x.tsbp"
expect_bad_flag "learn --sparsity 1" "--sparsity: must be a number in [0, 1)" \
  "$cli" -q pattern learn --q "$dir/q.npy" --k "$dir/k.npy" --sparsity 1 -o "$dir/x.tsbp"
expect_bad_flag "init --heads 0" "--heads: must be a whole number >= 1" \
  "$cli" -q pattern init --method random --n 100 --heads 0 -o "$dir/x.tsbp"
expect_bad_flag "show --columns 0" "--columns: must be a whole number >= 1" \
  "$cli" -q pattern show "$dir/b.tsbp" --png "$dir/x.png" --columns 0
head -c 60 "$dir/b.tsbp" > "$dir/cut.tsbp"
expect_error "truncated pattern file" "cut.tsbp: truncated" "$cli" -q pattern show "$dir/cut.tsbp"
exit $fail
