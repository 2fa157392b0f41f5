"""Prompt lookup as a strategy, `ngram`: model-free drafts copied from earlier occurrences of the sequence's last
n-gram (the drafter, shared with specinfer's `drafters=ngram`: drafters/lookup.py)."""

from __future__ import annotations

from functools import partial

from speculor.drafters.base import Shared
from speculor.drafters.lookup import NgramDrafter
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.profiling import live_cost


def make_ngram(pair: Pair, k: int = 8, n: int = 3, branches: int = 1, budget: str | None = None) -> Shared:
    """Builder of the `ngram` strategy: k tokens per continuation, n-grams of n down to 1 tokens, up to
    `branches` distinct continuations merged into a tree. budget "auto": cut to the length this machine's cost
    curve says pays (lookup.py); "k": always k. Default: k where the target's rows are cheap (torch), else auto
    (llama.cpp: t(n) grows with n)."""
    if budget is None:
        budget = "k" if pair.target.traits.cheap_rows else "auto"
    if budget not in ("auto", "k"):
        raise SpeculorError(f"ngram's budget is 'auto' or 'k', got {budget!r}")
    NgramDrafter(k=k, n=n, branches=branches)  # validates the options
    cost = live_cost(pair) if budget == "auto" else None
    return Shared(partial(NgramDrafter, k=k, n=n, branches=branches, cost=cost))
