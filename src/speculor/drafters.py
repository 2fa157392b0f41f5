"""Drafters: anything that proposes a `DraftTree` after the committed sequence.

Protocol: `reset()` before a generation; `propose(seq, cfg, generator)` returns a tree whose root is
seq[-1]; `observe(n_committed, verdict)` is told what the target accepted (n_committed = len(seq) at
propose time) so the drafter can keep the cache entries of the accepted path and drop the rest.

    ChainDrafter    K tokens from a draft model, one forward each (Leviathan et al.; Chen et al.)
    TreeDrafter     a static tree shape from a draft model, one batched forward per depth; children drawn
                    i.i.d. (SpecInfer, MSS) or without replacement (Sequoia), top-k at temperature 0
    NgramDrafter    prompt lookup: continuations of earlier occurrences of the last n tokens (model-free,
                    deterministic: point-mass rule)
    MergedDrafter   several drafters' trees merged by identical prefixes (SpecInfer's merge-based trees)
Notation of the papers: q is the draft distribution a token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, Protocol

import torch

from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.models import LM
from speculor.sampling import check_finite, draw_iid, draw_swor, greedy, sample, top_tokens, warp
from speculor.tree import DraftTree, check_shape, merge, shape_levels
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
    logits = lm.forward(pending, last=True)[-1]
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


class TreeDrafter:
    """A static tree shape drafted from a draft model, one batched draft forward per depth.

    shape: parents of the nodes in creation order (parents[i] < i, -1 = the root), a node's children in rank
    order = draw order. Depth 1 is drawn from the root's logits; then, per depth, the drafted nodes that have
    children are fed as one block appended to the draft cache's pending region (each row attends to the
    committed tokens and its drafted ancestors), giving the logits their children are drawn from. A SWOR node
    whose q has fewer than k tokens gets fewer children: the surplus ranks and their subtrees are left out of
    the tree (the tree's node i is the i-th surviving shape node). `temperature` overrides cfg's for the draws
    (q is then the law at that temperature, which the verifier uses: still exact). forwards = the depth.
    """

    def __init__(self, lm: LM, shape: Sequence[int], draw: Literal["iid", "swor"] = "iid",
                 temperature: float | None = None) -> None:
        if draw not in ("iid", "swor"):
            raise SpeculorError(f"a tree drafter draws 'iid' or 'swor', got {draw!r}")
        if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < 1e6):
            raise SpeculorError(f"a drafter temperature must be a number > 0, got {temperature!r}")
        self.lm, self.shape, self.draw, self.temperature = lm, check_shape(shape), draw, temperature
        self.levels = shape_levels(self.shape)
        self.n_children = [0] * len(self.shape)
        for parent in self.shape:
            if parent >= 0:
                self.n_children[parent] += 1
        self.forwards = 0
        self.rows: dict[int, int] = {}  # node of the last tree -> its pending row in the draft cache

    def reset(self) -> None:
        self.lm.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        logits = {-1: catch_up(self.lm, seq)}  # shape node -> draft logits in its context
        self.forwards = 1
        tokens: dict[int, int] = {}  # surviving shape node -> its token
        qs: dict[int, torch.Tensor] = {}
        rows: dict[int, int] = {}  # fed shape node -> pending row
        for depth, level in enumerate(self.levels):
            self._draw_level(level, logits, tokens, qs, cfg, generator)
            inner = [node for node in level if node in tokens and self.n_children[node]]
            if inner and depth + 1 < len(self.levels):
                logits = self._feed(inner, tokens, rows)
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

    def _feed(self, nodes: list[int], tokens: dict[int, int], rows: dict[int, int]) -> dict[int, torch.Tensor]:
        """One draft forward over drafted nodes of one depth; their logits, by shape node."""
        base = len(self.lm.pending)
        parents = [rows[self.shape[n]] if self.shape[n] >= 0 else -1 for n in nodes]
        out = self.lm.forward([tokens[n] for n in nodes], torch.tensor(parents), append=True)
        self.forwards += 1
        for i, n in enumerate(nodes):
            rows[n] = base + i
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
        assert self.lm.length == n_committed, "the draft cache must hold exactly the committed tokens"
        keep = []
        for node in verdict.path:
            if node not in self.rows:  # a leaf: never fed
                break
            keep.append(self.rows[node])
        self.lm.commit(keep)


def ngram_continuations(seq: Sequence[int], n_max: int, k: int, branches: int) -> list[list[int]]:
    """Prompt lookup: up to `branches` distinct continuations (≤ k tokens each) of earlier occurrences of the
    last n tokens of seq, for n = n_max down to 1, the most recent occurrence first."""
    out: list[list[int]] = []
    for n in range(min(n_max, len(seq) - 1), 0, -1):
        suffix = list(seq[-n:])
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start + n - 1] == suffix[-1] and list(seq[start:start + n]) == suffix:
                cont = list(seq[start + n:start + n + k])
                if cont not in out:
                    out.append(cont)
                if len(out) >= branches:
                    return out
    return out


class NgramDrafter:
    """Model-free prompt lookup: the continuations of `ngram_continuations`, merged by prefix into a tree of
    deterministic drafts (point-mass rule; greedy matching at temperature 0). Zero draft forwards."""

    def __init__(self, k: int = 8, n: int = 3, branches: int = 1) -> None:
        for name, value, top in (("k", k, 64), ("n", n, 16), ("branches", branches, 16)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise SpeculorError(f"{name} must be an integer in [1, {top}], got {value!r}")
        self.k, self.n, self.branches, self.forwards = k, n, branches, 0

    def reset(self) -> None:
        pass

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        chains = [DraftTree.chain(c, draw="point") for c in ngram_continuations(seq, self.n, self.k, self.branches)]
        return merge(chains).tree

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        pass


class MergedDrafter:
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

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        trees = [d.propose(seq, cfg, generator) for d in self.drafters]
        self.forwards = sum(d.forwards for d in self.drafters)
        self.merged = merge(trees)
        return self.merged.tree

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        for s, d in enumerate(self.drafters):
            d.observe(n_committed, Verdict(self.merged.sub_path(s, verdict.path), verdict.token))
