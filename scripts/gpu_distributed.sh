#!/usr/bin/env bash
# On a machine with several GPUs (kind nvidia-h200-x2 / -x4), in one call: builds the Python
# module there (scripts/gpu_dev.sh, with the GPU tests matching GTEST, default none), installs
# pymetis from .devpack/wheels if carried
# (pip download pymetis --only-binary=:all: --python-version 3.12 -d .devpack/wheels), runs the
# distributed tests over NCCL and the benchmarks of bench/python/distributed.py on 1 .. GPUS GPUs:
# the link, weak and strong scaling of the attention layer, context parallelism (MODES, default
# all of them), each under its own time limit; results under $OUT. NVLink multicast stays off.
# All four modes take more than one call's 10 minutes on 2 GPUs (build 85 s, tests 30 s, link 30 s,
# weak 150 s, strong 190 s): run MODES="link weak" in one call and MODES="strong context" in the next.
#   carry = [.devpack, .devlibs, data]; GPUS=4 MODES="link weak" bash scripts/gpu_distributed.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/trisparse-dist}
mkdir -p "$out"
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
counts=$(seq 1 "$gpus" | awk '$1 == 1 || $1 % 2 == 0' | tr '\n' ' ')
ls .devpack/wheels/pymetis*.whl > /dev/null 2>&1 &&
  python3 -m pip install -q --no-index .devpack/wheels/pymetis*.whl 2>&1 | tail -1
# The NCCL tests only (PYTEST_K; the Gloo ones run in CI and take ~4 minutes here).
GTEST=${GTEST:-none} PYTEST_K=${PYTEST_K:-nccl} PYTEST_FILES=tests/python/test_distributed.py OUT=$out \
  bash scripts/gpu_dev.sh || true
export PYTHONPATH=build/device/python
bench() {  # name, seconds, args...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" python3 bench/python/distributed.py "$@" >> "$out/$name.jsonl" 2>> "$out/$name.err"
  echo "$name: rc=$? $((SECONDS - start)) s"
}
for mode in ${MODES:-link weak strong context}; do
  case $mode in
    link) bench link 60 link --gpus $counts ;;
    weak) bench weak 200 weak --gpus $counts --repeat 5 ;;
    strong) bench strong 150 strong --gpus $counts --kinds rmat --edges 65000000 --repeat 5
            bench strong 60 strong --gpus $counts --kinds --graph data/snap_web_notredame.el.xz \
              --partition metis --repeat 5 ;;
    context) bench context 240 context --gpus $counts --seq 262144 1048576 --repeat 5 --ring ;;
  esac
done
