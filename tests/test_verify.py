"""Acceptance rules of verify.py on crafted distributions, checked by exact enumeration (docs §1, §2, §10).

Notation of the papers: p is the target distribution, q the draft's; d_j the law the j-th sibling was drawn from.

Two independent computations of a verifier's output law are used:
  * `mirror_*`: an analytic float64 re-statement of the rule (every draft draw enumerated with its probability,
    the accept / reject branches weighted by min(1, r/d) and 1 - min(1, r/d));
  * `real_law` (tests/support/exact.py, with the tables of p and q and the enumerations of draft draws): the law of
    `speculor.core.verify.verify_sampled` itself, obtained by running it on every branch of its random choices: each
    uniform u is scripted just below (accept) or just above (reject) the threshold r[x]/d[x] read from the residual
    and draw law the code was using, the branch weighted by the exact probability P(u·d[x] < r[x]) = min(1, r[x]/d[x]),
    and the final `sample(r)` replaced by the whole distribution r.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch
from scipy.stats import chisquare
from support.exact import (
    EXACT,
    F64,
    Tables,
    accept_prob,
    as_tensor,
    iid_draws,
    l1,
    merged_law,
    real_law,
    swor_draws,
    target_law,
    top_k,
    tv,
)

import speculor.core.verify as verify
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict, accept_at_node, verify_greedy, verify_sampled

CASES = ["random", "q_zeros", "q_eq_p", "disjoint", "top_p"]


def resid(r: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    res = torch.clamp(r - d, min=0)
    return r if float(res.sum()) <= 1e-12 else res / res.sum()


# ---------------------------------------------------------------- chains (§1): every draft draw enumerated


def mirror_chain(t: Tables, k: int, no_residual: bool = False) -> dict[tuple[int, ...], float]:
    """Analytic law of one step of Leviathan/Chen speculative sampling with a K-token chain."""
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def rec(ctx: tuple[int, ...], prob: float) -> None:
        p = t.p[ctx]
        if len(ctx) == k:  # every draft token accepted: bonus ~ p
            for x in range(t.v):
                law[ctx + (x,)] += prob * float(p[x])
            return
        q = t.q[ctx]
        for y in range(t.v):
            if q[y] > 0:
                rec(ctx + (y,), prob * float(q[y]) * accept_prob(float(p[y]), float(q[y])))
        reject = 1 - float(torch.minimum(p, q).sum())
        after = p if no_residual else resid(p, q)
        for x in range(t.v):
            law[ctx + (x,)] += prob * reject * float(after[x])

    rec((), 1.0)
    return dict(law)


def real_chain(t: Tables, k: int) -> dict[tuple[int, ...], float]:
    """Law of verify_sampled over every draft chain y_1..y_K ~ q, weighted by its probability."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for ys in itertools.product(range(t.v), repeat=k):
        weight = math.prod(float(t.q[ys[:i]][y]) for i, y in enumerate(ys))
        if weight == 0:
            continue
        tree = DraftTree.chain(list(ys), torch.stack([t.q[ys[:i]] for i in range(k)]))
        p = torch.stack([t.p[ys[:i]] for i in range(k + 1)])
        for out, prob in real_law(tree, p).items():
            law[out] += weight * prob
    return dict(law)


@pytest.mark.parametrize("v", [3, 4, 5])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_chain_is_exact(v, case, k):
    t = Tables(case, v, seed=10 * v + k)
    want = target_law(t, k + 1)
    assert abs(float(want.sum()) - 1) < EXACT
    mirror = mirror_chain(t, k)
    assert l1(as_tensor(mirror, t, k + 1), want) < EXACT
    real = real_chain(t, k)
    assert max(abs(real.get(s, 0.0) - mirror.get(s, 0.0)) for s in set(real) | set(mirror)) < EXACT
    assert l1(as_tensor(real, t, k + 1), want) < EXACT


