"""A step's drafting: every request's proposal driven round by round, the draft forwards of each round batched.

A drafter's `propose` is a generator (drafters/base.py): it yields each draft forward it needs, and each bid for a
shared draft round, and receives the answer. `propose_all` advances every request's proposal in request order to
its next yield; when all have yielded (or finished), the round's bids are settled together (`settle`) and those
requests advance again; then the round's forwards of each draft model run as ONE `forward` call (lean.py: the
linear layers over the stacked rows, attention per request) and each proposal gets its own result. So round r is
the r-th draft forward of every request still drafting: a tree drafter's depth r for all requests in one forward.

    round 0: each request catches up (its root)   -> one forward over all roots
    round r: each request draws, then feeds a depth -> one forward over all requests' depth-r rows

When any request of the step samples, the draft's rows are computed apart (`apart`, kernels.scale_rows): a
sampled request's q then follows from its own tokens alone, so its output follows from its seed alone, alone or in
any batch. A lone sampled request drafts the same way, so a seed gives the same text in `generate`, `bench` and
`serve`. Greedy steps keep the faster per-call kernel: any q gives the target's own tokens at temperature 0.

The batch-aware budget (docs/algorithms.md §11.1) reads request i's live `PlanView` of the step's `BatchPlan`: the
other requests' target rows and expected tokens as their trees stand now, and their rows in each round's draft
forward. A request that names a seed gets no view: it sizes its tree as if alone, so its seed gives the same sample
in any batch (the shapes of its trees, hence its random draws, cannot depend on its neighbours).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from speculor.core import goodput
from speculor.core.goodput import BatchLedger
from speculor.core.tree import EMPTY, DraftTree
from speculor.drafters.base import BatchAware, Forward, Proposal
from speculor.engine.request import Request

if TYPE_CHECKING:
    from speculor.runtime.cost import CostModel


class BatchPlan:
    """The batch of one step as its requests propose: per request, target rows and expected tokens so far (a root
    row and one token until it publishes), and its rows in each round's draft forward; `extra` target rows that are
    no request's tree (prompt chunks)."""

    def __init__(self, n: int, extra: int = 0) -> None:
        self.rows, self.tokens = [1] * n, [1.0] * n
        self.draft: list[list[int]] = []  # round -> rows of each request in that round's draft forward
        self.extra = extra

    def view(self, i: int) -> PlanView:
        return PlanView(self, i)

    def drafted(self, rnd: int, i: int, rows: int) -> None:
        while len(self.draft) <= rnd:
            self.draft.append([0] * len(self.rows))
        self.draft[rnd][i] += rows


class PlanView(BatchLedger):
    """Request i's live view of its step's `BatchPlan`: the others' rows, tokens and draft rows as they stand now."""

    def __init__(self, plan: BatchPlan, i: int) -> None:  # no fields of its own: they are read from the plan
        self.plan, self.i = plan, i

    @property
    def rows(self) -> int:
        return self.plan.extra + sum(self.plan.rows) - self.plan.rows[self.i]

    @property
    def tokens(self) -> float:
        return sum(self.plan.tokens) - self.plan.tokens[self.i]

    @property
    def filling(self) -> bool:
        return self.plan.extra > 0

    @property
    def draft_rows(self) -> list[int]:
        return [sum(r) - r[self.i] for r in self.plan.draft]

    def publish(self, rows: int, tokens: float) -> None:
        self.plan.rows[self.i], self.plan.tokens[self.i] = rows, tokens

    def round(self, cost: CostModel, gain: float, nodes: int, draft_rows: int,
              once: float = 0.0) -> Generator[RoundBid, bool | None, bool | None]:
        """A bid, answered once every request of the step has yielded (a bid, a forward, or its end): the joint
        answer (`settle`), or None for a request drafting alone (its own rate decides)."""
        return (yield RoundBid(self.plan, cost, gain, nodes, draft_rows, once))


