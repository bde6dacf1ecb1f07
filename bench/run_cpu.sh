#!/usr/bin/env bash
# The CPU section of docs/performance.md in one run: trisparse's fused CPU engine, its float64
# reference and PyG's TransformerConv message path on PyTorch CPU, on the same graphs.
#   bench/run_cpu.sh [BUILD_DIR] [PYTHON]      (PYTHON needs torch and torch_geometric)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build/release}
python=${2:-python3}
data=${TRISPARSE_DATASETS:-$here/../shared/datasets}
graphs=("$data/pubmed.el.xz" "$data/snap_web_notredame.el.xz")
out=${OUT:-$build/bench-cpu}
mkdir -p "$out"
echo "# $(date -u +%F) commit $(git -C "$here" rev-parse --short HEAD) $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee "$out/meta.txt"
"$build/bench_attention_cpu" --dim 128 --heads 1 --repeat 10 "${graphs[@]}" | tee "$out/trisparse.jsonl"
"$python" "$here/bench/python/pyg_attention.py" --dim 128 --heads 1 --repeat 10 --threads "$(nproc)" "${graphs[@]}" | tee "$out/pyg.jsonl"