@pytest.mark.parametrize("v", [3, 4, 5])
def test_chain_without_residual_is_detected(v, monkeypatch):
    """Negative control: resampling from p (not the residual) after a rejection is biased, and the harness sees it."""
    t = Tables("random", v, seed=v)
    want = target_law(t, 3)
    assert tv(as_tensor(mirror_chain(t, 2, no_residual=True), t, 3), want) > 0.01
    monkeypatch.setattr(verify, "residual", lambda r, d: r)
    assert tv(as_tensor(real_chain(t, 2), t, 3), want) > 0.01


# ---------------------------------------------------------------- one node, several children (§2)


def swor_laws(q: torch.Tensor, xs: list[int]) -> list[torch.Tensor]:
    """d_j of SWOR: q with the earlier draws zeroed, renormalised (None-free: callers stop at an empty one)."""
    out = []
    for j in range(len(xs)):
        d = q.clone()
        d[xs[:j]] = 0
        out.append(d / d.sum() if d.sum() > 0 else d)
    return out


def mirror_node(p: torch.Tensor, xs: list[int], ds: list[torch.Tensor], point: bool = False) -> torch.Tensor:
    """Analytic law of the recursive rejection loop of §2 for draws xs with draw laws ds (first emitted token)."""
    out, r, stay = torch.zeros_like(p), p.clone(), 1.0
    for x, d in zip(xs, ds, strict=True):
        if point:
            d = torch.nn.functional.one_hot(torch.tensor(x), len(p)).to(F64)
        if float(d.sum()) == 0:
            break
        a = accept_prob(float(r[x]), float(d[x]))
        out[x] += stay * a
        stay *= 1 - a
        r = resid(r, d)
    return out + stay * r


def first_token(law: dict[tuple[int, ...], float], v: int) -> torch.Tensor:
    out = torch.zeros(v, dtype=F64)
    for seq, prob in law.items():
        out[seq[0]] += prob
    return out


def node_tree(xs: list[int], q: torch.Tensor | None, draw: str, pad: int = 0) -> DraftTree:
    """k children of the root (plus `pad` extra children a SWOR draft could not have drawn)."""
    tokens = xs + [xs[0]] * pad
    qs = None if q is None else q.expand(len(tokens), -1).clone()
    return DraftTree(torch.tensor(tokens), torch.full((len(tokens),), -1), qs, draw)


def node_p(p: torch.Tensor, n_children: int) -> torch.Tensor:
    """Block rows for verify_sampled: p at the root, then (irrelevant here) uniform rows at the children."""
    return torch.cat([p[None], torch.full((n_children, len(p)), 1 / len(p), dtype=F64)])


def node_law(rule: str, p: torch.Tensor, q: torch.Tensor, k: int, real: bool, pad: int = 0) -> torch.Tensor:
    """First-token law of a node with k children drawn by `rule` and verified by `rule` (the correct pairing)."""
    out = torch.zeros_like(p)
    if rule == "point":
        draws = [(top_k(q, k), 1.0)]
    else:
        draws = iid_draws(q, k) if rule == "iid" else swor_draws(q, k)
    for xs, w in draws:
        if real:
            tree = node_tree(xs, None if rule == "point" else q, rule, pad)
            out += w * first_token(real_law(tree, node_p(p, len(tree))), len(p))
        else:
            ds = [q] * len(xs) if rule == "iid" else swor_laws(q, xs)
            out += w * mirror_node(p, xs, ds, point=rule == "point")
    return out


@pytest.mark.parametrize("v", [3, 4, 5])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rule", ["iid", "swor", "point"])
def test_node_rule_is_exact(rule, case, v):
    t = Tables(case, v, seed=100 + v)
    p, q = t.p[()], t.q[()]
    for k in (1, 2, 3):
        assert l1(node_law(rule, p, q, k, real=False), p) < EXACT, f"mirror, k={k}"
        assert l1(node_law(rule, p, q, k, real=True), p) < EXACT, f"verify_sampled, k={k}"


