#!/usr/bin/env bash
# On the GPU machine, in one call: builds the Python module there (sm_90 only, Release, its nvcc
# and Python; no file readers: the machine has none of their libraries), runs the GPU tests
# matching GTEST (a gtest filter; "none" skips them) from gpu_tests built here and packed in
# .devpack/gpu_tests.tar.xz, the CUDA pytest tests matching PYTEST_K in PYTEST_FILES (default: all
# of test_cuda.py; "none" skips them), and with BENCH=1 the layer benchmarks
# (bench/python/transformer_conv.py, both layers, on BENCH_GRAPHS; BENCH_ARGS, default: edge
# features and a random 10M-edge multigraph), with GPS=1 GPS's global attention (bench/python/gps_attention.py), with
# TRAIN=1 GPS training on OGB molecules, with AB_ENVS an A/B of a runtime switch (both below).
# Build and pack here first:
#   cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRISPARSE_CUDA=ON \
#         -DCMAKE_CUDA_ARCHITECTURES=90 -DTRISPARSE_DATASETS_DIR=data
#   scripts/devpack.sh && mkdir -p .devlibs data
#   cp -L /lib/x86_64-linux-gnu/libzip.so.4 /lib/x86_64-linux-gnu/libbz2.so.1.0 .devlibs/
#   cp ../shared/datasets/* data/   (and ogbg/, planetoid/)
# and call with carry = [.devpack, .devlibs, data]. Where .devpack's libtrisparse.a was built from
# the sources here (its stamp, scripts/source_stamp.sh), the module links it and compiles alone
# (the kernels are most of the 90-110 s build); else, or if that link fails, the whole library
# builds here. Logs go under $OUT (a device call brings back at most 8 files: the tests' logs and
# benchmark files of one call count together).
set -uo pipefail
out=${OUT:-/tmp/trisparse-dev}
mkdir -p "$out"
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
scripts/describe_tree.sh | tee -a "$out/gpu.txt"
build_module() {  # $1: the prebuilt library, or empty to build it from source
  cmake -S . -B build/device -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRISPARSE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTRISPARSE_PYTHON=ON -DTRISPARSE_IO=OFF -DTRISPARSE_BUILD_TESTS=OFF \
    -DTRISPARSE_BUILD_CLI=OFF -DTRISPARSE_BUILD_BENCH=OFF -DTRISPARSE_PREBUILT_LIBRARY="$1" \
    > "$out/build.log" 2>&1 &&
    cmake --build build/device -j "$(nproc)" --target trisparse_python trisparse_python_files \
      >> "$out/build.log" 2>&1 && PYTHONPATH=build/device/python python3 -c "import trisparse._C"
}
# Only the packed test binaries (no pytest, benchmarks or pytest under memcheck): no module.
python_needed=1
if [ "${PYTEST_K:-}" = none ] && [ -z "${SANITIZE_K:-}" ] &&
  [ "${BENCH:-0}${BLOCK:-0}${EXPHORMER:-0}${GPS:-0}${TRAIN:-0}" = 00000 ] && [ -z "${AB_ENVS:-}" ]; then
  python_needed=0
fi
lib=
if [ "$python_needed" = 1 ] && [ -f .devpack/libtrisparse.a.xz ] &&
  [ "$(cat .devpack/libtrisparse.stamp 2>/dev/null)" = "$(scripts/source_stamp.sh)" ]; then
  mkdir -p /tmp/prebuilt && xz -dc .devpack/libtrisparse.a.xz > /tmp/prebuilt/libtrisparse.a &&
    lib=/tmp/prebuilt/libtrisparse.a
fi
if [ "$python_needed" = 0 ]; then
  echo "library: none (no Python module needed)"
elif [ -n "$lib" ] && build_module "$lib"; then
  echo "library: prebuilt (.devpack, sources unchanged)"
else
  [ -n "$lib" ] && { echo "library: the prebuilt one failed, building it here"; tail -5 "$out/build.log"; }
  build_module "" || { grep -B2 -A12 "error" "$out/build.log" | head -60; exit 1; }
  echo "library: built here"
