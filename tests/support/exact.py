"""Exact laws for the verifier tests, by enumeration (no sampling): tables of p and q for every short context, every
draft tree a drafter could draw with its probability, and `real_law`, the law of the tokens that
`speculor.core.verify.verify_sampled` itself emits for one tree.

`real_law` runs the verifier on every branch of its random choices: each uniform u is scripted just below (accept) or
just above (reject) the threshold r[x]/d[x] read from the residual and draw law the code was using, the branch weighted
by the exact probability P(u·d[x] < r[x]) = min(1, r[x]/d[x]), and the final `sample(r)` replaced by the whole
distribution r.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch

import speculor.core.verify as verify
from speculor.config import SamplingConfig
from speculor.core.sampling import warp
from speculor.core.tree import DraftTree, merge, path_to
from speculor.core.verify import verify_sampled

F64 = torch.float64
EXACT = 1e-12


# ---------------------------------------------------------------- distributions and distances


class Tables:
    """p(.|ctx) and q(.|ctx) (fp64) for every context of up to 2 tokens, built for one `case`."""

    def __init__(self, case: str, v: int, seed: int) -> None:
        self.v = v
        g = torch.Generator().manual_seed(seed)
        self.p: dict[tuple[int, ...], torch.Tensor] = {}
        self.q: dict[tuple[int, ...], torch.Tensor] = {}
        for n in range(3):
            for ctx in itertools.product(range(v), repeat=n):
                self.p[ctx], self.q[ctx] = self._pair(case, g)

    def _pair(self, case: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.v
        zp, zq = 2 * torch.randn(v, generator=g, dtype=F64), 2 * torch.randn(v, generator=g, dtype=F64)
        p, q = zp.softmax(-1), zq.softmax(-1)
        if case == "q_zeros":  # q misses about half of the tokens (never all)
            dead = torch.randperm(v, generator=g)[: v // 2 + 1]
            q[dead] = 0
        elif case == "q_eq_p":
            q = p.clone()
        elif case == "disjoint":
            perm = torch.randperm(v, generator=g)
            p[perm[: (v + 1) // 2]] = 0
            q[perm[(v + 1) // 2:]] = 0
        elif case == "top_p":  # both transformed alike by W, as the engine does
            cfg = SamplingConfig(temperature=1.0, top_p=0.8)
            p, q = warp(zp, cfg).double(), warp(zq, cfg).double()
        return p / p.sum(), q / q.sum()


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum())


def accept_prob(r_x: float, d_x: float) -> float:
    """P(u·d_x < r_x) for u ~ U(0, 1): the acceptance test of §1/§2."""
    if d_x == 0:
        return 1.0 if r_x > 0 else 0.0
    return min(1.0, r_x / d_x)


# ---------------------------------------------------------------- the real verifier, every branch


class _Branch(Exception):
    pass


def real_law(tree: DraftTree, p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens emitted by `verify_sampled(tree, p)` (path tokens + recovered/bonus token)."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    real_draw = verify._draw_distribution
    state: dict = {}

    def draw_distribution(tree_, c, drawn, r):
        d = real_draw(tree_, c, drawn, r)
        if d is not None:
            x = int(tree_.tokens[c])
            r_x, d_x = float(r[x]), float(d[x])
            state["pending"] = (accept_prob(r_x, d_x), r_x / d_x if d_x > 0 else math.inf)
        return d

    def rand(*args, **kwargs):
        (acc, threshold), state["pending"] = state["pending"], None
        if state["i"] == len(state["script"]):
            raise _Branch(acc)
        accept = state["script"][state["i"]]
        state["i"] += 1
        state["weight"] *= acc if accept else 1 - acc
        # u just below / just above the threshold r/d: a verifier testing anything else takes the wrong branch
        u = min(threshold, 1.0) * (1 - 1e-9) if accept else threshold * (1 + 1e-9)
        return torch.tensor(u, dtype=F64)

    def sample(r, generator):
        state["final"] = r.clone()
        return -1

    class TorchProxy:
        def __getattr__(self, name):
            return rand if name == "rand" else getattr(torch, name)

    def explore(script: list[bool]) -> None:
        state.update(script=script, i=0, weight=1.0, final=None, pending=None)
        try:
            verdict = verify_sampled(tree, p, None)
        except _Branch as branch:
            acc = branch.args[0]
            if acc > 0:
                explore(script + [True])
            if acc < 1:
                explore(script + [False])
            return
        emitted = tuple(int(tree.tokens[i]) for i in verdict.path)
        if state["final"] is None:
            law[emitted + (verdict.token,)] += state["weight"]
        else:
            for x, px in enumerate(state["final"].tolist()):
                if px > 0:
                    law[emitted + (x,)] += state["weight"] * px

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "torch", TorchProxy())
        mp.setattr(verify, "_draw_distribution", draw_distribution)
        mp.setattr(verify, "sample", sample)
        explore([])
    return dict(law)


# ---------------------------------------------------------------- laws of the first n tokens


def complete(law: dict[tuple[int, ...], float], t: Tables, n: int) -> torch.Tensor:
    """Extend every emitted sequence to n tokens by ancestral sampling from p: a lossless step gives p's law."""
    out = torch.zeros([t.v] * n, dtype=F64)
    for seq, prob in law.items():
        for rest in itertools.product(range(t.v), repeat=n - len(seq)):
            full, w = seq, prob
            for x in rest:
                w *= float(t.p[full][x])
                full = full + (x,)
            out[full] += w
    return out


