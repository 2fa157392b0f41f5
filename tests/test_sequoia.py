"""Sequoia (ALGORITHMS.md §4): the DP against brute force, tree reconstruction, the hardware-aware choice on synthetic
cost models, calibration counting and full decoding with tiny models."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from speculor.sequoia import (
    CostModel,
    choose_tree,
    expected_tokens,
    level_widths,
    nested_to_shape,
    optimal_trees,
)

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
    c.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == c
    with pytest.raises(ValueError):
        CostModel((2, 1), (1.0, 1.0), (1,), (1.0,))


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
