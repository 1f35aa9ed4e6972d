#!/usr/bin/env bash
# GPU checks for a lent NVIDIA machine (see CONTRIBUTING.md). Installs nothing from
# the network: the machine's own python3 has CuPy, NumPy, Numba and pytest. UCX
# (ucxx) tests need the ucxx wheels carried in .whl/ (optional).
# Usage (device tool): bash bench/gpu_check.sh   -- details land in $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "install failed; see $OUT/install.log"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
bash kernels/check_nvcc.sh >"$OUT/nvcc.log" 2>&1; nvcc_rc=$?
# -p no:cacheprovider: the tree may be read-only; -o addopts= drops the default marker filter.
$PY -m pytest -p no:cacheprovider -o addopts= -m gpu -rA --strict-markers tests \
  --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1; tests_rc=$?
$PY -m pytest -p no:cacheprovider -o addopts= -m "bench and gpu" tests/bench --benchmark-enable \
  --benchmark-json="$OUT/gpu-bench.json" >"$OUT/gpu-bench.log" 2>&1; bench_rc=$?
echo
echo "== GPU check =="
cat "$OUT/gpu.txt"
printf '%-22s %s\n' "nvcc sm_90 compile" "$([ $nvcc_rc = 0 ] && echo ok || echo FAILED)"
printf '%-22s %s\n' "gpu tests" "$(tail -1 "$OUT/gpu-tests.log")"
printf '%-22s %s\n' "gpu benchmarks" "$(tail -1 "$OUT/gpu-bench.log")"
[ $nvcc_rc = 0 ] && [ $tests_rc = 0 ] && { [ $bench_rc = 0 ] || [ $bench_rc = 5 ]; }
