"""`eagle` (docs/algorithms.md §14): one boost-tuned head on the target's own features (the pool's SSM 1,
drafters/heads.py) grows DySpec's dynamic tree with its q (DySpec's rule, drafters/dynamic_tree.py: each draw's value
known before the token is seen, siblings SWOR): exact under sampling, and batch-aware with budget="auto" like
`dyspec`. The pool's other strategy, specinfer:drafters=boosted, merges every SSM's tree (heads.py `BoostedDrafter`).

The drafters that read the target's hidden states have a `store` (one request's FeatureStore), and the engine gives
it the target's features of every committed position (engine/steps.py `keep_features`).
"""

from __future__ import annotations

from functools import partial

import torch

from speculor.config import SamplingConfig
from speculor.drafters.base import Proposal, Shared
from speculor.drafters.dynamic_tree import DySpecDrafter, DySpecOptions
from speculor.drafters.heads import head_cost, pool
from speculor.runtime.backend import Pair
from speculor.runtime.cost import CostModel
from speculor.runtime.eagle_head import FeatureStore, HeadModel


class EagleDrafter(DySpecDrafter):
    """DySpec's dynamic tree drafted by one head over this request's features (`store`)."""

    def __init__(self, head: HeadModel, opts: DySpecOptions, cost: CostModel | None) -> None:
        self.store = FeatureStore()
        super().__init__(head.bind(self.store), opts, cost)
        if head.first_rate is not None:  # the prior of the first-token rate: the head's measured one
            self.first_rate = head.first_rate
        self.reads_features = not self.declines  # whether the target's forwards hand it their features

    @property
    def declines(self) -> bool:
        """auto, and alone no draft can pay at the first-token rate: it never drafts alone (the rate is frozen once
        it declines), so it needs no features, not even the prompt's."""
        return self.auto and not self.can_pay

    def reset(self) -> None:
        self.store.clear()
        super().reset()
        self.reads_features = not self.declines

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        if self.ledger is not None:  # in a batch a draft may pay: the features from now on
            self.reads_features = True
        if self.reads_features and len(seq) > 1 and self.store.get(len(seq) - 2) is None:
            return self.decline()  # no draft before the root's parent has a feature (a head without it walks the
            # whole prompt; a prompt whose call scored the root gave none: engine/steps.py `prompt_features`)
        tree = yield from super().propose(seq, cfg, generator)
        if self.skipped and self.ledger is None:  # alone, `can_pay` only falls (a is frozen then)
            self.reads_features = False
        return tree

    @property
    def can_pay(self) -> bool:
        """auto, alone: as DySpec's, and one draft token must pay at the rate first tokens were accepted so far
        (the head's q is more confident than it is right, so its values alone draft where it cannot pay):

            (1 + a) / (t_target(2) + t_draft(1)) > 1 / t_target(1),  a = the moving first-token rate.

        Decided from earlier steps only (exact); once it fails the request decodes plainly (a is no longer updated)."""
        c = self.cost
        return super().can_pay and (1 + self.first_rate) / (c.t_target(2) + c.t_draft(1)) > 1 / c.t_target(1)


def make_eagle(pair: Pair, budget: int | str = "auto", depth: int = 6, threshold: float | None = None,
               heads: str | None = None) -> Shared:
    """Builder of the `eagle` strategy: DySpec's tree from the pool's first head (budget, depth and threshold as
    `dyspec`'s; auto sizes it by the machine's target curve and the head's own cost)."""
    opts = DySpecOptions("threshold", budget, threshold, depth)
    head = pool(pair, heads)[0]
    cost = head_cost(pair, head) if budget == "auto" else None
    return Shared(partial(EagleDrafter, head, opts, cost))
