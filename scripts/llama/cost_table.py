"""t(n)/t(1) of a tree block of n rows (one forward, runtime/profiling.py `time_forwards`) on the embedded 1.5B
target in one call class, and the seconds of a 512-token prompt's prefill; one JSON line. Run once per class, each in
its own process (ggml reads its tiled-matmul switch once per process):

    .venv/bin/python scripts/llama/cost_table.py exact     # the patched kernels, calls of up to 31 rows
    .venv/bin/python scripts/llama/cost_table.py vector    # calls of at most 3 rows
    LD_PRELOAD=$STOCK/libggml-base.so:$STOCK/libggml-cpu.so .venv/bin/python scripts/llama/cost_table.py batched
                                                           # llama.cpp as released, its own call sizes
"""

import json
import statistics
import sys
import time

import torch

from speculor.runtime.backend import forward1
from speculor.runtime.embedded import ensure_gguf
from speculor.runtime.llama.model import LlamaModel
from speculor.runtime.profiling import time_forwards

calls = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
model = LlamaModel(ensure_gguf("qwen2.5-coder-1.5b-instruct"), threads=2, calls=calls, n_ctx=4096)
sizes = list(range(1, 33))
t = time_forwards(model, sizes, repeats=rounds)
tokens = torch.randint(10, 5000, (512,), generator=torch.Generator().manual_seed(1))
prefill = []
for _ in range(3):
    cache = model.new_cache()
    t0 = time.perf_counter()
    forward1(model, cache, tokens)
    prefill.append(time.perf_counter() - t0)
    del cache
print(json.dumps({"calls": model.calls, "t1_ms": round(t[0] * 1000, 2),
                  "ratio": {n: round(x / t[0], 3) for n, x in zip(sizes, t, strict=True)},
                  "prefill512_s": round(statistics.median(prefill), 3)}))