def target_law(t: Tables, n: int) -> torch.Tensor:
    return complete({(): 1.0}, t, n)


def as_tensor(law: dict[tuple[int, ...], float], t: Tables, n: int) -> torch.Tensor:
    return complete(law, t, n)


# ---------------------------------------------------------------- every draft a drafter could draw


def iid_draws(q: torch.Tensor, k: int):
    """Every i.i.d. sequence of k draws from q with its probability."""
    for xs in itertools.product(range(len(q)), repeat=k):
        w = math.prod(float(q[x]) for x in xs)
        if w > 0:
            yield list(xs), w


def swor_draws(q: torch.Tensor, k: int):
    """Every sequence of min(k, |supp q|) draws without replacement from q, with its probability."""
    support = [x for x in range(len(q)) if q[x] > 0]
    for xs in itertools.permutations(support, min(k, len(support))):
        w, left = 1.0, 1.0
        for x in xs:
            w *= float(q[x]) / left
            left -= float(q[x])
        yield list(xs), w


def top_k(q: torch.Tensor, k: int) -> list[int]:
    return torch.topk(q, min(k, len(q))).indices.tolist()


def source_outcomes(qt: dict, ks: tuple[int, ...], kind: str):
    """Every draft tree of expansion config ks drawn by `kind` ("iid", "swor", or "point" = top-k) from the context
    tables qt, with its probability."""
    def draws(ctx: tuple[int, ...], k: int):
        q = qt[ctx]
        return [(top_k(q, k), 1.0)] if kind == "point" else list(iid_draws(q, k) if kind == "iid" else swor_draws(q, k))

    def rec(level, depth, tokens, parents, rows, weight):
        if depth == len(ks) or not level:
            q = None if kind == "point" else torch.stack(rows) if rows else torch.zeros(0, len(qt[()]), dtype=F64)
            yield DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), q,
                            kind), weight
            return
        for combo in itertools.product(*(draws(ctx, ks[depth]) for _, ctx in level)):
            toks, pars, qs, nxt, w = list(tokens), list(parents), list(rows), [], weight
            for (node, ctx), (xs, wx) in zip(level, combo, strict=True):
                w *= wx
                for x in xs:
                    nxt.append((len(toks), ctx + (x,)))
                    toks.append(x)
                    pars.append(node)
                    qs.append(qt[ctx])
            yield from rec(nxt, depth + 1, toks, pars, qs, w)

    yield from rec([(-1, ())], 0, [], [], [], 1.0)


def tree_p(t: Tables, tree: DraftTree) -> torch.Tensor:
    """Block rows of p for a tree: p(.|ctx(root)) then p(.|ctx(node i))."""
    ctxs = [tuple(int(tree.tokens[j]) for j in path_to(tree.parents, i)) for i in range(len(tree))]
    return torch.stack([t.p[()]] + [t.p[c] for c in ctxs])


# ---------------------------------------------------------------- merged trees: several drafters, mixed kinds (§2, §3)


def drop_ghosts(tree: DraftTree) -> DraftTree:
    """A biased 'merge': sampled repeats of a sibling (the ghost leaves) deleted instead of verified."""
    keep, seen = [], set()
    for i in range(len(tree)):
        key = (int(tree.parents[i]), int(tree.tokens[i]))
        if key not in seen:
            keep.append(i)
            seen.add(key)
    index = {old: new for new, old in enumerate(keep)}
    parents = [index[int(tree.parents[i])] if tree.parents[i] >= 0 else -1 for i in keep]
    return DraftTree(tree.tokens[keep], torch.tensor(parents), tree.q[keep], tree.draw,
                     None if tree.kinds is None else tuple(tree.kinds[i] for i in keep), tree.groups[keep])


def merged_law(t: Tables, sources: list[tuple[dict, tuple[int, ...], str]], n: int, biased: bool = False):
    """Law of the first n tokens of one step verifying merge(sources' trees), every draft outcome enumerated."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for combo in itertools.product(*(list(source_outcomes(*s)) for s in sources)):
        weight = math.prod(w for _, w in combo)
        merged = merge([tr for tr, _ in combo]).tree
        if biased:
            merged = drop_ghosts(merged)
        for out, prob in real_law(merged, tree_p(t, merged)).items():
            law[out] += weight * prob
    return as_tensor(law, t, n)
