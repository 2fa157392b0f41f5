"""Several drafters' trees merged by identical prefixes into one (SpecInfer's merge-based trees)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculor.config import SamplingConfig
from speculor.core.tree import merge
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal
from speculor.errors import SpeculorError


class MergedDrafter(Drafter):
    """Several drafters' trees merged by identical token prefixes into one (SpecInfer's merge-based trees;
    see `tree.merge` for why it verifies exactly). The drafters must draw independently of each other (each
    model drafter with its own cache). forwards = the sum of theirs."""

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise SpeculorError("a merged drafter needs at least one drafter")
        self.drafters = list(drafters)
        self.forwards = 0
        self.merged = None

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        trees = []
        for d in self.drafters:  # in turn: each drafter's draws come from the request's generator in this order
            trees.append((yield from d.propose(seq, cfg, generator)))
        self.forwards = sum(d.forwards for d in self.drafters)
        self.merged = merge(trees)
        return self.merged.tree

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        for s, d in enumerate(self.drafters):
            d.observe(n_committed, Verdict(self.merged.sub_path(s, verdict.path), verdict.token))
