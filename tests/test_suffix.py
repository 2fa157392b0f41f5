"""SuffixDecoding (docs/algorithms.md §15): the suffix trie's counts and longest match against brute force, the tree
read off a hand-built sequence, the shared trie's bounded memory (oldest evicted first) and a threaded smoke test;
through the engine on the toy LM: greedy output equal to plain greedy with drafts accepted, the exact law at T = 1
and T = 0.7 (chi-square) with a negative control that the same harness catches, the shared trie helping a request
that repeats an earlier one's output; the auto budget on two cost curves; the strategy's options."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import replace

import pytest
import torch
from support.batch import run_batch
from support.costs import GENTLE, timed
from support.stats import goodness_of_fit
from support.toy import N, V, exact_law, plain_greedy, random_toy

import speculor.core.verify
from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.goodput import BatchLedger
from speculor.core.suffix import Candidate, SuffixCache, SuffixTrie
from speculor.core.verify import Verdict
from speculor.drafters import suffix
from speculor.drafters.registry import make_strategy, options_of
from speculor.drafters.suffix import PRIOR, TRUST_0, SuffixDrafter, SuffixOptions, SuffixStrategy
from speculor.engine.drafting import drive
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.cost import CostModel, Measured
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig()


def paths(node, prefix=()) -> dict[tuple[int, ...], int]:
    """Every node of a trie below `node`: its token path -> its count."""
    out = {}
    for t, kid in node.kids():
        out[prefix + (t,)] = kid.count
        out.update(paths(kid, prefix + (t,)))
    return out


def substrings(seqs: list[list[int]], depth: int) -> Counter:
    """Brute force: occurrences of every token string of 1..depth tokens in the sequences."""
    return Counter(tuple(s[i:i + n]) for s in seqs for n in range(1, depth + 1) for i in range(len(s) - n + 1))


def brute_match(seqs: list[list[int]], context: list[int], longest: int) -> int:
    """The longest tail of context (<= longest tokens) that occurs somewhere followed by a token."""
    followed = {tuple(s[i:i + n]) for s in seqs for n in range(1, longest + 1) for i in range(len(s) - n)}
    return max((n for n in range(1, min(longest, len(context)) + 1) if tuple(context[-n:]) in followed), default=0)


# ---------------------------------------------------------------- the trie


def test_counts_and_longest_match_equal_brute_force():
    rng = random.Random(0)
    for case in range(30):
        depth = rng.choice([2, 3, 5, 8])
        seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 4))]
        trie = SuffixTrie(depth)
        for i, s in enumerate(seqs):
            cut = rng.randrange(len(s) + 1)  # appended in two pieces: the same as at once
            trie.extend(s[:cut], i)
            trie.extend(s[cut:], i)
        want = substrings(seqs, depth)
        assert paths(trie.root) == dict(want), f"case {case}"
        assert trie.nodes == len(want)
        for context in (seqs[-1], [rng.randrange(4) for _ in range(6)]):
            length, node = trie.match(context)
            assert length == brute_match(seqs, context, depth // 2), f"case {case}: {context}"
            assert (node is None) == (length == 0) and (node is None or node.count == want[tuple(context[-length:])])


def test_the_tree_of_a_hand_built_sequence():
    """1 2 3 1 2 4 1 2 3 5 1 2: the tail 1 2 (4 times, the last unfinished) was followed by 3 twice and 4 once;
    1 2 3 by 1 and 5, 1 2 4 by 1. Depth 6 leaves 4 levels under the 2-token match."""
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    trie = SuffixTrie(6)
    trie.extend(seq)
    assert [trie.find(s).count for s in ([1, 2], [1, 2, 3], [2, 3, 1], [5])] == [4, 2, 1, 1]
    c = trie.propose(seq, 10, 0.05)
    assert c.match == 2
    assert c.tokens == [3, 4, 1, 5, 1, 2, 1, 2, 4, 2]
    assert c.parents == [-1, -1, 0, 0, 1, 2, 3, 4, 5, 6]
    # over the 3 followed occurrences of 1 2 (the last, the context's own, has no continuation yet): P(3) = 2/3,
    # P(4) = 1/3; 1 2 3 was followed by 1 and 5 (1/2 each), every deeper string by one token
    assert c.probs == pytest.approx([2 / 3] + [1 / 3] * 9) and c.score == pytest.approx(11 / 3)
    assert len(trie.propose(seq, 20, 0.05).tokens) == 11  # down to depth 6: 4 levels under the match
    assert trie.propose(seq, 3, 0.05).tokens == [3, 4, 1]  # the budget keeps the best-first prefix
    assert trie.propose(seq, 10, 0.4).tokens == [3]  # min_prob: P(4) = P(3 1) = 1/3 are left out
    assert trie.propose([1, 2, 3, 4, 6], 10, 0.05).match == 0  # 4 6 and 6 were never followed


def test_the_pattern_is_at_most_half_the_depth():
    seq = list(range(10)) * 2  # a long exact repeat: the match stops at depth // 2, so 4 tokens can follow
    trie = SuffixTrie(8)
    trie.extend(seq)
    c = trie.propose(seq, 20, 0.01)
    assert c.match == 4 and c.tokens == [0, 1, 2, 3] and c.parents == [-1, 0, 1, 2]


def fresh(seqs: dict[int, list[int]], depth: int) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for i, s in seqs.items():
        trie.extend(s, i)
    return trie


def test_shared_trie_memory_stays_bounded():
    rng = random.Random(1)
    cache = SuffixCache(max_depth=8, max_tokens=100)
    ids = []
    for _ in range(40):
        ids.append(cache.open())
        for _ in range(rng.randrange(1, 6)):
            cache.extend(ids[-1], [rng.randrange(5) for _ in range(rng.randrange(1, 12))])
            assert cache.tokens <= 100 and cache.trie.nodes <= 100 * 8
    kept = cache.sequences()
    assert 0 < cache.tokens == sum(map(len, kept.values())) <= 100 and len(kept) < 40
    assert list(kept) == ids[-len(kept):]  # the newest kept, the oldest evicted
    assert paths(cache.trie.root) == paths(fresh(kept, 8).root)  # evicted sequences counted out exactly
    assert cache.trie.nodes == fresh(kept, 8).nodes
    # one sequence alone past the bound: what fits is kept, then nothing more of it
    alone = SuffixCache(max_depth=4, max_tokens=10)
    a = alone.open()
    alone.extend(a, list(range(7)))
    alone.extend(a, list(range(7, 14)))
    alone.extend(a, [1, 2])
    assert alone.sequences() == {a: list(range(10))} and alone.tokens == 10
    b = alone.open()  # a new sequence evicts it
    alone.extend(b, [3, 3])
    assert alone.sequences() == {b: [3, 3]} and paths(alone.trie.root) == {(3,): 2, (3, 3): 1}


def test_shared_trie_under_threads():
    cache = SuffixCache(max_depth=6, max_tokens=400)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng, me = random.Random(seed), cache.open()
            seq: list[int] = []
            for _ in range(150):
                new = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
                cache.extend(me, new)
                seq += new
                c = cache.propose(seq, 8, 0.05)
                assert all(p < i for i, p in enumerate(c.parents)) and len(c.tokens) <= 8
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    kept = cache.sequences()
    assert 0 < cache.tokens == sum(map(len, kept.values())) <= 400
    assert paths(cache.trie.root) == paths(fresh(kept, 6).root)


# ---------------------------------------------------------------- the drafter


def test_no_match_drafts_nothing():
    drafter = SuffixDrafter(SuffixOptions(shared=False))
    tree = drive(drafter.propose([1, 2, 3, 4, 5], GREEDY, None))
    assert len(tree) == 0 and drafter.forwards == 0 and drafter.expected_tokens == 1.0
    tree = drive(drafter.propose([1, 2, 3, 4, 5, 1, 2], GREEDY, None))  # the sequence grew: 1 2 was followed by 3
    assert tree.tokens.tolist()[:1] == [3] and tree.draw == "point" and tree.q is None
    assert drafter.stats["match"] == 2 and drafter.expected_tokens == pytest.approx(1 + sum(drafter.candidate.probs))


def run(target, drafter, prompt: list[int], cfg: SamplingConfig) -> tuple[list[int], engine.Stats]:
    stats = engine.Stats()
    out = [t.id for t in engine.stream(Model(target), drafter, prompt, cfg, stats=stats)]
    return out, stats


REPETITIVE = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # 1 2 was followed by 3, 4 and 5: a root with three children


@pytest.mark.parametrize("budget", [1, 16])
def test_greedy_equals_plain_greedy(target, budget):
    strategy = SuffixStrategy(SuffixOptions(budget=budget, min_prob=0.05))
    accepted = {}
    for prompt in ([0], [1, 2], [5, 4, 3, 2], [3, 3, 3], REPETITIVE):
        out, stats = run(target, strategy.drafter(), prompt, SamplingConfig(max_new_tokens=30))
        assert out == plain_greedy(target, prompt, 30), f"prompt {prompt}"
        assert all(s.draft_forwards == 0 and s.drafted <= budget for s in stats.steps)
        accepted[tuple(prompt)] = sum(s.accepted for s in stats.steps)
    assert accepted[tuple(REPETITIVE)] > 0 and sum(accepted.values()) > 10, accepted


def law_counts(target, m: int, cfg: SamplingConfig, seed0: int) -> tuple[torch.Tensor, int, int]:
    """Counts [V]*N of the first N tokens after REPETITIVE over m unseeded runs (torch's global generator, seeded
    once) of one drafter, its shared trie filling with the runs' outputs (a seeded request would read its own trie
    only), the draft tokens accepted, and the steps drafted by the shared trie."""
    t_model, drafter = Model(target), SuffixStrategy(SuffixOptions(budget=8, min_prob=0.05)).drafter()
    counts, accepted, shared = torch.zeros([V] * N, dtype=torch.float64), 0, 0
    torch.manual_seed(seed0)
    for _ in range(m):
        stats = engine.Stats()
        run_cfg = replace(cfg, max_new_tokens=N, seed=None)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, REPETITIVE, run_cfg, stats=stats))] += 1
        accepted += sum(s.accepted for s in stats.steps)
        shared += sum(s.drafter_stats["shared"] for s in stats.steps)
    return counts, accepted, shared


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7)])
def test_the_exact_law(target, cfg):
    counts, accepted, shared = law_counts(target, 2500, cfg, seed0=101)
    pvalue, tv, floor = goodness_of_fit(counts, exact_law(target, REPETITIVE, cfg, N))
    assert pvalue > 1e-3, f"T={cfg.temperature}: chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"TV {tv:.4f} vs noise floor {floor:.4f}"
    assert accepted > 500 and shared > 0  # drafts of both tries were verified, many accepted


def test_chi_square_catches_a_verifier_that_accepts_every_point_draft(target, monkeypatch):
    """Negative control: point-mass children tested against a vanishing d(x), so any child the target allows is
    accepted (the first one tried wins)."""
    honest = speculor.core.verify._draw_distribution

    def lax(tree, c, drawn, r):
        d = honest(tree, c, drawn, r)
        return d * 1e-12 if tree.kind(c) == "point" else d

    monkeypatch.setattr(speculor.core.verify, "_draw_distribution", lax)
    cfg = SamplingConfig(temperature=1.0)
    counts, _, _ = law_counts(target, 800, cfg, seed0=5000)
    pvalue, tv, _ = goodness_of_fit(counts, exact_law(target, REPETITIVE, cfg, N))
    assert pvalue < 1e-6, f"biased verifier not detected: p-value {pvalue:.2e}, TV {tv:.4f}"


def test_the_shared_trie_helps_a_request_that_repeats_an_earlier_output():
    target = random_toy(64, seed=2, scale=0.5)  # its greedy output does not repeat itself within 32 tokens
    prompt, cfg = [0, 1], SamplingConfig(max_new_tokens=32)
    got = {}
    for shared in (True, False):
        strategy = SuffixStrategy(SuffixOptions(shared=shared))
        first, _ = run(target, strategy.drafter(), prompt, cfg)
        second, stats = run(target, strategy.drafter(), prompt, cfg)  # a new request, the same output
        assert first == second == plain_greedy(target, prompt, 32)
        got[shared] = sum(s.accepted for s in stats.steps), len(stats.steps)
        assert (strategy.cache is not None) == shared
    assert got[False] == (0, 32)  # alone: nothing to copy from
    assert got[True][0] >= 24 and got[True][1] <= 8, got  # the first request's output, drafted whole


def test_a_seeded_request_gets_its_tokens_whatever_the_shared_trie_holds():
    """What other requests wrote must not move a seed's draws: a seeded sampled request reads its own trie only
    (greedy and unseeded ones read both). Its answer after the same prompt's answers filled the shared trie equals
    its answer on an empty one; without the rule (a drafter that always reads the shared trie) it does not."""
    target = random_toy(64, seed=2, scale=0.5)
    prompt, cfg = [0, 1], SamplingConfig(temperature=0.8, seed=11, max_new_tokens=32)
    alone, _ = run(target, SuffixStrategy(SuffixOptions()).drafter(), prompt, cfg)
    for reads_shared in (False, True):
        strategy = SuffixStrategy(SuffixOptions())
        for seed in range(4):  # others' answers: the same prompt, other seeds, and greedy
            run(target, strategy.drafter(), prompt, replace(cfg, seed=100 + seed))
        run(target, strategy.drafter(), prompt, SamplingConfig(max_new_tokens=32))
        drafter = strategy.drafter()
        if reads_shared:  # negative control: the seed's draws meet the shared trie's drafts
            drafter.propose = lambda seq, c, g, propose=drafter.propose: propose(seq, replace(c, seed=None), g)
        out, stats = run(target, drafter, prompt, cfg)
        shared = sum(s.drafter_stats["shared"] for s in stats.steps)
        if reads_shared:
            assert shared > 0 and out != alone, "the control did not draft from the shared trie, or changed nothing"
        else:
            assert shared == 0 and out == alone


def test_forget_empties_the_shared_trie():
    target = random_toy(64, seed=2, scale=0.5)
    strategy = make_strategy("suffix", Pair(Model(target), None, None), budget=16)
    prompt, cfg = [0, 1], SamplingConfig(max_new_tokens=32)
    run(target, strategy.drafter(), prompt, cfg)
    assert strategy.cache.tokens == 32
    strategy.forget()
    assert strategy.cache.tokens == 0 and strategy.cache.sequences() == {}
    _, stats = run(target, strategy.drafter(), prompt, cfg)  # nothing of the first answer is left to copy
    assert sum(s.accepted for s in stats.steps) == 0 and strategy.cache.tokens == 32


def test_the_last_step_of_a_request_reaches_the_shared_trie():
    cache = SuffixCache(8, 100)
    drafter = SuffixDrafter(SuffixOptions(), cache)
    drive(drafter.propose([7, 8, 9], GREEDY, None))  # the prompt: the request's trie only
    drafter.observe(3, Verdict([], 4))
    assert cache.sequences() == {drafter.seq_id: [4]} and drafter.known == 4
    drive(drafter.propose([7, 8, 9, 4], GREEDY, None))
    assert cache.sequences() == {drafter.seq_id: [4]}  # nothing indexed twice


# ---------------------------------------------------------------- budget "auto"

SIZES = tuple(range(1, 17))
FLAT = CostModel(SIZES, tuple(0.5 + 0.01 * n for n in SIZES), SIZES, tuple(0.0 for _ in SIZES))
STEEP = CostModel(SIZES, tuple(0.05 * (1 + 0.6 * (n - 1)) for n in SIZES), SIZES, tuple(0.0 for _ in SIZES))
ONES = tuple((1.0,) * len(row) for row in TRUST_0)  # trust 1 to start everywhere
UNCAPPED = 1024  # max_spec_factor: no cap by the match's length (tests of the curve's cut)


@pytest.fixture
def counts_at_their_word(monkeypatch):
    """Trust 1 before anything is verified, in every bucket and depth: the tests of the curve's cut and of what is
    learned."""
    monkeypatch.setattr(suffix, "TRUST_0", ONES)


def step(drafter: SuffixDrafter, seq: list[int], accept: bool) -> int:
    """One proposal after seq; the target accepts the whole first path or nothing. Its size."""
    tree = drive(drafter.propose(seq, GREEDY, None))
    path: list[int] = []
    while accept and (kids := tree.children(path[-1] if path else -1)):
        path.append(kids[0])
    drafter.observe(len(seq), Verdict(path, 0))
    drafter.reset()  # the same sequence each time: its tokens are indexed afresh
    return len(tree)


@pytest.mark.usefixtures("counts_at_their_word")
def test_auto_cuts_to_what_the_curve_pays_and_learns():
    once = list(range(10, 20)) + [10, 11]  # 10 11 followed once before: P = 1 for each of the 10 tokens after
    half = [10, 11, 12, 1, 10, 11, 13, 2, 10, 11]  # 10 11 -> 12 once, -> 13 once: P = 1/2 each
    twice = [1, 10, 11, 12, 13, 2, 10, 11, 12, 13, 3, 10, 11]  # 10 11 -> 12 13 twice: P = 1; then 1/2 each
    auto = SuffixOptions(budget="auto", shared=False, max_spec_factor=UNCAPPED)  # the curve's cut alone
    assert step(SuffixDrafter(auto, cost=FLAT), once, True) == 10  # rows nearly free: all the continuation
    assert step(SuffixDrafter(auto, cost=STEEP), once, True) == 10  # P = 1: every row pays, even at 0.6 t(1)
    assert step(SuffixDrafter(auto, cost=STEEP), half, True) == 0  # (1 + 1/2) / t(2) < 1 / t(1)
    assert step(SuffixDrafter(auto, cost=STEEP), twice, True) == 2  # 12 13 pay, the 1/2 ones do not
    # 10 11 -> 12 20 21 22 twice (P = 2/3), -> 13 30 31 once (1/3): the 1/3 nodes just do not pay at t(n) = 1 + 0.15
    # (n - 1), until every drafted token is accepted and the counts are seen to understate (trust > 1)
    uneven = [10, 11, 12, 20, 21, 22, 1, 10, 11, 12, 20, 21, 22, 2, 10, 11, 13, 30, 31, 3, 10, 11]
    learner = SuffixDrafter(auto, cost=GENTLE)
    sizes = [step(learner, uneven, True) for _ in range(4)]
    assert sizes[0] == 4 and sizes[-1] > sizes[0] and learner.trust.of(2) > 1
    failing = SuffixDrafter(auto, cost=STEEP)
    tried = [step(failing, twice, False) for _ in range(3000)]
    assert tried[:3] == [2, 2, 0] and failing.trust.of(2) < 1  # rejected twice (each depth's 1 + 2 prior): it stops
    retries = [i for i, n in enumerate(tried) if n and i >= 3]
    assert retries and retries[0] > 100  # ... and tries again, rarely, once what it learned has faded
    with pytest.raises(SpeculorError, match="cost model"):
        SuffixStrategy(auto)


def test_auto_prices_by_the_timed_calls_unless_seeded():
    """The cut follows the target's calls as they are timed (runtime/cost.Measured): where a row costs more than a
    call, nothing pays; a seeded sampled request cuts by the profile alone (its tree follows from its seed)."""
    twice = [1, 10, 11, 12, 13, 2, 10, 11, 12, 13, 3, 10, 11]
    auto = SuffixOptions(budget="auto", shared=False, max_spec_factor=UNCAPPED)
    calls = timed({1: 1.0, 2: 4.0, 3: 9.0})  # rows far dearer than the profile says
    profile = step(SuffixDrafter(auto, cost=GENTLE), twice, True)
    assert profile >= 2 and step(SuffixDrafter(auto, cost=Measured(GENTLE, calls)), twice, True) == 0
    seeded = drive(SuffixDrafter(auto, cost=Measured(GENTLE, calls)).propose(twice, SamplingConfig(0.7, seed=5), None))
    assert len(seeded) == profile


@pytest.mark.usefixtures("counts_at_their_word")
def test_a_short_match_drafts_little():
    """Arctic's max_spec_factor: at most ⌈factor · match⌉ nodes, whatever the budget; the default (1) cuts a
    continuation seen once after a 2-token match to 2 nodes, where without it the curve takes all 10."""
    once = list(range(10, 20)) + [10, 11]  # 10 11 followed once before: P = 1 for each of the 10 tokens after
    trie = SuffixTrie(24)
    trie.extend(once)
    assert [len(trie.propose(once, 16, 0.1, f).tokens) for f in (0.4, 1, 2.5, 64)] == [1, 2, 5, 10]
    assert len(trie.propose(once, 3, 0.1, 64).tokens) == 3  # the budget still bounds it
    for budget, cost in (("auto", FLAT), ("auto", STEEP), (16, None)):
        capped = SuffixDrafter(SuffixOptions(budget=budget, shared=False), cost=cost)
        free = SuffixDrafter(SuffixOptions(budget=budget, shared=False, max_spec_factor=64), cost=cost)
        assert (step(capped, once, True), step(free, once, True)) == (2, 10), (budget, cost)
    with pytest.raises(SpeculorError, match="max_spec_factor"):
        SuffixOptions(max_spec_factor=0)


@pytest.mark.usefixtures("counts_at_their_word")
def test_trust_settles_at_what_the_target_accepts_at_each_depth():
    """P = 1 continuations of 2 nodes whose first node is accepted one step in two and whose second never is:
    trust(m, 1) → 1/2 and trust(m, 2) → 0 (prior aside), and the tree is cut to the node that pays. Learned over
    Σ P, not Σ v (trust-scaled values), which would settle at √(1/2) ≈ 0.71, the counts' overstatement half
    believed; one trust for both depths would settle at 1/4 and keep the second node at its price."""
    twice = [1, 10, 11, 12, 13, 2, 10, 11, 12, 13, 3, 10, 11]  # 10 11 -> 12 13 twice: P = 1, 1
    d = SuffixDrafter(SuffixOptions(budget="auto", shared=False), cost=FLAT)  # rows nearly free: it keeps drafting
    sizes = []
    for i in range(400):
        sizes.append(len(drive(d.propose(twice, GREEDY, None))))
        d.observe(len(twice), Verdict([0] if i % 2 else [], 0))
        d.reset()
    assert sizes[0] == 2 and sizes[-1] == 1 and min(sizes) == 1
    assert d.trust.of(2, 1) == pytest.approx((200 + PRIOR) / (400 + PRIOR))
    assert d.trust.of(2, 2) == pytest.approx(PRIOR / (sizes.count(2) + PRIOR)) and d.trust.of(2, 2) < 0.05


@pytest.mark.usefixtures("counts_at_their_word")
def test_trust_is_learned_per_match_length_and_shared_by_the_strategy_s_requests():
    strategy = SuffixStrategy(SuffixOptions(budget="auto", shared=False), cost=STEEP)
    twice = [1, 10, 11, 12, 13, 2, 10, 11, 12, 13, 3, 10, 11]  # match of 2 tokens
    long = [7, 8, 9, 10, 11, 12, 13, 1, 7, 8, 9, 10, 11, 12, 13, 2, 7, 8, 9, 10, 11, 12]  # 6-token match, P 1
    first = strategy.drafter()
    assert [step(first, twice, False) for _ in range(3)] == [2, 2, 0]
    assert step(strategy.drafter(), twice, False) == 0  # a later request starts from what the first learned
    assert strategy.trust.of(2) < 1 and strategy.trust.of(6) == 1  # ... at that match length only
    assert step(strategy.drafter(), long, True) > 0
    seeded = strategy.drafter()  # a seeded sampled request learns alone: nothing of the others' trust
    tree = drive(seeded.propose(twice, SamplingConfig(temperature=0.7, seed=1), torch.Generator().manual_seed(1)))
    assert len(tree) == 2 and seeded.trust is seeded.own_trust
    strategy.forget()
    assert strategy.trust.of(2) == 1  # a bench round starts afresh


def test_a_request_starts_from_the_prior_trust_of_its_match_length():
    """Before anything is verified a bucket's trust is TRUST_0's: a 2-token match's certain continuation (P = 1) is
    believed at 0.45, under the 0.6 a row costs on the steep curve, a 6-token one's at 0.8; a seeded sampled request
    starts from the same prior, and steps move the trust off it. Trust 1 to start drafts both (the control)."""
    twice = [1, 10, 11, 12, 13, 2, 10, 11, 12, 13, 3, 10, 11]  # match of 2 tokens, P = 1, 1
    long = [7, 8, 9, 10, 11, 12, 13, 1, 7, 8, 9, 10, 11, 12, 13, 2, 7, 8, 9, 10, 11, 12]  # 6-token match, P = 1
    auto = SuffixOptions(budget="auto", shared=False, max_spec_factor=UNCAPPED)
    sampled = SamplingConfig(temperature=0.7, seed=1)
    fresh = SuffixStrategy(auto, cost=STEEP)
    assert step(fresh.drafter(), twice, True) == 0 and step(fresh.drafter(), long, True) > 0
    seeded = fresh.drafter()
    assert len(drive(seeded.propose(twice, sampled, torch.Generator().manual_seed(1)))) == 0
    assert seeded.own_trust.of(2) == pytest.approx(TRUST_0[1][0]) and seeded.own_trust.of(6) == TRUST_0[3][0]
    # a node is valued by its depth too, and never above its parent
    prior = TRUST_0[3]
    assert seeded.own_trust.values(Candidate([12, 13, 14], [-1, 0, -1], [1.0, 0.5, 0.5], 6)) == pytest.approx(
        [prior[0], prior[1] * 0.5, prior[0] * 0.5])
    for _ in range(20):  # every drafted token accepted: the counts' word is good after all
        seeded.own_trust.learn(Candidate([12, 13], [-1, 0], [1.0, 1.0], 2), [0, 1])
    assert len(drive(seeded.propose(twice, sampled, torch.Generator().manual_seed(1)))) == 2
    with pytest.MonkeyPatch.context() as m:
        m.setattr(suffix, "TRUST_0", ONES)
        assert step(SuffixStrategy(auto, cost=STEEP).drafter(), twice, True) == 2


def test_in_a_batch_auto_prices_the_batch_s_step():
    """In a batch the cut is the batch step's (core/goodput.best_prefix): 1/2 nodes that pay alone on the gentle
    curve do not beside 15 requests decoding plainly, nor certain ones whose gain is within MARGIN, nothing drafts
    beside a prompt chunk, an empty ledger is the single-request rule, and a cut made for the load leaves what was
    learned after the match as it was."""
    half = [10, 11, 12, 1, 10, 11, 13, 2, 10, 11]  # 10 11 -> 12 once, -> 13 once: P = 1/2 each
    d = SuffixDrafter(SuffixOptions(budget="auto", shared=False, max_spec_factor=UNCAPPED), cost=GENTLE)
    assert d.batch_aware and step(d, half, True) >= 2  # (1 + 1/2 + ...) / t(n + 1) > 1 / t(1); its first path taken
    learned = d.trust.of(2)
    assert learned != TRUST_0[1][0]  # its tree was verified
    d.ledger = BatchLedger(rows=15, tokens=15.0)
    assert step(d, half, True) == 0 and d.trust.of(2) == learned  # (16 + v) / t(17) < 16 / t(16): not faded
    d.ledger = BatchLedger(filling=True)
    assert step(d, half, True) == 0
    # certain continuations (P = 1): 10 rows pay beside one other request; beside 15 they would raise the step's
    # rate 11% by the curve, within the model's error band (MARGIN 1.15): none
    once = list(range(10, 20)) + [10, 11]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(suffix, "TRUST_0", ONES)  # counts at their word
        sure = SuffixDrafter(SuffixOptions(budget="auto", shared=False, max_spec_factor=UNCAPPED), cost=GENTLE)
        sure.ledger = BatchLedger(rows=1, tokens=1.0)
        assert step(sure, once, True) == 10
        sure.ledger = BatchLedger(rows=15, tokens=15.0)
        assert step(sure, once, True) == 0
    d.ledger = BatchLedger()
    assert step(d, half, True) == step(SuffixDrafter(d.opts, cost=GENTLE, trust=d.trust), half, True) > 0
    # through the batched engine: 8 greedy requests that copy, each its plain greedy output
    target = random_toy(16, seed=3)
    strategy = SuffixStrategy(SuffixOptions(budget="auto"), cost=GENTLE)
    prompts = [REPETITIVE[i:] for i in range(8)]
    cfg = SamplingConfig(max_new_tokens=20)
    got = run_batch(Model(target), [strategy.drafter] * 8, prompts, [cfg] * 8)
    assert got == [plain_greedy(target, p, 20) for p in prompts]


# ---------------------------------------------------------------- the strategy and its options


def model_free() -> Pair:
    """A pair without a draft over a torch toy target (its rows cheap: the default budget is a number)."""
    return Pair(Model(random_toy(6, seed=0)), None, None)


def test_the_strategy_and_its_options():
    assert options_of("suffix") == ["budget", "max_depth", "min_prob", "shared", "max_tokens", "fallback",
                                    "max_spec_factor"]
    pair = model_free()
    default = make_strategy("suffix", pair)
    assert default.opts == SuffixOptions() and default.cache is not None and default.cost is None
    off = make_strategy("suffix", pair, shared="off", budget=4, max_depth=8, min_prob=0.5, max_tokens=64)
    assert off.cache is None and off.opts == SuffixOptions(4, 8, 0.5, False, 64)
    a, b = default.drafter(), default.drafter()
    assert a.cache is b.cache and a.trie is not b.trie and a.seq_id != b.seq_id  # shared trie, own tries
    other_vocab = Pair(pair.target, None, None, draft_tokenizer=object())  # model-free: a draft's tokenizer is moot
    assert make_strategy("suffix", other_vocab).cache is not None


@pytest.mark.parametrize(("option", "value"), [
    ("budget", 0), ("budget", "x"), ("budget", 2.5), ("budget", True), ("max_depth", 1), ("max_depth", "8"),
    ("min_prob", 0), ("min_prob", 1.5), ("min_prob", "0.1"), ("shared", "maybe"), ("shared", 2), ("max_tokens", 0),
    ("max_spec_factor", 0), ("max_spec_factor", "x"),
])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(SpeculorError, match=option):
        make_strategy("suffix", model_free(), **{option: value})


# ---------------------------------------------------------------- the hybrid (fallback)

PLAIN_PROMPT = [5, 4, 3, 2]  # no token repeats: the tries match only what the answer repeats

def hybrid(draft, cost=FLAT, **options) -> SuffixStrategy:
    """suffix with budget 'auto' and DySpec's auto tree on `draft` as its fallback, both on cost curve `cost`."""
    from functools import partial

    from speculor.drafters.base import Shared
    from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions

    fallback = Shared(partial(DySpecDrafter, Model(draft), DySpecOptions(budget="auto", depth=4), cost))
    return SuffixStrategy(SuffixOptions(budget="auto", **options), cost, fallback)


