"""GSD, graph-structured speculative decoding (docs/algorithms.md §8), as the `gsd` strategy.

Draft hypotheses are grown breadth-first from a draft model, one batched draft forward per level. At every expanded
node u the candidates are the top-n tokens of q_u = softmax(draft logits) (untempered; drafts are deterministic):

    skip y if q_u(y) < sibling_threshold · max q_u                       (relative pruning)
    if a node w with token y exists, w not u nor an ancestor of u, and the k tokens before w equal the last k
       tokens of ctx(u) (k = 0: the token alone; k = -1: never merge):
        *merge*: a pseudo edge u -> w, no new node and no draft compute (w's subtree is reused under u)
    else add node y under u; it is expanded on the next level if q_u(y) >= prob_threshold and depth is left
    stop when a level adds no expandable node, after `depth` levels, or at `budget` drafted nodes

The result is a DAG. Merged nodes were drafted in *other* contexts, so it is unrolled to a tree before
verification (`unroll`: breadth-first, each pseudo edge copies w's subtree under u, capped at `budget` nodes), and
the target scores every copy in its true context. The tree is verified only with the exact matching rule: greedy
matching at temperature 0, the point-mass rule at temperature > 0 (sample y ~ p, descend into the child equal to
y: exact for any candidate generation, §2). The ratio test would be biased here (the copies' draft probabilities
belong to other contexts), and GSD's original lossy path (independent acceptances, longest path) is not built.

Work saved by merging, per step (`GSDDrafter.stats`; sums over a generation in `totals`):
    drafted        DAG nodes (tokens drafted)          verified      nodes of the unrolled tree
    merges         pseudo edges made                   tokens_saved  copies in the unrolled tree (verified, never
                                                                     drafted in their context) = verified - real
    fed_rows       draft-forward rows fed              rows_saved    copies that have children in the tree (each
                                                                     would need a draft row to propose them)
    forwards       batched draft forwards made         forwards_saved  1 + levels of the unrolled tree holding a
                                                                     node with children, minus forwards (>= 0)
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from speculor.config import SamplingConfig, check_int
from speculor.core.sampling import check_finite
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal, Shared, catch_up, feed, keep_fed_path
from speculor.errors import SpeculorError
from speculor.runtime.backend import Backend, Pair

STAT_KEYS = ("drafted", "verified", "merges", "tokens_saved", "fed_rows", "rows_saved", "forwards", "forwards_saved")


@dataclass(frozen=True)
class GSDOptions:
    """n: candidates per expanded node (top-n); k: context tokens that must repeat for a merge (0: the token alone,
    -1: merging off); sibling_threshold: drop a candidate below this fraction of its node's best; prob_threshold:
    a node is expanded only if its q is at least this; depth: most draft levels; budget: most drafted nodes and
    most verified (unrolled) tokens per step."""

    n: int = 4
    k: int = 1
    sibling_threshold: float = 0.2
    prob_threshold: float = 0.3
    depth: int = 8
    budget: int = 24

    def __post_init__(self) -> None:
        for name, value, low, top in (("n", self.n, 1, 64), ("k", self.k, -1, 16), ("depth", self.depth, 1, 64),
                                      ("budget", self.budget, 1, 1024)):
            check_int(name, value, low, top)
        for name, value in (("sibling_threshold", self.sibling_threshold), ("prob_threshold", self.prob_threshold)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise SpeculorError(f"{name} must be a number in [0, 1], got {value!r}")


# ---------------------------------------------------------------- the draft DAG (pure)


@dataclass
class Dag:
    """Drafted nodes (tokens, tree parents: -1 = the root) and every node's out-edges in proposal order: its
    tree children and its pseudo children (merge targets, drafted elsewhere)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    kids: dict[int, list[int]] = field(default_factory=dict)  # node (-1 = root) -> out-edge targets
    merges: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, u: int, y: int) -> int:
        self.tokens.append(y)
        self.parents.append(u)
        self.kids.setdefault(u, []).append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def link(self, u: int, w: int) -> None:
        """A pseudo edge u -> w (the merge of u's candidate into w)."""
        self.kids.setdefault(u, []).append(w)
        self.merges += 1

    def path(self, u: int) -> list[int]:
        """Nodes from the top down to u inclusive ([] for the root)."""
        out = []
        while u >= 0:
            out.append(u)
            u = self.parents[u]
        return out[::-1]

    def context(self, seq: list[int], u: int) -> list[int]:
        """ctx(u): the committed sequence (ending with the root) and the path tokens down to u."""
        return list(seq) + [self.tokens[i] for i in self.path(u)]


def tail(tokens: list[int], k: int) -> list[int]:
    """The last k tokens (all of them if fewer; [] for k = 0)."""
    return tokens[max(len(tokens) - k, 0):]


def merge_target(dag: Dag, seq: list[int], u: int, y: int, k: int) -> int | None:
    """The first node w with token y, neither u nor an ancestor of u, whose k preceding context tokens equal the
    last k tokens of ctx(u); None if there is none or k < 0 (merging off). Depth equality is not required."""
    if k < 0:
        return None
    above = set(dag.path(u))
    want = tail(dag.context(seq, u), k)
    for w, tok in enumerate(dag.tokens):
        if tok == y and w not in above and tail(dag.context(seq, dag.parents[w]), k) == want:
            return w
    return None


@dataclass(frozen=True)
class Unrolled:
    """The DAG unrolled to a tree: tree node i copies DAG node origin[i]; real[i] iff it is reached from the root
    by tree edges only (then its draft-cache row, if fed, was computed in its true context)."""

    tree: DraftTree
    origin: list[int]
    real: list[bool]


