#!/usr/bin/env bash
# Installs what trisparse needs on Debian 12, by package name: apt, then PyPI (NumPy where the
# python3 on PATH lacks it; for the Python package, unless TRISPARSE_DEPS=cpp: torch,
# torch_geometric, scipy, pytest, nanobind, scikit-build-core, Pillow and pymetis).
set -euo pipefail
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
packages=(cmake ninja-build g++ pkg-config clang libclang-rt-14-dev libomp-dev zlib1g-dev liblzma-dev
          libzip-dev libpng-dev xtensor-dev libcli11-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev python3 python3-numpy
          python3-dev python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# PyPI packages for the python3 on PATH (Debian's own refuses pip without
# --break-system-packages, PEP 668).
pip_install() {
  python3 -m pip install --quiet "$@" 2>/dev/null || python3 -m pip install --quiet --break-system-packages "$@"
}
# The python3 on PATH may not be Debian's: give it NumPy from PyPI if it lacks it.
python3 -c "import numpy" 2>/dev/null || pip_install numpy || true
# The Python package's build and tests: skipped by the demo (TRISPARSE_DEPS=cpp).
if [ "${TRISPARSE_DEPS:-all}" = all ]; then
  python3 -c "import torch, torch_geometric, scipy, pytest, nanobind, scikit_build_core, PIL, pymetis" \
    2>/dev/null || pip_install "torch>=2.4" "torch_geometric>=2.5" scipy pytest "nanobind>=2.0" \
      "scikit-build-core>=0.10" pillow pymetis
fi
