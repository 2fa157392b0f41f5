"""Integration group, token trees on the embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32 on the
CPU: greedy output of `specinfer` (the paper's expansion, and merged with prompt lookup) and `ngram` is identical to
plain greedy decoding on 3 MT-Bench + 3 HumanEval prompts, 32 new tokens."""

from __future__ import annotations

import pytest

from speculor import SamplingConfig, Speculor, prompts

pytestmark = pytest.mark.integration
NEW = 32


@pytest.fixture(scope="module")
def pair(real_pair):
    return real_pair


@pytest.fixture(scope="module")
def sp(pair) -> Speculor:
    return Speculor(pair, strategy="plain")


@pytest.fixture(scope="module")
def cases(sp: Speculor) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt ids, plain greedy continuation) for 3 MT-Bench + 3 HumanEval prompts."""
    cfg = SamplingConfig(max_new_tokens=NEW)
    out = []
    for p in prompts.load(["mtbench", "humaneval"], 6):
        ids = sp.encode(p.text, chat=p.chat)
        out.append((p.id, ids, sp.generate(ids, cfg).token_ids))
    return out


@pytest.mark.parametrize(("strategy", "options", "min_tau"), [
    ("specinfer", {}, 1.5),
    ("specinfer", {"expansion": "2-1-1-1", "drafters": "draft+ngram"}, 1.5),
    ("ngram", {}, 1.0),
])
def test_tree_strategies_greedy_identical_to_plain(sp: Speculor, cases: list, strategy: str, options: dict,
                                                   min_tau: float) -> None:
    cfg = SamplingConfig(max_new_tokens=NEW)
    taus = []
    for pid, ids, plain in cases:
        out = sp.generate(ids, cfg, strategy=strategy, **options)
        assert out.token_ids == plain, f"{pid}: {strategy} {options} diverged from plain greedy decoding"
        taus.append(out.tau)
    print(f"\n{strategy} {options}: tau per prompt {[round(t, 2) for t in taus]}, mean {sum(taus) / len(taus):.2f}")
    assert sum(taus) / len(taus) >= min_tau
