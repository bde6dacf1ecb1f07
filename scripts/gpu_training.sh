#!/usr/bin/env bash
# On the GPU machine, in one call: the attention training benchmark (bench_fused3s --training: the
# forward writing the log-sum-exp, the backward, and both) on every shared graph per head dim,
# heads and dtype in TRAIN_CONFIGS ("dim:heads:dtype ..."), plus generated graphs (TRAIN_GENERATED,
# bench_fused3s arguments: a 200K-neighbour hub, rmat20, a 10M-node uniform graph; set it empty
# for none) in the first configuration. Binaries come packed in
# .devpack/new.tar.xz (see scripts/gpu_ab.sh); call with carry = [.devpack, .devlibs, data].
# TRAIN_GRAPHS: the graph files (default data/*.el.xz). One JSONL under $OUT, training.jsonl, every
# configuration's records (each names its dim, heads and dtype); TRAIN_ARGS: more bench_fused3s
# arguments (e.g. --f32-dout). TRAIN_BASE=1: also the parent build's bench_fused3s from
# .devpack/base.tar.xz on the same inputs (base.jsonl), for an A/B in the same call; TRAIN_NEW:
# another packed build in place of .devpack/new.tar.xz; TRAIN_BUILDS="new2 ...": more packed
# builds (.devpack/NAME.tar.xz, NAME.jsonl), each configuration run by every build in turn. (A
# device call brings back at most 8 files.)
set -uo pipefail
out=${OUT:-/tmp/trisparse-training}
mkdir -p "$out" /tmp/train
# Each build: a name (its JSONL under $OUT) and its packed bench_fused3s.
builds=("training:${TRAIN_NEW:-.devpack/new.tar.xz}")
[ "${TRAIN_BASE:-0}" = 1 ] && builds+=("base:.devpack/base.tar.xz")
for b in ${TRAIN_BUILDS:-}; do builds+=("$b:.devpack/$b.tar.xz"); done
for b in "${builds[@]}"; do
  mkdir -p "/tmp/train/${b%%:*}" && tar -xJf "${b#*:}" -C "/tmp/train/${b%%:*}"
done
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
start=$SECONDS
generated=${TRAIN_GENERATED-hub:400000 --rmat 20:16 --er 10000000:8}
for c in ${TRAIN_CONFIGS:-128:1:f16 64:8:f16 128:8:bf16}; do
  IFS=: read -r dim heads dt <<< "$c"
  for b in "${builds[@]}"; do
    "/tmp/train/${b%%:*}/bench_fused3s" --dim "$dim" --heads "$heads" --dtype "$dt" --repeat 10 \
      --no-baselines --training ${TRAIN_ARGS:-} ${TRAIN_GRAPHS:-data/*.el.xz} $generated \
      >> "$out/${b%%:*}.jsonl" 2>> "$out/stderr.log"
  done
  generated=
  echo "$c: $((SECONDS - start)) s"
done
tail -3 "$out/stderr.log" 2>/dev/null
