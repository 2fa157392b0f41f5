"""The one draft representation: a token tree hanging off the root (the last committed token).

A `DraftTree` holds, for N drafted nodes in draw order (siblings in the order they were drawn):
    tokens  [N] long   the drafted token of each node
    parents [N] long   index of the parent node, -1 for children of the root; parents[i] < i
    q       [N, V] f32 the draft distribution each node was drawn from, or None for deterministic drafts
    draw    how siblings were drawn: "iid" (independent draws from q), "swor" (sampling without
            replacement from q; q holds the distribution before earlier siblings were removed), or
            "point" (deterministic choices, verified with the point-mass rule; q is None)
    kinds   optional, per node: the draw kind of each node, overriding `draw` (a merged tree mixes them;
            q rows of "point" nodes are ignored)
    groups  optional [N] long: siblings drawn as one sequence share a group; the SWOR rule removes only
            earlier siblings of a node's own group (None: all siblings of a node form one group)
A chain is parents = [-1, 0, 1, ...]. The functions below are pure: they build the attention mask,
position ids and paths of a "block" = [root] + nodes, where block index 0 is the root and node i is
block index i + 1; build static tree *shapes* (a parents list in creation order, children of a node
in rank order, depth by depth) from an expansion config, a list of rank paths or a chain length; and
`merge` several draft trees by identical token prefixes into one tree that verifies exactly (§2).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from speculor.errors import SpeculorError

Draw = Literal["iid", "swor", "point"]


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    draw: Draw = "iid"
    kinds: tuple[Draw, ...] | None = None
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,), "tokens and parents differ in length"
        assert bool((self.parents < torch.arange(n)).all()), "a parent must precede its child"
        assert self.q is None or self.q.shape[0] == n, "one draft distribution per node"
        assert self.kinds is None or len(self.kinds) == n, "one draw kind per node"
        assert self.groups is None or self.groups.shape == (n,), "one group per node"

    def kind(self, node: int) -> Draw:
        """How `node` was drawn: its own kind in a mixed tree, else the tree's `draw`."""
        return self.draw if self.kinds is None else self.kinds[node]

    def group(self, node: int) -> int:
        """The draw sequence `node` belongs to among its siblings (0 when the tree has no groups)."""
        return 0 if self.groups is None else int(self.groups[node])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(tokens: list[int], q: torch.Tensor | None = None, draw: Draw = "iid") -> DraftTree:
        n = len(tokens)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1), q, draw)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in draw order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]


EMPTY = DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))  # no draft: plain decoding


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


