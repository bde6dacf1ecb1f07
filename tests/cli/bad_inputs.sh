#!/usr/bin/env bash
# Each malformed input makes `trisparse info` exit non-zero with one line naming file and line.
set -u
cli=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
check() {  # file expected-fragment
  local out rc
  out=$("$cli" -q info "$1" 2>&1)
  rc=$?
  local lines
  lines=$(printf '%s\n' "$out" | wc -l)
  if [ "$rc" -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$2" <<<"$out"; then
    echo "FAIL $1: rc=$rc lines=$lines output: $out"
    fail=1
  else
    echo "ok   $out"
  fi
}
printf '0 1\n2 x\n' > "$dir/token.el";              check "$dir/token.el" "token.el:2:"
printf '0 1\n-1 2\n' > "$dir/neg.el";               check "$dir/neg.el" "neg.el:2:"
printf '# nodes: 2 edges: 1\n0 5\n' > "$dir/range.el"; check "$dir/range.el" "range.el:2:"
printf '# nodes: 3 edges: 5\n0 1\n' > "$dir/count.el"; check "$dir/count.el" "count.el:1:"
: > "$dir/empty.el";                                  check "$dir/empty.el" "empty.el: empty file"
printf '%%%%MatrixMarket matrix coordinate pattern general\n3 3 2\n1 1\n' > "$dir/short.mtx"
check "$dir/short.mtx" "short.mtx:2:"
printf 'PK\003\004garbage' > "$dir/bad.npz";          check "$dir/bad.npz" "bad.npz"
printf 'TRSPARSE' > "$dir/bad.tsc";                   check "$dir/bad.tsc" "bad.tsc"
check "$dir/missing.el" "missing.el"
# 1 passed/failed line for CTest's log
exit $fail
