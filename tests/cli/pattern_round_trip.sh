#!/usr/bin/env bash
# `trisparse pattern`: init from a generated graph and from a layout, show as text, JSON and PNG;
# a damaged pattern file exits non-zero with one line naming the file and the problem.
set -u
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
expect() {  # description, command status (0 = ok)
  if [ "$2" -ne 0 ]; then echo "FAIL $1"; fail=1; else echo "ok   $1"; fi
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
head -c 60 "$dir/b.tsbp" > "$dir/cut.tsbp"
out=$("$cli" -q pattern show "$dir/cut.tsbp" 2>&1)
rc=$?
if [ "$rc" -ne 0 ] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && grep -qF "cut.tsbp: truncated" <<<"$out"; then
  echo "ok   $out"
else
  echo "FAIL truncated file: rc=$rc output: $out"
  fail=1
fi
exit $fail
