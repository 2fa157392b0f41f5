"""Static-tree drafting: a fixed tree shape drawn from a draft model, one batched draft forward per depth
(SpecInfer's expansions, Sequoia's DP trees)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch

from speculor.config import SamplingConfig
from speculor.core.sampling import check_finite, draw_iid, draw_swor, top_tokens, warp
from speculor.core.tree import DraftTree, check_shape, shape_levels
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal, catch_up, feed, keep_fed_path
from speculor.errors import SpeculorError
from speculor.runtime.backend import Backend, Cache


def draw_children(logits: torch.Tensor, k: int, cfg: SamplingConfig, draw: Literal["iid", "swor"],
                  generator: torch.Generator | None,
                  temperature: float | None = None) -> tuple[list[int], torch.Tensor | None]:
    """Up to k children of one node from its draft logits [V], in draw order, and the q they were drawn from.

    Greedy: the top-k distinct tokens and q = None. iid: k independent draws (repeats kept). swor: without
    replacement, capped at |supp q|. q = W(logits) at `temperature` if given, else at cfg's.
    """
    check_finite(logits, "draft")
    if cfg.greedy:
        return top_tokens(logits, k), None
    q = warp(logits, cfg if temperature is None else replace(cfg, temperature=temperature))
    return (draw_iid if draw == "iid" else draw_swor)(q, k, generator), q


class TreeDrafter(Drafter):
    """A static tree shape drafted from a draft model, one batched draft forward per depth.

    shape: parents of the nodes in creation order (parents[i] < i, -1 = the root), a node's children in rank
    order = draw order. Depth 1 is drawn from the root's logits; then, per depth, the drafted nodes that have
    children are fed as one block appended to the draft cache's pending region (each row attends to the
    committed tokens and its drafted ancestors), giving the logits their children are drawn from. A SWOR node
    whose q has fewer than k tokens gets fewer children: the surplus ranks and their subtrees are left out of
    the tree (the tree's node i is the i-th surviving shape node). `temperature` overrides cfg's for the draws
    (q is then the law at that temperature, which the verifier uses: still exact). forwards = the depth.
    """

    def __init__(self, model: Backend, shape: Sequence[int], draw: Literal["iid", "swor"] = "iid",
                 temperature: float | None = None, cache: Cache | None = None) -> None:
        if draw not in ("iid", "swor"):
            raise SpeculorError(f"a tree drafter draws 'iid' or 'swor', got {draw!r}")
        if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < 1e6):
            raise SpeculorError(f"a drafter temperature must be a number > 0, got {temperature!r}")
        self.model, self.shape, self.draw, self.temperature = model, check_shape(shape), draw, temperature
        self.cache = cache if cache is not None else model.new_cache()  # a request's own (given: shared by shapes)
        self.levels = shape_levels(self.shape)
        self.n_children = [0] * len(self.shape)
        for parent in self.shape:
            if parent >= 0:
                self.n_children[parent] += 1
        self.forwards = 0
        self.rows: dict[int, int] = {}  # node of the last tree -> its pending row in the draft cache

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        logits = {-1: (yield from catch_up(self.model, self.cache, seq))}  # shape node -> draft logits in its context
        self.forwards = 1
        tokens: dict[int, int] = {}  # surviving shape node -> its token
        qs: dict[int, torch.Tensor] = {}
        rows: dict[int, int] = {}  # fed shape node -> pending row
        for depth, level in enumerate(self.levels):
            self._draw_level(level, logits, tokens, qs, cfg, generator)
            inner = [node for node in level if node in tokens and self.n_children[node]]
            if inner and depth + 1 < len(self.levels):
                logits = yield from self._feed(inner, tokens, rows)
        return self._tree(tokens, qs, rows, cfg)

    def _draw_level(self, level: list[int], logits: dict[int, torch.Tensor], tokens: dict[int, int],
                    qs: dict[int, torch.Tensor], cfg: SamplingConfig, generator: torch.Generator | None) -> None:
        """Draw the nodes of one level, parent by parent, from the parents' draft logits."""
        by_parent: dict[int, list[int]] = {}
        for node in level:
            if self.shape[node] in logits:  # else the parent was dropped (SWOR cap)
                by_parent.setdefault(self.shape[node], []).append(node)
        for parent, kids in by_parent.items():
            drawn, q = draw_children(logits[parent], len(kids), cfg, self.draw, generator, self.temperature)
            for node, tok in zip(kids, drawn, strict=False):  # surplus ranks stay undrawn
                tokens[node] = tok
                if q is not None:
                    qs[node] = q

    def _feed(self, nodes: list[int], tokens: dict[int, int],
              rows: dict[int, int]) -> Generator[Any, Any, dict[int, torch.Tensor]]:
        """One draft forward over drafted nodes of one depth; their logits, by shape node."""
        parents = [rows[self.shape[n]] if self.shape[n] >= 0 else -1 for n in nodes]
        out, fed = yield from feed(self.model, self.cache, [tokens[n] for n in nodes], parents)
        self.forwards += 1
        rows.update(zip(nodes, fed, strict=True))
        return {n: out[i] for i, n in enumerate(nodes)}

    def _tree(self, tokens: dict[int, int], qs: dict[int, torch.Tensor], rows: dict[int, int],
              cfg: SamplingConfig) -> DraftTree:
        alive = [n for n in range(len(self.shape)) if n in tokens]
        index = {n: i for i, n in enumerate(alive)}
        parents = [index[self.shape[n]] if self.shape[n] >= 0 else -1 for n in alive]
        self.rows = {index[n]: r for n, r in rows.items()}
        q = torch.stack([qs[n] for n in alive]) if qs and alive else None
        return DraftTree(torch.tensor([tokens[n] for n in alive], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), q, "point" if cfg.greedy else self.draw)

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        """Keep the draft cache entries of the accepted path's fed prefix (compacted), drop the rest."""
        assert self.cache.length == n_committed, "the draft cache must hold exactly the committed tokens"
        keep_fed_path(self.cache, self.rows, verdict.path)


