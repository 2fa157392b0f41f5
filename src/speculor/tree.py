"""The one draft representation: a token tree hanging off the root (the last committed token).

A `DraftTree` holds, for N drafted nodes in draw order (siblings in the order they were drawn):
    tokens  [N] long   the drafted token of each node
    parents [N] long   index of the parent node, -1 for children of the root; parents[i] < i
    q       [N, V] f32 the draft distribution each node was drawn from, or None for deterministic drafts
    draw    how siblings were drawn: "iid" (independent draws from q), "swor" (sampling without
            replacement from q; q holds the distribution before earlier siblings were removed), or
            "point" (deterministic choices, verified with the point-mass rule; q is None)
A chain is parents = [-1, 0, 1, ...]. The functions below are pure: they build the attention mask,
position ids and paths of a "block" = [root] + nodes, where block index 0 is the root and node i is
block index i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Draw = Literal["iid", "swor", "point"]


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    draw: Draw = "iid"

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,), "tokens and parents differ in length"
        assert bool((self.parents < torch.arange(n)).all()), "a parent must precede its child"
        assert self.q is None or self.q.shape[0] == n, "one draft distribution per node"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(tokens: list[int], q: torch.Tensor | None = None, draw: Draw = "iid") -> DraftTree:
        n = len(tokens)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1), q, draw)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in draw order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]


def block_parents(parents: torch.Tensor) -> torch.Tensor:
    """Parents of [root] + nodes in block indices: root has -1, node i (block i+1) has parents[i] + 1."""
    return torch.cat([torch.tensor([-1]), parents + 1])


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, the roots of the forest (parent -1) at depth 0."""
    d = torch.zeros(len(parents), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """A[i, j] = True iff j is i or an ancestor of i (parents[i] < i makes one pass enough)."""
    n = len(parents)
    a = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            a[i] |= a[p]
    return a


def attention_mask(parents: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """4-D additive mask [1, 1, n, past + n]: every row sees the cached prefix and its own ancestors.

    M[i, j] = 0 if j < past or (j - past) in ancestors(i) ∪ {i}, else dtype-min.
    """
    n = len(parents)
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), ancestors(parents)], dim=1)
    mask = torch.zeros(n, past + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def position_ids(parents: torch.Tensor, past: int) -> torch.Tensor:
    """Position of each row = past + depth (never its flattened index), shape [1, n]."""
    return (past + depths(parents))[None]


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Indices from the top of the tree down to `node` inclusive ([] for node = -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]
