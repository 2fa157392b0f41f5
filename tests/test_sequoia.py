"""Sequoia (docs §4): the DP against brute force, tree reconstruction, the hardware-aware choice on synthetic
cost models, calibration counting and full decoding with tiny models."""

from __future__ import annotations

import functools
import itertools
import json
import math

import numpy as np
import pytest
import torch
from support.stats import goodness_of_fit
from support.tiny import near_pair, reference_greedy
from support.toy import ToyLM, V, exact_law, perturbed, plain_greedy, random_toy

from speculor import Speculor, engine
from speculor.config import SamplingConfig
from speculor.core.sequoia_dp import (
    choose_tree,
    expected_tokens,
    feed_widths,
    level_widths,
    nested_to_shape,
    optimal_trees,
)
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.registry import make_strategy
from speculor.drafters.sequoia import (
    AUTO_NODES,
    Calibration,
    SequoiaOptions,
    SequoiaPlans,
    builtin_calibrations,
    calibration_path,
    plan_tree,
    resolve_acc,
)
from speculor.errors import SpeculorError
from speculor.methods.sequoia_calibration import calibrate
from speculor.runtime.backend import Pair
from speculor.runtime.cache import KVCache
from speculor.runtime.cost import CostModel, cost_path
from speculor.runtime.model import Model
from speculor.runtime.profiling import implausible, profile_cost

# ---------------------------------------------------------------- the DP against brute force


@functools.cache
def all_trees(n: int, branching: int) -> tuple:
    """Every rooted ordered tree of exactly n nodes with at most `branching` children per node (nested tuples)."""
    if n == 1:
        return ((),)
    out = []
    for b in range(1, branching + 1):
        for sizes in _compositions(n - 1, b):
            for kids in itertools.product(*(all_trees(s, branching) for s in sizes)):
                out.append(tuple(kids))
    return tuple(out)


