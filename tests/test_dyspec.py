"""DySpec (docs/algorithms.md §5) on toy LMs: heap values and expansion order on a crafted draft, the threshold variant
reproducing the heap tree (§5.2), the auto budget's rule, the exact law of full decoding at temperature 1
(chi-square) for both variants, and a negative control (children pruned by value after sampling) that is caught."""

from __future__ import annotations

import pytest
import torch
from support.stats import counts, goodness_of_fit
from support.toy import CRAFTED, T1, N, ToyLM, V, exact_law, plain_greedy, random_toy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.tree import DraftTree, path_to
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.values import expected_gain, steer, worth
from speculor.engine.drafting import drive
from speculor.errors import SpeculorError
from speculor.runtime.cost import CostModel
from speculor.runtime.model import Model

GREEDY = SamplingConfig()


pytestmark = pytest.mark.usefixtures("one_thread")


def grow(model: ToyLM, seq: list[int], cfg: SamplingConfig, seed: int = 0, **options) -> tuple[DraftTree,
                                                                                                  DySpecDrafter]:
    drafter = DySpecDrafter(Model(model), DySpecOptions(**options))
    tree = drive(drafter.propose(seq, cfg, torch.Generator().manual_seed(seed)))
    return tree, drafter


def paths(tree: DraftTree, values: list[float]) -> dict[tuple[int, ...], float]:
    """Token path of every node -> its value (a tree as a set, whatever its node order)."""
    return {tuple(int(tree.tokens[j]) for j in path_to(tree.parents, i)): values[i] for i in range(len(tree))}


# ---------------------------------------------------------------- heap: values and expansion order


def test_heap_values_and_order_on_a_crafted_draft():
    """Alg. 1 by hand (root token 0, greedy draws = the most likely remaining token):
    pop 1.0 root -> 1 (v .55) | pop .55 n0 -> 0 (v .2475) | pop .45 root -> 2 (v .35) | pop .35 n2 -> 3 (v .14)
    | pop .3025 n0 -> 2 (v .22) | pop .2475 n1 -> 1 (v .136125)."""
    tree, d = grow(CRAFTED, [3, 0], GREEDY, variant="heap", budget=6, batch=1, temperature=1.0)
    assert tree.tokens.tolist() == [1, 0, 2, 3, 2, 1]
    assert tree.parents.tolist() == [-1, 0, -1, 2, 0, 1]
    assert d.values == pytest.approx([0.55, 0.2475, 0.35, 0.14, 0.22, 0.136125], abs=1e-6)
    assert d.draw_values == pytest.approx([1.0, 0.55, 0.45, 0.35, 0.3025, 0.2475], abs=1e-6)
    assert tree.draw == "point" and tree.q is None
    assert d.forwards == 1 + 3  # catch-up, then n0, n2, n1 one row each (batch=1): leaves are never fed
    assert sorted(d.rows) == [0, 1, 2]


def test_greedy_values_are_sharpened_by_default():
    """At temperature 0 the values use softmax(logits / 0.5), i.e. q² renormalised: the root's draws are the same
    tokens in the same order, valued .3025/.435 and .1225/.435 instead of .55 and .35."""
    tree, d = grow(CRAFTED, [3, 0], GREEDY, variant="heap", budget=2, depth=1)
    assert tree.tokens.tolist() == [1, 2] and tree.parents.tolist() == [-1, -1]
    assert d.values == pytest.approx([0.3025 / 0.435, 0.1225 / 0.435], abs=1e-6)


def test_heap_batching_changes_forwards_not_the_tree():
    one, d1 = grow(CRAFTED, [3, 0], GREEDY, variant="heap", budget=6, batch=1, temperature=1.0)
    four, d4 = grow(CRAFTED, [3, 0], GREEDY, variant="heap", budget=6, batch=4, temperature=1.0)
    assert one.tokens.tolist() == four.tokens.tolist() and one.parents.tolist() == four.parents.tolist()
    assert d4.forwards < d1.forwards


