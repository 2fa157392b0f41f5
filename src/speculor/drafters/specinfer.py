"""SpecInfer (docs/algorithms.md §3) as a strategy: option parsing and its drafter builder.

    specinfer   expansion-based token trees: a static config ⟨k1, ..., km⟩ (every node at depth i - 1 gets
                k_i children; the paper's ⟨1,1,3,1,1,1,1,1⟩ by default) with children drawn i.i.d. from the
                draft model and verified with multi-step speculative sampling (MSS, §2); top-k children and
                greedy matching at temperature 0. Merge-based with `drafters`: several drafters' trees merged
                by identical prefixes (`tree.merge`, exact: one residual update per original draw, each with
                the law of the drafter that drew it).

Options are given as Python values or as strings the bench/CLI can pass (no ',' or ':' needed):
    expansion   "1-1-3-1-1-1-1-1", "1,1,3", "4", a tuple (1, 1, 3) or an int
    drafters    items joined by '+' or ',', or a sequence: "draft" (the draft model at the sampling
                temperature), "draft@T" (the draft model drawing at temperature T > 0, with its own cache),
                "ngram" (prompt lookup, lookup.py: chains as deep as the expansion), "boosted" (every SSM of
                the boost-tuned pool on the target's features, drafters/heads.py), or any Drafter object
    heads       the pool's folder for "boosted" (default: the shipped pool of the embedded target)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from typing import Any

from speculor.core.tree import expansion_shape
from speculor.drafters.base import Drafter, Shared
from speculor.drafters.heads import boosted_drafter, pool
from speculor.drafters.lookup import NgramDrafter
from speculor.drafters.merged import MergedDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.errors import SpeculorError
from speculor.runtime.backend import Backend, Pair
from speculor.runtime.eagle_head import HeadModel

PAPER_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)  # SpecInfer's experiments
BOOSTED_EXPANSION = (1, 1)  # with drafters=boosted: a chain of 2 per SSM (the pool's heads, 3 by default, add up)
MAX_NODES = 512  # draft tokens per step


def parse_expansion(spec: str | int | Sequence[int]) -> tuple[int, ...]:
    """⟨k1, ..., km⟩ from "1-1-3", "1,1,3", 4 or (1, 1, 3); SpeculorError unless 1 <= k_i and the tree is
    at most 32 deep and MAX_NODES large."""
    if isinstance(spec, bool):
        raise SpeculorError(f"expansion must be like '1-1-3-1' or (1, 1, 3, 1), got {spec!r}")
    if isinstance(spec, int):
        spec = (spec,)
    if isinstance(spec, str):
        parts = [p for p in re.split(r"[\s,\-x]+", spec.strip()) if p]
        if not parts or not all(p.isdigit() for p in parts):
            raise SpeculorError(f"expansion must be like '1-1-3-1' or (1, 1, 3, 1), got {spec!r}")
        spec = tuple(int(p) for p in parts)
    ks = tuple(spec) if isinstance(spec, Sequence) else ()
    if not 1 <= len(ks) <= 32 or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise SpeculorError(f"expansion needs 1 to 32 integers >= 1, got {spec!r}")
    nodes, width = 0, 1
    for k in ks:
        width *= k
        nodes += width
        if nodes > MAX_NODES:
            raise SpeculorError(f"expansion {ks} drafts more than {MAX_NODES} tokens per step")
    return ks


def parse_drafters(spec: str | Sequence[Any]) -> list[Any]:
    """Drafter items: ("draft", None), ("draft", T), ("ngram", None), ("boosted", None), or Drafter objects."""
    items = re.split(r"[+,]", spec) if isinstance(spec, str) else list(spec)
    out: list[Any] = []
    for item in items:
        if not isinstance(item, str):
            if not hasattr(item, "drafter") and not all(hasattr(item, a) for a in ("propose", "observe", "reset")):
                raise SpeculorError(f"not a drafter: {item!r}")
            out.append(item)
            continue
        m = re.fullmatch(r"\s*(draft|ngram|boosted)\s*(?:@\s*([0-9.eE+-]+))?\s*", item)
        temperature = _positive(m.group(2)) if m and m.group(2) else None
        if not m or (m.group(2) and (m.group(1) != "draft" or temperature is None)):
            raise SpeculorError(f"bad drafter {item!r}: use 'draft', 'draft@T' (T > 0), 'ngram' or 'boosted'")
        out.append((m.group(1), temperature))
    if not out:
        raise SpeculorError("drafters is empty")
    return out


def _positive(text: str) -> float | None:
    try:
        t = float(text)
    except ValueError:
        return None
    return t if 0 < t < 1e6 else None


def make_specinfer(pair: Pair, expansion: str | int | Sequence[int] | None = None,
                   drafters: str | Sequence[Any] = "draft", heads: str | None = None) -> Shared:
    """Builder of the `specinfer` strategy (see the module docstring). Each request gets its own drafters (every
    model drafter with its own draft cache); a Strategy given among `drafters` makes one per request too, a
    Drafter object given as is serves every request (the caller's choice). Default expansion: the paper's, or
    BOOSTED_EXPANSION with the boosted pool."""
    items = parse_drafters(drafters)
    boosted = any(isinstance(i, tuple) and i[0] == "boosted" for i in items)
    ks = parse_expansion(expansion if expansion is not None else BOOSTED_EXPANSION if boosted else PAPER_EXPANSION)
    if pair.draft is None and any(isinstance(i, tuple) and i[0] == "draft" for i in items):
        raise SpeculorError("strategy 'specinfer' with a 'draft' drafter needs a draft model")
    if heads is not None and not boosted:
        raise SpeculorError("specinfer's heads option is for drafters=boosted")
    ssms = pool(pair, heads) if boosted else None
    return Shared(partial(_specinfer_drafter, pair.draft, expansion_shape(list(ks)), len(ks), items, ssms))


def _specinfer_drafter(draft: Backend | None, shape: list[int], depth: int, items: list[Any],
                       ssms: list[HeadModel] | None = None) -> Drafter:
    subs: list[Drafter] = []
    for item in items:
        if not isinstance(item, tuple):
            subs.append(item.drafter() if hasattr(item, "drafter") else item)
        elif item[0] == "ngram":
            subs.append(NgramDrafter(k=depth))
        elif item[0] == "draft":
            subs.append(TreeDrafter(draft, shape, "iid", temperature=item[1]))
    if ssms is not None:  # the pool's SSMs first, over one store of the request's features
        return boosted_drafter(ssms, lambda view: TreeDrafter(view, shape, "iid"), subs)
    return subs[0] if len(subs) == 1 else MergedDrafter(subs)