def attention_mask(parents: torch.Tensor, past: int, dtype: torch.dtype, *, start: int = 0,
                   window: int | None = None) -> torch.Tensor:
    """4-D additive mask [1, 1, n - start, past + n] of rows start.. of a region: 0 where `visible`, dtype-min
    elsewhere."""
    allowed = visible(parents, past, start=start, window=window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def visible(parents: torch.Tensor, past: int, *, start: int = 0, window: int | None = None) -> torch.Tensor:
    """[n - start, past + n] bool: which entries rows start.. of a region see. Row i sees the cached prefix and its
    own ancestors and itself; with a sliding `window` only keys less than `window` positions behind it
    (transformers' sliding_window_overlay: key k is visible from query q iff pos(q) - pos(k) < window), positions
    being the prefix's 0 .. past - 1 and past + depth in the region. Built per call, never memoised: a chain (a
    prompt) is a lower triangle; a tree's ancestor block is cached by shape for small trees only."""
    n = len(parents)
    chain = _is_chain(parents)
    if chain:
        block = torch.ones(n - start, n, dtype=torch.bool).tril(start)
    elif n <= SMALL_TREE:
        block = _ancestors(tuple(parents.tolist()))[start:]
    else:
        block = ancestors(parents)[start:]
    allowed = torch.cat([torch.ones(n - start, past, dtype=torch.bool), block], dim=1)
    if window is not None and past + n > window:
        pos = past + _depth(parents, chain)
        keys = torch.cat([torch.arange(past), pos])
        allowed &= (pos[start:, None] - keys[None, :]) < window
    return allowed


def position_ids(parents: torch.Tensor, past: int) -> torch.Tensor:
    """Position of each row = past + depth (never its flattened index), shape [1, n]."""
    return (past + _depth(parents, _is_chain(parents)))[None]


SMALL_TREE = 64  # trees up to this many rows have their ancestor sets and depths cached by shape


def _is_chain(parents: torch.Tensor) -> bool:
    return bool((parents == torch.arange(-1, len(parents) - 1)).all())


@functools.lru_cache(maxsize=512)
def _ancestors(parents: tuple[int, ...]) -> torch.Tensor:
    return ancestors(torch.tensor(parents, dtype=torch.long))  # callers never modify it


def _depth(parents: torch.Tensor, chain: bool) -> torch.Tensor:
    if chain:
        return torch.arange(len(parents))
    return _depths(tuple(parents.tolist())) if len(parents) <= SMALL_TREE else depths(parents)


@functools.lru_cache(maxsize=512)
def _depths(parents: tuple[int, ...]) -> torch.Tensor:
    return depths(torch.tensor(parents, dtype=torch.long))


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Indices from the top of the tree down to `node` inclusive ([] for node = -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


# ---------------------------------------------------------------- static tree shapes


def chain_shape(n: int) -> list[int]:
    """A chain of n draft tokens: parents [-1, 0, 1, ..., n - 2]."""
    if not isinstance(n, int) or n < 0:
        raise SpeculorError(f"a chain length must be an integer >= 0, got {n!r}")
    return list(range(-1, n - 1))


def expansion_shape(ks: Sequence[int]) -> list[int]:
    """SpecInfer's expansion config ⟨k1, ..., km⟩: every node at depth i - 1 (the root at depth 0) gets k_i
    children. Nodes depth by depth, each node's children together and in rank order."""
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise SpeculorError(f"an expansion config needs one or more integers >= 1, got {ks!r}")
    shape: list[int] = []
    level = [-1]
    for k in ks:
        nxt = []
        for parent in level:
            for _ in range(k):
                nxt.append(len(shape))
                shape.append(parent)
        level = nxt
    return shape


def paths_shape(paths: Sequence[Sequence[int]]) -> list[int]:
    """A shape from Medusa / vLLM tree choices: each path is a tuple of 0-based child ranks from the root,
    e.g. [(0,), (1,), (0, 0), (0, 1)]. Every proper prefix of a path must be listed too, and the ranks of a
    node's children must be 0..k-1 (the k-th drawn child needs the first k - 1). Duplicates are ignored.
    Nodes come depth by depth, then by parent, then by rank."""
    uniq = {tuple(p) for p in paths}
    if not uniq or any(not t or any(not isinstance(r, int) or r < 0 for r in t) for t in uniq):
        raise SpeculorError(f"tree paths must be non-empty tuples of ranks >= 0, got {paths!r}")
    uniq = sorted(uniq, key=lambda t: (len(t), t))
    index = {t: i for i, t in enumerate(uniq)}
    for t in uniq:
        if len(t) > 1 and t[:-1] not in index:
            raise SpeculorError(f"tree path {t} is listed without its prefix {t[:-1]}")
        if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in index:
            raise SpeculorError(f"tree path {t} is listed without its elder sibling {t[:-1] + (t[-1] - 1,)}")
    return [index[t[:-1]] if len(t) > 1 else -1 for t in uniq]


def shape_levels(shape: Sequence[int]) -> list[list[int]]:
    """Nodes of a shape grouped by depth (depth 1 first), each level in shape order."""
    levels: list[list[int]] = []
    for node, d in enumerate(depths(torch.tensor(list(shape), dtype=torch.long)).tolist()):
        if d == len(levels):
            levels.append([])
        levels[d].append(node)
    return levels


def check_shape(shape: Sequence[int]) -> list[int]:
    """A valid shape as a list (parents[i] in [-1, i)), else SpeculorError."""
    shape = list(shape)
    if not shape or any(not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(shape)):
        raise SpeculorError(f"a tree shape is a non-empty parents list with -1 <= parents[i] < i, got {shape!r}")
    return shape


# ---------------------------------------------------------------- merging draft trees


@dataclass(frozen=True)
class Merged:
    """`tree`: the merged tree; origins[s][m]: a node of source tree s with the token prefix of merged node m,
    or -1 (a source keeps the cache entries of the accepted path through these)."""

    tree: DraftTree
    origins: list[list[int]]

    def sub_path(self, source: int, path: list[int]) -> list[int]:
        """The longest prefix of a merged path (top-down) that source tree `source` also drafted, in its nodes."""
        out = []
        for m in path:
            if self.origins[source][m] < 0:
                break
            out.append(self.origins[source][m])
        return out


def merge(trees: Sequence[DraftTree]) -> Merged:
    """Merge draft trees by identical token prefixes into one tree that verifies exactly (docs/algorithms.md §2).

    Siblings keep the draw order: the children of a merged node are those of source 0 first (in its order),
    then source 1's, and so on. A draw whose token already is a sibling *merges* into it: its subtree joins the
    first occurrence's. What remains of the duplicate draw itself depends on its kind:
      * point (deterministic): dropped. After the first occurrence is rejected r(x) = 0, so the point-mass
        test (accept with prob. r(x), then r(x) <- 0) is a no-op;
      * iid / swor (sampled): kept as a *ghost* leaf at its place in the draw order. It can never be accepted
        (r(x) = 0 already) but its residual update r <- resid(r, d_j) is the one §2 requires per original draw
        ("one residual update replayed per original draw": exact; dropping it is biased).
    Children of one source node form one draw sequence (group), so SWOR removes only its own earlier siblings; a
    source that is itself a merged tree keeps its own groups apart (its siblings were several draw sequences).
    A tree without q holds deterministic drafts: its nodes become point draws.
    """
    tokens: list[int] = []
    parents: list[int] = []
    kinds: list[Draw] = []
    groups: list[int] = []
    rows: list[tuple[int, int]] = []  # (source, node) whose q row a merged node carries
    members: list[list[tuple[int, int]]] = []  # merged node -> source nodes merged into it (ghosts: [])
    kids = [children_lists(t.parents) for t in trees]
    queue = deque([(-1, [(s, -1) for s in range(len(trees))])])
    group_of: dict[tuple[int, int, int], int] = {}  # (source, source node, source group) -> group
    while queue:
        m, sources = queue.popleft()
        first: dict[int, int] = {}  # token -> merged child of m holding its first occurrence
        for s, o in sources:
            for c in kids[s].get(o, []):
                g = group_of.setdefault((s, o, trees[s].group(c)), len(group_of))
                x, kind = int(trees[s].tokens[c]), _source_kind(trees[s], c)
                if x in first:
                    members[first[x]].append((s, c))
                    if kind == "point":
                        continue
                    members.append([])  # a ghost: never accepted, no children
                else:
                    first[x] = len(tokens)
                    members.append([(s, c)])
                tokens.append(x)
                parents.append(m)
                kinds.append(kind)
                groups.append(g)
                rows.append((s, c))
        queue.extend((i, members[i]) for i in first.values())
    return Merged(_assemble(trees, tokens, parents, kinds, groups, rows), _origins(len(trees), members))


def children_lists(parents: torch.Tensor) -> dict[int, list[int]]:
    """parent (-1 = root) -> its children in draw order; childless nodes are absent."""
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(parents.tolist()):
        kids.setdefault(par, []).append(i)
    return kids


def _source_kind(tree: DraftTree, node: int) -> Draw:
    return "point" if tree.q is None else tree.kind(node)


def _assemble(trees: Sequence[DraftTree], tokens: list[int], parents: list[int], kinds: list[Draw],
              groups: list[int], rows: list[tuple[int, int]]) -> DraftTree:
    """The merged DraftTree: q rows from the sources (zeros for point nodes), None when every node is a point."""
    q = None
    qs = [t.q for t in trees if t.q is not None]
    if any(k != "point" for k in kinds):
        zero = torch.zeros_like(qs[0][0])
        q = torch.stack([zero if k == "point" else trees[s].q[c] for k, (s, c) in zip(kinds, rows, strict=True)])
    mixed = tuple(kinds) if len(set(kinds)) > 1 else None
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), q,
                     kinds[0] if kinds else "point", mixed, torch.tensor(groups, dtype=torch.long))


def _origins(n_sources: int, members: list[list[tuple[int, int]]]) -> list[list[int]]:
    origins = [[-1] * len(members) for _ in range(n_sources)]
    for m, group in enumerate(members):
        for s, c in group:
            if origins[s][m] < 0:
                origins[s][m] = c
    return origins