def test_heap_sampled_tree_is_swor_with_falling_draw_values(draft):
    for seed in range(5):
        tree, d = grow(draft, [1, 2, 3], T1, seed, variant="heap", budget=10, depth=4)
        assert len(tree) == 10 and tree.draw == "swor" and tree.q.shape == (10, V)
        assert all(a >= b - 1e-9 for a, b in zip(d.draw_values, d.draw_values[1:], strict=False))
        for node in [-1, *range(len(tree))]:
            kids = tree.children(node)
            toks = [int(tree.tokens[c]) for c in kids]
            assert len(set(toks)) == len(toks)  # without replacement
            for c in kids:  # every sibling row holds the parent's full q (the verifier removes earlier ones)
                assert torch.equal(tree.q[c], tree.q[kids[0]])
                parent_v = 1.0 if node < 0 else d.values[node]
                assert d.values[c] == pytest.approx(parent_v * float(tree.q[c, tree.tokens[c]]), rel=1e-5)
        assert max(len(path_to(tree.parents, i)) for i in range(len(tree))) <= 4


# ---------------------------------------------------------------- threshold variant (§5.2)


def test_threshold_variant_on_the_crafted_draft():
    tree, d = grow(CRAFTED, [3, 0], GREEDY, variant="threshold", budget=6, threshold=0.2475, temperature=1.0)
    heap, dh = grow(CRAFTED, [3, 0], GREEDY, variant="heap", budget=6, temperature=1.0)
    assert paths(tree, d.values) == pytest.approx(paths(heap, dh.values))
    assert d.forwards == 3  # catch-up + one batched forward per depth (depths 1 and 2 fed)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [3, 7, 12])
def test_threshold_at_the_last_heap_value_reproduces_the_heap_tree(seed, budget):
    """Deterministic draws (temperature 0): t = the last draw value the heap takes, same cap -> the same tree."""
    model = random_toy(V, seed=10 + seed, scale=1.0)
    seq = [seed % V, (seed + 3) % V]
    heap, dh = grow(model, seq, GREEDY, variant="heap", budget=budget, depth=5)
    layers, dl = grow(model, seq, GREEDY, variant="threshold", budget=budget, depth=5, threshold=dh.draw_values[-1])
    assert paths(layers, dl.values) == pytest.approx(paths(heap, dh.values))
    assert dl.forwards <= 5


def test_threshold_sampled_draws_stop_below_t(draft):
    for seed in range(5):
        tree, d = grow(draft, [0, 4], T1, seed, variant="threshold", budget=64, threshold=0.05, depth=6)
        assert len(tree) < 64 and min(d.draw_values) >= 0.05
        assert d.forwards <= 6


def test_steered_threshold(draft):
    assert steer(0.1, 16, 16) == pytest.approx(0.15) and steer(0.1, 8, 16) == pytest.approx(0.1 / 1.2)
    assert steer(0.1, 13, 16) == 0.1 and steer(0.4, 16, 16) == 0.5 and steer(1.1e-4, 0, 16) == 1e-4
    draft_model = Model(draft)
    drafter = DySpecDrafter(draft_model, DySpecOptions("threshold", budget=4, depth=6))
    ts = []
    for seed in range(8):
        ts.append(drafter.t)
        drafter.cache = draft_model.new_cache()  # a fresh draft cache; reset() would also restart the threshold
        tree = drive(drafter.propose([1, 2], T1, torch.Generator().manual_seed(seed)))
        assert len(tree) <= 4 and drafter.stats["threshold"] == ts[-1]
    assert ts[0] == 0.25 and len(set(ts)) > 1  # it moved
    fixed = DySpecDrafter(Model(draft), DySpecOptions("threshold", budget=4, threshold=0.01))
    drive(fixed.propose([1, 2], T1, None))
    assert fixed.t == 0.01 and not fixed.opts.adaptive


# ---------------------------------------------------------------- the auto budget


