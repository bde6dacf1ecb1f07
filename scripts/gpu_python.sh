#!/usr/bin/env bash
# On the GPU machine, in one call: builds the Python package there (its Python 3.12, torch and
# nvcc; sm_90 only, to keep the build short) and runs the pytest suite with CUDA, the GPU tests
# included; with PY_BENCH=1 then the Python benchmarks (below). Call with carry = [data] for the
# dataset tests. Logs and results go under $OUT.
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
  tests/python ${PYTEST_ARGS:-} > "$out/pytest.log" 2>&1
status=$?
tail -15 "$out/pytest.log"
# PY_BENCH=1: then the benchmarks with the package: the attention training step against PyG on
# the graphs in PY_BENCH_GRAPHS, and the Planetoid models PY_BENCH_MODELS (both backends,
# PY_BENCH_SEEDS seeds).
if [ "${PY_BENCH:-0}" = 1 ]; then
  export PYTHONPATH="$site" TRISPARSE_DATASETS=$PWD/data
  graphs=${PY_BENCH_GRAPHS:-cora pubmed blogcatalog musae_github reddit10k deezer_egos het_tolokers snap_web_notredame}
  paths=()
  for g in $graphs; do paths+=("data/$g.el.xz"); done
  python3 bench/python/attention_training.py --dim 64 --heads 8 "${paths[@]}" \
    > "$out/attention_training.jsonl" 2>> "$out/bench_stderr.log"
  echo "attention training: $((SECONDS - start)) s"
  for model in ${PY_BENCH_MODELS:-gcn gat transformer}; do
    for dataset in cora citeseer; do
      for backend in pyg trisparse; do
        python3 examples/python/train_planetoid.py --model $model --dataset $dataset \
          --backend $backend --seeds "${PY_BENCH_SEEDS:-10}" --root data/planetoid --json \
          >> "$out/planetoid_training.jsonl" 2>> "$out/bench_stderr.log"
      done
    done
  done
  echo "planetoid: $((SECONDS - start)) s"
  tail -5 "$out/bench_stderr.log"
fi
# BLOCK_BENCH=1: the block-sparse forward and forward+backward against flex_attention.
if [ "${BLOCK_BENCH:-0}" = 1 ]; then
  PYTHONPATH="$site" python3 bench/python/block_sparse_training.py ${BLOCK_BENCH_ARGS:-} \
    > "$out/block_sparse_training.jsonl" 2>> "$out/bench_stderr.log"
  echo "block-sparse training: $((SECONDS - start)) s"
  tail -3 "$out/bench_stderr.log"
fi
# GNN_BENCH=1: the three example models' epoch time, peak memory and (Graph Transformer)
# inference, both backends, on the largest shared graphs and a generated 1M-node graph.
if [ "${GNN_BENCH:-0}" = 1 ]; then
  PYTHONPATH="$site" python3 bench/python/gnn_epoch.py ${GNN_BENCH_ARGS:---graphs \
    data/snap_web_notredame.el.xz data/deezer_egos.el.xz data/het_tolokers.el.xz \
    --generate 1000000:10} > "$out/gnn_epoch.jsonl" 2>> "$out/bench_stderr.log"
  echo "gnn epochs: $((SECONDS - start)) s"
fi
# GCN_BENCH=1: the GCN layer with its ReLU against PyG's GCNConv + ReLU, both orders.
if [ "${GCN_BENCH:-0}" = 1 ]; then
  graphs=${GCN_BENCH_GRAPHS:-cora citeseer pubmed musae_github het_tolokers deezer_egos snap_web_notredame}
  paths=()
  for g in $graphs; do paths+=("data/$g.el.xz"); done
  PYTHONPATH="$site" python3 bench/python/gcn_layer.py "${paths[@]}" \
    > "$out/gcn_layer.jsonl" 2>> "$out/bench_stderr.log"
  echo "GCN layer: $((SECONDS - start)) s"
fi
# LAYER_BENCH=1: one TransformerConv layer's forward + backward against PyG's on every shared
# graph with at least 200K edges, fp32 and bf16 autocast.
if [ "${LAYER_BENCH:-0}" = 1 ]; then
  PYTHONPATH="$site" python3 bench/python/transformer_conv.py data/*.el.xz \
    > "$out/transformer_conv.jsonl" 2>> "$out/bench_stderr.log"
  echo "TransformerConv layer: $((SECONDS - start)) s"
  tail -3 "$out/bench_stderr.log"
fi
exit $status
