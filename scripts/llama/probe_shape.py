"""Does a call's time depend on the shape of the call before it? t(1), t(2), t(3) of our llama.cpp target in runs of
one shape, alternating, and with a rare multi-row call among one-row calls (kernel seconds: llama_decode alone)."""

import statistics as st
import sys

import torch

import speculor
from speculor.runtime.backend import forward1

pair = speculor.load_pair("default", threads=2)
m = pair.target
g = torch.Generator().manual_seed(0)
toks = torch.randint(0, 1000, (4000,), generator=g).tolist()
cache = m.new_cache()
pos = 400
forward1(m, cache, toks[:pos])
cache.keep(list(range(pos)))


def call(n):
    global pos
    k0 = m.kernel_s
    forward1(m, cache, toks[pos : pos + n], torch.arange(-1, n - 1))
    cache.keep(list(range(n)))
    pos += n
    return m.kernel_s - k0


def pattern(shapes):
    got = {}
    for i, n in enumerate(shapes):
        got.setdefault((n, shapes[i - 1] if i else None), []).append(call(n))
    return {k: (st.median(v) * 1e3, len(v)) for k, v in got.items()}


for n in (1, 2, 3):
    call(n)
for rnd in range(2):
    for name, shapes in (
        ("runs of 1", [1] * 30),
        ("runs of 2", [2] * 30),
        ("runs of 3", [3] * 30),
        ("1/2 alternating", [1, 2] * 15),
        ("1/3 alternating", [1, 3] * 15),
        ("rare 2 (1 in 8)", ([1] * 7 + [2]) * 5),
        ("rare 3 (1 in 8)", ([1] * 7 + [3]) * 5),
    ):
        res = pattern(shapes)
        print(
            f"round {rnd} {name:18s}",
            "  ".join(
                f"t({n}) after {p}: {ms:.1f} ms x{c}"
                for (n, p), (ms, c) in sorted(res.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
            ),
        )
    sys.stdout.flush()
print("timed calls (EMA ms):", [round(x * 1e3, 1) for x in m.call_times.s[1:]] if m.call_times else None)
