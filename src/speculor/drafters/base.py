"""Drafters: anything that proposes a `DraftTree` after the committed sequence. The protocols and shared helpers.

Two roles, kept apart so that many requests can share one model pair:
    Strategy  per pair and options, shared and read-only while decoding: the draft model, a strategy's
              options, its plans, cost model or trained head. `strategy.drafter()` makes a Drafter.
    Drafter   per request: its draft KV cache, the rows it fed, its adaptive state. `reset()` before a
              generation; `propose(seq, cfg, generator)` is a generator (a `Proposal`) whose value is a tree
              whose root is seq[-1]; `observe(n_committed, verdict)` is told what the target accepted
              (n_committed = len(seq) at propose time) so the drafter can keep the cache entries of the accepted
              path and drop the rest.

A proposal yields what it needs from the outside world and receives the answer:

    rows = yield Forward(model, Block(cache, tokens, parents))       a draft forward: its result (`Rows`)
    joint = yield from ledger.round(...)                             a bid for a shared draft round (batch-aware)

so the engine can run one round's draft forwards of many requests as ONE forward (engine/drafting.py; `drive`
there runs one alone), and a reader sees every point where a drafter waits for the others. The shared helpers
(`catch_up`, `feed`, `draw`, `keep_fed_path`, `keep_chain`) live here; the drafters several strategies share in
chain.py, static_tree.py, dynamic_tree.py, lookup.py, merged.py and heads.py (the EAGLE heads' pool), and one module
per strategy, which imports no other strategy's. Notation of the papers: q is the draft distribution a token was
drawn from.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from speculor.config import SamplingConfig
from speculor.core.goodput import BatchLedger
from speculor.core.sampling import check_finite, greedy, sample, warp
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.runtime.backend import Backend, Block, Cache

if TYPE_CHECKING:
    from speculor.runtime.eagle_head import FeatureStore


@dataclass(frozen=True, eq=False)
class Forward:
    """A drafter's request for one forward of `model` over `block`; the drafting loop sends back its result."""

    model: Backend
    block: Block


Proposal = Generator[Any, Any, DraftTree]  # yields Forward (or a ledger's bid), returns the tree


class Drafter:
    """Per-request drafting state (module docstring). The engine reads these fields after each `propose`:
    forwards (draft forward passes of the step), expected_tokens (1 + Σ node values of the tree, 1 where unknown:
    what the batch counts the request as) and stats (the drafter's own numbers of the step, or None). A drafter
    over the target's features (drafters/eagle.py, heads.py) has a `store` the target's forwards fill while it
    `reads_features`."""

    forwards: int = 0
    expected_tokens: float = 1.0
    stats: dict[str, float] | None = None
    batch_aware: bool = False  # sizes its tree for the batch: see `BatchAware`
    store: FeatureStore | None = None  # the target's features of the committed positions, None: it reads none
    reads_features: bool = True  # with a store: whether the target's forwards still hand it their features

    def reset(self) -> None:
        pass

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        pass


class BatchAware(Drafter):
    """A drafter that sizes its tree for the batch it runs in (`batch_aware` True when its options ask for it): the
    batched engine gives it a live `ledger` before each propose; until it publishes its own rows and expected
    tokens, the batch counts it as `estimate`, its last tree's."""

    ledger: BatchLedger | None = None
    estimate: tuple[int, float] = (1, 1.0)


class Strategy(Protocol):
    """What a strategy shares across requests (module docstring); read-only while decoding, except what a strategy
    learns from the requests' outputs (suffix's trie), which it empties on `forget()` (a no-op where it learns
    nothing)."""

    def drafter(self) -> Drafter: ...

    def forget(self) -> None: ...


@dataclass(frozen=True)
class Shared:
    """A strategy whose shared part is its models and options alone: `make` builds a request's drafter from them."""

    make: Callable[[], Drafter]

    def drafter(self) -> Drafter:
        return self.make()

    def forget(self) -> None:
        """Nothing learned across requests."""


def behind(cache: Cache, seq: list[int]) -> int:
    """How many tokens `catch_up` would feed: the committed ones the draft cache lacks, at least the root."""
    return len(seq) - min(cache.length, len(seq) - 1)


def catch_up(model: Backend, cache: Cache, seq: list[int]) -> Generator[Forward, Any, torch.Tensor]:
    """Feed the committed tokens the draft cache lacks (always at least the root); logits of the root."""
    cache.trim(len(seq) - 1)
    pending = seq[-behind(cache, seq):]
    logits = (yield Forward(model, Block(cache, pending, last=True))).logits[-1]
    cache.keep(list(range(len(pending))))
    return logits


def feed(model: Backend, cache: Cache, tokens: list[int],
         parent_rows: list[int]) -> Generator[Forward, Any, tuple[torch.Tensor, list[int]]]:
    """One batched draft forward appending `tokens` to the pending region; parent_rows[i] is the pending row of
    row i's parent (-1 = the root, committed). Returns (logits [n, V], the rows given to the tokens)."""
    base = len(cache.pending)
    logits = (yield Forward(model, Block(cache, tokens, torch.tensor(parent_rows, dtype=torch.long),
                                         append=True))).logits
    check_finite(logits, "draft")
    return logits, list(range(base, base + len(tokens)))


def keep_fed_path(cache: Cache, rows: dict[int, int], path: list[int]) -> None:
    """Commit the pending rows of the accepted path's fed prefix (top-down, so ascending), drop the rest."""
    keep = []
    for node in path:
        if node not in rows:  # a leaf: never fed
            break
        keep.append(rows[node])
    cache.keep(keep)


def keep_chain(cache: Cache, n_committed: int, accepted: int, fed: int) -> None:
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
