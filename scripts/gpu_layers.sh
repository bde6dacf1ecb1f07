#!/usr/bin/env bash
# On the GPU machine, in one call: the GNN layer tests (GpuLayers.*, GpuFusedGcn.*), optionally
# under compute-sanitizer (LAYERS_SANITIZE=1), and the fused GCN layer benchmark (bench_layers
# --only fused, both orders per width pair and dtype) on LAYERS_GRAPHS. Binaries come packed in
# .devpack/new.tar.xz (see scripts/gpu_ab.sh); call with carry = [.devpack, .devlibs, data].
set -uo pipefail
out=${OUT:-/tmp/trisparse-layers}
mkdir -p "$out" /tmp/layers
tar -xJf .devpack/new.tar.xz -C /tmp/layers
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TRISPARSE_DATASETS=$PWD/data
status=0
filter='GpuLayers.*:GpuFusedGcn.*'
/tmp/layers/tests/gpu_tests --gtest_brief=1 --gtest_filter="$filter" > "$out/layer_tests.log" 2>&1 || status=1
tail -5 "$out/layer_tests.log"
if [ "${LAYERS_SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    TRISPARSE_TEST_GRAPHS=cora compute-sanitizer --tool "$tool" --error-exitcode 9 \
      /tmp/layers/tests/gpu_tests --gtest_brief=1 --gtest_filter='GpuFusedGcn.*' \
      > "$out/$tool.log" 2>&1 &
  done
  wait
  for tool in memcheck racecheck; do
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$out/$tool.log" | tr '\n' ' ')"
  done
fi
[ "${LAYERS_BENCH:-1}" = 1 ] || exit $status
graphs=${LAYERS_GRAPHS:-cora citeseer pubmed musae_github het_tolokers deezer_egos snap_web_notredame}
paths=()
for g in $graphs; do paths+=("data/$g.el.xz"); done
# (The graphs first: --fused takes every word after it.)
/tmp/layers/bench_layers "${paths[@]}" ${LAYERS_GENERATED:-} --only fused --repeat 20 \
  --fused ${LAYERS_WIDTHS:-1433:16 16:16 16:64 64:64 64:128 128:128 128:64 32:256} \
  > "$out/fused_gcn.jsonl" 2>> "$out/bench_stderr.log" || status=1
tail -3 "$out/bench_stderr.log" 2>/dev/null
exit $status
