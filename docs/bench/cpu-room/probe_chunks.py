# a prompt filled through the server's path (engine/batch.py step) in chunks of c rows, in the prompts' context: time and the cells' bytes per chunk size
# python probe_chunks.py 32,128,512
import sys, time, hashlib, numpy as np, torch
from speculor import load_pair, SamplingConfig
from speculor.api import Speculor
from speculor.bench import prompts as P
from speculor.engine.loop import start, Stats
from speculor.engine.batch import Active, step
from speculor.runtime import llama_fill as fill
pair = load_pair(backend="llama.cpp", threads=2)
sp = Speculor(pair, strategy="plain")
T = pair.target
texts = [p for p in P.load(["mtbench", "humaneval", "summarize"], 4)]
encs = sorted({len(e): e for e in (sp.encode(p.text, chat=True) for p in texts)}.items())
sel = [encs[0][1], encs[len(encs)//2][1], encs[-1][1]]
cfg = SamplingConfig(max_new_tokens=2)
sizes = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 64, 128, 512]
for rnd in range(2):
  for enc in sel:
    ref = None
    for c in sizes:
        T.prompts.clear()
        a = Active(start(T, None, enc, cfg, Stats(), prefill=False), sp.eos_ids)
        t0 = time.perf_counter(); calls = 0
        while a.req.unfilled:
            step(T, [a], chunk=c); calls += 1
        t = time.perf_counter() - t0
        st = fill.parse(fill.state_of(T.L, T.ctx, a.req.cache.base))
        h = hashlib.sha1(b"".join(k.tobytes() for _, _, k in st.keys) + b"".join(np.ascontiguousarray(v).tobytes() for _, _, v in st.values)).hexdigest()[:10]
        out = step(T, [a], chunk=c)[0]
        print(f"round {rnd} n={len(enc)} chunk {c}: {t:.2f}s {calls} steps cells {h} first {[x.id for x in out]}", flush=True)
        a.req.cache.trim(0) if hasattr(a.req.cache, 'trim') else None
        T.release() if hasattr(T, 'release') else None
