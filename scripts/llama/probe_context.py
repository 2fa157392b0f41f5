"""Do t(2)/t(1) and t(3)/t(1) of our llama.cpp target move with the context length? Kernel seconds (llama_decode
alone) of 1-, 2- and 3-row calls interleaved, 12 of each, after prompts of 100 to 2000 tokens."""

import statistics as st

import torch

import speculor
from speculor.runtime.backend import forward1

pair = speculor.load_pair("default", threads=2)
m = pair.target
toks = torch.randint(0, 1000, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
for length in (100, 500, 1000, 2000, 100):
    cache, pos = m.new_cache(), length
    forward1(m, cache, toks[:pos])
    cache.keep(list(range(pos)))
    got = {1: [], 2: [], 3: []}
    for _ in range(12):
        for n in (1, 2, 3):
            k0 = m.kernel_s
            forward1(m, cache, toks[pos : pos + n], torch.arange(-1, n - 1))
            got[n].append(m.kernel_s - k0)
            cache.keep(list(range(n)))
            pos += n
    t = {n: st.median(v) * 1e3 for n, v in got.items()}
    print(
        f"context {length:5d}: t(1) {t[1]:.1f} ms, t(2)/t(1) {t[2] / t[1]:.2f}, t(3)/t(1) {t[3] / t[1]:.2f}", flush=True
    )
    del cache
