"""`speculor.load_pair`: a model pair from a `PairSpec` (or its fields), in three stages, each run once and in order:

    resolve   runtime/resolve.py   the spec -> a frozen Plan: each model's source, one backend ("auto" chosen by
                                   runtime/choice.py), the options; the checks that need no model
    prepare   runtime/prepare.py   the plan's files made ready: embedded models fetched, joined, converted
    load      runtime/load.py      the backends and tokenizer built, the Pair packed

Each stage also runs alone (a plan inspected, a model's files made ready without loading it).
"""

from __future__ import annotations

from typing import Any

from speculor.runtime.backend import Pair
from speculor.runtime.load import load
from speculor.runtime.prepare import prepare
from speculor.runtime.resolve import resolve
from speculor.runtime.spec import PairSpec


def load_pair(spec: PairSpec | str = "default", *args: Any, **options: Any) -> Pair:
    """The pair of a PairSpec, or of its fields: `load_pair()`, `load_pair("default", None, backend="torch")`."""
    return load(prepare(resolve(PairSpec.of(spec, *args, **options))))
