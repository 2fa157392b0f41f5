"""The host time a grammar adds per step, on real generations of the embedded pair (llama.cpp, 2 threads): BFCL
simple_python questions answered with their tools (tool_choice auto), plain constrained decoding and the server's
default strategy. Run from the repository root (bfcl-eval installed):

    .venv/bin/python scripts/grammar/host.py [questions]

First what a forced run's fill costs per row against a decode step (a block of k rows, its last row's logits, after
a 400-token prompt: the call a forced run makes). Then every entry into the grammar's state from the engine (masks,
the tree walk, forced runs, fast-forward, consuming emitted tokens; llguidance's own calls included) is timed;
printed per strategy: steps, tokens, those seconds per step and per token, and the wall seconds per token.
"""

from __future__ import annotations

import sys
import time
from functools import wraps

from speculor import SamplingConfig, Speculor, load_pair
from speculor.bench import toolcalls
from speculor.grammar.state import GrammarState
from speculor.serving.app import DEFAULT_STRATEGY, default_options

spent = [0.0]
depth = [0]


def timed(fn):
    @wraps(fn)
    def run(*args, **kwargs):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:  # an entry from outside the grammar's state
                spent[0] += time.perf_counter() - t0

    return run


for _name in ("allowed", "advance", "forced_run", "fast_forward", "walk"):
    setattr(GrammarState, _name, timed(getattr(GrammarState, _name)))


def fill_cost(pair, reps: int = 7) -> None:
    """Seconds of a k-row fill call (last row's logits) over k, against a one-row call, median of `reps`."""
    from speculor.runtime.backend import forward1

    target = pair.target
    cache = target.new_cache()
    forward1(target, cache, list(range(1000, 1400)), last=True)
    cache.keep(list(range(400)))
    one = None
    for k in (1, 2, 4, 8, 16, 32):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            forward1(target, cache, list(range(2000, 2000 + k)), last=True)
            times.append(time.perf_counter() - t0)
            cache.keep([])
        t = sorted(times)[reps // 2]
        one = one or t
        print(
            f"fill of {k:2d} rows: {1000 * t:6.1f} ms, {1000 * t / k:5.1f} ms a row = {t / k / one:.2f} of a "
            "decode step"
        )


def main(n: int) -> None:
    pair = load_pair(threads=2)
    fill_cost(pair)
    sp = Speculor(pair, strategy="plain")
    qs = toolcalls.load("bfcl-simple", n)
    cfg = SamplingConfig(max_new_tokens=256)
    for name, opts in (("plain", {}), (DEFAULT_STRATEGY[0], default_options(pair))):
        sp.generate(qs[0].messages, cfg, tools=qs[0].tools, strategy=name, **opts)  # warm-up
        spent[0], steps, tokens, wall = 0.0, 0, 0, 0.0
        for q in qs:
            out = sp.generate(q.messages, cfg, tools=q.tools, strategy=name, **opts)
            steps, tokens = steps + len(out.stats.steps), tokens + len(out.token_ids)
            wall += out.total_s - out.stats.prefill_s
        g = spent[0]
        print(
            f"{name:8s} {len(qs)} answers, {steps} steps, {tokens} tokens: grammar {1000 * g / steps:.2f} ms a step "
            f"({1000 * g / tokens:.2f} ms a token; {100 * g / wall:.1f}% of the time after the prompt's fill, "
            f"{1000 * wall / tokens:.1f} ms a token)"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
