"""Integration group: the greedy output of every speculative strategy on the embedded real pair (Qwen2.5-Coder
1.5B target, 0.5B draft, fp32 on the CPU) is token-for-token the plain greedy output on 3 MT-Bench + 3 HumanEval
prompts (32 new tokens, the session's `greedy_cases`; the chains on all six, the other strategies on the first
three, which keeps CI's time in bounds: `speculor bench` checks every strategy on every prompt of its run), and the
draft is accepted often enough to matter."""

from __future__ import annotations

import pytest

from speculor import SamplingConfig, Speculor, engine

pytestmark = pytest.mark.integration

CASES = [  # (strategy, options, least mean tau, (fewest, most) draft tokens per step; None = unbounded)
    ("chain", {"k": 2}, 1.5, (None, 2)),
    ("chain", {"k": 4}, 1.5, (None, 4)),
    ("chain", {"k": 6}, 1.5, (None, 6)),
    ("specinfer", {}, 1.5, (None, None)),
    ("specinfer", {"expansion": "2-1-1-1", "drafters": "draft+ngram"}, 1.5, (None, None)),
    ("ngram", {}, 1.0, (None, None)),
    ("sequoia", {"budget": 16, "depth": 6, "width": 4}, 1.5, (None, 16)),
    ("dyspec", {}, 1.5, (None, None)),
    ("dyspec", {"variant": "heap", "budget": 8}, 1.5, (None, 8)),
    ("topk-tree", {}, 1.5, (None, 16)),
    ("gsd", {}, 1.5, (None, None)),
    ("specdecpp", {}, 1.5, (2, 20)),  # SpecDec++'s (K_min, K_max)
    ("eagle", {"budget": 4}, 1.2, (None, 4)),  # the shipped heads on the target's features (~0.5 first tokens)
    ("specinfer", {"drafters": "boosted"}, 1.2, (None, 6)),  # the pool of 3: chains of 2 merged
]


@pytest.mark.parametrize(("strategy", "options", "min_tau", "tree"), CASES,
                         ids=[f"{s}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for s, o, *_ in CASES])
def test_greedy_identical_to_plain(real_sp: Speculor, greedy_cases: list, strategy: str, options: dict,
                                   min_tau: float, tree: tuple[int | None, int | None]) -> None:
    cfg = SamplingConfig(max_new_tokens=32)
    taus, sizes = [], []
    for pid, ids, plain in greedy_cases if strategy == "chain" else greedy_cases[:3]:
        stats = engine.Stats()
        out = [t.id for t in real_sp.tokens(ids, cfg, strategy=strategy, stats=stats, **options)]
        assert out == plain, f"{pid}: {strategy} {options} diverged from plain greedy decoding"
        taus.append(stats.tau)
        sizes += [s.drafted for s in stats.steps]
    print(f"\n{strategy} {options}: tau per prompt {[round(t, 2) for t in taus]}, mean {sum(taus) / len(taus):.2f}, "
          f"mean tree {sum(sizes) / len(sizes):.1f}")
    assert sum(taus) / len(taus) >= min_tau
    assert tree[0] is None or min(sizes) >= tree[0]
    assert tree[1] is None or max(sizes) <= tree[1]


def test_sampling_is_seeded(real_sp: Speculor, greedy_cases: list) -> None:
    _, ids, _ = greedy_cases[1]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=16)
    # most tokens per step: the longest drafted path + 1 (chain k; sequoia's and dyspec's default depth 8)
    for strategy, options, most in (("chain", {"k": 4}, 5), ("sequoia", {"budget": 12}, 9), ("dyspec", {}, 9)):
        a = real_sp.generate(ids, cfg, strategy=strategy, **options)
        b = real_sp.generate(ids, cfg, strategy=strategy, **options)
        assert a.token_ids == b.token_ids, f"{strategy}: a seed must fix the sample"
        assert len(a.token_ids) == 16 and 1 <= a.tau <= most
