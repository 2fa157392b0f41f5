#!/usr/bin/env bash
# llama.cpp as speculor builds it, from the source that llama-cpp-python VERSION vendors (its sdist):
#   build.sh python VERSION PYTHON   llama-cpp-python itself, patches/llama.cpp/*.patch applied, into PYTHON's env
#   build.sh stock  VERSION DIR      ggml's CPU backend without the patches (libggml-base.so, libggml-cpu.so) into DIR:
#                                    the unchanged kernels, the negative control of tests/test_llama_bits.py
#   build.sh server VERSION FILE     llama-server without the patches (the peer users run) as FILE
# CMAKE_ARGS from the environment is passed on (the Makefile's: -march=native without AMX tiles).
set -euo pipefail
mode=$1 version=$2 dest=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$tmp" 2>/dev/null
mkdir "$tmp/src"
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp/src" --strip-components=1
llama="$tmp/src/vendor/llama.cpp"
eval "flags=(-DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-})"  # CMAKE_ARGS holds quoted words
case $mode in
  python)
    for p in "$root"/patches/llama.cpp/*.patch; do
      patch -d "$llama" -p1 --forward --quiet < "$p"
    done
    "$dest" -m pip install -q "$tmp/src"   # pip reads CMAKE_ARGS itself
    ;;
  stock)
    cmake -S "$llama" -B "$tmp/build" -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "${flags[@]}" > /dev/null
    cmake --build "$tmp/build" --target ggml-cpu -j2 > /dev/null
    mkdir -p "$dest"
    cp "$tmp"/build/bin/libggml-base.so "$tmp"/build/bin/libggml-cpu.so "$dest"/
    ;;
  server)
    cmake -S "$llama" -B "$tmp/build" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      "${flags[@]}" > /dev/null
    cmake --build "$tmp/build" --target llama-server -j2 > /dev/null
    mkdir -p "$(dirname "$dest")"
    cp "$tmp/build/bin/llama-server" "$dest.partial"
    mv "$dest.partial" "$dest"
    ;;
  *)
    echo "build.sh: unknown mode $mode (python, stock or server)" >&2
    exit 2
    ;;
esac
