"""Dynamic trees and draft graphs on tiny random transformers Qwen2 models (fp32, CPU, no download): the draft
distributions of `dyspec` trees and the values of `topk-tree` trees equal plain forwards over each node's root path
(also after commits), a model drafting for itself is fully accepted, greedy output of dyspec / topk-tree / gsd
equals plain greedy, and the strategies' options."""

from __future__ import annotations

import pytest
import torch
from support.tiny import PROMPTS, reference_greedy, reference_logits, tiny_model
from support.tiny import draft as draft  # noqa: F401  (fixtures)
from support.tiny import pair as pair  # noqa: F401
from support.tiny import target as target  # noqa: F401
from support.toy import Watched

from speculor import Model, SamplingConfig, Speculor, SpeculorError, engine
from speculor.core.tree import path_to
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.drafters.gsd import GSDDrafter, GSDOptions
from speculor.drafters.topk_tree import TopkOptions, TopkTreeDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


class Checked(Watched):
    """After every proposal checks the draft numbers against plain forwards of the draft model over each parent's
    root path: dyspec's q rows (log q = log_softmax(logits / T)), topk-tree's value increments
    (log_softmax(logits), untempered)."""

    def __init__(self, inner, model) -> None:
        super().__init__(inner)
        self.model = model

    def seen(self, seq, cfg, tree) -> None:
        for i in range(len(tree)):
            parent = int(tree.parents[i])
            above = [int(tree.tokens[j]) for j in path_to(tree.parents, parent)]
            logits = reference_logits(self.model, list(seq) + above)
            want = torch.log_softmax(logits / (cfg.temperature or 1.0), -1)
            if isinstance(self.inner, DySpecDrafter):
                diff = float((torch.log(tree.q[i]) - want).abs().max())
            else:
                base = self.inner.values[parent] if parent >= 0 else 0.0
                diff = abs(self.inner.values[i] - base - float(want[tree.tokens[i]]))
            assert diff < 1e-4, f"node {i}: max abs diff {diff:.2e}"


@pytest.mark.parametrize(("make", "temperature"), [
    # a low temperature: the tiny random models are nearly uniform, and deeper nodes must be accepted sometimes
    (lambda model: DySpecDrafter(model, DySpecOptions("heap", budget=10, depth=4, batch=3)), 0.05),
    (lambda model: DySpecDrafter(model, DySpecOptions("threshold", budget=10, threshold=0.2, depth=4)), 0.05),
    (lambda model: TopkTreeDrafter(model, TopkOptions(budget=10, depth=4, k=3)), 0.0),
])
def test_draft_numbers_equal_path_forwards(target, draft, make, temperature):  # noqa: F811
    drafter = Checked(make(Model(draft)), draft)
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=24, seed=1)
    stats = engine.Stats()
    out = list(engine.stream(Model(target), drafter, PROMPTS[0], cfg, stats=stats))
    assert len(out) == 24 and drafter.proposals == len(stats.steps) >= 3
    assert any(s.accepted >= 2 for s in stats.steps)  # commits of accepted paths happened between proposals


@pytest.mark.parametrize("make", [
    lambda model: TopkTreeDrafter(model, TopkOptions(budget=4, depth=4, k=1)),
    lambda model: GSDDrafter(model, GSDOptions(n=1, k=-1, sibling_threshold=0.0, prob_threshold=0.0, depth=4,
                                               budget=4)),
    lambda model: GSDDrafter(model, GSDOptions(n=1, k=0, sibling_threshold=0.0, prob_threshold=0.0, depth=4,
                                               budget=4)),
])
def test_self_draft_chain_is_fully_accepted(target, make):  # noqa: F811
    """The target drafting for itself, top-1 only: a chain of 4 greedy tokens, all accepted, every step."""
    stats = engine.Stats()
    model = Model(target)  # one Model for both roles: the drafter drafts into its own cache
    out = list(engine.stream(model, make(model), PROMPTS[0], SamplingConfig(max_new_tokens=20), stats=stats))
    assert [t.id for t in out] == reference_greedy(target, PROMPTS[0], 20)
    assert [s.accepted for s in stats.steps] == [4] * 4


def drafters(model: Model) -> dict[str, object]:
    return {
        "dyspec-heap": DySpecDrafter(model, DySpecOptions("heap", budget=8, depth=5)),
        "dyspec-threshold": DySpecDrafter(model, DySpecOptions("threshold", budget=12, threshold=0.05)),
        "topk-tree": TopkTreeDrafter(model, TopkOptions(budget=10, depth=5, k=3)),
        "gsd-k0": GSDDrafter(model, GSDOptions(k=0, budget=16)),
        "gsd-k1": GSDDrafter(model, GSDOptions(k=1, budget=16)),
    }


@pytest.mark.parametrize("name", ["dyspec-heap", "dyspec-threshold", "topk-tree", "gsd-k0", "gsd-k1"])
def test_greedy_equals_plain_greedy(target, draft, name):  # noqa: F811
    t_model = Model(target)
    drafter = drafters(Model(draft))[name]
    cfg = SamplingConfig(max_new_tokens=20)
    for prompt in PROMPTS:
        stats = engine.Stats()
        spec = [t.id for t in engine.stream(t_model, drafter, prompt, cfg, stats=stats)]
        assert spec == reference_greedy(target, prompt, 20), f"prompt {prompt}"
        assert stats.tau >= 1


def test_greedy_with_an_unrelated_draft(target):  # noqa: F811
    other = tiny_model(7, hidden=16, layers=1, context=128)
    for name, drafter in drafters(Model(other)).items():
        out = [t.id for t in engine.stream(Model(target), drafter, PROMPTS[3], SamplingConfig(max_new_tokens=12))]
        assert out == reference_greedy(target, PROMPTS[3], 12), name


@pytest.mark.parametrize(("name", "options"), [
    ("dyspec", {}), ("dyspec", {"variant": "heap", "budget": 6}), ("dyspec", {"threshold": 0.1, "depth": 3}),
    ("dyspec", {"temperature": 0.6}), ("topk-tree", {}), ("topk-tree", {"budget": 6, "depth": 3, "k": 2}),
    ("gsd", {}), ("gsd", {"k": 0, "n": 2}), ("gsd", {"k": -1, "budget": 8}),
])
def test_strategies_greedy(pair, target, name, options):  # noqa: F811
    sp = Speculor(pair, strategy=name, **options)
    out = sp.generate(PROMPTS[3], SamplingConfig(max_new_tokens=12, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, PROMPTS[3], 12)
    sampled = sp.generate(PROMPTS[1], SamplingConfig(temperature=0.8, top_p=0.9, seed=4, max_new_tokens=8,
                                                     stop_on_eos=False))
    assert len(sampled.token_ids) == 8


@pytest.mark.parametrize(("name", "options"), [
    ("dyspec", {"variant": "x"}), ("dyspec", {"budget": -1}), ("dyspec", {"width": 3}), ("topk-tree", {"k": 0}),
    ("topk-tree", {"expansion": "2"}), ("gsd", {"k": 5.5}), ("gsd", {"sibling_threshold": 2}),
])
def test_bad_options(pair, name, options):  # noqa: F811
    with pytest.raises(SpeculorError):
        Speculor(pair, strategy=name, **options)


@pytest.mark.parametrize("name", ["dyspec", "topk-tree", "gsd"])
def test_needs_a_draft_model(pair, name):  # noqa: F811
    from speculor import Pair

    with pytest.raises(SpeculorError, match="needs a draft"):
        Speculor(Pair(pair.target, None, pair.tokenizer), strategy=name)