@dataclass(frozen=True, eq=False)  # compared by identity: two requests may bid alike
class RoundBid:
    """A request of `plan`'s step asks for a draft forward of `draft_rows` rows that adds `nodes` target rows worth
    `gain` expected tokens, and charges `once` seconds more to the step (a catch-up's share)."""

    plan: BatchPlan
    cost: CostModel
    gain: float
    nodes: int
    draft_rows: int
    once: float = 0.0


def settle(bids: Sequence[RoundBid]) -> list[bool]:
    """Which bids of one draft round go ahead: the subset S that maximises the step's tokens per second
    (core/goodput.py), the round's forward priced once for all its rows. With T, R the batch's expected tokens and
    target rows as the trees stand and D the step's draft forwards so far,

        rate(S) = (T + Σ_S gain) / (D + t_draft(Σ_S draft_rows) [S not empty] + Σ_S once + t_target(R + Σ_S nodes)).

    S grows greedily (the bid that gives the best rate next, even when the rate falls: the round's cost is paid by
    the first and shared by the rest) and the best prefix wins, the empty one on a tie. Priced request by request,
    each round looked as dear as a lone request's, and a batch of 4 drafted less than it should (§11.1)."""
    plan, cost = bids[0].plan, bids[0].cost
    tokens, rows = sum(plan.tokens), plan.extra + sum(plan.rows)
    spent = sum(cost.t_draft(sum(r)) for r in plan.draft if sum(r) > 0)

    def rate(chosen: list[RoundBid]) -> float:
        if not chosen:
            return goodput.rate(cost, tokens, rows, spent)
        return goodput.rate(cost, tokens + sum(b.gain for b in chosen), rows + sum(b.nodes for b in chosen),
                            spent + cost.t_draft(sum(b.draft_rows for b in chosen)) + sum(b.once for b in chosen))

    order, left = [], list(bids)
    while left:
        best = max(left, key=lambda b: rate(order + [b]))
        order.append(best)
        left.remove(best)
    k = max(range(len(order) + 1), key=lambda k: rate(order[:k]))
    return [b in order[:k] for b in bids]


def propose_all(reqs: Sequence[Request], plan: BatchPlan | None = None) -> tuple[list[DraftTree], float]:
    """Each request's draft tree (EMPTY without a drafter), and the seconds the step's drafting took. A batch-aware
    drafter is given its view of `plan` (if given) as its `ledger`."""
    t0 = time.perf_counter()
    apart = any(r.drafter is not None and not r.cfg.greedy for r in reqs)
    trees = [EMPTY] * len(reqs)
    forwarded = {i: _fast_forward(r) for i, r in enumerate(reqs) if r.drafter is not None and r.root_result is None}
    for i, tree in forwarded.items():  # the grammar drafts where it knows the next bytes: the drafter rests
        trees[i] = tree
        if plan is not None and tree is not EMPTY:
            plan.rows[i], plan.tokens[i] = 1 + len(tree), 1.0 + len(tree)
    drafting = [i for i in forwarded if trees[i] is EMPTY]  # the prompt's call scored the root: no draft
    if plan is not None:
        for i in (i for i, r in enumerate(reqs) if r.root_result is not None):
            plan.rows[i] = 0  # its token from the prompt's call, no row
    for i in drafting:
        d = reqs[i].drafter
        if plan is not None and isinstance(d, BatchAware) and d.batch_aware:
            # a seeded request sizes its tree as if alone, so its seed gives the same sample in any batch
            d.ledger = None if reqs[i].cfg.seed is not None else plan.view(i)
            plan.rows[i], plan.tokens[i] = d.estimate  # its last tree, until it decides (so the requests before
            # it in turn count it too)
    joint = len(drafting) > 1 and plan is not None  # alone: no other rows to wait for, bids decided alone
    on_round = (lambda rnd, j, rows: plan.drafted(rnd, drafting[j], rows)) if joint else None
    proposals = [_proposal(reqs[i], plan, i) for i in drafting]
    for i, tree in zip(drafting, rounds(proposals, apart, joint, on_round), strict=True):
        trees[i] = tree
    for i, r in enumerate(reqs):  # under a grammar: each row's mask; at T = 0 the nodes it rules out cut
        if r.grammar is not None and r.root_result is None:
            r.walk = replace(r.grammar.walk(trees[i], r.cfg.greedy), drafted=i in drafting)
            trees[i] = r.walk.tree
    return trees, time.perf_counter() - t0


