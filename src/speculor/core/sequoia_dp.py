"""Sequoia's dynamic program (docs/algorithms.md §4.2): the tree of at most N nodes and D levels that maximises the
expected tokens per step F(T) under the positional acceptance assumption, and its hardware-aware size.

Glossary (the paper's names):
    acc[k]   acceptance vector, k = 1..B: the *marginal* probability that the k-th child (in draw order) of an
             accepted node is the one accepted, so Σ_k acc[k] <= 1 (§4.1).
    f(v)     Π acc[rank] along the path root -> v, f(root) = 1.
    F(T)     Σ_{v ∈ T} f(v): expected tokens emitted per step of tree T (the root term is the recovered or
             bonus token).
    N, D, B  nodes including the root, levels including the root (a path holds at most D - 1 draft tokens),
             branching factor.
    shape    a static tree as a parents list in creation order: node i has parent shape[i] < i (-1 = the root),
             nodes listed depth by depth, a node's children in rank order (child k is drawn k-th and uses acc[k]).

Pure functions (no model): `optimal_trees` (the DP), `TreeTable.shape`, `choose_tree` (maximise F / step time for
a cost model with `step_s(shape)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

NEG = -math.inf


@dataclass(frozen=True)
class TreeTable:
    """Result of the DP for one acceptance vector.

    best  [N + 1, D + 1] f64  Tmax[n, d]: max F over trees of exactly n nodes (root included), at most d levels,
                              at most B children per node; -inf where no such tree exists (n = 0, d = 0, or
                              n beyond the capacity of depth d and branching B)
    kids  [N + 1, D + 1] i64  b*: number of root children of an optimal tree
    split [N + 1, D + 1, B + 1] i64  m*: nodes in the subtree of child b when the root has children 1..b
    """

    acc: np.ndarray
    best: np.ndarray
    kids: np.ndarray
    split: np.ndarray

    @property
    def n_max(self) -> int:
        return self.best.shape[0] - 1

    @property
    def d_max(self) -> int:
        return self.best.shape[1] - 1

    def feasible(self, n: int, d: int) -> bool:
        return 1 <= n <= self.n_max and 1 <= d <= self.d_max and self.best[n, d] > NEG

    def largest_feasible(self, n: int, d: int) -> int:
        """The largest n' <= n with a tree of n' nodes in d levels (Tmax is nondecreasing in n where finite)."""
        while not self.feasible(n, d):
            n -= 1
        return n

    def nested(self, n: int, d: int) -> list:
        """An optimal tree for (n, d) as nested lists: a node is the list of its children in rank order.

        Reconstruction of §4.2: b* = kids[n, d]; for b = b*, ..., 1 child b gets an optimal subtree of
        m* = split[n, d, b] nodes and depth d - 1, and n <- n - m*.
        """
        if not self.feasible(n, d):
            raise ValueError(f"no tree of {n} nodes within {d} levels and branching {len(self.acc)}")
        children = []
        for b in range(int(self.kids[n, d]), 0, -1):
            m = int(self.split[n, d, b])
            children.append(self.nested(m, d - 1))
            n -= m
        assert n == 1
        return children[::-1]

    def shape(self, n: int, d: int) -> list[int]:
        """An optimal tree for (n, d) as a parents list (depth by depth, children in rank order); len = n - 1."""
        return nested_to_shape(self.nested(n, d))


def optimal_trees(acc: Sequence[float], n_max: int, d_max: int) -> TreeTable:
    """The DP of §4.2 for every n <= n_max nodes and d <= d_max levels (root included), B = len(acc).

        T[1][d][0] = 1                                                   (the root alone)
        T[n][d][b] = max_{1<=m<=n-1} T[n-m][d][b-1] + acc[b] · Tmax[m][d-1]   (child b's subtree has m nodes)
        Tmax[n][d] = max_b T[n][d][b]

    Vectorised over d and m: O(N·B) numpy operations of size O(N·D). Time O(N²·D·B), memory O(N·D·B).
    """
    a = np.asarray(acc, dtype=np.float64)
    if a.ndim != 1 or len(a) == 0 or (a < 0).any() or not np.isfinite(a).all():
        raise ValueError(f"acc must be a non-empty vector of probabilities, got {acc!r}")
    if n_max < 1 or d_max < 1:
        raise ValueError(f"n_max and d_max must be >= 1, got {n_max}, {d_max}")
    nb = len(a)
    t = np.full((n_max + 1, d_max + 1, nb + 1), NEG)
    split = np.zeros((n_max + 1, d_max + 1, nb + 1), dtype=np.int64)
    best = np.full((n_max + 1, d_max + 1), NEG)
    t[1, 1:, 0] = 1.0
    best[1, 1:] = 1.0
    for n in range(2, n_max + 1):
        sub = best[1:n, 1:d_max]  # Tmax[m][d-1] for m = 1..n-1, d = 2..d_max   [n-1, d_max-1]
        for b in range(1, nb + 1):
            rest = t[n - 1:0:-1, 2:, b - 1]  # T[n-m][d][b-1] for the same m and d     [n-1, d_max-1]
            total = rest + np.where(sub > NEG, a[b - 1] * np.where(sub > NEG, sub, 0.0), NEG)
            arg = np.argmax(total, axis=0)
            t[n, 2:, b] = total[arg, np.arange(d_max - 1)]
            split[n, 2:, b] = arg + 1
        best[n, 2:] = t[n, 2:, 1:].max(axis=1)
    kids = np.argmax(t, axis=2)
    kids[best == NEG] = 0
    return TreeTable(a, best, kids, split)


def nested_to_shape(root: list) -> list[int]:
    """Nested children lists -> parents list in breadth-first order (so parents[i] < i and depths ascend)."""
    parents: list[int] = []
    frontier = [(-1, root)]
    while frontier:
        nxt = []
        for index, children in frontier:
            for child in children:
                parents.append(index)
                nxt.append((len(parents) - 1, child))
        frontier = nxt
    return parents


def expected_tokens(acc: Sequence[float], shape: Sequence[int]) -> float:
    """F(T) = Σ_v f(v) of a shape; the k-th child of a node (in the order listed) uses acc[k]."""
    f = [1.0]  # f of the root, then of every node (index i + 1)
    seen: dict[int, int] = {}
    for p in shape:
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        f.append(f[p + 1] * (acc[rank] if rank < len(acc) else 0.0))
    return float(sum(f))


def level_widths(shape: Sequence[int]) -> list[int]:
    """Number of nodes at depth 1, 2, ... of a shape."""
    depth: list[int] = []
    for p in shape:
        depth.append(0 if p < 0 else depth[p] + 1)
    return [depth.count(k) for k in range(max(depth) + 1)] if depth else []


def feed_widths(shape: Sequence[int]) -> list[int]:
    """Per depth 1, 2, ...: the nodes that have children, i.e. the rows of each batched draft forward of
    `TreeDrafter` (the last depth is never fed); [] for a depth-1 tree."""
    has_kids = set(p for p in shape if p >= 0)
    depth: list[int] = []
    for p in shape:
        depth.append(0 if p < 0 else depth[p] + 1)
    widths = [0] * (max(depth) if depth else 0)
    for node in has_kids:
        widths[depth[node]] += 1
    return widths



class StepCost(Protocol):
    def step_s(self, shape: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class Choice:
    """The tree chosen for a machine: n nodes (root included), d levels, its shape, F and seconds per step."""

    n: int
    d: int
    shape: tuple[int, ...]
    expected_tokens: float
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.step_s


def tree_choices(acc: Sequence[float], cost: StepCost, n_max: int, d_max: int, n_min: int = 2) -> list[Choice]:
    """The DP's tree for every n_min <= n <= n_max and d <= d_max (a deeper limit that changes nothing skipped), with
    G = Tmax[n][d] and the step time of that tree (`runtime.cost.CostModel.step_s`)."""
    table = optimal_trees(acc, n_max, d_max)
    out = []
    for n in range(max(n_min, 1), n_max + 1):
        for d in range(1, d_max + 1):
            if not table.feasible(n, d) or (d > 1 and table.best[n, d] == table.best[n, d - 1]):
                continue  # a deeper limit that changes nothing gives the same tree
            shape = tuple(table.shape(n, d))
            out.append(Choice(n, d, shape, float(table.best[n, d]), cost.step_s(shape)))
    return out


def choose_tree(acc: Sequence[float], cost: StepCost, n_max: int, d_max: int, n_min: int = 2) -> Choice:
    """argmax over n_min <= n <= n_max, d <= d_max of G(n, d) / step time, G = Tmax[n][d] (§4.2): expected tokens
    per second."""
    choices = tree_choices(acc, cost, n_max, d_max, n_min)
    if not choices:
        raise ValueError(f"no tree with {n_min}..{n_max} nodes within {d_max} levels")
    return max(choices, key=lambda c: c.tokens_per_s)