fi
echo "build: $((SECONDS - start)) s"
status=0
export TRISPARSE_DATASETS=$PWD/data TRISPARSE_GPU_TEST_QUICK=1
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ "${GTEST:-*}" != none ]; then
  mkdir -p /tmp/packed && tar -xJf .devpack/gpu_tests.tar.xz -C /tmp/packed
  # TEST_SHARDS processes share the GPU and split the host's cores between their OpenMP float64
  # references (4 shards each on all 16 cores took 1,149 s of test time against 149 s in one).
  n=${TEST_SHARDS:-1} pids=()
  for ((i = 0; i < n; i++)); do
    OMP_NUM_THREADS=$(($(nproc) / n > 0 ? $(nproc) / n : 1)) \
      GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i /tmp/packed/gpu_tests --gtest_brief=1 \
      --gtest_filter="${GTEST:-*}" > "$out/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  cat "$out"/gpu_tests_*.log > "$out/gpu_tests.log" && rm -f "$out"/gpu_tests_*.log
  passed=$(grep -ho '^\[  PASSED  \] [0-9]*' "$out/gpu_tests.log" | awk '{s += $NF} END {print s + 0}')
  echo "gpu_tests: $passed passed in $n shards, $(grep -c '^\[  FAILED  \] [A-Z]' "$out/gpu_tests.log") failed"
  # Every op x backend x dtype on CUDA, and offsets and sizes past 2^31 (tests/generic), where packed.
  if [ -x /tmp/packed/op_gpu_tests ]; then
    /tmp/packed/op_gpu_tests > "$out/op_gpu_tests.log" 2>&1 || status=1
    grep -E "cases on|FAILED|PASSED" "$out/op_gpu_tests.log" | head -5
  fi
  if [ -x /tmp/packed/large_gpu_tests ]; then
    /tmp/packed/large_gpu_tests --gtest_brief=1 > "$out/large_gpu_tests.log" 2>&1 || status=1
    tail -3 "$out/large_gpu_tests.log"
  fi
  echo "gpu tests: $((SECONDS - start)) s"
