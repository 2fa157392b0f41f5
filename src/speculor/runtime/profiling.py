"""Measuring this machine's cost curve (runtime/cost.py's `CostModel`) on a pair's models: `time_forwards` times one
model's forwards, `profile_cost` the pair's, and `machine_cost` is the pair's cached profile, measured once where none
is cached (a minute or two; what Sequoia's, DySpec's and the other strategies' `budget="auto"` read), and again where
the target's exact calls, timed at the first read in a process, have moved off it (`drifted`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from speculor.runtime.backend import Pair, forward1
from speculor.runtime.cost import CostModel, Measured, cached_cost, cost_path, machine_key
from speculor.runtime.model import Model

logger = logging.getLogger("speculor")


STALE = 0.15  # how far t(k)/t(1) timed now may be off the cached profile's (relative) before it is measured again
SIZES = (*range(1, 17), 24, 32, 48, 64, 96, 128)  # block sizes timed (every one to 16: llama.cpp's curve steps with
# the 4-row blocks of its repacked kernels, and with calls="vector" t(n) = t(3) per 3 rows + the rest); others
# interpolated


def _sync(model: Model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def time_forwards(model: Model, sizes: Sequence[int], *, prefix: int = 200, repeats: int = 3,
                  tick: Callable[[], object] | None = None) -> list[float]:
    """Median seconds of one `model.forward` over a block of n tokens after `prefix` committed tokens, per n.

    A block is a chain given as a tree (its parents), so it runs in the calls a draft tree of n rows runs in
    (llama.cpp: its call class's calls, runtime/llama/model.py), not in a prompt's. Every size is run once untimed
    first; the repeats then run in rounds over all sizes (not back to back), so a burst of load from another
    process spreads over sizes instead of inflating one. Uses a cache of its own;
    `tick()` after every forward.
    """
    cache = model.new_cache()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(model.vocab_size, 1000), (prefix + max(sizes),), generator=g)
    forward1(model, cache, tokens[:prefix])
    cache.keep(list(range(prefix)))
    def block(n: int):
        return forward1(model, cache, tokens[prefix:prefix + n], torch.arange(-1, n - 1))

    for n in sizes:  # warm-up: every block size once, untimed (a cold first forward made t(1) read 0.37 s > t(4))
        block(n)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            _sync(model)
            t0 = time.perf_counter()
            block(n)
            _sync(model)
            times[i].append(time.perf_counter() - t0)
            if tick is not None:
                tick()
    return [statistics.median(t) for t in times]


def implausible(ns: Sequence[int], seconds: Sequence[float], slack: float = 1.5) -> bool:
    """True when a bigger block was timed much faster than a smaller one (a busy machine, not the model)."""
    return any(seconds[j] * slack < seconds[i] for i in range(len(ns)) for j in range(i + 1, len(ns)))


def profile_cost(pair: Pair, sizes: Sequence[int] = SIZES, *, repeats: int = 3, progress: bool = True) -> CostModel:
    """Time the target on blocks of n tokens and the draft on blocks of w tokens, after a 200-token prefix."""
    from tqdm import tqdm  # only when profiling: the decoding path imports no progress bar

    with tqdm(total=2 * len(sizes) * repeats, desc="profile target+draft", unit="fwd", disable=not progress) as bar:
        t = time_forwards(pair.target, sizes, repeats=repeats, tick=bar.update)
        d = ([0.0] * len(sizes) if pair.draft is None  # model-free drafts (n-gram) cost nothing
             else time_forwards(pair.draft, sizes, repeats=repeats, tick=bar.update))
    if implausible(sizes, t) or implausible(sizes, d):
        logger.warning("sequoia: forward times do not grow with the block size (%s); the machine looks busy: "
                       "run `speculor profile --force` when it is idle", [round(x, 3) for x in t])
    return CostModel(tuple(sizes), tuple(t), tuple(sizes), tuple(d), tuple(sorted(machine_key(pair).items())))


def drifted(model: Model, cost: CostModel, sizes: Sequence[int] = (2, 3), repeats: int = 5) -> bool:
    """Whether the model's blocks of k rows, timed now against one row, are off the profile's t(k)/t(1) by more than
    STALE for some k in sizes: the curve the budgets priced by is no longer the machine's (llama.cpp's kernels on a
    shared CPU: 1.53 cached, 1.8 measured for t(2)/t(1) on another day)."""
    now = time_forwards(model, (1, *sizes), repeats=repeats)
    return any(abs(now[i] / now[0] / (cost.t_target(k) / cost.t_target(1)) - 1) > STALE
               for i, k in enumerate(sizes, 1))


def machine_cost(pair: Pair, *, progress: bool = True) -> CostModel:
    """The cached cost model of this machine and pair; profiles (a minute or two) if there is none, or, where the
    target times its exact calls (llama.cpp), if its first read in this process finds it `drifted`. Once a process:
    a seeded sampled request's tree, priced by it, follows from its seed for the process's life."""
    path = cost_path(pair)

    def measure() -> CostModel:
        logger.warning("speculor: profiling forward times on this machine for --budget auto (cached in %s)", path)
        return profile_cost(pair, progress=progress)

    def stale(cost: CostModel) -> bool:
        if pair.target.call_times is None or not drifted(pair.target, cost):
            return False
        logger.warning("speculor: the target's calls have moved off the cached cost profile by more than %d%%",
                       round(STALE * 100))
        return True

    return cached_cost(path, measure, stale)


def live_cost(pair: Pair, *, progress: bool = True) -> CostModel | Measured:
    """`machine_cost` with its target curve following the target's calls as they are timed (runtime/cost.Measured),
    where the target times them (llama.cpp's exact calls): the model-free drafts' cuts."""
    cost = machine_cost(pair, progress=progress)
    return cost if pair.target.call_times is None else Measured(cost, pair.target.call_times)
