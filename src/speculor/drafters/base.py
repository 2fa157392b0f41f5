"""Drafters: anything that proposes a `DraftTree` after the committed sequence.

Two roles, kept apart so that many requests can share one model pair:
    Strategy  per pair and options, shared and read-only while decoding: the draft model, a strategy's
              options, its plans, cost model or trained head. `strategy.drafter()` makes a Drafter.
    Drafter   per request: its draft KV cache, the rows it fed, its adaptive state. `reset()` before a
              generation; `propose(seq, cfg, generator)` returns a tree whose root is seq[-1];
              `observe(n_committed, verdict)` is told what the target accepted (n_committed = len(seq) at
              propose time) so the drafter can keep the cache entries of the accepted path and drop the rest.
The shared drafting helpers of every strategy live here: `catch_up`, `draw`, `draw_children`, `feed`,
`keep_fed_path`, and the drafters that other strategies build on:

    ChainDrafter    K tokens from a draft model, one forward each (Leviathan et al.; Chen et al.)
    TreeDrafter     a static tree shape from a draft model, one batched forward per depth; children drawn
                    i.i.d. (SpecInfer, MSS) or without replacement (Sequoia), top-k at temperature 0
    NgramDrafter    prompt lookup: continuations of earlier occurrences of the last n tokens (model-free,
                    deterministic: point-mass rule)
    MergedDrafter   several drafters' trees merged by identical prefixes (SpecInfer's merge-based trees)
Notation of the papers: q is the draft distribution a token was drawn from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from speculor.config import SamplingConfig, check_int
from speculor.core.sampling import check_finite, draw_iid, draw_swor, greedy, sample, top_tokens, warp
from speculor.core.tree import DraftTree, check_shape, merge, shape_levels
from speculor.core.verify import Verdict
from speculor.errors import SpeculorError
from speculor.runtime.cache import KVCache
from speculor.runtime.model import Model

if TYPE_CHECKING:
    from speculor.runtime.cost import CostModel


class Drafter(Protocol):
    """Per-request drafting state (module docstring)."""

    forwards: int  # draft forward passes made by the last propose()

    def reset(self) -> None: ...

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree: ...

    def observe(self, n_committed: int, verdict: Verdict) -> None: ...


class Strategy(Protocol):
    """What a strategy shares across requests (module docstring); read-only while decoding."""

    def drafter(self) -> Drafter: ...


@dataclass
class BatchLedger:
    """What the other requests of a batched step commit the batch to, as one batch-aware drafter (`batch_aware =
    True`, given it as `ledger`) sees it: target rows (1 + tree size each, a prompt chunk's rows), expected tokens
    (1 + Σ node values each, 1 where unknown), their rows in each of the step's batched draft forwards, and
    `pending` requests counted as a root row and a token each; `filling`: some request's prompt chunk is in the
    step. The batched engine hands out a live one (engine/drafting.py `Seat`) that the drafter tells how far its own
    tree has grown (`publish`); this one is fixed.
    """

    rows: int = 0
    tokens: float = 0.0
    draft_rows: Sequence[int] = ()
    pending: int = 0
    filling: bool = False  # prompt chunks share the step: their requests wait for it, so nothing drafts

    def publish(self, rows: int, tokens: float) -> None:
        """The drafter's own tree so far: `rows` target rows (root included), `tokens` expected tokens."""

    def draft_s(self, t_draft: Callable[[int], float]) -> float:
        """Seconds of the others' draft forwards, t_draft(rows) each."""
        return sum(t_draft(r) for r in self.draft_rows if r > 0)

    def round(self, cost: CostModel, gain: float, nodes: int, draft_rows: int, once: float = 0.0) -> bool | None:
        """Joint decision on a draft forward of `draft_rows` rows (plus `once` seconds charged to this step) that
        would add `nodes` target rows of expected value `gain`: the batched engine's seat weighs it with every other
        request's bid for the same draft round (engine/drafting.py `settle`). None here: a fixed ledger has no
        round, the drafter decides alone."""
        return None


@dataclass(frozen=True)
class Shared:
    """A strategy whose shared part is its models and options alone: `make` builds a request's drafter from them."""

    make: Callable[[], Drafter]

    def drafter(self) -> Drafter:
        return self.make()


def behind(cache: KVCache, seq: list[int]) -> int:
    """How many tokens `catch_up` would feed: the committed ones the draft cache lacks, at least the root."""
    return len(seq) - min(cache.length, len(seq) - 1)


def catch_up(model: Model, cache: KVCache, seq: list[int]) -> torch.Tensor:
    """Feed the committed tokens the draft cache lacks (always at least the root); logits of the root."""
    cache.trim(len(seq) - 1)
    pending = seq[-behind(cache, seq):]
    logits = model.forward(cache, pending, last=True)[-1]
    cache.keep(list(range(len(pending))))
    return logits


def feed(model: Model, cache: KVCache, tokens: list[int], parent_rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One batched draft forward appending `tokens` to the pending region; parent_rows[i] is the pending row of
    row i's parent (-1 = the root, committed). Returns (logits [n, V], the rows given to the tokens)."""
    base = len(cache.pending)
    logits = model.forward(cache, tokens, torch.tensor(parent_rows, dtype=torch.long), append=True)
    check_finite(logits, "draft")
    return logits, list(range(base, base + len(tokens)))


def keep_fed_path(cache: KVCache, rows: dict[int, int], path: list[int]) -> None:
    """Commit the pending rows of the accepted path's fed prefix (top-down, so ascending), drop the rest."""
    keep = []
    for node in path:
        if node not in rows:  # a leaf: never fed
            break
        keep.append(rows[node])
    cache.keep(keep)


def keep_chain(cache: KVCache, n_committed: int, accepted: int, fed: int) -> None:
    """After a chain of which `fed` tokens were fed (the cache holds seq, y_1..y_fed): keep the accepted y's."""
    cache.trim(n_committed + min(accepted, fed))


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

    def __init__(self, model: Model, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.model, self.k, self.forwards = model, k, 0
        self.cache = model.new_cache()

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        logits = catch_up(self.model, self.cache, seq)
        tokens, qs = [], []
        for i in range(self.k):
            y, q = draw(logits, cfg, generator)
            tokens.append(y)
            qs.append(q)
            if i < self.k - 1:  # the last draft token is fed on the next step, if accepted
                logits = self.model.forward(self.cache, [y])[-1]
                self.cache.keep([0])
        self.forwards = self.k
        return DraftTree.chain(tokens, None if cfg.greedy else torch.stack(qs))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        keep_chain(self.cache, n_committed, len(verdict.path), self.k - 1)


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

    def __init__(self, model: Model, shape: Sequence[int], draw: Literal["iid", "swor"] = "iid",
                 temperature: float | None = None, cache: KVCache | None = None) -> None:
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

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        logits = {-1: catch_up(self.model, self.cache, seq)}  # shape node -> draft logits in its context
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
        parents = [rows[self.shape[n]] if self.shape[n] >= 0 else -1 for n in nodes]
        out, fed = feed(self.model, self.cache, [tokens[n] for n in nodes], parents)
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
            check_int(name, value, 1, top)
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
