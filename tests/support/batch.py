"""Batched decoding for the batch tests: a few prompts of the tiny models, and a helper that decodes them together
through `speculor.engine.batch`."""

from __future__ import annotations

from speculor.engine import batch as batched_engine

PROMPTS = [[3, 14, 15, 9, 2, 6], [27, 18, 28], [1, 1, 2, 3, 5, 8, 13, 21, 34], [60, 61]]


def run_batch(target, makers, prompts, cfgs) -> list[list[int]]:
    """The token ids of each request (a drafter made by `makers[i]`, `prompts[i]`, `cfgs[i]`) decoded in one batch."""
    out: list[list[int]] = [[] for _ in prompts]
    entries = [(make(), p, c) for make, p, c in zip(makers, prompts, cfgs, strict=True)]
    for i, toks in batched_engine.generate(target, entries):
        out[i].extend(t.id for t in toks)
    return out
