"""Drafters: anything that proposes a `DraftTree` after the committed sequence.

Protocol: `reset()` before a generation; `propose(seq, cfg, generator)` returns a tree whose root is
seq[-1]; `observe(n_committed, verdict)` is told what the target accepted (n_committed = len(seq) at
propose time) so the drafter can keep the cache entries of the accepted path and drop the rest.
"""

from __future__ import annotations

from typing import Protocol

import torch

from speculor.config import SamplingConfig
from speculor.models import LM
from speculor.sampling import check_finite, greedy, sample, warp
from speculor.tree import DraftTree
from speculor.verify import Verdict


class Drafter(Protocol):
    forwards: int  # draft forward passes made by the last propose()

    def reset(self) -> None: ...

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree: ...

    def observe(self, n_committed: int, verdict: Verdict) -> None: ...


def catch_up(lm: LM, seq: list[int]) -> torch.Tensor:
    """Feed the committed tokens the draft cache lacks (always at least the root); logits of the root."""
    lm.truncate(len(seq) - 1)
    pending = seq[lm.length:]
    logits = lm.forward(pending)[-1]
    lm.commit(list(range(len(pending))))
    return logits


def draw(logits: torch.Tensor, cfg: SamplingConfig,
         generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """One draft token and the distribution q it was drawn from (None when greedy)."""
    check_finite(logits, "draft")
    if cfg.greedy:
        return greedy(logits), None
    q = warp(logits, cfg)
    return sample(q, generator), q


class ChainDrafter:
    """K tokens from a draft model, one at a time (Leviathan et al.; Chen et al.)."""

    def __init__(self, lm: LM, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.lm, self.k, self.forwards = lm, k, 0

    def reset(self) -> None:
        self.lm.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        logits = catch_up(self.lm, seq)
        tokens, qs = [], []
        for i in range(self.k):
            y, q = draw(logits, cfg, generator)
            tokens.append(y)
            qs.append(q)
            if i < self.k - 1:  # the last draft token is fed on the next step, if accepted
                logits = self.lm.forward([y])[-1]
                self.lm.commit([0])
        self.forwards = self.k
        return DraftTree.chain(tokens, None if cfg.greedy else torch.stack(qs))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        # the cache holds seq, y_1..y_{k-1}: keep the accepted y's that were fed
        self.lm.truncate(n_committed + min(len(verdict.path), self.k - 1))