def unroll(dag: Dag, budget: int) -> Unrolled:
    """Breadth-first unrolling: under every tree node, one child per out-edge of its DAG node (a pseudo edge copies
    the merge target with its whole subtree), repeated tokens among siblings dropped, at most `budget` nodes (which
    also bounds the unrolling of cycles that pseudo edges can close)."""
    tokens: list[int] = []
    parents: list[int] = []
    origin: list[int] = []
    real: list[bool] = []
    queue, head = [(-1, -1, True)], 0  # (DAG node, its tree node, real)
    while head < len(queue) and len(tokens) < budget:
        u, t, is_real = queue[head]
        head += 1
        seen: set[int] = set()
        for c in dag.kids.get(u, []):
            if len(tokens) >= budget:
                break
            if dag.tokens[c] in seen:
                continue
            seen.add(dag.tokens[c])
            tokens.append(dag.tokens[c])
            parents.append(t)
            origin.append(c)
            real.append(is_real and dag.parents[c] == u)
            queue.append((c, len(tokens) - 1, real[-1]))
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None, "point")
    return Unrolled(tree, origin, real)


def savings(un: Unrolled, dag: Dag, fed_rows: int, forwards: int) -> dict[str, int]:
    """The step's numbers (module docstring): what merging saved in draft tokens, rows and forwards."""
    parents = un.tree.parents.tolist()
    inner = set(p for p in parents if p >= 0)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    copies = [i for i, r in enumerate(un.real) if not r]
    needed = 1 + len({depth[i] for i in inner})
    return {"drafted": len(dag), "verified": len(parents), "merges": dag.merges, "tokens_saved": len(copies),
            "fed_rows": fed_rows, "rows_saved": sum(i in inner for i in copies), "forwards": forwards,
            "forwards_saved": max(needed - forwards, 0)}


def candidates(logits: torch.Tensor, n: int, sibling_threshold: float) -> list[tuple[int, float]]:
    """(token, q) for the top-n tokens of q = softmax(logits) with q >= sibling_threshold · max q, best first."""
    check_finite(logits, "draft")
    top = torch.topk(torch.softmax(logits.float(), dim=-1), min(n, logits.shape[-1]))
    best = float(top.values[0])
    return [(y, q) for y, q in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            if q > 0 and q >= sibling_threshold * best]


# ---------------------------------------------------------------- the drafter


class GSDDrafter(Drafter):
    """GSD's draft graph from a draft model, unrolled to a tree (module docstring). After `propose`: `dag`,
    `unrolled`, `rows` (tree node -> pending row, for fed real nodes), `stats` of the step; `totals` sums the
    stats since `reset()`."""

    def __init__(self, model: Backend, opts: GSDOptions | None = None) -> None:
        self.model, self.opts = model, opts or GSDOptions()
        self.cache = model.new_cache()
        self.forwards = 0
        self.rows: dict[int, int] = {}
        self.dag = Dag()
        self.unrolled: Unrolled | None = None
        self.stats: dict[str, int] = {}
        self.totals: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.totals = dict.fromkeys(STAT_KEYS, 0)

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        dag, fed = yield from self._draft(seq)
        un = unroll(dag, self.opts.budget)
        self.dag, self.unrolled = dag, un
        self.rows = {i: fed[o] for i, (o, r) in enumerate(zip(un.origin, un.real, strict=True)) if r and o in fed}
        self.stats = savings(un, dag, len(fed), self.forwards)
        for key, value in self.stats.items():
            self.totals[key] += value
        return un.tree

    def _draft(self, seq: list[int]) -> Generator[Any, Any, tuple[Dag, dict[int, int]]]:
        """Breadth-first drafting with merging; the DAG and DAG node -> pending row of the fed nodes."""
        o = self.opts
        dag, fed = Dag(), {}
        frontier = [(-1, (yield from catch_up(self.model, self.cache, seq)))]
        self.forwards = 1
        for level in range(o.depth):
            expand = []
            for u, logits in frontier:
                for y, q in candidates(logits, o.n, o.sibling_threshold):
                    if len(dag) >= o.budget:
                        break
                    w = merge_target(dag, seq, u, y, o.k)
                    if w is not None:
                        dag.link(u, w)
                        continue
                    c = dag.add(u, y)
                    if q >= o.prob_threshold and level + 1 < o.depth:
                        expand.append(c)
            if not expand or len(dag) >= o.budget:
                break
            parent_rows = [fed.get(dag.parents[c], -1) for c in expand]
            out, rows = yield from feed(self.model, self.cache, [dag.tokens[c] for c in expand], parent_rows)
            self.forwards += 1
            fed.update(zip(expand, rows, strict=True))
            frontier = list(zip(expand, out, strict=True))
        return dag, fed

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        assert self.cache.length == n_committed, "the draft cache must hold exactly the committed tokens"
        keep_fed_path(self.cache, self.rows, verdict.path)


def make_gsd(pair: Pair, n: int = 4, k: int = 1, sibling_threshold: float = 0.2, prob_threshold: float = 0.3,
             depth: int = 8, budget: int = 24) -> Shared:
    """Builder of the `gsd` strategy (see `GSDOptions`)."""
    if pair.draft is None:
        raise SpeculorError("strategy 'gsd' needs a draft model")
    return Shared(partial(GSDDrafter, pair.draft, GSDOptions(n, k, sibling_threshold, prob_threshold, depth, budget)))
