"""GSD (docs/algorithms.md §8) on hand-built DAGs and toy LMs: the merge criterion (k = -1, 0, 1, 2; ancestors
excluded), unrolling (copies, real nodes, the budget, cycles), the work-saved numbers, drafting with merges,
greedy output equal to plain greedy, and the exact law of full decoding at temperature 1 (matching rule)."""

from __future__ import annotations

import pytest
import torch
from support.stats import counts, goodness_of_fit
from support.toy import CRAFTED, T1, exact_law, plain_greedy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.drafters.gsd import Dag, GSDDrafter, GSDOptions, candidates, merge_target, savings, tail, unroll
from speculor.engine.drafting import drive
from speculor.errors import SpeculorError
from speculor.runtime.model import Model

SEQ = [10, 11]  # committed tokens; the root is 11


pytestmark = pytest.mark.usefixtures("one_thread")


def hand_dag() -> Dag:
    """root(11) -> 0:1 -> 1:2 -> 2:3 ;  root -> 3:5 -> 4:1"""
    dag = Dag()
    for u, y in [(-1, 1), (0, 2), (1, 3), (-1, 5), (3, 1)]:
        dag.add(u, y)
    return dag


def test_tail():
    assert tail([1, 2, 3], 0) == [] and tail([1, 2, 3], 2) == [2, 3] and tail([1, 2, 3], 5) == [1, 2, 3]


def test_merge_target():
    dag = hand_dag()
    assert merge_target(dag, SEQ, 3, 2, 0) == 1  # the token alone
    assert merge_target(dag, SEQ, 3, 2, 1) is None  # 1 is preceded by token 1, ctx(3) ends with 5
    assert merge_target(dag, SEQ, 4, 2, 1) == 1  # ctx(4) ends with 1 like the context of node 1
    assert merge_target(dag, SEQ, 4, 2, 2) is None  # [5, 1] vs [11, 1]
    assert merge_target(dag, SEQ, 2, 1, 0) == 4  # node 0 (token 1) is an ancestor of 2: skipped
    assert merge_target(dag, SEQ, 0, 1, 0) == 4  # never u itself
    assert merge_target(dag, SEQ, 4, 2, -1) is None  # merging off
    assert merge_target(dag, SEQ, 3, 9, 0) is None  # no node with that token
    assert merge_target(dag, [7, 11], -1, 5, 1) == 3  # root's context comes from the committed sequence


def test_unroll_copies_the_merged_subtree():
    dag = hand_dag()
    dag.link(4, 1)  # 4's candidate 2 merged into node 1: node 1 and its subtree are copied under 4
    un = unroll(dag, 32)
    assert un.tree.tokens.tolist() == [1, 5, 2, 1, 3, 2, 3]
    assert un.tree.parents.tolist() == [-1, -1, 0, 1, 2, 3, 5]
    assert un.origin == [0, 3, 1, 4, 2, 1, 2]
    assert un.real == [True, True, True, True, True, False, False]
    assert un.tree.draw == "point" and un.tree.q is None  # verified by matching only
    assert savings(un, dag, fed_rows=4, forwards=3) == {
        "drafted": 5, "verified": 7, "merges": 1, "tokens_saved": 2, "fed_rows": 4, "rows_saved": 1,
        "forwards": 3, "forwards_saved": 1}
    assert unroll(dag, 4).tree.tokens.tolist() == [1, 5, 2, 1]  # the budget keeps the shallowest nodes


def test_unroll_of_a_cycle_is_bounded():
    dag = hand_dag()
    dag.link(4, 1)
    dag.link(2, 3)  # 3 -> 4 ~> 1 -> 2 ~> 3: a cycle through two pseudo edges
    un = unroll(dag, 30)
    assert len(un.tree) == 30 and sum(un.real) == 5


def test_unroll_drops_repeated_sibling_tokens():
    dag = hand_dag()
    dag.link(-1, 4)  # a second root edge to a token-1 node: the first one wins
    assert unroll(dag, 32).tree.tokens.tolist()[:2] == [1, 5]
    assert len(unroll(dag, 32).tree) == 5