@pytest.mark.parametrize("v", [3, 4])
def test_swor_with_more_children_than_support(v):
    """k > |supp q|: the SWOR draft stops early; extra undrawable children are skipped by the verifier."""
    t = Tables("q_zeros", v, seed=7)
    p, q = t.p[()], t.q[()]
    support = int((q > 0).sum())
    assert support < 3
    assert l1(node_law("swor", p, q, 3, real=True), p) < EXACT
    assert l1(node_law("swor", p, q, 3, real=True, pad=2), p) < EXACT


def test_swor_covering_supp_p_always_accepts():
    """SWOR with k = |supp q| and supp q ⊇ supp p accepts some child with probability 1 (§10.2)."""
    t = Tables("random", 4, seed=3)
    p, q = t.p[()], t.q[()]
    for xs, w in swor_draws(q, 4):
        law = real_law(node_tree(xs, q, "swor"), node_p(p, 4))
        assert all(len(seq) == 2 for seq in law), "a child must be accepted (path of length 1 + bonus)"
        assert abs(sum(law.values()) - 1) < EXACT and w > 0


@pytest.mark.parametrize("v", [3, 4, 5])
def test_point_rule_accepts_with_children_mass(v):
    """Deterministic top-k + point-mass rule: P(some child accepted) = Σ_children p(x)."""
    t = Tables("random", v, seed=v)
    p, q = t.p[()], t.q[()]
    for k in (1, 2, 3):
        xs = top_k(q, k)
        law = real_law(node_tree(xs, None, "point"), node_p(p, len(xs)))
        accepted = sum(w for seq, w in law.items() if len(seq) == 2)
        assert abs(accepted - float(p[xs].sum())) < EXACT


@pytest.mark.parametrize("v", [3, 4, 5])
@pytest.mark.parametrize("case", ["random", "q_zeros", "top_p"])
def test_k1_acceptance_is_one_minus_tv(v, case):
    t = Tables(case, v, seed=20 + v)
    p, q = t.p[()], t.q[()]
    accepted = 0.0
    for xs, w in iid_draws(q, 1):
        law = real_law(node_tree(xs, q, "iid"), node_p(p, 1))
        accepted += w * sum(prob for seq, prob in law.items() if len(seq) == 2)
    assert abs(accepted - (1 - tv(p, q))) < EXACT


def biased_law(kind: str, p: torch.Tensor, q: torch.Tensor, k: int, real: bool) -> torch.Tensor:
    """First-token law of a wrong draw/verify pairing from the §2 table."""
    out = torch.zeros_like(p)
    if kind == "iid_draws_swor_verify":
        draws, verify_as = iid_draws(q, k), "swor"
    elif kind == "swor_draws_iid_verify":
        draws, verify_as = swor_draws(q, k), "iid"
    else:  # "topk_ratio_test": deterministic children verified with the ratio test against q
        draws, verify_as = [(top_k(q, k), 1.0)], "iid"
    for xs, w in draws:
        ds = swor_laws(q, xs) if verify_as == "swor" else [q] * len(xs)
        if real and not (verify_as == "swor" and len(set(xs)) < len(xs)):
            out += w * first_token(real_law(node_tree(xs, q, verify_as), node_p(p, len(xs))), len(p))
        else:  # a repeated token labelled SWOR is refused by the verifier (test_mislabelled_draws_are_refused)
            out += w * mirror_node(p, xs, ds)
    return out


@pytest.mark.parametrize("kind", ["iid_draws_swor_verify", "swor_draws_iid_verify", "topk_ratio_test"])
@pytest.mark.parametrize("v", [3, 4, 5])
def test_wrong_pairings_are_detected(kind, v):
    """Negative controls (§2 table): the bias depends on (p, q) and vanishes for some pairs, so look at a few."""
    worst = 0.0
    for seed in range(30, 36):
        t = Tables("random", v, seed=seed)
        p, q = t.p[()], t.q[()]
        mirror, real = biased_law(kind, p, q, 3, real=False), biased_law(kind, p, q, 3, real=True)
        assert l1(mirror, real) < EXACT  # the real verifier, mislabelled, does exactly what the wrong rule says
        worst = max(worst, tv(real, p))
    assert worst > 0.01


