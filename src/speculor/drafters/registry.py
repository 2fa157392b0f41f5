"""Strategy registry: a name and its options -> the strategy's shared part (None for plain decoding).

`make_strategy(name, pair, **options)` validates the options and builds what the strategy shares across requests
(`base.Strategy`); `strategy.drafter()` then makes one request's drafter. `options_of(name)` lists the options a
strategy takes, so that a caller (the CLI, the server) can refuse options meant for another strategy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from speculor.config import check_int
from speculor.drafters.base import Shared, Strategy
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.cross_vocab import CrossVocabDrafter
from speculor.drafters.dyspec import make_dyspec
from speculor.drafters.eagle import make_eagle
from speculor.drafters.gsd import make_gsd
from speculor.drafters.ngram import make_ngram
from speculor.drafters.ngram_mod import make_ngram_mod
from speculor.drafters.sequoia import make_sequoia
from speculor.drafters.specdecpp import make_specdecpp
from speculor.drafters.specinfer import make_specinfer
from speculor.drafters.suffix import make_suffix
from speculor.drafters.topk_tree import make_topk_tree
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair


def _chain(pair: Pair, k: int = 4) -> Shared:
    check_int("k", k, 1, 64)
    if pair.draft is None:
        raise SpeculorError("strategy 'chain' needs a draft model")
    if pair.draft_tokenizer is not None:  # another tokenizer: k draft tokens through text, proposed as point masses
        return Shared(partial(CrossVocabDrafter, pair.draft, pair.draft_tokenizer, pair.tokenizer, k))
    return Shared(partial(ChainDrafter, pair.draft, k))


# what a draft with another tokenizer can serve
TEXT_LEVEL = ("default", "plain", "chain", "ngram", "ngram-mod", "suffix")
FALLBACKS = ("dyspec", "eagle")  # suffix's fallbacks: trees sized by the cost curve, that decline where they do not pay


def _suffix(pair: Pair, budget: int | str | None = None, max_depth: int = 24, min_prob: float = 0.1,
            shared: bool | str = True, max_tokens: int = 16384, fallback: str = "none",
            max_spec_factor: float = 1.0) -> Strategy:
    """suffix (drafters/suffix.py), its fallback built here (strategies do not import each other): dyspec or eagle
    with budget "auto", asked where the tries draft nothing worth its rows."""
    if fallback not in ("none", *FALLBACKS):
        raise SpeculorError(f"fallback must be none or one of {', '.join(FALLBACKS)}, got {fallback!r}")
    other = None if fallback == "none" else make_strategy(fallback, pair, budget="auto")
    return make_suffix(pair, budget, max_depth, min_prob, shared, max_tokens, other, max_spec_factor)


def _default(pair: Pair, **options: Any) -> Strategy:
    """The default strategy everywhere (library, `generate`, `serve`, the bench's `default` row), the one that is never
    slower than plain decoding (docs/bench/INDEX.md): suffix drafts with budget "auto" and, where a draft model is
    loaded, DySpec's trees as their fallback, all sized by the cost curve for the running batch; `options` are
    suffix's. A draft with another tokenizer drafts chains through text (chain's defaults)."""
    if pair.draft_tokenizer is not None:
        if options:
            raise SpeculorError(f"the default strategy for a draft with another tokenizer is chain, which takes no "
                                f"option {', '.join(map(repr, sorted(options)))}: name a strategy")
        return _chain(pair)
    return _suffix(pair, **{"budget": "auto", "fallback": "dyspec" if pair.draft is not None else "none", **options})


BUILDERS: dict[str, Callable[..., Strategy | None]] = {
    "default": _default,  # suffix's options (`_default`)
    "plain": lambda pair: None,
    "chain": _chain,  # options: k
    "sequoia": make_sequoia,  # options: budget (int or "auto"), depth, width, acc (see sequoia.SequoiaOptions)
    "specinfer": make_specinfer,  # options: expansion ("1-1-3-1-1-1-1-1"), drafters ("draft+draft@1.5+ngram")
    "ngram": make_ngram,  # options: k (tokens per continuation), n (longest n-gram), branches
    "ngram-mod": make_ngram_mod,  # llama.cpp's ngram-mod; options: n, n_max, n_min, size (drafters/ngram_mod.py)
    "specdecpp": make_specdecpp,  # options: threshold, k_min, k_max, head (see specdecpp.SpecDecPPOptions)
    "dyspec": make_dyspec,  # options: variant, budget (int or "auto"), threshold, depth, temperature, batch
    "topk-tree": make_topk_tree,  # options: budget, depth, k (see topk_tree.TopkOptions)
    "gsd": make_gsd,  # options: n, k, sibling_threshold, prob_threshold, depth, budget (see gsd.GSDOptions)
    "eagle": make_eagle,  # options: budget (int or "auto"), depth, threshold, heads (see eagle.make_eagle)
    "suffix": _suffix,  # options: budget, max_depth, min_prob, shared, max_tokens, fallback, max_spec_factor
}


def _check_name(name: str) -> None:
    if name not in BUILDERS:
        raise SpeculorError(f"unknown strategy {name!r}; known: {', '.join(BUILDERS)}")


def options_of(name: str) -> list[str]:
    """The options strategy `name` takes (the keyword parameters of its builder)."""
    _check_name(name)
    builder = BUILDERS["suffix" if name == "default" else name]
    return [p for p in inspect.signature(builder).parameters if p != "pair"]


def check_options(name: str, options: dict[str, Any]) -> None:
    """SpeculorError for an unknown strategy (the message lists every registered one) or an option it does not take
    (the message lists those it takes); values are checked by the strategy's builder."""
    takes = options_of(name)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise SpeculorError(f"strategy {name!r} takes no option {', '.join(map(repr, unknown))} (its options: "
                            f"{', '.join(takes) or 'none'})")


def make_strategy(name: str, pair: Pair, **options: Any) -> Strategy | None:
    """The shared part of strategy `name` with `options` (None for plain decoding); SpeculorError for an unknown
    strategy, an option it does not take, or a bad value."""
    check_options(name, options)
    if pair.draft_tokenizer is not None and name not in TEXT_LEVEL:
        raise SpeculorError(f"strategy {name!r} needs a draft with the target's tokenizer; this draft has another "
                            f"one: use {', '.join(TEXT_LEVEL)} (chain drafts through text)")
    return BUILDERS[name](pair, **options)
