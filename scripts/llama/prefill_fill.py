"""#36 must-show after the prompts' context (runtime/llama/fill.py): prefill of 500-2000-token prompts on the llama.cpp
backend against llama-cpp-python's own (high-level Llama.eval, its defaults) on the same prompts, 2 threads, 4 rounds,
the two interleaved and their order alternated round by round; the ratio is the median of the per-round ratios.
Run: .venv/bin/python scripts/llama/prefill_fill.py (record: docs/bench/cpu-never-slower/prefill_fill_stop56.txt)"""

import statistics
import time

import torch

from speculor import load_pair
from speculor.api import Speculor
from speculor.bench.prompts import sharegpt_records
from speculor.runtime.backend import forward1
from speculor.runtime.llama import quiet_llama
from speculor.runtime.prepare import gguf_file

torch.set_num_threads(2)
pair = load_pair(backend="llama.cpp", threads=2, draft=None)
sp = Speculor(pair, strategy="plain")
texts = [c["value"] for r in sharegpt_records(400) for c in r.get("conversations", [])[:1] if len(c["value"]) > 400]
prompts, pool = [], iter(texts)
for n in (500, 1000, 1500, 2000):  # ShareGPT turns joined until the chat-templated prompt has n tokens
    body = ""
    while len(sp.encode("Summarize:\n\n" + body, chat=True)) < n:
        body += next(pool) + "\n\n"
    prompts.append(sp.encode("Summarize:\n\n" + body, chat=True)[:n])
llm = quiet_llama(gguf_file(pair.target_name), threads=2, n_ctx=4096)


def ours(x):
    c = pair.target.new_cache()
    t0 = time.perf_counter()
    forward1(pair.target, c, x, last=True)
    return time.perf_counter() - t0


def theirs(x):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(x)
    return time.perf_counter() - t0


times = {len(x): ([], []) for x in prompts}
for rnd in range(4):
    for x in prompts:
        if rnd % 2 == 0:
            a = ours(x)
            b = theirs(x)
        else:
            b = theirs(x)
            a = ours(x)
        times[len(x)][0].append(a)
        times[len(x)][1].append(b)
for n, (a, b) in times.items():
    r = [y / x for x, y in zip(a, b, strict=False)]
    print(
        f"{n:5d} tokens: speculor {n / statistics.median(a):6.1f} tokens/s, llama-cpp-python "
        f"{n / statistics.median(b):6.1f} tokens/s: {statistics.median(r):.3f}x (per round "
        f"{' '.join(f'{v:.3f}' for v in r)})",
        flush=True,
    )