FAST_FORWARD = 16  # the most tokens the grammar drafts in one step


def _fast_forward(req: Request) -> DraftTree:
    """The grammar's draft: the bytes every continuation starts with, as the tokenizer writes them, a point-mass
    chain (exact for any p: core/verify.py); EMPTY where there are none or no grammar."""
    run = req.grammar.fast_forward(FAST_FORWARD) if req.grammar is not None else []
    return DraftTree.chain(run, draw="point") if run else EMPTY


def _proposal(req: Request, plan: BatchPlan | None, i: int) -> Proposal:
    """Request i's tree; a drafter that does not publish as it grows is entered in the plan once it is done."""
    tree = yield from req.drafter.propose(req.seq, req.cfg, req.generator)
    if plan is not None and not (isinstance(req.drafter, BatchAware) and req.drafter.ledger is not None):
        # it did not publish as it grew
        plan.rows[i], plan.tokens[i] = 1 + len(tree), float(req.drafter.expected_tokens)
    return tree


class _Driven:
    """Proposal i as the rounds drive it: what it asks for next (`ask`), or its tree once `done`."""

    def __init__(self, i: int, proposal: Proposal) -> None:
        self.i, self.proposal = i, proposal
        self.answer: Any = None
        self.ask: Forward | RoundBid | None = None
        self.tree: DraftTree | None = None
        self.done = False

    def advance(self) -> None:
        """Send the answer to the last ask; run the proposal to its next ask or its end."""
        try:
            self.ask = self.proposal.send(self.answer)
        except StopIteration as stop:
            self.tree, self.ask, self.done = stop.value, None, True
        self.answer = None


def rounds(proposals: Sequence[Proposal], apart: bool, joint: bool = True,
           on_round: Callable[[int, int, int], None] | None = None) -> list[DraftTree]:
    """Drive the proposals round by round (module docstring), their forwards of each round batched per model; their
    trees. joint: bids are settled together (else answered None: each decides alone). on_round(round, proposal,
    rows) is told each proposal's rows in each round's forward."""
    turns = [_Driven(i, p) for i, p in enumerate(proposals)]
    live, rnd = list(turns), 0
    try:
        while live:
            for t in live:  # each to its next ask or its end, in request order
                t.advance()
            live = [t for t in live if not t.done]
            while bidding := [t for t in live if isinstance(t.ask, RoundBid)]:  # a round's bids, settled together
                answers = settle([t.ask for t in bidding]) if joint else [None] * len(bidding)
                for t, yes in zip(bidding, answers, strict=True):
                    t.answer = yes
                    t.advance()
                live = [t for t in live if not t.done]
            by_model: dict[int, list[_Driven]] = {}
            for t in live:  # requests' views of one model (a head's, drafters/eagle.py) batch as that model
                by_model.setdefault(id(t.ask.model.shared), []).append(t)
            for group in by_model.values():
                results = group[0].ask.model.forward([t.ask.block for t in group], apart=apart)
                for t, result in zip(group, results, strict=True):
                    t.answer = result
                    if on_round is not None:
                        on_round(rnd, t.i, len(t.ask.block.tokens))
            rnd += 1
    finally:
        for t in turns:
            t.proposal.close()  # a failed step: the others' proposals end where they wait
    return [t.tree for t in turns]


def drive(proposal: Proposal, apart: bool = False) -> DraftTree:
    """One proposal driven alone, a batch of one: its forwards made as it asks, its bids answered None."""
    return rounds([proposal], apart, joint=False)[0]
