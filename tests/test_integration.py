"""Integration group on the embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32 on the CPU."""

import pytest

from speculor import SamplingConfig, Speculor, prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sp(real_pair) -> Speculor:
    return Speculor(real_pair, strategy="plain")


@pytest.fixture(scope="module")
def cases(sp: Speculor) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, prompt ids, plain greedy continuation) for 3 MT-Bench + 3 HumanEval prompts."""
    cfg = SamplingConfig(max_new_tokens=32)
    out = []
    for p in prompts.load(["mtbench", "humaneval"], 6):
        ids = sp.encode(p.text, chat=p.chat)
        out.append((p.id, ids, sp.generate(ids, cfg).token_ids))
    return out


def test_prompt_sets_are_mixed(cases: list) -> None:
    ids = [c[0] for c in cases]
    assert sum(i.startswith("mtbench/") for i in ids) == 3 and sum(i.startswith("HumanEval/") for i in ids) == 3
    assert all(len(c[2]) == 32 for c in cases)


@pytest.mark.parametrize("k", [2, 4, 6])
def test_chain_greedy_identical_to_plain(sp: Speculor, cases: list, k: int) -> None:
    cfg = SamplingConfig(max_new_tokens=32)
    taus = []
    for pid, ids, plain in cases:
        out = sp.generate(ids, cfg, strategy="chain", k=k)
        assert out.token_ids == plain, f"{pid}: chain k={k} diverged from plain greedy decoding"
        taus.append(out.tau)
    assert sum(taus) / len(taus) > 1.5  # the draft agrees with the target often enough to matter


def test_chain_sampling_runs_and_reports(sp: Speculor, cases: list) -> None:
    _, ids, _ = cases[1]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=16)
    a = sp.generate(ids, cfg, strategy="chain", k=4)
    b = sp.generate(ids, cfg, strategy="chain", k=4)
    assert a.token_ids == b.token_ids  # a seed fixes the sample
    assert 1 <= a.tau <= 5 and len(a.token_ids) == 16


def test_vocabulary_check_passes_for_the_pair(sp: Speculor) -> None:
    from speculor.models import check_same_vocab

    check_same_vocab(sp.pair.tokenizer, sp.pair.tokenizer)
    assert sp.pair.draft is not None and sp.pair.draft.vocab_size == sp.pair.target.vocab_size
