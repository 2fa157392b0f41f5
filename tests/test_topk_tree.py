"""EAGLE-2-style `topk-tree` (docs/algorithms.md §6) on toy LMs: reranking keeps the tree connected on exact ties, the
tree built on a crafted draft, greedy output equal to plain greedy, and the exact law of full decoding at
temperature 1 with point-mass verification (chi-square)."""

from __future__ import annotations

import pytest
import torch
from support.stats import counts, goodness_of_fit
from support.toy import CRAFTED, T1, exact_law, first_order, plain_greedy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.drafters.topk_tree import Pool, TopkOptions, TopkTreeDrafter, rank, select
from speculor.engine.drafting import drive
from speculor.errors import SpeculorError
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rank_breaks_ties_toward_shallower_nodes():
    # a chain of certain tokens (log c = 0): every node has value 0; created deepest-first on purpose
    pool = Pool(tokens=[7, 8, 9, 5], parents=[1, 2, -1, -1], values=[0.0, 0.0, 0.0, -1.0], depths=[3, 2, 1, 1])
    assert rank(pool.values, pool.depths) == [2, 1, 0, 3]
    assert select(pool, 2) == [2, 1]  # the parent of a selected node is always selected
    assert select(pool, 3) == [2, 1, 0]


def test_tree_on_a_crafted_draft():
    """By hand (root token 0, k = 2, depth 3, budget 5): depth 1 {1: .55, 2: .35}; fed both -> under 1 {0: .2475,
    2: .22}, under 2 {3: .14, 2: .105}; fed the best two, 1-0 and 1-2 -> values <= .136; top 5 of the pool."""
    drafter = TopkTreeDrafter(Model(CRAFTED), TopkOptions(budget=5, depth=3, k=2))
    tree = drive(drafter.propose([3, 0], SamplingConfig(), None))
    assert tree.tokens.tolist() == [1, 2, 0, 2, 3] and tree.parents.tolist() == [-1, -1, 0, 0, 1]
    assert torch.tensor(drafter.values).exp().tolist() == pytest.approx([0.55, 0.35, 0.2475, 0.22, 0.14], abs=1e-6)
    assert tree.draw == "point" and tree.q is None
    assert drafter.forwards == 3 and sorted(drafter.rows) == [0, 1, 2, 3]


def test_certain_draft_keeps_the_tree_connected():
    """A draft that is certain after every token (confidence exactly 1, log value ties) stays a connected tree."""
    certain = first_order([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    drafter = TopkTreeDrafter(Model(certain), TopkOptions(budget=4, depth=6, k=3))
    tree = drive(drafter.propose([2, 3], SamplingConfig(), None))
    assert tree.tokens.tolist() == [0, 1, 2, 3] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert drafter.values == [0.0] * 4


def test_unfed_when_no_child_can_be_selected(draft):
    drafter = TopkTreeDrafter(Model(draft), TopkOptions(budget=2, depth=6, k=3))
    tree = drive(drafter.propose([1, 2], SamplingConfig(), None))
    assert len(tree) == 2 and drafter.forwards <= 2


@pytest.mark.parametrize("opts", [TopkOptions(budget=8, depth=4, k=3), TopkOptions(budget=3, depth=2, k=1)])
@pytest.mark.parametrize("prompt", [[0], [1, 2], [5, 4, 3, 2]])
def test_greedy_equals_plain_greedy(target, draft, opts, prompt):
    stats = engine.Stats()
    out = [t.id for t in engine.stream(Model(target), TopkTreeDrafter(Model(draft), opts), prompt,
                                       SamplingConfig(max_new_tokens=15), stats=stats)]
    assert out == plain_greedy(target, prompt, 15)
    assert all(s.drafted <= opts.budget for s in stats.steps)


def test_topk_tree_follows_the_exact_law(target, draft):
    drafter = TopkTreeDrafter(Model(draft), TopkOptions(budget=6, depth=3, k=2))
    pvalue, tv, floor = goodness_of_fit(counts(target, drafter, [1, 2], 1500, 300), exact_law(target, [1, 2], T1, 3))
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"TV {tv:.4f} vs noise floor {floor:.4f}"


@pytest.mark.parametrize("options", [{"budget": 0}, {"depth": 0}, {"k": 0}, {"k": 2.5}, {"budget": True}])
def test_bad_options(options):
    with pytest.raises(SpeculorError):
        TopkOptions(**options)
