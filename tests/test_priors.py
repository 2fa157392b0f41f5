"""The fitted priors as data (core/priors.py, data/priors.json): the values the drafters read are the constants they
had in code, and every prior says how it was fitted. No model."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

from speculor.core import goodput, priors
from speculor.drafters import dynamic_tree, lookup, suffix, values

# the constants as they were written in code before they moved to data/priors.json
BEFORE = {
    "suffix.trust_0": ((0.35, 0.25, 0.2, 0.15), (0.45, 0.3, 0.25, 0.2), (0.6, 0.4, 0.35, 0.3), (0.8, 0.7, 0.65, 0.6),
                       (0.95, 0.9, 0.85, 0.8)),
    "ngram.prior": ((0.6, 1.4), (1.0, 1.0), (1.6, 0.4)),
    "goodput.margin": 1.15,
    "dyspec.first_rate": 0.8,
    "dyspec.greedy_value_temperature": 0.5,
}
BOUND = {"suffix.trust_0": suffix.TRUST_0, "ngram.prior": lookup.PRIOR, "goodput.margin": goodput.MARGIN,
         "dyspec.first_rate": dynamic_tree.FIRST_RATE,
         "dyspec.greedy_value_temperature": values.GREEDY_VALUE_TEMPERATURE}


def _floats(x) -> list:
    """Every number of a nested value, with its type."""
    return [v for e in x for v in _floats(e)] if isinstance(x, tuple) else [(x, type(x))]


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_the_loaded_priors_are_the_constants_they_replace_bit_for_bit(name) -> None:
    loaded = priors.value(name)
    assert loaded == BEFORE[name] and BOUND[name] == BEFORE[name]
    assert _floats(loaded) == _floats(BEFORE[name])  # floats stay floats (1.0 is not 1)
    assert [v.hex() for v, _ in _floats(loaded)] == [v.hex() for v, _ in _floats(BEFORE[name])]
    assert isinstance(BOUND[name], (tuple, float))  # read-only: nothing a drafter could change in place


def test_every_prior_says_how_it_was_fitted() -> None:
    entries = priors.entries()
    assert set(entries) == set(BEFORE)
    for name, entry in entries.items():
        assert {"value", "read_by", "meaning", "fitted", "refit"} <= set(entry), name
        fitted = entry["fitted"]
        for key in ("set", "machine", "command", "date", "commit", "how"):
            assert isinstance(fitted.get(key), str) and fitted[key].strip(), (name, key)
        assert entry["refit"].strip(), name
    trust = entries["suffix.trust_0"]["fitted"]
    assert all((Path(__file__).parents[1] / r).is_file() for r in trust["records"])  # the answers it was fitted on
    assert trust["by_hand"], "the cells set by hand are listed"


def test_the_priors_file_ships_in_the_wheel() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["speculor"]
    assert any(fnmatch.fnmatch(priors.FILE, g) for g in globs)
    assert priors.path().is_file()


def test_the_file_is_what_dumps_writes() -> None:
    """A refit rewrites the file with `dumps`: the shipped file is in that form, so a refit's diff is its changes."""
    text = priors.path().read_text(encoding="utf-8")
    assert priors.dumps(json.loads(text)) == text
