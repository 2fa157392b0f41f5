"""Integration group: Sequoia trees on the embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32 CPU."""

import pytest

from speculor import SamplingConfig, Speculor, load_pair, prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sp() -> Speculor:
    return Speculor(load_pair(), strategy="plain")


@pytest.fixture(scope="module")
def cases(sp: Speculor) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt ids, plain greedy continuation) for 3 MT-Bench + 3 HumanEval prompts, 32 new tokens."""
    cfg = SamplingConfig(max_new_tokens=32)
    out = []
    for p in prompts.load(["mtbench", "humaneval"], 6):
        ids = sp.encode(p.text, chat=p.chat)
        out.append((p.id, ids, sp.generate(ids, cfg).token_ids))
    return out


def test_sequoia_greedy_identical_to_plain(sp: Speculor, cases: list) -> None:
    cfg = SamplingConfig(max_new_tokens=32)
    taus = []
    for pid, ids, plain in cases:
        out = sp.generate(ids, cfg, strategy="sequoia", budget=16, depth=6, width=4)
        assert out.token_ids == plain, f"{pid}: sequoia diverged from plain greedy decoding"
        assert max(s.drafted for s in out.stats.steps) <= 16
        taus.append(out.tau)
    assert sum(taus) / len(taus) > 1.5


def test_sequoia_sampling_runs(sp: Speculor, cases: list) -> None:
    _, ids, _ = cases[0]
    cfg = SamplingConfig(temperature=0.7, seed=3, max_new_tokens=16)
    a = sp.generate(ids, cfg, strategy="sequoia", budget=12)
    b = sp.generate(ids, cfg, strategy="sequoia", budget=12)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16 and a.tau >= 1
