"""The fitted priors as data (core/priors.py, data/priors.json) and their refit (drafters/refit.py,
`speculor refit-priors`): the values the drafters read are the constants they had in code, every prior says how it
was fitted, and the refit's measurement on a tiny hand-worked input gives what it should. No model."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

from speculor import cli
from speculor.commands import refit_priors
from speculor.core import goodput, priors
from speculor.drafters import dynamic_tree, lookup, refit, suffix, values

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


# ------------------------------------------------------------------ the refit's measurement on a hand-worked input

# The prompt 5 6 7 5 6: its tail (5, 6) was followed by 7 once, and (5, 6, 7) by 5. suffix matches 2 tokens and
# drafts at most 2 nodes (max_spec_factor 1): 7 at depth 1 and 5 at depth 2, each P = 1. ngram's longest earlier
# n-gram is (5, 6): it copies 7 5 6. The answer 7 8 accepts the first node of each and rejects the second.
PROMPT, ANSWER = [5, 6, 7, 5, 6], [7, 8]


def test_suffix_cells_of_a_hand_worked_answer() -> None:
    cells = refit.suffix_cells([[(PROMPT, ANSWER)]])
    got = {(b, d): (c.nodes, c.mass, c.accepted) for b, row in enumerate(cells) for d, c in enumerate(row) if c.nodes}
    assert got == {(1, 0): (1, 1.0, 1), (1, 1): (1, 1.0, 0)}  # match bucket 2: depth 1 accepted, depth 2 not
    assert cells[1][0].ratio == 1.0 and cells[1][1].ratio == 0.0 and cells[0][0].ratio is None


def test_trust_values_round_what_was_measured_and_keep_the_rest() -> None:
    cells = refit.suffix_cells([[(PROMPT, ANSWER)]])
    new = refit.trust_values(cells, suffix.TRUST_0)
    want = [list(row) for row in suffix.TRUST_0]
    want[1][0], want[1][1] = 1.0, 0.0
    assert [list(row) for row in new] == want
    one = [[refit.Cell()] * 4 for _ in range(5)]
    one[0][0] = refit.Cell(nodes=3, mass=3.0, accepted=1)  # 0.333... -> 0.35, the float a literal 0.35 is
    assert refit.trust_values(one, suffix.TRUST_0)[0][0] == 0.35
    one[0][0] = refit.Cell(nodes=10, mass=10.0, accepted=6)  # 0.6 -> 0.6
    assert refit.trust_values(one, suffix.TRUST_0)[0][0] == 0.6


def test_ngram_copies_of_a_hand_worked_answer() -> None:
    copies = refit.ngram_copies([[(PROMPT, ANSWER)]])
    assert [(c.steps, c.reached, c.accepted, c.first) for c in copies] == [(0, 0, 0, 0), (1, 2, 1, 1), (0, 0, 0, 0)]
    assert copies[1].acceptance == 0.5 and copies[1].first_rate == 1.0 and copies[0].acceptance is None


def test_a_whole_accepted_chain_commits_it_and_the_bonus_token() -> None:
    steps = []
    refit.replay(lookup.NgramDrafter(k=3), PROMPT, [7, 5, 6, 9, 4], lambda d, toks, path: steps.append((toks, path)))
    assert steps[0] == ([7, 5, 6], [0, 1, 2])  # then 9 is the bonus token: 4 tokens in one step
    assert len(steps) == 2  # the last token in a step of its own


def test_the_shared_trie_fills_across_a_runs_answers() -> None:
    """Two answers in one run: the second prompt's tail was followed in the first answer only."""
    first, second = ([1, 2, 3], [4, 5, 6, 7]), ([9, 4, 5], [6, 7])
    cells = refit.suffix_cells([[first, second]])
    apart = refit.suffix_cells([[first], [second]])  # one run each: nothing shared
    assert cells[1][0].nodes == 1 and cells[1][0].accepted == 1  # (4, 5) -> 6, learned from the first answer
    assert apart[1][0].nodes == 0


def test_refit_trust_records_the_fit_and_lists_what_changed() -> None:
    entry = priors.entries()["suffix.trust_0"]
    cells = refit.suffix_cells([[(PROMPT, ANSWER)]])
    fitted = {"set": "s", "records": ["r"], "machine": "m", "command": "c", "date": "d", "commit": "x"}
    out, changes = refit.refit_trust(entry, cells, fitted)
    assert out["value"][1][:2] == [1.0, 0.0] and out["value"][0] == list(suffix.TRUST_0[0])
    assert changes == ["match 2, depth 1: 0.45 -> 1.0 (measured 1.0000, 1 nodes)",
                       "match 2, depth 2: 0.3 -> 0.0 (measured 0.0000, 1 nodes)"]
    assert out["fitted"]["machine"] == "m" and out["fitted"]["measured"]["nodes"][1] == [1, 1, 0, 0]
    assert len(out["fitted"]["by_hand"]) == 18  # every cell not measured here kept its value
    assert entry["value"][1][0] == 0.45  # the entry given is left as it was


def test_the_command_refits_the_file_from_records(tmp_path, monkeypatch, capsys) -> None:
    questions = tmp_path / "toy.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "prompt": "abcab"}) + "\n")
    plain = {"strategy": "plain", "round": 0, "temperature": 0.0, "prompt_id": "toy/1", "set": "toy"}
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in (
        plain | {"token_ids": ANSWER}, plain | {"strategy": "suffix", "token_ids": [1]},
        plain | {"round": 1, "token_ids": [2]})) + "\n")
    monkeypatch.setattr(refit_priors, "encoder", lambda folder: lambda p: [5, 6, 7, 5, 6][:len(p.text)])
    source, out = tmp_path / "priors.json", tmp_path / "refit.json"
    source.write_text(priors.path().read_text())
    assert cli.main(["refit-priors", "--records", str(records), "--questions", str(questions), "--priors",
                     str(source), "--out", str(out), "--tokenizer", str(tmp_path), "--machine", "toy"]) == 0
    printed = capsys.readouterr().out
    assert "1 plain answers at T = 0 (toy) in 1 runs" in printed and "m = 2: a = 0.5000" in printed
    written = json.loads(out.read_text())["priors"]
    before = json.loads(source.read_text())["priors"]
    assert written["suffix.trust_0"]["value"][1][:2] == [1.0, 0.0]
    assert written["suffix.trust_0"]["fitted"]["machine"] == "toy"
    assert written["suffix.trust_0"]["fitted"]["records"] == [str(records)]
    assert {k: v for k, v in written.items() if k != "suffix.trust_0"} == \
        {k: v for k, v in before.items() if k != "suffix.trust_0"}  # the others are not refit


def test_the_command_names_prompts_it_cannot_find(tmp_path, monkeypatch, capsys) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"strategy": "plain", "round": 0, "temperature": 0.0, "prompt_id": "elsewhere/3",
                                   "set": "elsewhere", "token_ids": [1]}) + "\n")
    monkeypatch.setattr(refit_priors, "encoder", lambda folder: lambda p: [1])
    assert cli.main(["refit-priors", "--records", str(records), "--dry-run"]) == 2
    assert "prompts not found: elsewhere/3" in capsys.readouterr().err
