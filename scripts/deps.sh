#!/usr/bin/env bash
# Installs what trisparse needs on Debian 12, by package name (apt), and NumPy (Debian or PyPI).
set -euo pipefail
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
packages=(cmake ninja-build g++ pkg-config clang libclang-rt-14-dev libomp-dev zlib1g-dev liblzma-dev
          libzip-dev libcli11-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev python3 python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The python3 on PATH may not be Debian's: give it NumPy from PyPI if it lacks it.
python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet numpy || true