def test_candidates():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert [y for y, _ in candidates(logits, 3, 0.2)] == [0, 1, 2]
    assert [y for y, _ in candidates(logits, 3, 0.4)] == [0, 1]  # .15 < .4 x .5
    assert [y for y, _ in candidates(logits, 8, 0.0)] == [0, 1, 2, 3]


# ---------------------------------------------------------------- the drafter


def test_drafting_merges_and_reports_the_work_saved():
    """A first-order draft (q depends on the last token) with k = 1: a candidate after token a merges into an
    earlier node with the same token after a, and its subtree is reused in the unrolled tree."""
    merged = GSDDrafter(Model(CRAFTED), GSDOptions(n=3, k=1, depth=4, budget=64))
    tree = drive(merged.propose([3, 0], SamplingConfig(), None))
    s = merged.stats
    assert s["merges"] > 0 and s["verified"] == len(tree)
    assert s["tokens_saved"] == len(tree) - sum(merged.unrolled.real) > 0
    assert sum(merged.unrolled.real) == s["drafted"]  # every drafted node is in the tree once in its own context
    assert all(merged.unrolled.real[i] for i in merged.rows)  # cache rows only where the context is true
    off = GSDDrafter(Model(CRAFTED), GSDOptions(n=3, k=-1, depth=4, budget=64))
    drive(off.propose([3, 0], SamplingConfig(), None))
    assert off.stats["merges"] == 0 and off.stats["tokens_saved"] == 0
    # merging drafted and fed fewer tokens, and verified more
    assert s["drafted"] < off.stats["drafted"] and s["fed_rows"] < off.stats["fed_rows"]
    assert s["verified"] > off.stats["verified"]


@pytest.mark.parametrize("k", [-1, 0, 1, 2])
@pytest.mark.parametrize("prompt", [[0], [1, 2], [5, 4, 3, 2]])
def test_greedy_equals_plain_greedy(target, draft, k, prompt):
    drafter = GSDDrafter(Model(draft), GSDOptions(n=3, k=k, sibling_threshold=0.1, prob_threshold=0.2, budget=12))
    out = [t.id for t in engine.stream(Model(target), drafter, prompt, SamplingConfig(max_new_tokens=15))]
    assert out == plain_greedy(target, prompt, 15)
    if k >= 0:
        assert set(drafter.totals) >= {"merges", "tokens_saved", "forwards_saved"}


def test_gsd_follows_the_exact_law(target, draft):
    drafter = GSDDrafter(Model(draft), GSDOptions(n=3, k=0, sibling_threshold=0.05, prob_threshold=0.1, depth=3,
                                               budget=10))
    m = 1500
    c = counts(target, drafter, [1, 2], m, 500)
    pvalue, tv, floor = goodness_of_fit(c, exact_law(target, [1, 2], T1, 3))
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"TV {tv:.4f} vs noise floor {floor:.4f}"
    assert drafter.totals["merges"] > 0  # merged subtrees were verified (the totals of the last generation)


@pytest.mark.parametrize("options", [{"n": 0}, {"k": -2}, {"k": 17}, {"depth": 0}, {"budget": 0},
                                     {"sibling_threshold": 1.5}, {"prob_threshold": -0.1}, {"n": True}])
def test_bad_options(options):
    with pytest.raises(SpeculorError):
        GSDOptions(**options)


def test_engine_and_bench_record_the_work_saved(target, draft):
    from speculor.bench.run import sum_stats

    drafter = GSDDrafter(Model(draft), GSDOptions(n=3, k=0, sibling_threshold=0.1, prob_threshold=0.2, budget=12))
    stats = engine.Stats()
    list(engine.stream(Model(target), drafter, [1, 2], SamplingConfig(max_new_tokens=15), stats=stats))
    per_step = [s.drafter_stats for s in stats.steps]
    assert all(d is not None and d["verified"] == s.drafted for d, s in zip(per_step, stats.steps, strict=True))
    assert sum_stats(per_step) == drafter.totals
    assert sum_stats([None, {"a": 1}, {"a": 2, "b": 1}]) == {"a": 3, "b": 1} and sum_stats([None]) is None
