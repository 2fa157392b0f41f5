"""`ngram-mod` (drafters/ngram_mod.py), llama.cpp's n-gram hash drafter on our verifier: its hash is llama.cpp's,
its drafts follow the table and its thresholds, requests share one table, and its output is plain decoding's."""

from __future__ import annotations

import pytest
from support.toy import plain_greedy, random_toy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.verify import Verdict
from speculor.drafters.ngram_mod import EMPTY, STREAK, K, Table, make_ngram_mod
from speculor.drafters.registry import make_strategy
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


def propose(drafter, seq):
    gen = drafter.propose(seq, SamplingConfig(), None)
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value.tokens.tolist()
    raise AssertionError("ngram-mod asked for a forward")


def test_the_hash_is_llama_cpps():
    """common_ngram_mod::idx: res = res * 6364136223846793005 + token over the n tokens, in size_t, mod the size."""
    t = Table(3, 1000003)
    want = ((((7 * K + 11) % 2**64) * K + 13) % 2**64) % 1000003
    assert t.index([7, 11, 13]) == want
    assert t.index([13, 11, 7]) != want


def test_a_draft_follows_the_table_and_its_thresholds():
    """A first request's prompt 1..11 fills the table; another request ending in 1 2 then finds 3..11 (9 tokens),
    cut at n_max, and nothing where fewer than n_min are found."""
    for n_max, n_min, want in ((16, 8, list(range(3, 12))), (4, 1, [3, 4, 5, 6]), (16, 10, [])):
        strategy = make_ngram_mod(None, n=2, n_max=n_max, n_min=n_min, size=1 << 16)
        propose(strategy.drafter(), list(range(1, 12)) + [50])
        assert propose(strategy.drafter(), [60, 1, 2]) == want, (n_max, n_min)


def test_requests_share_one_table_and_forget_empties_it():
    strategy = make_ngram_mod(None, n=2, n_max=4, n_min=1, size=1 << 12)
    propose(strategy.drafter(), [1, 2, 3, 4, 5, 6, 9])  # a first request's prompt enters the table
    assert propose(strategy.drafter(), [8, 8, 2, 3]) == [4, 5, 6]  # another request drafts from its prompt
    strategy.forget()
    assert (strategy.table.entries == EMPTY).all() and propose(strategy.drafter(), [8, 8, 2, 3]) == []


def test_poorly_accepted_drafts_empty_the_table():
    strategy = make_ngram_mod(None, n=2, n_max=4, n_min=1, size=1 << 12)
    drafter = strategy.drafter()
    seq = [1, 2, 3, 4, 5, 1, 2]
    for _ in range(STREAK):
        assert propose(drafter, seq) == [3, 4, 5, 1]
        drafter.observe(1, Verdict(path=[], token=7))
    assert strategy.table.used == 0


def test_greedy_output_is_plain_decodings():
    target = random_toy(6, seed=3)
    strategy = make_strategy("ngram-mod", Pair(Model(target), None, None), n=2, n_max=8, n_min=1)
    accepted = 0
    for prompt in ([0], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 4, 3, 2]):
        stats = engine.Stats()
        out = [t.id for t in engine.stream(Model(target), strategy.drafter(), prompt,
                                           SamplingConfig(max_new_tokens=40), stats=stats)]
        assert out == plain_greedy(target, prompt, 40), prompt
        accepted += sum(s.accepted for s in stats.steps)
    assert accepted > 0


def test_bad_options_are_refused():
    with pytest.raises(SpeculorError, match="n_min"):
        make_ngram_mod(None, n_max=8, n_min=9)
    with pytest.raises(SpeculorError):
        make_ngram_mod(None, n=0)
