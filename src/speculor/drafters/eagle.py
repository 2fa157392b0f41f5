"""Drafting from the boost-tuned heads on the target's own features (runtime/eagle_head.py; docs/algorithms.md §14).

    eagle                         one head (the pool's SSM 1) grows DySpec's dynamic tree with its q (DySpec's
                                  rule: each draw's value known before the token is seen, siblings SWOR): exact
                                  under sampling, and batch-aware with budget="auto" like `dyspec`.
    specinfer:drafters=boosted    every SSM of the pool drafts a SpecInfer tree (default ⟨1, 1⟩: a chain of 2)
                                  and the trees are merged (tree.merge: each draw verified with the q of the SSM
                                  that drew it, so the merged tree is exact with mixed q's).

These are the drafters that read the target's hidden states: each has a `store` (one request's FeatureStore), and
the engine gives it the target's features of every committed position (engine/loop.py `keep_features`).
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from importlib import resources
from pathlib import Path

import torch

from speculor.config import SamplingConfig
from speculor.drafters.base import Drafter, Proposal, Shared
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.merged import MergedDrafter
from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.backend import Block
from speculor.runtime.cost import SIZES, CostModel, machine_cost
from speculor.runtime.eagle_head import FeatureStore, GGUFRows, HeadModel, load_pool, torch_embedding
from speculor.runtime.loading import Pair

SHIPPED = "data/boosted"  # the pool trained for the embedded target (its manifest says how)


# ---------------------------------------------------------------- the pool, bound to a target


_POOLS: dict[tuple[int, str], list[HeadModel]] = {}


def pool(pair: Pair, heads: str | None = None) -> list[HeadModel]:
    """The pool's heads over the pair's target (its token embedding: torch weights, or rows of its GGUF), loaded
    once per pair; `heads` = a folder made by `speculor boost-tune` (default: the shipped pool, for the embedded
    target only)."""
    key = (id(pair.target), heads or "")
    if key not in _POOLS:
        folder = Path(heads) if heads else Path(str(resources.files("speculor").joinpath(SHIPPED)))
        if heads is None and pair.target_name != embedded.DEFAULT_TARGET:
            raise SpeculorError(f"the shipped heads were trained for {embedded.DEFAULT_TARGET}, not "
                                f"{pair.target_name!r}: train a pool for it with `speculor boost-tune --target ...` "
                                "and pass --heads FOLDER")
        target = pair.target
        device = getattr(target, "device", torch.device("cpu"))
        found, manifest = load_pool(folder, device if str(device).startswith("cuda") else "cpu")
        size = target.hidden_size if pair.backend == "llama.cpp" else target.model.config.hidden_size
        if size != found[0].cfg.hidden_size:
            raise SpeculorError(f"the heads in {folder} read features of size {found[0].cfg.hidden_size}; the "
                                f"target's are {size}: they were trained for another model")
        if pair.backend == "llama.cpp":
            embed = GGUFRows(target.path, ["token_embd.weight"])
        else:
            embed = torch_embedding(target.model)
        _POOLS[key] = [HeadModel(h, embed, vocab_size=target.vocab_size, context_length=target.context_length,
                                 name=f"eagle-ssm{k}", first_rate=heldout_first_rate(manifest, k))
                       for k, h in enumerate(found, 1)]
    return _POOLS[key]


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


# ---------------------------------------------------------------- the drafters


class EagleDrafter(DySpecDrafter):
    """DySpec's dynamic tree drafted by one head over this request's features (`store`)."""

    def __init__(self, head: HeadModel, opts: DySpecOptions, cost: CostModel | None) -> None:
        self.store = FeatureStore()
        super().__init__(head.bind(self.store), opts, cost)
        if head.first_rate is not None:  # the prior of the first-token rate: the head's measured one
            self.first_rate = head.first_rate
        self.reads_features = not self.declines  # whether the target's forwards hand it their features

    @property
    def declines(self) -> bool:
        """auto, and alone no draft can pay at the first-token rate: it never drafts alone (the rate is frozen once
        it declines), so it needs no features, not even the prompt's."""
        return self.auto and not self.can_pay

    def reset(self) -> None:
        self.store.clear()
        super().reset()
        self.reads_features = not self.declines

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        if self.ledger is not None:  # in a batch a draft may pay: the features from now on, and no draft before
            self.reads_features = True  # the root's parent has one (a head without it walks the whole prompt)
            if len(seq) > 1 and self.store.get(len(seq) - 2) is None:
                return self.decline()
        tree = yield from super().propose(seq, cfg, generator)
        if self.skipped and self.ledger is None:  # alone, `can_pay` only falls (a is frozen then)
            self.reads_features = False
        return tree

    @property
    def can_pay(self) -> bool:
        """auto, alone: as DySpec's, and one draft token must pay at the rate first tokens were accepted so far
        (the head's q is more confident than it is right, so its values alone draft where it cannot pay):

            (1 + a) / (t_target(2) + t_draft(1)) > 1 / t_target(1),  a = the moving first-token rate.

        Decided from earlier steps only (exact); once it fails the request decodes plainly (a is no longer updated)."""
        c = self.cost
        return super().can_pay and (1 + self.first_rate) / (c.t_target(2) + c.t_draft(1)) > 1 / c.t_target(1)


class BoostedDrafter(MergedDrafter):
    """The pool's trees merged (SpecInfer's merge-based tree); its SSMs read one `store`, the request's."""

    def __init__(self, drafters: list[Drafter], store: FeatureStore) -> None:
        super().__init__(drafters)
        self.store = store

    def reset(self) -> None:
        self.store.clear()
        super().reset()


def make_eagle(pair: Pair, budget: int | str = "auto", depth: int = 6, threshold: float | None = None,
               heads: str | None = None) -> Shared:
    """Builder of the `eagle` strategy: DySpec's tree from the pool's first head (budget, depth and threshold as
    `dyspec`'s; auto sizes it by the machine's target curve and the head's own cost)."""
    opts = DySpecOptions("threshold", budget, threshold, depth)
    head = pool(pair, heads)[0]
    cost = head_cost(pair, head) if budget == "auto" else None
    return Shared(partial(EagleDrafter, head, opts, cost))


def boosted_drafter(heads: list[HeadModel], make_tree, extra: list[Drafter]) -> Drafter:
    """A request's drafter of `specinfer:drafters=boosted(+others)`: one tree drafter per SSM, all over one store."""
    store = FeatureStore()
    return BoostedDrafter([make_tree(h.bind(store)) for h in heads] + extra, store)
