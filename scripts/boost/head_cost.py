"""The cost of a head forward against a target step on this machine (llama.cpp backend, 2 threads):
median seconds of one head forward over w rows of one depth (their parents' features known, as a tree grows) and of
one target forward of n rows after a 200-token prefix, 15 repeats each, interleaved.

    .venv/bin/python scripts/boost/head_cost.py
"""

import statistics
import time

import torch

from speculor import load_pair
from speculor.drafters.eagle import pool
from speculor.runtime.backend import Block, forward1
from speculor.runtime.eagle_head import FeatureStore

torch.set_num_threads(2)
pair = load_pair("default", "default", backend="llama.cpp", threads=2)
head = pool(pair)[0]
store = FeatureStore()
store.put(0, torch.randn(1, head.head.cfg.hidden_size))
view = head.bind(store)
target = pair.target
cache = target.new_cache()
forward1(target, cache, list(range(1000, 1200)))
cache.keep(list(range(200)))
times: dict[str, list[float]] = {}
for _ in range(15):
    for w in (1, 4):
        c = view.new_cache()
        c.length = 1
        t0 = time.perf_counter()
        view.forward([Block(c, list(range(w)), torch.full((w,), -1))])
        times.setdefault(f"head, {w} rows", []).append(time.perf_counter() - t0)
    for n in (1, 2, 3):
        t0 = time.perf_counter()
        forward1(target, cache, list(range(2000, 2000 + n)), torch.arange(-1, n - 1))
        times.setdefault(f"target, {n} rows", []).append(time.perf_counter() - t0)
t1 = statistics.median(times["target, 1 rows"])
for k, v in times.items():
    m = statistics.median(v)
    print(
        f"{k:16s} {m * 1e3:7.2f} ms  ({m / t1:.3f} of a 1-row target step; "
        f"min {min(v) * 1e3:.2f}, max {max(v) * 1e3:.2f})"
    )
