"""Strategy registry: a name and its options -> a drafter (None for plain decoding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from speculor.drafters import ChainDrafter, Drafter
from speculor.dyspec import make_dyspec
from speculor.errors import SpeculorError
from speculor.gsd import make_gsd
from speculor.models import Pair
from speculor.sequoia import make_sequoia
from speculor.specdecpp import make_specdecpp
from speculor.specinfer import make_ngram, make_specinfer
from speculor.topk_tree import make_topk_tree


def _need_draft(pair: Pair, name: str):
    if pair.draft is None:
        raise SpeculorError(f"strategy {name!r} needs a draft model")
    return pair.draft


def _chain(pair: Pair, k: int = 4) -> Drafter:
    if not isinstance(k, int) or not 1 <= k <= 64:
        raise SpeculorError(f"k must be an integer in [1, 64], got {k!r}")
    return ChainDrafter(_need_draft(pair, "chain"), k)


BUILDERS: dict[str, Callable[..., Drafter | None]] = {
    "plain": lambda pair: None,
    "chain": _chain,
    "sequoia": make_sequoia,  # options: budget (int or "auto"), depth, width, acc (see sequoia.SequoiaOptions)
    "specinfer": make_specinfer,  # options: expansion ("1-1-3-1-1-1-1-1"), drafters ("draft+draft@1.5+ngram")
    "ngram": make_ngram,  # options: k (tokens per continuation), n (longest n-gram), branches
    "specdecpp": make_specdecpp,  # options: threshold, k_min, k_max, head (see specdecpp.SpecDecPPOptions)
    "dyspec": make_dyspec,  # options: variant, budget (int or "auto"), threshold, depth, temperature, batch
    "topk-tree": make_topk_tree,  # options: budget, depth, k (see topk_tree.TopkOptions)
    "gsd": make_gsd,  # options: n, k, sibling_threshold, prob_threshold, depth, budget (see gsd.GSDOptions)
}


def make_drafter(name: str, pair: Pair, **options: Any) -> Drafter | None:
    if name not in BUILDERS:
        raise SpeculorError(f"unknown strategy {name!r}; known: {', '.join(BUILDERS)}")
    try:
        return BUILDERS[name](pair, **options)
    except TypeError as exc:
        raise SpeculorError(f"bad options for strategy {name!r}: {exc}") from exc
