"""Integration group on the embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32 on the CPU: the pair
itself, the shared prompts, the committed SpecDec++ head. Greedy identity per strategy: test_integration_strategies."""

import pytest

from speculor import Speculor
from speculor.drafters import specdecpp
from speculor.runtime.load import check_same_vocab

pytestmark = pytest.mark.integration


def test_prompt_sets_are_mixed(greedy_cases: list) -> None:
    ids = [c[0] for c in greedy_cases]
    assert sum(i.startswith("mtbench/") for i in ids) == 3 and sum(i.startswith("HumanEval/") for i in ids) == 3
    assert all(len(c[2]) == 32 for c in greedy_cases)


def test_vocabulary_check_passes_for_the_pair(real_sp: Speculor) -> None:
    check_same_vocab(real_sp.pair.tokenizer, real_sp.pair.tokenizer)
    assert real_sp.pair.draft is not None and real_sp.pair.draft.vocab_size == real_sp.pair.target.vocab_size


def test_committed_head_fits_the_pair(real_sp: Speculor) -> None:
    head, record, _ = specdecpp.cached_head(specdecpp.HEAD_FILE, real_sp.pair.draft.device)
    assert record["hidden_size"] == real_sp.pair.draft.model.config.hidden_size
    assert record["draft"]["name"] == real_sp.pair.draft_name
    assert record["loss"]["heldout"] > 0 and record["training"]["data"]["sequences"] > 0
