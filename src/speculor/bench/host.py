"""Host time of a decoding step: what a plain step of the engine spends outside the model's kernels (the Python of
the engine and the backend, copies of logit rows, verification). llama.cpp's backend counts its seconds inside
llama_decode (`kernel_s`); torch's does not, so there a step's host time is read against t(1) of the cost curve."""

from __future__ import annotations

import statistics
import time

from speculor.config import SamplingConfig
from speculor.engine import Stats
from speculor.engine.loop import stream
from speculor.runtime.backend import Pair

PROMPT = list(range(1000, 1200))  # 200 tokens, as the cost curve's prefix
TOKENS = 33


def plain_step_s(pair: Pair, rounds: int = 3) -> tuple[float, float | None]:
    """(seconds of one plain decoding step, of it inside the kernels or None where not counted): medians over
    `rounds` generations of TOKENS tokens after PROMPT."""
    walls, kernels = [], []
    cfg = SamplingConfig(max_new_tokens=TOKENS, stop_on_eos=False)
    for _ in range(rounds):
        stats = Stats()
        tokens = stream(pair.target, None, PROMPT, cfg, stats=stats)
        next(tokens)  # the prefill and the first step
        k0, n0, t0 = pair.target.kernel_s, len(stats.steps), time.perf_counter()
        for _tok in tokens:
            pass
        steps = stats.steps[n0:]
        walls.append((time.perf_counter() - t0) / len(steps))
        if k0 is not None:
            kernels.append((pair.target.kernel_s - k0) / len(steps))
    return statistics.median(walls), (statistics.median(kernels) if kernels else None)


def host_line(pair: Pair, t1: float) -> str:
    """One line for `speculor profile`: a plain step's wall time, its host time and share, beside t(1)."""
    wall, kernel = plain_step_s(pair)
    host = wall - (kernel if kernel is not None else t1)
    against = "in llama_decode" if kernel is not None else "t(1) of the curve"
    return (f"plain step: {1000 * wall:.2f} ms, {1000 * (wall - host):.2f} ms {against}, host {1000 * host:.2f} ms "
            f"({host / wall:.1%}) a step")
