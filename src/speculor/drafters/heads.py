"""The boost-tuned heads on the target's features (runtime/eagle_head.py) as a helper of the strategies that draft
with them (`eagle`, specinfer's `drafters=boosted`): the pool bound to a target, a head's cost curve, and the pool's
merged drafter (SpecInfer's merge-based tree, each SSM with its own q).

A pool is loaded once per target and folder, and held by the target itself (a weak-keyed mapping): it lives as
long as that model does and can never be handed to another model that takes its place in memory.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

from speculor.drafters.base import Drafter
from speculor.drafters.merged import MergedDrafter
from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.backend import Backend, Block, Pair
from speculor.runtime.cost import CostModel
from speculor.runtime.eagle_head import FeatureStore, HeadModel, HeadView, load_pool
from speculor.runtime.profiling import SIZES, machine_cost

SHIPPED = "data/boosted"  # the pool trained for the embedded target (its manifest says how)

_POOLS: weakref.WeakKeyDictionary[Backend, dict[str, list[HeadModel]]] = weakref.WeakKeyDictionary()


def pool(pair: Pair, heads: str | None = None) -> list[HeadModel]:
    """The pool's heads over the pair's target (its token embedding: torch weights, or rows of its GGUF), loaded
    once per target; `heads` = a folder made by `speculor boost-tune` (default: the shipped pool, for the embedded
    target only)."""
    target = pair.target
    loaded = _POOLS.setdefault(target, {})
    key = heads or ""
    if key not in loaded:
        folder = Path(heads) if heads else Path(str(resources.files("speculor").joinpath(SHIPPED)))
        if heads is None and pair.target_name != embedded.DEFAULT_TARGET:
            raise SpeculorError(f"the shipped heads were trained for {embedded.DEFAULT_TARGET}, not "
                                f"{pair.target_name!r}: train a pool for it with `speculor boost-tune --target ...` "
                                "and pass --heads FOLDER")
        found, manifest = load_pool(folder, target.device if str(target.device).startswith("cuda") else "cpu")
        if target.hidden_size != found[0].cfg.hidden_size:
            raise SpeculorError(f"the heads in {folder} read features of size {found[0].cfg.hidden_size}; the "
                                f"target's are {target.hidden_size}: they were trained for another model")
        embed = target.embedding()
        loaded[key] = [HeadModel(h, embed, vocab_size=target.vocab_size, context_length=target.context_length,
                                 name=f"eagle-ssm{k}", first_rate=heldout_first_rate(manifest, k))
                       for k, h in enumerate(found, 1)]
    return loaded[key]


def heldout_first_rate(manifest: dict, k: int) -> float | None:
    """SSM k's first-token acceptance on the pool's held-out prompts (mean over its sets), if the manifest has it."""
    rates = [s[f"ssm{k}"]["acceptance"][0] for s in manifest.get("heldout", {}).values()
             if isinstance(s, dict) and f"ssm{k}" in s]
    return sum(rates) / len(rates) if rates else None


def head_cost(pair: Pair, head: HeadModel, repeats: int = 5) -> CostModel:
    """The machine's target curve with the head's own: t_draft(w) = one head forward over w rows of one depth
    (their parents' features known, as when a tree grows), median of `repeats`."""
    target = machine_cost(pair)
    store = FeatureStore()
    store.put(0, torch.zeros(1, head.head.cfg.hidden_size))
    view = head.bind(store)
    times = []
    for w in SIZES:
        runs = []
        for _ in range(repeats + 1):
            cache = view.new_cache()
            cache.length = 1
            t0 = time.perf_counter()
            view.forward([Block(cache, list(range(w)), torch.full((w,), -1))])
            runs.append(time.perf_counter() - t0)
        times.append(statistics.median(runs[1:]))  # the first: a warm-up
    return CostModel(target.target_n, target.target_s, tuple(SIZES), tuple(times),
                     target.meta + (("head", head.cost_key),))


class BoostedDrafter(MergedDrafter):
    """The pool's trees merged (SpecInfer's merge-based tree); its SSMs read one `store`, the request's."""

    def __init__(self, drafters: list[Drafter], store: FeatureStore) -> None:
        super().__init__(drafters)
        self.store = store

    def reset(self) -> None:
        self.store.clear()
        super().reset()


def boosted_drafter(heads: list[HeadModel], make_tree: Callable[[HeadView], Drafter],
                    extra: list[Drafter]) -> Drafter:
    """A request's drafter of `specinfer:drafters=boosted(+others)`: one tree drafter per SSM, all over one store."""
    store = FeatureStore()
    return BoostedDrafter([make_tree(h.bind(store)) for h in heads] + extra, store)
