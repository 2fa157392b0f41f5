"""Tree verification: pure functions from (draft tree, target outputs) to the accepted path + next token.

Glossary (vLLM's): *accepted* tokens are draft tokens the target kept; the *recovered* token is drawn
from the residual after every child of the last accepted node was rejected; the *bonus* token is drawn
from p at an accepted leaf. Every step emits len(path) + 1 tokens.

Notation (docs/algorithms.md): p is the target distribution, q the draft's; block row 0 holds p(·|ctx(root)),
row i + 1 holds p(·|ctx(node i)).

Rules, by how the tree's siblings were drawn (§2, the recursive rejection loop at every node):
    iid   (SpecInfer MSS; a chain is its one-child case, i.e. Leviathan/Chen speculative sampling)
          d_j = q_j:                       accept x_j if u·d_j(x_j) < r(x_j), else r ← resid(r, d_j)
    swor  (Sequoia / DySpec)  d_j = q with earlier siblings zeroed, renormalised; same test and update
    point (deterministic top-k)  d_j = δ_{x_j}: accept with prob. r(x_j), else r(x_j) ← 0, renormalise
In a merged tree (`tree.kinds`) each child uses the rule of its own kind, and SWOR removes only the
earlier siblings of its own group (draw sequence), so point-mass, i.i.d. and SWOR children of several
drafters mix at one node exactly (d_j is always the law child j was drawn from). A child whose token has
zero mass under its d_j could not have been drawn that way: the tree is mislabelled, and verification
refuses it rather than accept it for free. After the siblings of the current node are exhausted the
recovered token is drawn from r; at an accepted leaf the bonus token is drawn from p. At temperature 0
`verify_greedy` follows the child equal to argmax p, which every rule reduces to when p is a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculor.core.sampling import greedy, residual, sample
from speculor.core.tree import DraftTree, children_lists


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted nodes, top-down (node indices of the tree)
    token: int  # recovered or bonus token, emitted after the path


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Follow, from the root, the child whose token equals argmax p; append argmax p at the last node."""
    kids = _children_by_parent(tree)
    path, node = [], -1
    while True:
        best = greedy(logits[node + 1])
        match = next((c for c in kids.get(node, []) if int(tree.tokens[c]) == best), None)
        if match is None:
            return Verdict(path, best)
        path.append(match)
        node = match


def verify_sampled(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling down the tree with the rule of `tree.draw`; p is [N + 1, V] fp32."""
    kids = _children_by_parent(tree)
    path, node = [], -1
    while True:
        accepted, r = accept_at_node(p[node + 1], kids.get(node, []), tree, generator)
        if accepted is None:
            return Verdict(path, sample(r, generator))
        path.append(accepted)
        node = accepted


def accept_at_node(
    r: torch.Tensor, children: list[int], tree: DraftTree, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """One node of §2: try the children in draw order; return (accepted child or None, final residual r)."""
    drawn: dict[int, list[int]] = {}  # group -> tokens of its siblings tried so far
    for c in children:
        x = int(tree.tokens[c])
        d = _draw_distribution(tree, c, drawn.setdefault(tree.group(c), []), r)
        if d is None:  # this SWOR sequence was exhausted: the child could not have been drawn
            continue
        if not float(d[x]) > 0:
            raise ValueError(f"node {c} (token {x}) has no mass under the law it is labelled as drawn from "
                             f"('{tree.kind(c)}'): a mislabelled draft would be verified with a biased rule")
        u = float(torch.rand((), generator=generator))
        if u * float(d[x]) < float(r[x]):
            return c, r
        r = _update(r, d)
        drawn[tree.group(c)].append(x)
    return None, r


def _draw_distribution(tree: DraftTree, c: int, drawn: list[int], r: torch.Tensor) -> torch.Tensor | None:
    """d_j: the distribution child c was drawn from, given the tokens of its earlier siblings of its group."""
    kind = tree.kind(c)
    if kind == "point":
        return torch.nn.functional.one_hot(tree.tokens[c], r.shape[-1]).to(r.dtype)
    assert tree.q is not None, f"a '{kind}' node needs its draft distribution"
    d = tree.q[c]
    if kind == "swor" and drawn:
        d = d.clone()
        d[drawn] = 0
        mass = d.sum()
        if mass <= 0:
            return None
        d = d / mass
    return d


def _update(r: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    res = residual(r, d)
    return r if res is None else res  # no mass left only when r == d, where rejection has prob. 0


def _children_by_parent(tree: DraftTree) -> dict[int, list[int]]:
    return children_lists(tree.parents)
