"""Sequoia (ALGORITHMS.md §4): the DP-optimal static tree, its hardware-aware size, and the acceptance vector.

Glossary (the paper's names):
    acc[k]   acceptance vector, k = 1..B: the *marginal* probability that the k-th child (in draw order) of an
             accepted node is the one accepted, so Σ_k acc[k] <= 1 (§4.1). Measured by `calibrate`.
    f(v)     Π acc[rank] along the path root -> v, f(root) = 1.
    F(T)     Σ_{v ∈ T} f(v): expected tokens emitted per step of tree T (the root term is the recovered or
             bonus token) under the positional acceptance assumption.
    N, D, B  nodes including the root, levels including the root (a path holds at most D - 1 draft tokens),
             branching factor.
    shape    a static tree as a parents list in creation order: node i has parent shape[i] < i (-1 = the root),
             nodes listed depth by depth, a node's children in rank order (child k is drawn k-th and uses acc[k]).

Pure parts (no model): `optimal_trees` (the §4.2 DP), `TreeTable.shape`, `CostModel` and `choose_tree`
(maximise F / step time). Model parts: `profile_cost` (time the target per block size and the draft per
depth width), `calibrate` (measure acc through the engine), and `SequoiaDrafter`, the `sequoia` strategy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

NEG = -math.inf


# ---------------------------------------------------------------- the dynamic program (§4.2)


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


# ---------------------------------------------------------------- hardware-aware size (§4.2)


@dataclass(frozen=True)
class CostModel:
    """Seconds of one forward pass, measured at a few block sizes and interpolated linearly.

    t_target(n): the target verifying a block of n tokens (root + n - 1 draft nodes) after a ~200-token prefix.
    t_draft(w):  one draft forward over w tokens (one depth of the tree, or the catch-up block).
    A step drafting shape T costs  t_target(|T| + 1) + t_draft(1) + Σ_{depth k < depth(T)} t_draft(width_k):
    the catch-up forward gives q at the root, then one batched forward per depth except the last.
    """

    target_n: tuple[int, ...]
    target_s: tuple[float, ...]
    draft_n: tuple[int, ...]
    draft_s: tuple[float, ...]
    meta: tuple[tuple[str, str], ...] = ()  # machine and model pair it was measured for

    def __post_init__(self) -> None:
        for n, s in ((self.target_n, self.target_s), (self.draft_n, self.draft_s)):
            if len(n) != len(s) or not n or list(n) != sorted(set(n)) or min(s) < 0:
                raise ValueError("a cost curve needs ascending distinct sizes and as many non-negative times")

    def t_target(self, n: int) -> float:
        return _interp(n, self.target_n, self.target_s)

    def t_draft(self, w: int) -> float:
        return _interp(w, self.draft_n, self.draft_s)

    def step_s(self, shape: Sequence[int]) -> float:
        """Seconds of one speculative step with this tree shape (plain decoding for an empty shape)."""
        widths = level_widths(shape)
        draft = (self.t_draft(1) + sum(self.t_draft(w) for w in widths[:-1])) if widths else 0.0
        return self.t_target(len(shape) + 1) + draft

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "meta": dict(self.meta)}, indent=1)

    @staticmethod
    def from_json(text: str) -> CostModel:
        d = json.loads(text)
        return CostModel(tuple(d["target_n"]), tuple(d["target_s"]), tuple(d["draft_n"]), tuple(d["draft_s"]),
                         tuple(sorted(d.get("meta", {}).items())))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @staticmethod
    def load(path: Path) -> CostModel:
        return CostModel.from_json(path.read_text())


def _interp(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation; linear extrapolation from the last two points beyond the largest x."""
    if len(xs) >= 2 and x > xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


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


def choose_tree(acc: Sequence[float], cost: CostModel, n_max: int, d_max: int, n_min: int = 2) -> Choice:
    """argmax over n_min <= n <= n_max, 2 <= d <= d_max of G(n, d) / step time, G = Tmax[n][d] (§4.2):
    expected tokens per second, with the step time of the DP's own tree for (n, d) (`CostModel.step_s`)."""
    table = optimal_trees(acc, n_max, d_max)
    best: Choice | None = None
    for n in range(max(n_min, 1), n_max + 1):
        for d in range(1, d_max + 1):
            if not table.feasible(n, d) or (d > 1 and table.best[n, d] == table.best[n, d - 1]):
                continue  # a deeper limit that changes nothing gives the same tree
            shape = tuple(table.shape(n, d))
            c = Choice(n, d, shape, float(table.best[n, d]), cost.step_s(shape))
            if best is None or c.tokens_per_s > best.tokens_per_s:
                best = c
    if best is None:
        raise ValueError(f"no tree with {n_min}..{n_max} nodes within {d_max} levels")
    return best
