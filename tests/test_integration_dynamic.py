"""Integration group, dynamic trees and draft graphs on the embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B
draft), fp32 on the CPU: greedy output of `dyspec` (both variants), `topk-tree` and `gsd` is identical to plain
greedy decoding on 3 MT-Bench + 3 HumanEval prompts, 32 new tokens."""

from __future__ import annotations

import pytest

from speculor import SamplingConfig, Speculor, engine, prompts

pytestmark = pytest.mark.integration
NEW = 32


@pytest.fixture(scope="module")
def sp(real_pair) -> Speculor:
    return Speculor(real_pair, strategy="plain")


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
    ("dyspec", {}, 1.5),
    ("dyspec", {"variant": "heap", "budget": 8}, 1.5),
    ("topk-tree", {}, 1.5),
    ("gsd", {}, 1.5),
])
def test_dynamic_strategies_greedy_identical_to_plain(sp: Speculor, cases: list, strategy: str, options: dict,
                                                      min_tau: float) -> None:
    cfg = SamplingConfig(max_new_tokens=NEW)
    taus, sizes = [], []
    for pid, ids, plain in cases:
        stats = engine.Stats()
        out = [t.id for t in sp.tokens(ids, cfg, strategy=strategy, stats=stats, **options)]
        assert out == plain, f"{pid}: {strategy} {options} diverged from plain greedy decoding"
        taus.append(stats.tau)
        sizes += [s.drafted for s in stats.steps]
    print(f"\n{strategy} {options}: tau per prompt {[round(t, 2) for t in taus]}, mean {sum(taus) / len(taus):.2f}, "
          f"mean tree {sum(sizes) / len(sizes):.1f}")
    assert sum(taus) / len(taus) >= min_tau