fi
# SANITIZE=1: compute-sanitizer memcheck and racecheck side by side over the generic test's ops
# named in SANITIZE_OPS (TRISPARSE_OPS; "none" skips them), both over the GPU tests matching
# SANITIZE_GTEST (a gtest filter) where set, in SANITIZE_SHARDS processes side by side (gtest's
# sharding; racecheck over GpuAttentionBackward.* takes ~12 min in one, 5.5 in four), and the
# tools in SANITIZE_K_TOOLS (default memcheck) over the pytest tests matching SANITIZE_K in
# SANITIZE_FILES (default test_cuda.py), with SANITIZE_ARGS (e.g. "--kernel-name kns=trisparse
# --print-limit 1000": our kernels only); each under SANITIZE_SECONDS.
if [ "${SANITIZE:-0}" = 1 ]; then
  mkdir -p /tmp/packed && tar -xJf .devpack/gpu_tests.tar.xz -C /tmp/packed
  for tool in memcheck racecheck; do
    if [ "${SANITIZE_OPS:-}" != none ]; then
      TRISPARSE_OPS=${SANITIZE_OPS:-block_sparse_dropout,segment,topk} timeout "${SANITIZE_SECONDS:-300}" \
        compute-sanitizer --tool $tool --error-exitcode 9 /tmp/packed/op_gpu_tests \
        > "$out/${tool}_ops.log" 2>&1 &
    fi
    if [ -n "${SANITIZE_GTEST:-}" ]; then
      for ((i = 0; i < ${SANITIZE_SHARDS:-1}; i++)); do
        GTEST_TOTAL_SHARDS=${SANITIZE_SHARDS:-1} GTEST_SHARD_INDEX=$i timeout "${SANITIZE_SECONDS:-300}" \
          compute-sanitizer --tool $tool --error-exitcode 9 /tmp/packed/gpu_tests --gtest_brief=1 \
          --gtest_filter="$SANITIZE_GTEST" > "$out/${tool}_gtest_shard$i.part" 2>&1 &
      done
    fi
  done
  if [ -n "${SANITIZE_K:-}" ]; then
    for tool in ${SANITIZE_K_TOOLS:-memcheck}; do
      # shellcheck disable=SC2086
      timeout "${SANITIZE_SECONDS:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
        ${SANITIZE_ARGS:-} env PYTHONPATH=build/device/python python3 -m pytest -q -p no:cacheprovider \
        ${SANITIZE_FILES:-tests/python/test_cuda.py} -k "$SANITIZE_K" > "$out/${tool}_pytest.log" 2>&1 &
    done
  fi
  wait
  for tool in memcheck racecheck; do  # one log a tool, the shards' in order
    ls "$out/${tool}"_gtest_shard*.part > /dev/null 2>&1 || continue
    cat "$out/${tool}"_gtest_shard*.part > "$out/${tool}_gtest.log" && rm -f "$out/${tool}"_gtest_shard*.part
  done
  for f in "$out"/*check_*.log; do
    echo "$(basename "$f"): $(grep -E 'cases on|PASSED|ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$f" | tr '\n' ' ')"
    grep -q -E "ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]|FAILED" "$f" && status=1
  done
  echo "sanitize: $((SECONDS - start)) s"
fi
if [ "${PYTEST_K:-}" != none ]; then
  # Tests poison every workspace (_tensors.workspace); benchmarks below do not pay that fill.
  TRISPARSE_POISON_WORKSPACE=1 PYTHONPATH=build/device/python python3 -m pytest -q -p no:cacheprovider ${PYTEST_FILES:-tests/python/test_cuda.py} \
    ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -8
  echo "pytest: $((SECONDS - start)) s"
fi
if [ "${BENCH:-0}" = 1 ]; then
  graphs=()
  for g in ${BENCH_GRAPHS:-snap_web_notredame deezer_egos het_tolokers}; do graphs+=("data/$g.el.xz"); done
  for layer in ${BENCH_LAYERS:-TransformerConv GATConv}; do
    PYTHONPATH=build/device/python python3 bench/python/transformer_conv.py --layer $layer \
      --min-edges 1000000 "${graphs[@]}" ${BENCH_ARGS:---edge-dim 16 --random 1000000:10000000} \
      >> "$out/layers_edge.jsonl" 2>> "$out/stderr.log" || status=1
  done
  tail -5 "$out/stderr.log"
  echo "bench: $((SECONDS - start)) s"
fi
# GAT_KERNELS=1: the fused GAT attention's kernels (bench_layers --only gat, packed by devpack.sh
# with BENCH_BINS=bench_layers) on BENCH_GRAPHS, head layouts GAT_LAYOUTS: dropout factors read,
# none, and drawn in the kernels.
if [ "${GAT_KERNELS:-0}" = 1 ]; then
  mkdir -p /tmp/bench && tar -xJf .devpack/bench.tar.xz -C /tmp/bench
  graphs=()
  for g in ${BENCH_GRAPHS:-snap_web_notredame deezer_egos het_tolokers}; do graphs+=("data/$g.el.xz"); done
  # shellcheck disable=SC2086
  /tmp/bench/bench_layers --only gat --gat ${GAT_LAYOUTS:-8:8 8:16 1:16} --repeat 20 "${graphs[@]}" \
    > "$out/gat_kernels.jsonl" 2>> "$out/stderr.log" || status=1
  echo "gat kernels: $((SECONDS - start)) s"
fi
# BLOCK=1: block-sparse attention through the package against FlexAttention, forward and
# forward + backward (bench/python/block_sparse_training.py with BLOCK_ARGS).
if [ "${BLOCK:-0}" = 1 ]; then
  PYTHONPATH=build/device/python python3 bench/python/block_sparse_training.py ${BLOCK_ARGS:-} \
    > "$out/block_sparse_training.jsonl" 2>> "$out/stderr.log" || status=1
  echo "block: $((SECONDS - start)) s"
fi
# EXPHORMER=1: an Exphormer model, trisparse against PyG's layers (bench/python/exphormer.py).
if [ "${EXPHORMER:-0}" = 1 ]; then
  PYTHONPATH=build/device/python python3 bench/python/exphormer.py data/snap_web_notredame.el.xz \
    data/deezer_egos.el.xz > "$out/exphormer.jsonl" 2>> "$out/stderr.log" || status=1
  echo "exphormer: $((SECONDS - start)) s"
fi
# GPS=1: GPS's global attention against FlexAttention and PyG's padded path (NCI1).
if [ "${GPS:-0}" = 1 ]; then
  PYTHONPATH=build/device/python python3 bench/python/gps_attention.py data/tu_nci1.graph_ptr.xz \
    ${GPS_ARGS:-} > "$out/gps_attention.jsonl" 2> "$out/stderr.log" || status=1
  tail -3 "$out/stderr.log"
  echo "gps: $((SECONDS - start)) s"
fi
# TRAIN=1: GPS on ogbg-molbace and ogbg-molesol (scaffold split), both backends, TRAIN_SEEDS seeds
# of TRAIN_EPOCHS epochs (examples/python/train_gps_ogbg.py).
if [ "${TRAIN:-0}" = 1 ]; then
  for ds in ${TRAIN_SETS:-ogbg-molbace ogbg-molesol}; do
    for backend in pyg trisparse; do
      PYTHONPATH=build/device/python python3 examples/python/train_gps_ogbg.py --dataset "$ds" \
        --backend $backend --root data/ogbg --seeds "${TRAIN_SEEDS:-1}" --epochs "${TRAIN_EPOCHS:-20}" \
        --json ${TRAIN_ARGS:-} >> "$out/gps_training.jsonl" 2>> "$out/stderr.log" || status=1
      echo "$ds $backend: $((SECONDS - start)) s"
    done
  done
  tail -3 "$out/stderr.log"
fi
# AB_ENVS ("NAME=a NAME=b ..."): AB_CMD (a command printing JSON lines, read by bash -c) under each
# setting in turn and then in reverse order (A B B A for two), each line labelled with its setting,
# into $out/ab_env.jsonl: an A/B of a runtime switch in one build.
if [ -n "${AB_ENVS:-}" ]; then
  read -ra envs <<< "$AB_ENVS"
  order=("${envs[@]}")
  for ((i = ${#envs[@]} - 1; i >= 0; i--)); do order+=("${envs[i]}"); done
  for e in "${order[@]}"; do
    env "$e" PYTHONPATH=build/device/python bash -c "$AB_CMD" 2>> "$out/stderr.log" |
      sed "s/^{/{\"env\": \"$e\", /" >> "$out/ab_env.jsonl" || status=1
    echo "$e: $((SECONDS - start)) s"
  done
fi
exit $status
