#!/usr/bin/env bash
# A/B on the GPU machine, in one call: the same benchmark set from two builds, alternating, so that
# "no performance lost" is measured on one card in one session. Results (JSONL) go under $OUT;
# bench/compare_ab.py prints the table.
#   fused 3S: every shared graph, the anchors' setting (1 head, d = 128, f16), two rounds;
#   block-sparse: N = 32K and 128K, G = 64 and 128, p = 0.5 to 0.99, 8 heads, d = 64;
#   SpMM (n = 128) and SDDMM (d = 32): ten shared graphs, two rounds.
# AB_ROUNDS=1 runs every set once (both builds), to fit a shorter lease; AB_ONLY=blocks
# runs only its second round (this build first, then the parent's); AB_ONLY=fused, sparse or
# fused,sparse runs only those sets, two rounds in both orders.
# Build both here (Release, sm_90, benchmarks) and pack them:
#   tar -cJf .devpack/base.tar.xz -C build/gpu-base bench_fused3s bench_me_bcrs bench_block_sparse
#   tar -cJf .devpack/new.tar.xz -C build/gpu bench_fused3s bench_me_bcrs bench_block_sparse ...
# then call with carry = [.devpack, .devlibs, data]: scripts/gpu_ab.sh
set -uo pipefail
final=${OUT:-/tmp/trisparse-ab}
out=/tmp/ab/runs
mkdir -p "$final" "$out" /tmp/ab/base /tmp/ab/new
tar -xJf .devpack/base.tar.xz -C /tmp/ab/base
tar -xJf .devpack/new.tar.xz -C /tmp/ab/new
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader \
  | tee "$out/gpu.txt"
graphs=(data/*.el.xz)
ten=(data/cora.el.xz data/citeseer.el.xz data/pubmed.el.xz data/blogcatalog.el.xz
     data/musae_github.el.xz data/deezer_europe.el.xz data/snap_web_notredame.el.xz
     data/snap_ca_hepth.el.xz data/dimacs10_delaunay_n14.el.xz data/gemsec_deezer_hu.el.xz)
present=()
for g in "${ten[@]}"; do [ -f "$g" ] && present+=("$g"); done
fused() { "/tmp/ab/$1/bench_fused3s" --dim 128 --heads 1 --dtype f16 --repeat 20 --no-baselines \
            "${graphs[@]}" > "$out/fused3s_$1_$2.jsonl" 2>> "$out/stderr.log"; }
sparse() { "/tmp/ab/$1/bench_me_bcrs" --n 128 --d 32 --repeat 20 --no-baselines "${present[@]}" \
             > "$out/sparse_$1_$2.jsonl" 2>> "$out/stderr.log"; }
blocks() { "/tmp/ab/$1/bench_block_sparse" --n 32768,131072 --g 64,128 --p 0.5,0.9,0.95,0.99 \
             --heads 8 --dim 64 --no-mma-sync > "$out/block_sparse_$1_$2.jsonl" 2>> "$out/stderr.log"; }
start=$SECONDS
if [[ "${AB_ONLY:-}" == *fused* || "${AB_ONLY:-}" == *sparse* ]]; then
  if [[ "$AB_ONLY" == *fused* ]]; then
    fused base 1; fused new 1; fused new 2; fused base 2; echo "fused3s, two rounds: $((SECONDS - start)) s"
  fi
  if [[ "$AB_ONLY" == *sparse* ]]; then
    sparse new 1; sparse base 1; sparse base 2; sparse new 2; echo "sparse, two rounds: $((SECONDS - start)) s"
  fi
  tar -cf "$final/ab_runs.tar" -C "$out" .
  exit 0
fi
if [ "${AB_ONLY:-}" = blocks ]; then
  blocks new 2; blocks base 2; echo "block-sparse round 2: $((SECONDS - start)) s"
  tar -cf "$final/ab_runs.tar" -C "$out" .
  exit 0
fi
fused base 1; fused new 1; echo "fused3s round 1: $((SECONDS - start)) s"
sparse new 1; sparse base 1; echo "sparse round 1: $((SECONDS - start)) s"
blocks base 1; blocks new 1; echo "block-sparse round 1: $((SECONDS - start)) s"
if [ "${AB_ROUNDS:-2}" -ge 2 ]; then
  fused new 2; fused base 2; echo "fused3s round 2: $((SECONDS - start)) s"
  sparse base 2; sparse new 2; echo "sparse round 2: $((SECONDS - start)) s"
  blocks new 2; blocks base 2; echo "block-sparse round 2: $((SECONDS - start)) s"
fi
tail -3 "$out/stderr.log" 2>/dev/null
tar -cf "$final/ab_runs.tar" -C "$out" .
