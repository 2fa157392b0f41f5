"""EAGLE-2-style deterministic dynamic tree (docs/algorithms.md §6), as the `topk-tree` strategy.

Glossary (EAGLE-2's names): the *confidence* c_u(y) = softmax(draft logits at u)(y), untempered; the *value* of a
node V = Π c along its path from the root, kept as a sum of log-probabilities.

    layer = [root]; pool = []
    for step in 1..depth:                         # one draft forward per step over <= k rows
        cand = [child(u, y, V_u · c_u(y)) for u in layer for y in top-k(c_u)]
        pool += cand
        layer = top-k of cand by V                # expansion: only these are fed forward
    selected = top-`budget` of pool by V, ties -> shallower, then earlier   (reranking)

Children are chosen deterministically, so the tree is verified with the point-mass rule at temperature > 0
(accept child x with probability r(x), else r(x) <- 0 and renormalise; exact for any tree, §2) and by greedy
matching at temperature 0, never with the ratio test (biased: §2's table). The selection is closed under parents:
a child's value is <= its parent's and on a tie the shallower node ranks first, so every selected node's parent
ranks before it. Draft forwards per step <= depth (the catch-up forward gives the root's logits); a node outside
the pool's current top `budget - 1` is not fed (values only fall, so no child of it could be selected), which
ends the growth early when no node of a layer can matter.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from speculor.config import SamplingConfig, check_int
from speculor.core.sampling import check_finite
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal, Shared, catch_up, feed, keep_fed_path
from speculor.errors import SpeculorError
from speculor.runtime.backend import Backend, Pair


@dataclass(frozen=True)
class TopkOptions:
    """budget: draft tokens per step (the reranked tree size); depth: draft steps (most tokens on a path);
    k: children per expanded node and nodes expanded per step (EAGLE-2: 60 / 6 / 10 on a GPU)."""

    budget: int = 16
    depth: int = 6
    k: int = 4

    def __post_init__(self) -> None:
        for name, value, top in (("budget", self.budget, 1024), ("depth", self.depth, 64), ("k", self.k, 64)):
            check_int(name, value, 1, top)


@dataclass
class Pool:
    """Every candidate made: its token, parent (pool index, -1 = root), log value and depth, in creation order."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def expand(self, parent: int, logits: torch.Tensor, k: int) -> list[int]:
        """Add the top-k children of `parent` (value V_parent + log c(y)); returns their pool indices."""
        check_finite(logits, "draft")
        logc = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logc, min(k, int(torch.isfinite(logc).sum())))
        base = self.values[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        out = []
        for y, lc in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            out.append(len(self.tokens))
            self.tokens.append(y)
            self.parents.append(parent)
            self.values.append(base + lc)
            self.depths.append(depth)
        return out


def rank(values: list[float], depths: list[int], among: list[int] | None = None) -> list[int]:
    """Pool indices (all, or `among`) best first: higher value, then shallower, then created earlier."""
    among = list(range(len(values))) if among is None else among
    return sorted(among, key=lambda i: (-values[i], depths[i], i))


def select(pool: Pool, budget: int) -> list[int]:
    """The reranked tree: the top-`budget` pool nodes (closed under parents), ordered by depth then creation so
    that parents come first."""
    chosen = rank(pool.values, pool.depths)[:budget]
    return sorted(chosen, key=lambda i: (pool.depths[i], i))


class TopkTreeDrafter(Drafter):
    """The EAGLE-2-style tree from a draft model (module docstring). After `propose`: `values` (log values of
    the tree's nodes), `rows` (tree node -> pending row of the draft cache for fed nodes), `stats`."""

    def __init__(self, model: Backend, opts: TopkOptions | None = None) -> None:
        self.model, self.opts = model, opts or TopkOptions()
        self.cache = model.new_cache()
        self.forwards = 0
        self.rows: dict[int, int] = {}
        self.values: list[float] = []
        self.stats: dict[str, float] = {}

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        pool, fed = yield from self._grow((yield from catch_up(self.model, self.cache, seq)))
        chosen = select(pool, self.opts.budget)
        index = {p: i for i, p in enumerate(chosen)}
        assert all(pool.parents[p] < 0 or pool.parents[p] in index for p in chosen), "reranking broke the tree"
        parents = [index[pool.parents[p]] if pool.parents[p] >= 0 else -1 for p in chosen]
        self.rows = {index[p]: r for p, r in fed.items() if p in index}
        self.values = [pool.values[p] for p in chosen]
        self.stats = {"nodes": len(chosen), "pool": len(pool.tokens), "fed_rows": len(fed)}
        return DraftTree(torch.tensor([pool.tokens[p] for p in chosen], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), None, "point")

    def _grow(self, root_logits: torch.Tensor) -> Generator[Any, Any, tuple[Pool, dict[int, int]]]:
        """The candidate pool after `depth` steps, and pool index -> pending row of the nodes fed forward."""
        pool, fed = Pool(), {}
        cand = pool.expand(-1, root_logits, self.opts.k)
        self.forwards = 1
        for _ in range(1, self.opts.depth):
            kept = set(rank(pool.values, pool.depths)[: self.opts.budget - 1])  # else no child can be selected
            layer = [u for u in rank(pool.values, pool.depths, cand)[: self.opts.k] if u in kept]
            if not layer:
                break
            logits, rows = yield from feed(self.model, self.cache, [pool.tokens[u] for u in layer],
                                [fed.get(pool.parents[u], -1) for u in layer])
            self.forwards += 1
            fed.update(zip(layer, rows, strict=True))
            cand = [c for i, u in enumerate(layer) for c in pool.expand(u, logits[i], self.opts.k)]
        return pool, fed

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        assert self.cache.length == n_committed, "the draft cache must hold exactly the committed tokens"
        keep_fed_path(self.cache, self.rows, verdict.path)


def make_topk_tree(pair: Pair, budget: int = 16, depth: int = 6, k: int = 4) -> Shared:
    """Builder of the `topk-tree` strategy (see `TopkOptions`)."""
    if pair.draft is None:
        raise SpeculorError("strategy 'topk-tree' needs a draft model")
    return Shared(partial(TopkTreeDrafter, pair.draft, TopkOptions(budget, depth, k)))
