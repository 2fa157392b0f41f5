"""The priors the drafters start from, fitted to measurements, kept as data (data/priors.json) beside how each was
fitted: the answers or runs measured, the machine, the command, the date and commit, and what a refit recomputes.

The file is read once per process and never written here: `value(name)` gives a prior as nested tuples (the module
that uses it binds it to its constant, e.g. drafters/suffix.py TRUST_0). `speculor refit-priors`
(commands/refit_priors.py, drafters/refit.py) recomputes what can be recomputed and writes a file for a person to
review and commit.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

FILE = "data/priors.json"  # package data of `speculor`


def path() -> Path:
    """The packaged file (in a source checkout: src/speculor/data/priors.json)."""
    return Path(str(resources.files("speculor").joinpath(FILE)))


@cache
def _entries() -> dict[str, dict[str, Any]]:
    return json.loads(resources.files("speculor").joinpath(FILE).read_text(encoding="utf-8"))["priors"]


def value(name: str) -> Any:
    """Prior `name`'s value, lists as tuples (read-only)."""
    return _frozen(_entries()[name]["value"])


def entries() -> dict[str, dict[str, Any]]:
    """Every prior's entry (value and provenance), a copy."""
    return copy.deepcopy(_entries())


def _frozen(x: Any) -> Any:
    return tuple(_frozen(v) for v in x) if isinstance(x, list) else x


def dumps(document: dict[str, Any]) -> str:
    """The file's text: JSON, one entry a line, a list of numbers (or of lists of numbers) on one line."""
    return _dump(document, 0) + "\n"


def _dump(x: Any, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(x, dict):
        if not x:
            return "{}"
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dump(v, depth + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(x, list) and x and not all(_numbers(v) for v in x):
        return "[\n" + ",\n".join(inner + _dump(v, depth + 1) for v in x) + "\n" + pad + "]"
    return json.dumps(x, ensure_ascii=False)


def _numbers(x: Any) -> bool:
    """A number, null, or a list of those (one level)."""
    scalar = x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
    return scalar or (isinstance(x, list) and all(v is None or isinstance(v, (int, float)) for v in x))