def test_the_hybrid_is_greedy_identical_and_uses_both(target, draft):
    """Where the tries draft nothing the draft model's tree is asked; greedy output is plain decoding's either way,
    and each step is credited to the drafter that proposed it."""
    strategy = hybrid(draft)
    seen = Counter()
    for prompt in ([0], REPETITIVE, [5, 4, 3, 2]):
        stats = engine.Stats()
        out = [t.id for t in engine.stream(Model(target), strategy.drafter(), prompt,
                                           SamplingConfig(max_new_tokens=30), stats=stats)]
        assert out == plain_greedy(target, prompt, 30), f"prompt {prompt}"
        for s in stats.steps:
            by = "fallback" if s.drafter_stats.get("fallback") else "suffix" if s.drafted else "plain"
            seen[by] += 1
            assert (s.draft_forwards > 0) <= (by == "fallback")  # only the fallback runs the draft model
    assert seen["fallback"] > 0 and seen["suffix"] > 0, seen


def test_the_hybrids_exact_law(target, draft):
    """The law of the first N tokens after a prompt whose tries rarely match (the request's own trie only), so that
    the draft model's trees and the tries' are both verified."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=N)
    t_model, drafter = Model(target), hybrid(draft, shared=False).drafter()
    counts, fell_back = torch.zeros([V] * N, dtype=torch.float64), 0
    torch.manual_seed(7)
    for _ in range(2000):
        stats = engine.Stats()
        counts[tuple(t.id for t in engine.stream(t_model, drafter, PLAIN_PROMPT, cfg, stats=stats))] += 1
        fell_back += sum(bool(s.drafter_stats.get("fallback")) and s.drafted > 0 for s in stats.steps)
    pvalue, tv, floor = goodness_of_fit(counts, exact_law(target, PLAIN_PROMPT, cfg, N))
    assert pvalue > 1e-3 and tv < 2 * floor, f"p-value {pvalue:.2e}, TV {tv:.4f}"
    assert fell_back > 100  # the draft model's trees were verified too


def test_the_hybrid_in_a_batch_equals_alone(target, draft):

    strategy = hybrid(draft)
    prompts = [REPETITIVE, [0], [5, 4, 3, 2]]
    cfgs = [SamplingConfig(max_new_tokens=24), SamplingConfig(temperature=0.8, seed=3, max_new_tokens=24),
            SamplingConfig(max_new_tokens=20)]
    alone = [[t.id for t in engine.stream(Model(target), strategy.drafter(), p, c)]
             for p, c in zip(prompts, cfgs, strict=True)]
    assert run_batch(Model(target), [strategy.drafter] * 3, prompts, cfgs) == alone


def test_the_registry_builds_the_fallback(monkeypatch):
    import speculor.drafters.dyspec as dyspec_module
    import speculor.drafters.suffix as suffix_module

    monkeypatch.setattr(dyspec_module, "machine_cost", lambda pair: FLAT)
    monkeypatch.setattr(suffix_module, "live_cost", lambda pair: FLAT)
    pair = Pair(Model(random_toy(6, seed=0)), Model(random_toy(6, seed=1)), None)
    strategy = make_strategy("suffix", pair, budget="auto", fallback="dyspec")
    assert strategy.fallback is not None and strategy.drafter().fallback is not None
    assert make_strategy("suffix", pair).fallback is None and "fallback" in options_of("suffix")
    with pytest.raises(SpeculorError, match="fallback"):
        make_strategy("suffix", pair, fallback="chain")
    with pytest.raises(SpeculorError, match="draft model"):
        make_strategy("suffix", Pair(pair.target, None, None), fallback="dyspec")