def test_worth_and_expected_gain():
    flat = CostModel((1, 2, 9, 17), (0.5, 0.9, 0.9, 1.35), (1, 8), (0.2, 0.3))
    assert worth(flat, 3, 1.0, 0.4, 0.01)  # free target tokens between 2 and 9 rows: any gain pays
    assert not worth(flat, 10, 2.0, 0.4, 0.01)  # 56 ms per token above 9 rows
    assert worth(flat, 10, 2.0, 0.4, 0.5)
    assert not worth(flat, 3, 1.0, 0.4, 0.1, extra_draft_s=0.3)  # a draft forward for little
    r = torch.tensor([0.5, 0.0, 0.3, 0.2])
    assert expected_gain(0.5, r) == pytest.approx(0.5 * (0.25 + 0.09 + 0.04) / 1.0)


@pytest.mark.parametrize("variant", ["heap", "threshold"])
def test_auto_budget_is_greedy_identical(target, draft, variant):
    cost = CostModel((1, 2, 9, 17), (0.5, 0.9, 0.9, 1.35), (1, 8), (0.2, 0.3))
    drafter = DySpecDrafter(Model(draft), DySpecOptions(variant, "auto", depth=6), cost)
    stats = engine.Stats()
    out = [t.id for t in engine.stream(Model(target), drafter, [1, 2], SamplingConfig(max_new_tokens=20), stats=stats)]
    assert out == plain_greedy(target, [1, 2], 20)
    assert all(1 <= s.drafted <= 64 for s in stats.steps)
    with pytest.raises(SpeculorError, match="cost model"):
        DySpecDrafter(Model(draft), DySpecOptions(budget="auto"))


@pytest.mark.parametrize("options", [{"variant": "dfs"}, {"budget": 0}, {"budget": "big"}, {"threshold": 2},
                                     {"depth": 0}, {"temperature": 0}, {"batch": 0}, {"budget": True}])
def test_bad_options(options):
    with pytest.raises(SpeculorError):
        DySpecOptions(**options)


# ---------------------------------------------------------------- exact law (chi-square)


class PrunedAfterSampling(DySpecDrafter):
    """Negative control (§2: "SWOR, children pruned after drawing, by their q: biased"): draw the root's children
    without replacement, then drop those whose value v·q(y) fell below `cut`, after their tokens were seen.
    After the prompt [5, 0] the first token's law is off by TV 0.45 (exact enumeration of the three draws)."""

    cut = 0.3

    def propose(self, seq, cfg, generator):
        tree = yield from super().propose(seq, cfg, generator)
        keep = [i for i in range(len(tree)) if self.values[i] >= self.cut]
        self.rows = {}
        return DraftTree(tree.tokens[keep], torch.full((len(keep),), -1), tree.q[keep], "swor")


@pytest.mark.parametrize(("variant", "options"), [("heap", {"budget": 5, "batch": 2}),
                                                  ("threshold", {"budget": 6})])  # steered threshold
def test_dyspec_follows_the_exact_law(target, draft, variant, options):
    drafter = DySpecDrafter(Model(draft), DySpecOptions(variant, depth=3, **options))
    m = 1500
    pvalue, tv, floor = goodness_of_fit(counts(target, drafter, [1, 2], m, 100), exact_law(target, [1, 2], T1, N))
    assert pvalue > 1e-3, f"{variant}: chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"{variant}: TV {tv:.4f} vs noise floor {floor:.4f}"


def test_chi_square_catches_pruning_after_sampling(target, draft):
    opts = DySpecOptions("threshold", budget=3, threshold=0.0, depth=1)
    law = exact_law(target, [5, 0], T1, N)
    pvalue, tv, _ = goodness_of_fit(counts(target, PrunedAfterSampling(Model(draft), opts), [5, 0], 600, 7000), law)
    assert pvalue < 1e-6, f"pruning after sampling not detected: p-value {pvalue:.2e}, TV {tv:.4f}"
    # the same draws left unpruned pass the same harness
    pvalue, tv, floor = goodness_of_fit(counts(target, DySpecDrafter(Model(draft), opts), [5, 0], 600, 7000), law)
    assert pvalue > 1e-3 and tv < 2 * floor, f"unpruned control: p-value {pvalue:.2e}, TV {tv:.4f}"