def test_mislabelled_draws_are_refused():
    """A child with no mass under its declared draw law (a repeat labelled SWOR, a q = 0 token labelled i.i.d.)
    would be accepted for free; the verifier raises instead of running the biased rule."""
    p = torch.tensor([0.5, 0.0, 0.5])  # p(1) = 0: the first child is surely rejected
    q = torch.tensor([0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="mislabelled"):
        accept_at_node(p, [0, 1], node_tree([1, 1], q, "swor"), None)
    with pytest.raises(ValueError, match="mislabelled"):
        accept_at_node(p, [0], node_tree([2], q, "iid"), None)


# ---------------------------------------------------------------- the residual after a rejection


def reject_everything(monkeypatch) -> None:
    class TorchProxy:
        def __getattr__(self, name):
            return (lambda *a, **kw: torch.tensor(1.0)) if name == "rand" else getattr(torch, name)

    monkeypatch.setattr(verify, "torch", TorchProxy())


@pytest.mark.parametrize("draw", ["iid", "swor", "point"])
def test_residual_after_rejection(draw, monkeypatch):
    """After rejecting x: r(x) = 0, Σr = 1, no NaN; a SWOR draft has no mass on siblings already drawn."""
    reject_everything(monkeypatch)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float32)
    tree = node_tree([0, 1], None if draw == "point" else q, draw)
    accepted, r = accept_at_node(p, [0, 1], tree, None)
    assert accepted is None
    assert torch.isfinite(r).all()
    assert abs(float(r.sum()) - 1) < 1e-6
    assert float(r[0]) == 0 and float(r[1]) == 0
    if draw == "swor":
        d = verify._draw_distribution(tree, 1, [0], p)
        assert float(d[0]) == 0 and abs(float(d.sum()) - 1) < 1e-6


def test_rejection_when_q_equals_p_keeps_p(monkeypatch):
    """resid(p, p) has no mass; the verifier keeps r = p (rejection had probability 0) and never produces NaN."""
    reject_everything(monkeypatch)
    p = torch.tensor([0.25, 0.25, 0.5])
    accepted, r = accept_at_node(p, [0], node_tree([2], p, "iid"), None)
    assert accepted is None and torch.equal(r, p)


def test_verify_sampled_with_real_generator():
    """Monte-Carlo check of the real random path (torch.rand / multinomial) against p for a 2-child iid node."""
    t = Tables("random", 4, seed=5)
    p, q = t.p[()].float(), t.q[()].float()
    g = torch.Generator().manual_seed(0)
    m = 6000
    counts = torch.zeros(4)
    for _ in range(m):
        xs = torch.multinomial(q, 2, replacement=True, generator=g).tolist()
        tree = node_tree(xs, q, "iid")
        verdict = verify_sampled(tree, node_p(p.double(), 2).float(), g)
        counts[xs[verdict.path[0]] if verdict.path else verdict.token] += 1
    exp = (p.double() * m).numpy()
    assert chisquare(counts.numpy(), exp * (m / exp.sum())).pvalue > 1e-3


# ---------------------------------------------------------------- greedy


def peaked(rows: list[int], v: int = 5) -> torch.Tensor:
    """Logits whose argmax in row i is rows[i]."""
    logits = torch.zeros(len(rows), v)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 3.0
    return logits + 0.1 * torch.arange(v)  # no ties


def test_greedy_chain_perfect_match():
    tree = DraftTree.chain([2, 4, 1])
    assert verify_greedy(tree, peaked([2, 4, 1, 3])) == Verdict([0, 1, 2], 3)


