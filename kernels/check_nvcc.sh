#!/usr/bin/env bash
# Compile every CUDA source in kernels/ for sm_90 with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "check_nvcc: nvcc not found (set NVCC=)" >&2; exit 1; }
shopt -s nullglob
files=(*.cu)
if [ ${#files[@]} -eq 0 ]; then echo "check_nvcc: no .cu files"; exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  "$NVCC" -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
    -c "$f" -o "$tmp/${f%.cu}.o"
  echo "check_nvcc: $f ok (sm_90)"
done
