"""Chain drafting: K tokens from a draft model, one forward each (Leviathan et al.; Chen et al.)."""

from __future__ import annotations

import torch

from speculor.config import SamplingConfig
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Forward, Proposal, catch_up, draw, keep_chain
from speculor.runtime.backend import Backend, Block


class ChainDrafter(Drafter):
    """K tokens from a draft model, one at a time; the last one is fed on the next step, if accepted."""

    def __init__(self, model: Backend, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.model, self.k, self.forwards = model, k, 0
        self.cache = model.new_cache()

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        logits = yield from catch_up(self.model, self.cache, seq)
        tokens, qs = [], []
        for i in range(self.k):
            y, q = draw(logits, cfg, generator)
            tokens.append(y)
            qs.append(q)
            if i < self.k - 1:
                logits = (yield Forward(self.model, Block(self.cache, [y]))).logits[-1]
                self.cache.keep([0])
        self.forwards = self.k
        return DraftTree.chain(tokens, None if cfg.greedy else torch.stack(qs))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        keep_chain(self.cache, n_committed, len(verdict.path), self.k - 1)
