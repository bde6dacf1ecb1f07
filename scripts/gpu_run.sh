#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), in one call: GPU tests on every shared dataset,
# compute-sanitizer memcheck and racecheck, the fused 3S benchmark with its in-project baselines
# (cuSPARSE, dense cuBLAS) and the PyTorch / PyG script. Logs and JSONL go under $OUT.
# Build here first (the GPU machine has no package registry):
#   cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRISPARSE_CUDA=ON \
#         -DCMAKE_CUDA_ARCHITECTURES=90 -DTRISPARSE_DATASETS_DIR=data
#   cmake --build build/gpu --target gpu_tests bench_fused3s bench_me_bcrs bench_layers trisparse_cli
#   mkdir -p data .devlibs && cp ../shared/datasets/* data/ && cp -L /lib/x86_64-linux-gnu/libzip.so.4 /lib/x86_64-linux-gnu/libbz2.so.1.0 .devlibs/
# and call with carry = [build/gpu, data, .devlibs].
# Usage: scripts/gpu_run.sh [tests|sanitize|bench|matrix|large|sweep|sparse|layers|blocksparse|reportsweep|flexsweep|bssanitize|all] (all = tests sanitize bench)
# The device tool brings back at most 8 files per call: run tests+sanitize and bench+large+matrix apart.
set -uo pipefail
out=${OUT:-/tmp/trisparse-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export TRISPARSE_DATASETS=$PWD/data
b=build/gpu
what=${1:-all}
status=0
run() { [ "$what" = "$1" ] || { [ "$what" = all ] && [ "$1" != matrix ] && [ "$1" != large ] && [ "$1" != sweep ] && [ "$1" != sparse ] && [ "$1" != layers ]; }; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
scripts/describe_tree.sh | tee -a "$out/gpu.txt"

if run tests; then
  "$b/tests/gpu_tests" --gtest_brief=1 > "$out/gpu_tests.log" 2>&1 || status=1
  tail -5 "$out/gpu_tests.log"
  # The demo on the GPU (embedded default graph), and --save checked independently with NumPy.
  "$b/trisparse" -q run > "$out/demo.log" 2>&1 || status=1
  "$b/trisparse" -q run data/cora.el.xz --heads 2 --dim 64 --dtype bf16 --out-dtype f16 --save /tmp/saved \
    >> "$out/demo.log" 2>&1 && python3 tools/check_saved.py /tmp/saved >> "$out/demo.log" 2>&1 || status=1
  cat "$out/demo.log"
fi

if run sanitize; then
  # Every GPU test; the per-dataset ones with two type configurations (TRISPARSE_GPU_TEST_QUICK).
  for tool in memcheck racecheck; do
    TRISPARSE_GPU_TEST_QUICK=1 compute-sanitizer --tool "$tool" --error-exitcode 9 "$b/tests/gpu_tests" \
      --gtest_brief=1 > "$out/sanitizer_$tool.log" 2>&1 || status=1
    echo "$tool: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi

gen() {  # generated graphs as edge lists both tools read (R-MAT, seed 7)
  mkdir -p data/gen
  for spec in "$@"; do
    s=${spec%%:*} ef=${spec##*:}
    [ -f "data/gen/rmat$s.el" ] || "$b/trisparse" -q generate rmat "data/gen/rmat$s.el" --scale "$s" --edge-factor "$ef" --seed 7
  done
}

if run sparse; then  # SpMM / SDDMM / softmax (ME-BCRS) against cuSPARSE, every dataset + generated
  # SuiteSparse-like classes (bench/cuda/common.hpp matrix_class) at 10K, 100K and 1M rows.
  matrices=()
  for c in fem circuit web lp uniform; do for r in 10000 100000 1000000; do matrices+=(--matrix "$c:$r"); done; done
  "$b/bench_me_bcrs" --repeat 20 data/*.el.xz --rmat 18:10 --rmat 20:10 --er 100000:16 --er 1000000:8 \
    "${matrices[@]}" > "$out/bench_me_bcrs.jsonl" 2>> "$out/stderr.log" || status=1
  tail -c 600 "$out/bench_me_bcrs.jsonl"
fi

if run layers; then  # GCN / AGNN forward against PyG's GCNConv / AGNNConv, every dataset
  graphs=(data/*.el.xz)
  "$b/bench_layers" --in 128 --out 128 --agnn 128 --repeat 20 "${graphs[@]}" \
    > "$out/bench_layers.jsonl" 2>> "$out/stderr.log" || status=1
  python3 bench/python/pyg_layers.py --in-dim 128 --out-dim 128 --agnn-dim 128 --repeat 20 "${graphs[@]}" \
    > "$out/pyg_layers.jsonl" 2>> "$out/stderr.log" || status=1
  tail -c 400 "$out/bench_layers.jsonl"; tail -c 400 "$out/pyg_layers.jsonl"
fi

if run bench; then
  gen 18:10 20:10
  graphs=(data/*.el.xz data/gen/rmat18.el data/gen/rmat20.el)
  "$b/bench_fused3s" --dim 128 --heads 1 --repeat 20 --dtype f16 "${graphs[@]}" \
    > "$out/bench_fused3s.jsonl" 2>> "$out/stderr.log" || status=1
  python3 bench/python/pyg_attention.py --device cuda --dim 128 --heads 1 --repeat 20 "${graphs[@]}" \
    > "$out/pyg_cuda.jsonl" 2>> "$out/stderr.log" || status=1
  # The join with the peers' times needs ../shared/anchors (not on the GPU machine): run it here after.
  [ -f ../shared/anchors/README.md ] && python3 bench/compare_anchors.py "$out/bench_fused3s.jsonl" --pyg "$out/pyg_cuda.jsonl" | tail -8
fi

if [ "$what" = matrix ]; then
  # D, heads and dtype beyond the anchors' setting, on graphs of each kind.
  graphs=(data/pubmed.el.xz data/musae_github.el.xz data/blogcatalog.el.xz data/snap_web_notredame.el.xz
          data/tu_nci1.el.xz data/deezer_egos.el.xz data/reddit10k.el.xz)
  for dtype in f16 bf16; do
    for dim in 64 128 256; do
      for heads in 1 8; do
        "$b/bench_fused3s" --no-baselines --dim "$dim" --heads "$heads" --dtype "$dtype" --repeat 20 "${graphs[@]}" \
          >> "$out/matrix.jsonl" 2>> "$out/stderr.log" || status=1
      done
    done
  done
  grep -c graph "$out/matrix.jsonl"
fi

if [ "$what" = large ]; then
  # Batches of small graphs (like the batched anchors rows), then a >= 100M-edge R-MAT
  # (Reddit-like skew) and a 10M-node / 120M-edge uniform graph.
  "$b/bench_fused3s" --dim 128 --heads 1 --repeat 20 --batch 1024:10:40 --batch 1024:20:60 --batch 8192:10:40 \
    > "$out/batches.jsonl" 2>> "$out/stderr.log" || status=1
  "$b/bench_fused3s" --dim 128 --heads 1 --repeat 10 --rmat 23:8 --er 10000000:12 \
    > "$out/large.jsonl" 2>> "$out/stderr.log" || status=1
  cat "$out/large.jsonl"
fi

if [ "$what" = sweep ]; then
  # The split threshold against the cost model (0) on graphs of each kind.
  "$b/bench_fused3s" --no-baselines --repeat 20 --split 0,8,16,32,64,100000 data/cora.el.xz data/pubmed.el.xz \
    data/twitch_ru.el.xz data/musae_github.el.xz data/blogcatalog.el.xz data/snap_web_notredame.el.xz \
    data/tu_nci1.el.xz --rmat 18:10 > "$out/sweep.jsonl" 2>&1 || status=1
fi

# Block-sparse attention (issue 5): our kernel over random block masks, then SDPA (flash, cuDNN)
# and flex_attention with the same masks. BLOCK_SPARSE_ARGS overrides the sweep's extent.
if [ "$what" = blocksparse ]; then
  masks=$(mktemp -d)
  "$b/bench_block_sparse" --export "$masks" ${BLOCK_SPARSE_ARGS:---n 4096,32768 --g 64,128 --p 0.5,0.9,0.95,0.99} \
    > "$out/block_sparse_ours.jsonl" 2>> "$out/stderr.log" || status=1
  python3 bench/python/block_sparse.py "$out/block_sparse_ours.jsonl" --mask-dir "$masks" \
    > "$out/block_sparse.jsonl" 2>> "$out/stderr.log" || status=1
  tail -c 1500 "$out/block_sparse.jsonl"; tail -5 "$out/stderr.log"
  # Top-k masks selected on the device: selection time against the attention under the mask.
  "$b/bench_block_sparse" ${BLOCK_SPARSE_TOPK_ARGS:---n 4096,32768 --g 64,128 --topk 8,26} \
    > "$out/block_sparse_topk.jsonl" 2>> "$out/stderr.log" || status=1
  tail -c 600 "$out/block_sparse_topk.jsonl"
fi
# The report's sweep (issue 5): per N, our fused kernel and the report's three kernels
# (cuda_block_unfused, per-kernel times), then the PyTorch baselines; each N's lines are appended as it
# finishes, so a call cut short keeps what it finished. SWEEP_NS, SWEEP_SEEDS, SWEEP_ARGS (e.g. --heads 1
# --dim 128) and SWEEP_TAG (the output file's suffix) override.
if [ "$what" = reportsweep ]; then
  masks=$(mktemp -d)
  for n in ${SWEEP_NS:-1024 4096 16384 32768 65536 131072}; do
    "$b/bench_block_sparse" --n "$n" --g 1,2,8,32,64,128 --p 0.5,0.9,0.95,0.99 --seeds "${SWEEP_SEEDS:-3}" --repeat 10 \
      --unfused --no-mma-sync --max-pairs 268435456 --max-unfused-pairs 8589934592 \
      --export "$masks" ${SWEEP_ARGS:-} > "$masks/ours.jsonl" 2>> "$out/stderr.log" || status=1
    python3 bench/python/block_sparse.py "$masks/ours.jsonl" --mask-dir "$masks" --repeat 10 \
      >> "$out/sweep${SWEEP_TAG:-}.jsonl" 2>> "$out/stderr.log" || status=1
    rm -f "$masks"/*.u8
    echo "N=$n done $(date +%T)"
  done
fi
# Our inputs are laid out [heads, N, D] (--heads-first), as flex_attention's are: at 128K that
# layout alone is 0-4% faster for our kernel than [N, heads, D] (docs/performance.md, 2026-11-22).
if [ "$what" = flexsweep ]; then  # the fused kernel against flex_attention, G 64 and 128, long N
  masks=$(mktemp -d)
  for n in ${SWEEP_NS:-32768 65536 131072}; do
    "$b/bench_block_sparse" --n "$n" --g 64,128 --p 0.5,0.9,0.95,0.99 --seeds "${SWEEP_SEEDS:-1}" \
      --repeat 10 --no-mma-sync --heads-first --export "$masks" ${SWEEP_ARGS:-} > "$masks/ours.jsonl" \
      2>> "$out/stderr.log" || status=1
    python3 bench/python/block_sparse.py "$masks/ours.jsonl" --mask-dir "$masks" --repeat 10 \
      >> "$out/flexsweep${SWEEP_TAG:-}.jsonl" 2>> "$out/stderr.log" || status=1
    rm -f "$masks"/*.u8
    echo "N=$n done $(date +%T)"
  done
fi
# The block-sparse GPU tests under compute-sanitizer (quick mode), in one call: memcheck and
# racecheck each over four filters at once (the whole suite in one racecheck process takes more
# than a call's 10 minutes; correctness only, so sharing the GPU is harmless).
if [ "$what" = bssanitize ]; then
  filters=('GpuBlockSparse.EveryBlockType*:GpuBlockSparse.WgmmaKernelOnStrided*'
           'GpuBlockSparse.ManyWorkItemsPerBlock:GpuBlockSparse.TopK*:GpuBlockSparse.RectangularCausalTopKMasks'
           'GpuBlockSparse.LayoutsAndEdgeCases:GpuBlockSparse.FineBlocks*:GpuBlockSparse.TheReports*:GpuBlockSparse.Rejects*'
           'GpuBlockSparse.BlocksOfLaterWaves*')
  logs=$(mktemp -d)
  for tool in ${BS_TOOLS:-memcheck racecheck}; do
    for i in "${!filters[@]}"; do
      TRISPARSE_GPU_TEST_QUICK=1 timeout "${BS_TIMEOUT:-560}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$b/tests/gpu_tests" --gtest_filter="${filters[$i]}" > "$logs/$i.log" 2>&1 &
    done
    failed=0
    for job in $(jobs -p); do wait "$job" || failed=1; done
    [ $failed = 0 ] || status=1
    for i in "${!filters[@]}"; do  # one file per tool (the device tool brings back at most 8)
      { echo "=== $tool ${filters[$i]}"; cat "$logs/$i.log"; } >> "$out/bs_$tool.log"
      echo "$tool $i: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$logs/$i.log" | tr '\n' ' ')"
    done
  done
fi
exit $status
