#!/usr/bin/env bash
# On the GPU machine, in one call: Nsight Compute's view of the backward kernels where their
# targets are missed: (1) the attention backward (tensor-core dq and dk/dv passes) and forward on
# PROFILE_GRAPH, D = 128, one head, f16; (2) the block-sparse backward against FlexAttention's
# (compiled) at N = 32K, G = 64, p = 0.9, H = 8, D = 64, bf16, through the Python package (built
# here, as scripts/gpu_python.sh does). Summaries under $OUT. Call with carry = [.devpack,
# .devlibs, data].
set -uo pipefail
out=${OUT:-/tmp/trisparse-profile}
site=/tmp/trisparse-site
mkdir -p "$out" /tmp/profile
tar -xJf .devpack/new.tar.xz -C /tmp/profile
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section Occupancy --section WarpStateStats --section LaunchStats)
graph=${PROFILE_GRAPH:-data/het_tolokers.el.xz}
if [ "${PROFILE_ATTENTION:-1}" = 1 ]; then
  ncu "${sections[@]}" -k 'regex:tc_(row|column)_pass|fused3s_kernel' --launch-skip 12 \
    --launch-count 6 /tmp/profile/bench_fused3s --dim 128 --heads 1 --repeat 2 --no-baselines \
    --training "$graph" > "$out/ncu_attention.txt" 2>&1
  echo "attention: $(grep -c '^  [a-z_]*.*(' "$out/ncu_attention.txt") kernels profiled"
fi
# PROFILE_TIMES="graph:dim:heads ...": each kernel's duration (ncu, one pass) in bench_fused3s
# --training on those shared graphs (f16), the median launch of each kernel and grid size: where a
# backward's time goes.
for spec in ${PROFILE_TIMES:-}; do
  IFS=: read -r name dim heads <<< "$spec"
  ncu --csv --print-units base --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    -k 'regex:tc_|reduce|core_|fused3s_kernel' --launch-count 400 /tmp/profile/bench_fused3s \
    --dim "$dim" --heads "$heads" --repeat 3 --no-baselines --training "data/$name.el.xz" \
    > /tmp/profile/times.csv 2> /tmp/profile/times.err
  echo "$spec" >> "$out/kernel_times.txt"
  python3 - /tmp/profile/times.csv >> "$out/kernel_times.txt" <<'PY'
import csv, statistics, sys
from collections import defaultdict
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
runs = defaultdict(lambda: defaultdict(list))
for r in csv.DictReader(lines):
    key = (r["Kernel Name"].split("(")[0].split("<")[0].split("::")[-1], r["Grid Size"])
    runs[key][r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
for (k, grid), m in sorted(runs.items()):
    t = m["gpu__time_duration.sum"]
    w = m.get("sm__warps_active.avg.pct_of_peak_sustained_active", [0])
    print(f"  {k:24s} grid {grid:>16s} n {len(t):3d} median {statistics.median(t) / 1e3:8.1f} us"
          f" occupancy {statistics.median(w):5.1f} %")
PY
done
[ -n "${PROFILE_TIMES:-}" ] && cat "$out/kernel_times.txt"
if [ "${PROFILE_BLOCK:-1}" = 1 ]; then
  # (PROFILE_SKIP_BUILD=1: the package is already there, from scripts/gpu_python.sh.)
  if [ "${PROFILE_SKIP_BUILD:-0}" != 1 ]; then
    python3 -m pip install --no-build-isolation --no-deps --target "$site" \
      -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build.verbose=false . > "$out/pip_install.log" 2>&1 ||
      { tail -30 "$out/pip_install.log"; exit 1; }
  fi
  # After the warm-ups and autotuning: one launch of our backward kernel, two of flex's backward.
  : > "$out/ncu_block_sparse.txt"
  for k in 'regex:^backward_kernel' 'regex:tem_fused_flex_attention_backward'; do
    PYTHONPATH="$site" ncu "${sections[@]}" -k "$k" --launch-skip 3 --launch-count 2 \
      python3 bench/python/block_sparse_training.py --n 32768 --block 64 --sparsity 0.9 \
      --repeat 3 >> "$out/ncu_block_sparse.txt" 2>&1
  done
  grep -E '^  [A-Za-z_].*\(|Duration|Compute \(SM\) Throughput|L1/TEX Cache Throughput|Achieved Occupancy' \
    "$out/ncu_block_sparse.txt" | head -40
fi
