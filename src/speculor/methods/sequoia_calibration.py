"""Measuring Sequoia's acceptance vector (docs/algorithms.md §4.1) for a model pair: `speculor calibrate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal
from speculor.drafters.sequoia import Calibration
from speculor.drafters.static_tree import TreeDrafter
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair


class AcceptanceRecorder(Drafter):
    """A drafter wrapper that counts, per step, which child of the root was accepted (node i = rank i + 1)."""

    def __init__(self, inner: Any, width: int) -> None:
        self.inner, self.counts, self.steps = inner, [0] * width, 0

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        return (yield from self.inner.propose(seq, cfg, generator))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        self.steps += 1
        if verdict.path:
            self.counts[verdict.path[0]] += 1
        self.inner.observe(n_committed, verdict)


def calibrate(pair: Pair, prompts: Sequence[list[int]], cfg: SamplingConfig, *, width: int = 16, steps: int = 16,
              eos_ids: frozenset[int] = frozenset(), progress: bool = True, sets: str = "") -> Calibration:
    """Measure the acceptance vector of §4.1 for pair at cfg's temperature and top-p.

    Per step the engine drafts a depth-1 tree of `width` children drawn without replacement from q (the
    top-`width` tokens at temperature 0), verifies it (SWOR rule, or greedy matching at temperature 0) and
    commits the verdict, so contexts are those of real generation; `steps` steps per prompt (fewer if the
    prompt's generation ends). counts[k - 1] = steps where the k-th child was accepted.
    """
    if pair.draft is None:
        raise SpeculorError("calibration needs a draft model")
    recorder = AcceptanceRecorder(TreeDrafter(pair.draft, [-1] * width, draw="swor"), width)
    with tqdm(total=len(prompts) * steps, desc=f"calibrate T={cfg.temperature:g}", unit="step",
              disable=not progress) as bar:
        for i, ids in enumerate(prompts):
            run = replace(cfg, max_new_tokens=2 * steps, seed=None if cfg.seed is None else cfg.seed + i)
            start, done = recorder.steps, 0
            for _ in engine.stream(pair.target, recorder, ids, run, eos_ids):
                bar.update(recorder.steps - start - done)
                done = recorder.steps - start
                if done >= steps:
                    break
            bar.update(steps - done)  # a generation that ended early counts as done
    return Calibration(pair.target_name, pair.draft_name, cfg.temperature, cfg.top_p, tuple(recorder.counts),
                       recorder.steps, len(prompts), sets)