@pytest.mark.parametrize("j", [0, 1, 2])
def test_greedy_chain_early_mismatch(j):
    rows = [2, 4, 1, 3]
    rows[j] = 0  # the target disagrees at position j
    tree = DraftTree.chain([2, 4, 1])
    assert verify_greedy(tree, peaked(rows)) == Verdict(list(range(j)), 0)


def test_greedy_empty_draft():
    tree = DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert verify_greedy(tree, peaked([3])) == Verdict([], 3)


def test_greedy_ties_take_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert verify_greedy(DraftTree.chain([3]), logits) == Verdict([], 1)  # 3 ties with 1, 1 wins
    assert verify_greedy(DraftTree.chain([1]), logits) == Verdict([0], 0)  # then all tie: 0


def test_greedy_follows_the_matching_branch():
    # root children: node 0 (token 1), node 1 (token 2); node 1 has children node 2 (token 3), node 3 (token 4)
    tree = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, -1, 1, 1]))
    logits = peaked([2, 0, 4, 0, 1])  # rows: root, node 0, node 1, node 2, node 3
    assert verify_greedy(tree, logits) == Verdict([1, 3], 1)


def test_sampled_point_mass_p_matches_greedy():
    """When p is a point mass every rule reduces to greedy."""
    g = torch.Generator().manual_seed(0)
    tree = DraftTree.chain([2, 4, 1], torch.full((3, 5), 0.2))
    p = torch.nn.functional.one_hot(torch.tensor([2, 4, 0, 3]), 5).float()
    for _ in range(20):
        assert verify_sampled(tree, p, g) == Verdict([0, 1], 0)


# ---------------------------------------------------------------- merged trees: several drafters, mixed kinds (§2, §3)


@pytest.mark.parametrize(("case", "v"), [("random", 4), ("random", 5), ("q_zeros", 5), ("top_p", 5)])
def test_merged_node_with_mixed_kinds_is_exact(case, v):
    """One node whose children were drawn i.i.d. by drafter A, without replacement by drafter B and
    deterministically by C (several sampled repeats become ghosts): the output law is p."""
    a, b, c = Tables(case, v, seed=200), Tables(case, v, seed=201), Tables(case, v, seed=202)
    for sources in ([(a.q, (2,), "iid"), (b.q, (2,), "swor"), (c.q, (1,), "point")],
                    [(c.q, (2,), "point"), (a.q, (2,), "iid"), (a.q, (1,), "iid")]):
        assert l1(merged_law(a, sources, 2), target_law(a, 2)) < EXACT


@pytest.mark.parametrize("seed", [210, 213])
def test_merged_trees_are_exact(seed):
    """Depth-2 trees of several drafters merged by prefix (subtrees joined under shared prefixes, repeats kept
    as ghosts): the law of the first three tokens is p's."""
    a, b, c = (Tables("random", 3, seed=seed + i) for i in range(3))
    want = target_law(a, 3)
    assert l1(merged_law(a, [(a.q, (2, 1), "iid"), (b.q, (1, 1), "iid"), (c.q, (1, 1), "point")], 3), want) < EXACT
    assert l1(merged_law(a, [(c.q, (1, 1), "point"), (a.q, (2, 1), "swor")], 3), want) < EXACT


def test_merge_without_ghosts_is_detected():
    """Negative control: deleting sampled repeats (one residual update per unique token) is biased (§2 table)."""
    worst = 0.0
    for seed in range(220, 226):
        a = Tables("random", 3, seed=seed)
        sources = [(a.q, (3,), "iid")]
        assert l1(merged_law(a, sources, 2), target_law(a, 2)) < EXACT
        worst = max(worst, tv(merged_law(a, sources, 2, biased=True), target_law(a, 2)))
    assert worst > 1e-3  # exact would be < 1e-12; the bias depends on (p, q) and is 0.012 at its largest here
