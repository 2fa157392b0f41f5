"""llama-cpp-python alone: 64 one-token decodes of the 1.5B target (2 threads) in the main thread, then in a new
thread; with `--release`, the main thread ends its OpenMP team (runtime/openmp.py) before the other thread decodes."""

import os
import sys
import threading
import time

import llama_cpp

from speculor.runtime import openmp

m = llama_cpp.Llama(
    os.path.expanduser("~/.cache/speculor/gguf/qwen2.5-coder-1.5b-instruct.gguf"),
    n_threads=2,
    n_threads_batch=2,
    verbose=False,
    n_ctx=2048,
)
toks = m.tokenize(b"Write a short story about a robot who learns to paint.")


def run(tag: str) -> None:
    m.reset()
    m.eval(toks)
    t0 = time.perf_counter()
    for i in range(64):
        m.eval([toks[i % len(toks)]])
    print(f"{tag:7s} {(time.perf_counter() - t0) / 64 * 1000:.1f} ms/token", flush=True)


for _ in range(3):
    run("main")
    if "--release" in sys.argv:
        openmp.release()
    t = threading.Thread(target=run, args=("thread",))
    t.start()
    t.join()