def _compositions(total: int, parts: int):
    """Ordered tuples of `parts` positive integers summing to `total`."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))


def levels(tree: tuple) -> int:
    return 1 + max((levels(c) for c in tree), default=0)


def score(tree: tuple, acc: list[float], f: float = 1.0) -> float:
    """F(T) = Σ_v f(v), child k of a node scoring acc[k]."""
    return f + sum(score(c, acc, f * acc[k]) for k, c in enumerate(tree))


ACCS = {
    "decreasing": [0.6, 0.2, 0.1],
    "not monotone": [0.3, 0.45, 0.05],
    "with a zero": [0.7, 0.0, 0.2],
    "one strong": [0.95, 0.03, 0.01],
    "flat": [0.25, 0.25, 0.25],
    "two only": [0.5, 0.3],
}


def test_tree_enumeration_counts():
    # ordered trees with n nodes: Catalan numbers 1, 1, 2, 5, 14, 42, 132 (unbounded branching, n <= 4 needs <= 3)
    assert [len(all_trees(n, 6)) for n in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]
    assert len(all_trees(4, 2)) == 4  # the 3-child star is excluded


@pytest.mark.parametrize("name", list(ACCS))
def test_dp_equals_brute_force(name):
    acc = ACCS[name]
    table = optimal_trees(acc, n_max=7, d_max=4)
    for n in range(1, 8):
        for d in range(1, 5):
            scores = [score(t, acc) for t in all_trees(n, len(acc)) if levels(t) <= d]
            want = max(scores, default=-math.inf)
            assert table.best[n, d] == pytest.approx(want, abs=1e-12), f"n={n} d={d}"
            if scores:
                shape = table.shape(n, d)
                assert expected_tokens(acc, shape) == pytest.approx(want, abs=1e-12)
            else:
                assert not table.feasible(n, d)


def check_shape(shape: list[int], n: int, d: int, branching: int) -> None:
    """Connected, n nodes with the root, at most d levels, parents before children, listed depth by depth,
    siblings contiguous in rank order, at most `branching` children each."""
    assert len(shape) == n - 1
    depth = []
    for i, p in enumerate(shape):
        assert -1 <= p < i
        depth.append(0 if p < 0 else depth[p] + 1)
    assert depth == sorted(depth) and (not depth or max(depth) <= d - 2)
    assert shape == sorted(shape)  # breadth-first: children of earlier nodes come first, siblings together
    counts = np.bincount(np.array(shape) + 1, minlength=1) if shape else np.zeros(1)
    assert counts.max(initial=0) <= branching


@pytest.mark.parametrize("acc", [[0.8, 0.1, 0.05, 0.02], [0.5, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01]])
def test_reconstruction_properties_on_bigger_tables(acc):
    table = optimal_trees(acc, n_max=40, d_max=8)
    for n in range(1, 41):
        for d in range(1, 9):
            if table.feasible(n, d):
                shape = table.shape(n, d)
                check_shape(shape, n, d, len(acc))
                assert expected_tokens(acc, shape) == pytest.approx(table.best[n, d], rel=1e-12)
            if d > 1 and table.feasible(n, d - 1):
                assert table.best[n, d] >= table.best[n, d - 1] - 1e-12  # a looser depth limit never hurts
            if n > 1 and table.feasible(n, d) and table.feasible(n - 1, d):
                assert table.best[n, d] >= table.best[n - 1, d] - 1e-12  # another node never hurts


def test_special_cases():
    # a single child rank: only chains, F = Σ acc^k
    table = optimal_trees([0.7], n_max=6, d_max=6)
    assert table.shape(6, 6) == [-1, 0, 1, 2, 3]
    assert table.best[6, 6] == pytest.approx(sum(0.7**k for k in range(6)))
    assert not table.feasible(6, 5) and table.largest_feasible(6, 5) == 5
    # depth 2: a star over the best ranks
    table = optimal_trees([0.5, 0.3, 0.1, 0.05], n_max=4, d_max=2)
    assert table.shape(4, 2) == [-1, -1, -1] and table.best[4, 2] == pytest.approx(1.9)
    assert table.shape(1, 2) == []
    with pytest.raises(ValueError):
        optimal_trees([], 3, 3)
    with pytest.raises(ValueError):
        optimal_trees([0.5, -0.1], 3, 3)


def test_shape_helpers():
    assert nested_to_shape([[[], []], [[[]]]]) == [-1, -1, 0, 0, 1, 4]
    assert level_widths([-1, -1, 0, 0, 1, 4]) == [2, 3, 1] and level_widths([]) == []
    assert feed_widths([-1, -1, 0, 0, 1, 4]) == [2, 1] and feed_widths([-1, -1]) == [] and feed_widths([]) == []
    assert expected_tokens([0.5, 0.25], [-1, -1, 0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


# ---------------------------------------------------------------- hardware-aware choice on synthetic cost models

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
ACC = [0.55, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01]


def cost(target, draft) -> CostModel:
    return CostModel(SIZES, tuple(target(n) for n in SIZES), SIZES, tuple(draft(n) for n in SIZES))


def test_cost_model_interpolation_and_json(tmp_path):
    c = cost(lambda n: 1 + 0.1 * n, lambda w: 0.2 + 0.01 * w)
    assert c.t_target(1) == pytest.approx(1.1) and c.t_target(3) == pytest.approx(1.3)
    assert c.t_target(256) == pytest.approx(1 + 25.6)  # linear beyond the last point
    # a chain of 3: target over 4 tokens, draft catch-up + forwards at depths 1 and 2 (not the last)
    assert c.step_s([-1, 0, 1]) == pytest.approx(1.4 + 3 * 0.21)
    assert c.step_s([]) == pytest.approx(1.1)
    assert c.step_s([-1, -1, 0, 0, 1, 4]) == pytest.approx(1.7 + 0.21 + 0.22 + 0.21)
    c.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == c
    with pytest.raises(ValueError):
        CostModel((2, 1), (1.0, 1.0), (1,), (1.0,))
    # given as lists (a profile just measured): kept as tuples, so the interpolation's cache can key on them, and
    # two curves at the same sizes answer each from its own times
    listed = CostModel(list(SIZES), [2 * c.t_target(n) for n in SIZES], list(SIZES), [c.t_draft(n) for n in SIZES])
    assert isinstance(listed.target_s, tuple) and listed.t_target(3) == pytest.approx(2.6) == 2 * c.t_target(3)


def test_flat_cost_takes_the_biggest_tree():
    c = cost(lambda n: 1.0, lambda w: 0.0)
    choice = choose_tree(ACC, c, n_max=64, d_max=8)
    assert choice.n == 64 and choice.d == 8
    assert choice.expected_tokens == pytest.approx(optimal_trees(ACC, 64, 8).best[64, 8])
    assert choice.tokens_per_s == pytest.approx(choice.expected_tokens)


def test_steep_target_cost_gives_a_small_chain():
    c = cost(lambda n: float(n), lambda w: 0.01 * w)  # every verified token costs a full forward
    choice = choose_tree([0.9, 0.05, 0.02], c, n_max=64, d_max=12)
    assert choice.n <= 4 and level_widths(choice.shape) == [1] * (choice.n - 1)


def test_expensive_draft_depth_gives_a_shallow_wide_tree():
    c = cost(lambda n: 1.0, lambda w: 2.0)  # each draft forward costs two target forwards, whatever its width
    choice = choose_tree(ACC, c, n_max=32, d_max=8)
    assert choice.d == 2 and choice.n == 9  # a star of all B ranks: depth 1 costs one catch-up forward only
    assert level_widths(choice.shape) == [8]


def test_choice_is_the_argmax_of_the_ratio():
    c = cost(lambda n: 0.3 + 0.02 * n + 0.0005 * n * n, lambda w: 0.1 + 0.003 * w)
    choice = choose_tree(ACC, c, n_max=48, d_max=10)
    table = optimal_trees(ACC, 48, 10)
    ratios = [table.best[n, d] / c.step_s(table.shape(n, d)) for n in range(2, 49) for d in range(2, 11)
              if table.feasible(n, d)]
    assert choice.tokens_per_s == pytest.approx(max(ratios))


# ---------------------------------------------------------------- options, plans and where acc comes from


def test_options_are_validated(tmp_path):
    SequoiaOptions(budget="auto")
    SequoiaOptions(budget=4, depth=2, width=3, acc=[0.5, 0.2])
    for bad in [dict(budget=0), dict(budget="big"), dict(budget=2.5), dict(depth=0), dict(width=65),
                dict(budget=True), dict(acc=[0.8, 0.5]), dict(acc=[-0.1]), dict(acc=str(tmp_path / "none.json"))]:
        with pytest.raises(SpeculorError):
            SequoiaOptions(**bad)


def test_plan_for_a_fixed_budget_uses_the_dp_tree():
    opts = SequoiaOptions(budget=5, depth=3, width=2)
    shape, expected, choice = plan_tree([0.6, 0.2, 0.1], opts, None)
    table = optimal_trees([0.6, 0.2], 6, 4)
    assert list(shape) == table.shape(6, 4) and expected == pytest.approx(table.best[6, 4]) and choice is None
    # a budget beyond what depth x width can hold is cut to the biggest tree that fits
    shape, _, _ = plan_tree([0.6], SequoiaOptions(budget=10, depth=3, width=1), None)
    assert list(shape) == [-1, 0, 1]


def test_plan_auto_uses_the_cost_model():
    c = cost(lambda n: 1.0, lambda w: 0.0)
    shape, expected, choice = plan_tree(ACC, SequoiaOptions(budget="auto", depth=4, width=4), c)
    assert choice is not None and len(shape) == AUTO_NODES - 1 and choice.d == 5
    assert max(np.bincount(np.array(shape) + 1)) <= 4


def test_calibration_json_and_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path))
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    cal = Calibration("t", "d", 0.7, 0.9, (6, 2, 0, 1), 12, prompts=3, sets="x")
    assert cal.acc == pytest.approx([0.5, 1 / 6, 0, 1 / 12])
    path = calibration_path("t", "d", 0.7, 0.9)
    assert path.parent == tmp_path / "sequoia"
    cal.save(path)
    assert Calibration.from_dict(json.loads(path.read_text())) == cal
    assert resolve_acc(None, "t", "d", cfg) == (cal.acc, str(path))  # the cached calibration of the pair
    assert resolve_acc([0.3, 0.1], "t", "d", cfg) == ([0.3, 0.1], "given")
    plain = tmp_path / "acc.json"
    plain.write_text(json.dumps({"acc": [0.4, 0.2]}))
    assert resolve_acc(str(plain), "t", "d", cfg)[0] == [0.4, 0.2]
    plain.write_text("{broken")
    with pytest.raises(SpeculorError, match="speculor calibrate"):
        resolve_acc(str(plain), "t", "d", cfg)
    # another pair, or another temperature, has no cached calibration: the built-in vector of the embedded pair
    for target, c in [("other", cfg), ("t", SamplingConfig()), ("t", SamplingConfig(temperature=1.3))]:
        acc, source = resolve_acc(None, target, "d", c)
        assert source.startswith("built-in") and 0 < sum(acc) <= 1
    greedy, sampled = (resolve_acc(None, "x", "y", SamplingConfig(temperature=t))[1] for t in (0, 1.3))
    assert "T=0," in greedy and "T=0.7," in sampled


def test_builtin_calibrations_are_sane():
    cals = builtin_calibrations()
    assert {c.temperature for c in cals} >= {0.0, 0.7}
    for c in cals:
        assert c.target == "qwen2.5-coder-1.5b-instruct" and c.draft == "qwen2.5-coder-0.5b-instruct"
        assert sum(c.counts) <= c.steps and c.steps >= 100 and len(c.counts) >= 8


# ---------------------------------------------------------------- with models: calibration, decoding, profiling


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy_target() -> ToyLM:
    return random_toy(V, seed=0)


def toy_pair(target: ToyLM, draft: ToyLM) -> Pair:
    return Pair(Model(target), Model(draft), tokenizer=None, target_name="toy-t", draft_name="toy-d")


PROMPTS = [[1, 2], [0], [5, 4, 3], [3, 3]]
TINY_PROMPTS = [[1, 2, 3, 4, 5], [42], [99, 0, 13, 56, 21, 8, 3, 71, 30]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_calibration_with_the_target_as_draft_accepts_the_first_child(toy_target, temperature):
    pair = toy_pair(toy_target, perturbed(toy_target, seed=0, noise=0.0))
    cfg = SamplingConfig(temperature=temperature, seed=0)
    cal = calibrate(pair, PROMPTS, cfg, width=4, steps=6, progress=False)
    assert cal.steps == 24 and cal.counts == (24, 0, 0, 0) and cal.acc[0] == 1.0
    assert (cal.target, cal.draft, cal.temperature, cal.prompts) == ("toy-t", "toy-d", temperature, 4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_calibration_counts_with_another_draft(toy_target, temperature):
    pair = toy_pair(toy_target, perturbed(toy_target, seed=1, noise=1.5))
    cal = calibrate(pair, PROMPTS * 5, SamplingConfig(temperature=temperature, seed=1), width=V, steps=10,
                    progress=False)
    assert cal.steps == 200 and 0 < sum(cal.counts) <= cal.steps and sum(cal.acc) <= 1
    assert cal.counts[0] > 0 and sum(cal.counts[1:]) > 0  # later ranks are accepted too
    if temperature == 0:  # greedy matching: the target's argmax is always one of all V tokens
        assert sum(cal.counts) == cal.steps


@pytest.mark.parametrize("shape_opts", [dict(budget=6, depth=3, width=3), dict(budget=3, depth=3, width=1)])
def test_greedy_sequoia_equals_plain_greedy_on_the_toy(toy_target, shape_opts):
    draft = perturbed(toy_target, seed=1, noise=0.8)
    drafter = SequoiaPlans(Model(draft), "t", "d", SequoiaOptions(acc=(0.6, 0.2, 0.1), **shape_opts)).drafter()
    for prompt in PROMPTS:
        stats = engine.Stats()
        out = [t.id for t in engine.stream(Model(toy_target), drafter, prompt, SamplingConfig(max_new_tokens=15),
                                           stats=stats)]
        assert out == plain_greedy(toy_target, prompt, 15)
        assert max(s.drafted for s in stats.steps) == shape_opts["budget"]


N_LAW = 3
LAW_PROMPT = [1, 2]


def sequoia_counts(target: ToyLM, draft: ToyLM, cfg: SamplingConfig, m: int, seed0: int) -> torch.Tensor:
    """Counts [V]*3 of the first 3 tokens over m seeded sequoia generations with a branching tree."""
    t_model = Model(target)
    plans = SequoiaPlans(Model(draft), "t", "d", SequoiaOptions(budget=5, depth=2, width=3, acc=(0.5, 0.25, 0.1)))
    assert plans.plan(cfg).shape == (-1, -1, 0, 0, 1)  # siblings at both depths
    drafter = plans.drafter()
    counts = torch.zeros([V] * N_LAW, dtype=torch.float64)
    for i in range(m):
        run = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=N_LAW, seed=seed0 + i)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, LAW_PROMPT, run))] += 1
    return counts


@pytest.mark.parametrize(("cfg", "m"), [(SamplingConfig(temperature=1.0), 2500),
                                        (SamplingConfig(temperature=0.7, top_p=0.9), 1200)])
def test_sequoia_decoding_follows_the_exact_law(toy_target, cfg, m):
    draft = perturbed(toy_target, seed=1, noise=0.8)
    pvalue, tv, floor = goodness_of_fit(sequoia_counts(toy_target, draft, cfg, m, seed0=7),
                                        exact_law(toy_target, LAW_PROMPT, cfg, N_LAW))
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f}, noise floor {floor:.4f})"
    assert tv < 2 * floor


@pytest.fixture(scope="module")
def tiny_pair() -> Pair:
    return near_pair("tiny-t", "tiny-d")


@pytest.mark.parametrize("options", [dict(budget=8, depth=4, width=3), dict(budget=12, depth=2, width=8),
                                     dict(budget=4, depth=4, width=1)])
def test_greedy_sequoia_equals_plain_greedy_on_tiny_qwen2(tiny_pair, options):
    sp = Speculor(tiny_pair, strategy="sequoia", acc=[0.6, 0.15, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01], **options)
    cfg = SamplingConfig(max_new_tokens=20, stop_on_eos=False)
    for prompt in TINY_PROMPTS:
        out = sp.generate(prompt, cfg)
        assert out.token_ids == reference_greedy(tiny_pair.target.model, prompt, 20), f"prompt {prompt}"
        assert max(s.drafted for s in out.stats.steps) == options["budget"] and out.tau > 1


def test_sequoia_sampling_on_tiny_qwen2_runs_with_the_builtin_vector(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path))
    sp = Speculor(tiny_pair, strategy="sequoia", budget=10)
    a, b = (sp.generate([1, 2, 3], SamplingConfig(temperature=0.8, seed=4, max_new_tokens=12, stop_on_eos=False))
            for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12  # a seed fixes the sample


def test_budget_auto_uses_the_cached_cost_model(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path))
    CostModel((1, 6, 7, 128), (1.0, 1.0, 100.0, 100.0), (1, 128), (0.0, 0.0)).save(cost_path(tiny_pair))
    plans = make_strategy("sequoia", tiny_pair, budget="auto", depth=3, width=4, acc=[0.5, 0.2, 0.1, 0.1])
    plan = plans.plan(SamplingConfig())
    assert plan.choice is not None and len(plan.shape) == 5 and plan.choice.n == 6


def holds_a_cache(model: Model) -> bool:
    return any(isinstance(v, KVCache) for v in vars(model).values())


def test_profile_cost_on_tiny_models(tiny_pair):
    """Profiling leaves the pair's requests untouched: the models hold no cache, so a generation in flight during
    the profile goes on with the tokens it would have produced without it."""
    cfg = SamplingConfig(max_new_tokens=12, stop_on_eos=False)
    prompt = TINY_PROMPTS[0]
    ref = [t.id for t in engine.stream(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3), prompt, cfg)]
    in_flight = engine.stream(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3), prompt, cfg)
    first = [next(in_flight).id for _ in range(5)]
    c = profile_cost(tiny_pair, sizes=(1, 2, 4), repeats=1, progress=False)
    assert c.target_n == (1, 2, 4) and len(c.draft_s) == 3 and min(c.target_s + c.draft_s) > 0
    meta = dict(c.meta)
    assert meta["target"] == "tiny-t" and meta["threads"] == "1" and meta["device"] == "cpu"
    assert first + [t.id for t in in_flight] == ref  # the pair's requests are untouched
    assert not holds_a_cache(tiny_pair.target) and not holds_a_cache(tiny_pair.draft)


def test_implausible_cost_curves_are_flagged():
    assert not implausible((1, 2, 4), (0.4, 0.9, 0.95)) and not implausible((1, 2), (0.5, 0.4))
    assert implausible((1, 2, 4), (11.3, 4.1, 4.4))


def test_bad_sequoia_options(tiny_pair):
    for bad in [dict(budget=0), dict(depth="3"), dict(acc="/no/such/calibration.json"), dict(nope=1)]:
        with pytest.raises(SpeculorError):
            make_strategy("sequoia", tiny_pair, **bad)
    with pytest.raises(SpeculorError, match="needs a draft"):
        make_strategy("sequoia", Pair(tiny_pair.target, None, tiny_pair.tokenizer))
