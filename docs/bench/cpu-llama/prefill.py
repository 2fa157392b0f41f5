"""#26 must-show: prefill tokens/s on the llama.cpp backend against llama.cpp's own (high-level Llama.eval) on the
same prompts, 2 threads, interleaved, 3 rounds."""
import statistics, sys, time
import torch
from speculor import load_pair
from speculor.bench import prompts as P
from speculor.runtime.backend import forward1
from speculor.runtime.llama import quiet_llama
from speculor.runtime.loading import gguf_file
from speculor.api import Speculor

torch.set_num_threads(2)
pair = load_pair(backend="llama.cpp", threads=2, draft=None)
sp = Speculor(pair, strategy="plain")
sets = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mtbench", "humaneval", "code-edit", "summarize"]
ps = P.load(sets, 8)
ids = [sp.encode(p.text, chat=p.chat) for p in ps]
llm = quiet_llama(gguf_file(pair.target_name), threads=2, n_ctx=4096)
ours, theirs = [], []
for rnd in range(3):
    for x in ids:
        t0 = time.perf_counter(); c = pair.target.new_cache(); forward1(pair.target, c, x, last=True); ours.append(len(x) / (time.perf_counter() - t0)); del c
        llm.reset(); t0 = time.perf_counter(); llm.eval(x); theirs.append(len(x) / (time.perf_counter() - t0))
print("prompt tokens", [len(x) for x in ids])
print(f"speculor llama.cpp backend prefill: median {statistics.median(ours):.1f} tokens/s; llama.cpp Llama.eval: median {statistics.median(theirs):.1f} tokens/s; ratio of medians {statistics.median(ours)/statistics.median(theirs):.3f}")
r = [a / b for a, b in zip(ours, theirs)]
print(f"per prompt ratio: median {statistics.median(r):.3f}, min {min(r):.3f}, max {max(r):.3f}")
