"""Full tree decoding through `engine.stream` with the toy LMs of tests/support/toy.py: the law of the first N tokens
of SpecInfer trees (expansion-based, and merged from several drafters with point-mass, i.i.d. and other-temperature
children) is the target's (chi-square, docs/algorithms.md §10.3), a mislabelled tree is caught, and greedy output is
plain greedy."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.stats import counts, goodness_of_fit
from support.toy import T1, N, ToyLM, exact_law, plain_greedy

from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.tree import expansion_shape
from speculor.drafters.merged import MergedDrafter
from speculor.drafters.ngram import NgramDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.engine.drafting import drive
from speculor.runtime.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")


class SworLabelledIid(TreeDrafter):
    """Negative control: children drawn without replacement but declared i.i.d. (verified with d_j = q: biased)."""

    def propose(self, seq, cfg, generator):
        return replace((yield from super().propose(seq, cfg, generator)), draw="iid")


def drafters(draft: ToyLM) -> dict[str, object]:
    model = Model(draft)  # weights only: every drafter below has its own draft cache
    return {
        "expansion": lambda: TreeDrafter(model, expansion_shape([2, 2])),
        # the draft model i.i.d., the same model at T' = 1.7 (its own cache) and prompt lookup, merged by prefix
        "merged": lambda: MergedDrafter([TreeDrafter(model, expansion_shape([2, 1])),
                                         TreeDrafter(model, expansion_shape([1, 2]), temperature=1.7),
                                         NgramDrafter(2)]),
        "swor_as_iid": lambda: SworLabelledIid(model, expansion_shape([3, 1]), "swor"),
    }


@pytest.mark.parametrize(("name", "prompt"), [("expansion", [1, 2]), ("merged", [2, 1, 2])])
def test_specinfer_trees_follow_the_exact_law(target, draft, name, prompt):
    # prompt [2, 1, 2]: prompt lookup proposes the continuation of the earlier 2, so point-mass children mix with
    # sampled ones at the root
    drafter = drafters(draft)[name]()
    m = 2000
    pvalue, tv, floor = goodness_of_fit(counts(target, drafter, prompt, m, seed0=100), exact_law(target, prompt, T1, N))
    assert pvalue > 1e-3, f"{name}: chi-square p-value {pvalue:.2e}, TV {tv:.4f}"
    assert tv < 2 * floor, f"{name}: TV {tv:.4f} vs noise floor {floor:.4f}"


def test_merged_trees_mix_kinds(target, draft):
    drafter = drafters(draft)["merged"]()
    seen = set()
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        drafter.reset()
        tree = drive(drafter.propose([2, 1, 2], T1, g))
        seen |= set(tree.kinds or (tree.draw,))
        assert drafter.forwards == 2 + 2  # two model drafters of depth 2, prompt lookup free
    assert seen == {"iid", "point"}


def test_chi_square_catches_swor_children_verified_as_iid(target, draft):
    drafter = drafters(draft)["swor_as_iid"]()
    pvalue, tv, _ = goodness_of_fit(counts(target, drafter, [1, 2], 800, seed0=5000), exact_law(target, [1, 2], T1, N))
    assert pvalue < 1e-6, f"biased tree not detected: p-value {pvalue:.2e}, TV {tv:.4f}"


@pytest.mark.parametrize("name", ["expansion", "merged"])
@pytest.mark.parametrize("prompt", [[0], [1, 2], [5, 4, 3, 2], [3, 3, 3]])
def test_greedy_equals_plain_greedy(target, draft, name, prompt):
    out = [t.id for t in engine.stream(Model(target), drafters(draft)[name](), prompt,
                                       SamplingConfig(max_new_tokens=15))]
    assert out == plain_greedy(target, prompt, 15)
