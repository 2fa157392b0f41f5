"""DySpec (docs/algorithms.md §5) as a strategy: a draft model's dynamic token tree, grown at run time by the
estimated value of each draw (the drafter, shared with `eagle`: drafters/dynamic_tree.py)."""

from __future__ import annotations

from functools import partial

from speculor.drafters.base import Shared
from speculor.drafters.dynamic_tree import DySpecDrafter, DySpecOptions, Variant
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.profiling import machine_cost


def make_dyspec(pair: Pair, variant: Variant = "threshold", budget: int | str = 16, threshold: float | None = None,
                depth: int = 8, temperature: float | None = None, batch: int = 4) -> Shared:
    """Builder of the `dyspec` strategy (see `DySpecOptions`); budget='auto' profiles the machine once."""
    if pair.draft is None:
        raise SpeculorError("strategy 'dyspec' needs a draft model")
    opts = DySpecOptions(variant, budget, threshold, depth, temperature, batch)
    return Shared(partial(DySpecDrafter, pair.draft, opts, machine_cost(pair) if budget == "auto" else None))
