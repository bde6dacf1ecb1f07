#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), in one call: GPU tests on every shared dataset,
# compute-sanitizer memcheck and racecheck, then the fused 3S benchmark. Logs go under $OUT.
# Build here first (the GPU machine has no package registry):
#   cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRISPARSE_CUDA=ON \
#         -DCMAKE_CUDA_ARCHITECTURES=90 -DTRISPARSE_DATASETS_DIR=data
#   cmake --build build/gpu --target gpu_tests bench_fused3s trisparse_cli
#   mkdir -p data .devlibs && cp ../shared/datasets/* data/ && cp -L /lib/x86_64-linux-gnu/libzip.so.4 /lib/x86_64-linux-gnu/libbz2.so.1.0 .devlibs/
# and call with carry = [build/gpu, data, .devlibs]. Usage: scripts/gpu_run.sh [tests|sanitize|bench|sweep|all]
set -uo pipefail
out=${OUT:-/tmp/trisparse-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
export TRISPARSE_DATASETS=$PWD/data
b=build/gpu
what=${1:-all}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$b/tests/gpu_tests" --gtest_brief=1 > "$out/gpu_tests.log" 2>&1 || status=1
  tail -5 "$out/gpu_tests.log"
  # The demo on the GPU (embedded default graph), and --save checked independently with NumPy.
  "$b/trisparse" -q run > "$out/demo.log" 2>&1 || status=1
  "$b/trisparse" -q run data/cora.el.xz --heads 2 --dim 64 --dtype bf16 --out-dtype f16 --save /tmp/saved \
    >> "$out/demo.log" 2>&1 && python3 tools/check_saved.py /tmp/saved >> "$out/demo.log" 2>&1 || status=1
  cat "$out/demo.log"
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  filter='GpuFused3s.EveryTypeAndHeadDim*:GpuFused3s.MultiHead*:GpuFused3s.ScoreEdgeCases:Gpu.*:GpuBsbBuild.EqualsTheHostBuilder'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$b/tests/gpu_tests" --gtest_brief=1 \
      --gtest_filter="$filter" > "$out/sanitizer_$tool.log" 2>&1 || status=1
    echo "$tool: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi
if [ "$what" = sweep ]; then
  # The split threshold against the cost model (0) on graphs of each kind.
  "$b/bench_fused3s" --repeat 20 --split 0,8,16,32,64,100000 data/cora.el.xz data/pubmed.el.xz data/twitch_ru.el.xz \
    data/musae_github.el.xz data/blogcatalog.el.xz data/snap_web_notredame.el.xz data/tu_nci1.el.xz --rmat 18:10 \
    > "$out/sweep.jsonl" 2>&1 || status=1
  python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if 'graph' in r: print(f\"{r['graph']:22s} split {r['split_tcbs']:>6d} {r['kernel_ms']:8.4f} ms err {r['max_rel_error']:.1e}\")
" "$out/sweep.jsonl"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$b/bench_fused3s" --dim 128 --heads 1 --repeat 20 --dtype f16 data/*.el.xz --rmat 18:10 --rmat 20:10 \
    > "$out/bench_fused3s.jsonl" 2> "$out/bench_fused3s.err" || status=1
  python3 - "$out/bench_fused3s.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(rows[0])
for r in rows[1:]:
    print(f"{r['graph']:28s} nnz {r['nnz']:>9d} kernel {r['kernel_ms']:8.4f} ms  build {r['build_ms']:8.2f} ms "
          f"{r['gflops']:8.1f} GFLOP/s {r['compulsory_gbps']:7.1f} GB/s err {r['max_rel_error']:.1e} finite {r['all_finite']}")
PY
fi
exit $status
