"""#36 must-show: prefill of 500-2000-token prompts on the llama.cpp backend against llama-cpp-python's own
(high-level Llama.eval, its defaults) on the same prompts, 2 threads, interleaved, 3 rounds.
Run: .venv/bin/python docs/bench/cpu-never-slower/prefill_long.py"""
import statistics, time
import torch
from speculor import load_pair
from speculor.api import Speculor
from speculor.bench.prompts import sharegpt_records
from speculor.runtime.backend import forward1
from speculor.runtime.llama import quiet_llama
from speculor.runtime.loading import gguf_file

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
ours, theirs = {len(x): [] for x in prompts}, {len(x): [] for x in prompts}
for rnd in range(3):
    for x in prompts:
        c = pair.target.new_cache(); t0 = time.perf_counter(); forward1(pair.target, c, x, last=True)
        ours[len(x)].append(time.perf_counter() - t0); del c
        llm.reset(); t0 = time.perf_counter(); llm.eval(x); theirs[len(x)].append(time.perf_counter() - t0)
for n in ours:
    a, b = statistics.median(ours[n]), statistics.median(theirs[n])
    r = [y / x for x, y in zip(ours[n], theirs[n])]
    print(f"{n:5d} tokens: speculor {n / a:6.1f} tokens/s, llama-cpp-python {n / b:6.1f} tokens/s: "
          f"{b / a:.3f}x (per round {min(r):.3f}-{max(r):.3f})")
