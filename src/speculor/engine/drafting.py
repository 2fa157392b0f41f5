"""A step's drafting: every request's `propose`, with the draft forwards of all of them batched.

A drafter is sequential code that calls its draft model's `forward` between draws. To batch those calls across
requests without rewriting any drafter, each request proposes on a thread of its own (kept between steps) and the
threads take turns, one at a time in request order; a lean draft forward parks its thread (`Model.forward` is
routed here, runtime/model.py `routed`). When every request has parked or finished, the parked calls run as ONE
forward per draft model (`Model.forward_many`: the linear layers over the stacked rows, attention per request),
each thread gets its own result and the next round of turns begins. So round r is the r-th draft forward of every
request still drafting: a tree drafter's depth r for all requests in one forward.

    round 0: each request catches up (its root)   -> one forward over all roots
    round r: each request draws, then feeds a depth -> one forward over all requests' depth-r rows

Kernels. fbgemm's int8 quantises a call's activations with one step for the call, so stacked rows would round
with their neighbours. When any request of the step samples, the draft's rows are computed apart
(kernels.scale_rows): a sampled request's q then follows from its own tokens alone, so its output follows from
its seed alone, alone or in any batch. A lone sampled request (the single-stream loop) drafts the same way, so a
seed gives the same text in `generate`, `bench` and `serve`. Greedy steps keep the faster per-call kernel: any q
gives the target's own tokens at temperature 0.

The batch-aware budget (docs/algorithms.md §11.1) reads a live `Seat` of the step's `Book`: the other requests'
target rows and expected tokens as their trees stand now, and their rows in each round's draft forward (the
others' draft seconds). A request's wish for a draft forward is a `Bid`, parked like a forward; the round's bids are
settled together (`settle`), the round's forward priced once for all the rows that go ahead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from speculor.core.tree import EMPTY, DraftTree
from speculor.drafters.base import BatchLedger
from speculor.errors import SpeculorError
from speculor.runtime.model import Call, Model, routed

if TYPE_CHECKING:
    from speculor.engine.loop import Request
    from speculor.runtime.cost import CostModel

_here = threading.local()  # .turn: the `_Turn` this worker thread is running (None outside a rendezvous)


class Book:
    """The batch of one step as its requests propose: per request, target rows and expected tokens so far (a root
    row and one token until it publishes), and its rows in each round's draft forward; `extra` target rows that are
    no request's tree (prompt chunks)."""

    def __init__(self, n: int, extra: int = 0) -> None:
        self.rows, self.tokens = [1] * n, [1.0] * n
        self.draft: list[list[int]] = []  # round -> rows of each request in that round's draft forward
        self.extra = extra

    def seat(self, i: int) -> Seat:
        return Seat(self, i)

    def drafted(self, rnd: int, i: int, rows: int) -> None:
        while len(self.draft) <= rnd:
            self.draft.append([0] * len(self.rows))
        self.draft[rnd][i] += rows


class Seat(BatchLedger):
    """Request i's live view of its step's `Book`: the others' rows, tokens and draft rows as they stand now."""

    def __init__(self, book: Book, i: int) -> None:  # no fields of its own: they are read from the book
        self.book, self.i = book, i

    @property
    def rows(self) -> int:
        return self.book.extra + sum(self.book.rows) - self.book.rows[self.i]

    @property
    def tokens(self) -> float:
        return sum(self.book.tokens) - self.book.tokens[self.i]

    @property
    def filling(self) -> bool:
        return self.book.extra > 0

    @property
    def draft_rows(self) -> list[int]:
        return [sum(r) - r[self.i] for r in self.book.draft]

    def publish(self, rows: int, tokens: float) -> None:
        self.book.rows[self.i], self.book.tokens[self.i] = rows, tokens

    def round(self, cost: CostModel, gain: float, nodes: int, draft_rows: int, once: float = 0.0) -> bool | None:
        """Park this bid until every request of the step has parked (a bid, a forward, or its end), then get the
        joint answer (`settle`). None for a request drafting alone (no rendezvous): its own rate decides."""
        turn = getattr(_here, "turn", None)
        return None if turn is None else turn.bid(Bid(self.book, cost, gain, nodes, draft_rows, once))


@dataclass(frozen=True, eq=False)  # compared by identity: two requests may bid alike
class Bid:
    """A request of `book`'s step asks for a draft forward of `draft_rows` rows that adds `nodes` target rows worth
    `gain` expected tokens, and charges `once` seconds more to the step (a catch-up's share)."""

    book: Book
    cost: CostModel
    gain: float
    nodes: int
    draft_rows: int
    once: float = 0.0


def settle(bids: Sequence[Bid]) -> list[bool]:
    """Which bids of one draft round go ahead: the subset that maximises the step's tokens per second, the round's
    forward priced once for all its rows. With T, R the batch's expected tokens and target rows as the trees stand,
    D the step's draft forwards so far and S a subset of the bids,

        rate(S) = (T + Σ_S gain) / (D + t_draft(Σ_S draft_rows) [S not empty] + Σ_S once + t_target(R + Σ_S nodes)).

    S grows greedily (the bid that gives the best rate next, even when the rate falls: the round's cost is paid by
    the first and shared by the rest) and the best prefix wins, the empty one on a tie. Priced request by request,
    each round looked as dear as a lone request's, and a batch of 4 drafted less than it should (§11.1)."""
    book, cost = bids[0].book, bids[0].cost
    tokens, rows = sum(book.tokens), book.extra + sum(book.rows)
    spent = sum(cost.t_draft(sum(r)) for r in book.draft if sum(r) > 0)

    def rate(chosen: list[Bid]) -> float:
        if not chosen:
            return tokens / (spent + cost.t_target(rows))
        return ((tokens + sum(b.gain for b in chosen))
                / (spent + cost.t_draft(sum(b.draft_rows for b in chosen)) + sum(b.once for b in chosen)
                   + cost.t_target(rows + sum(b.nodes for b in chosen))))

    order, left = [], list(bids)
    while left:
        best = max(left, key=lambda b: rate(order + [b]))
        order.append(best)
        left.remove(best)
    k = max(range(len(order) + 1), key=lambda k: rate(order[:k]))
    return [b in order[:k] for b in bids]


def propose_all(reqs: Sequence[Request], book: Book | None = None) -> tuple[list[DraftTree], float]:
    """Each request's draft tree (EMPTY without a drafter), and the seconds the step's drafting took. A batch-aware
    drafter is given its seat of `book` (if given) as its `ledger`."""
    t0 = time.perf_counter()
    apart = any(r.drafter is not None and not r.cfg.greedy for r in reqs)
    drafting = [i for i, r in enumerate(reqs) if r.drafter is not None]
    for i in drafting:
        if book is not None and getattr(reqs[i].drafter, "batch_aware", False):
            reqs[i].drafter.ledger = book.seat(i)
            book.rows[i], book.tokens[i] = getattr(reqs[i].drafter, "estimate", (1, 1.0))  # its last tree, until
            # it decides (so the requests before it in turn count it too)
    trees = [EMPTY] * len(reqs)
    jobs = [partial(_proposal, reqs[i], book, i) for i in drafting]
    if len(jobs) == 1:  # alone: no other rows to wait for
        with routed(lambda model, call: model.forward_many([call], apart=apart)[0]):
            trees[drafting[0]] = jobs[0]()
    elif jobs:
        on_round = (lambda rnd, j, rows: book.drafted(rnd, drafting[j], rows)) if book is not None else None
        for i, tree in zip(drafting, rendezvous(jobs, apart, on_round), strict=True):
            trees[i] = tree
    return trees, time.perf_counter() - t0


def _proposal(req: Request, book: Book | None, i: int) -> DraftTree:
    """Request i's tree; a drafter that does not publish as it grows is entered in the book once it is done."""
    tree = req.drafter.propose(req.seq, req.cfg, req.generator)
    if book is not None and not getattr(req.drafter, "batch_aware", False):
        book.rows[i], book.tokens[i] = 1 + len(tree), float(getattr(req.drafter, "expected_tokens", 1.0))
    return tree


class _Worker:
    """A thread kept for turns (threads are made once, not every step: sixteen made and ended per step cost the
    embedded pair's batched steps ~10 ms each and slowed the target's forward beside them)."""

    def __init__(self) -> None:
        self.go, self.back = threading.Semaphore(0), threading.Semaphore(0)
        self.turn: _Turn | None = None
        threading.Thread(target=self._loop, daemon=True, name="speculor-drafting").start()

    def _loop(self) -> None:
        while True:
            self.go.acquire()
            self.turn.run()
            self.back.release()


_idle: list[_Worker] = []  # workers between steps
_idle_lock = threading.Lock()


def _hire(n: int) -> list[_Worker]:
    with _idle_lock:
        hired = [_idle.pop() for _ in range(min(n, len(_idle)))]
    return hired + [_Worker() for _ in range(n - len(hired))]


def _release(workers: list[_Worker]) -> None:
    with _idle_lock:
        _idle.extend(workers)


class _Turn:
    """One job on a worker thread, run a turn at a time: from its start or its last forward to its next forward
    (parked in `call`) or its end."""

    def __init__(self, job: Callable[[], DraftTree], worker: _Worker) -> None:
        self.job, self.worker = job, worker
        self.modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # thread-local: the caller's
        self.call: tuple[Model, Call] | None = None
        self.result: object = None
        self.tree: DraftTree | None = None
        self.error: BaseException | None = None
        self.done = self.aborted = False
        worker.turn = self

    def run(self) -> None:
        """On the worker: the job, to its end (parking at each forward)."""
        try:
            if self.aborted:
                raise _Abort("the step's drafting failed in another request")
            grad, inference = self.modes
            _here.turn = self
            with routed(self._park), torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self.tree = self.job()
        except BaseException as exc:  # handed to the coordinating thread, which raises it
            self.error = exc
        _here.turn = None
        self.done = True

    def bid(self, bid: Bid) -> bool:
        """Park a bid (model None) until the round's bids are settled; the answer."""
        return bool(self._park(None, bid))

    def _park(self, model: Model | None, call: Call | Bid) -> object:
        self.call = (model, call)
        self.worker.back.release()
        self.worker.go.acquire()
        if self.aborted:
            raise _Abort("the step's drafting failed in another request")
        result, self.result, self.call = self.result, None, None
        return result

    def turn(self) -> None:
        """Run this job until it parks a forward or ends."""
        self.worker.go.release()
        self.worker.back.acquire()


class _Abort(SpeculorError):
    """Ends a parked job whose step failed elsewhere."""


def rendezvous(jobs: Sequence[Callable[[], DraftTree]], apart: bool,
               on_round: Callable[[int, int, int], None] | None = None) -> list[DraftTree]:
    """Run the jobs in turns, their lean forwards of each round batched per model (module docstring); their trees.
    on_round(round, job, rows) is told each job's rows in each round's forward."""
    workers = _hire(len(jobs))
    turns = [_Turn(job, w) for job, w in zip(jobs, workers, strict=True)]
    index = {id(t): j for j, t in enumerate(turns)}
    live, rnd = list(turns), 0

    def run(ts: list[_Turn]) -> None:  # each to its next bid, forward or end
        for t in ts:
            t.turn()
            if t.error is not None:
                raise t.error

    try:
        while live:
            run(live)
            live = [t for t in live if not t.done]
            while bidding := [t for t in live if t.call[0] is None]:  # a round's bids, settled together
                for t, yes in zip(bidding, settle([t.call[1] for t in bidding]), strict=True):
                    t.result = yes
                run(bidding)
                live = [t for t in live if not t.done]
            by_model: dict[int, list[_Turn]] = {}
            for t in live:
                by_model.setdefault(id(t.call[0]), []).append(t)
            for group in by_model.values():
                results = group[0].call[0].forward_many([t.call[1] for t in group], apart=apart)
                for t, result in zip(group, results, strict=True):
                    t.result = result
                    if on_round is not None:
                        on_round(rnd, index[id(t)], len(t.call[1].tokens))
            rnd += 1
    finally:
        for t in turns:
            if not t.done:  # a failed step: unpark the others so their threads end
                t.aborted = True
                t.turn()
        _release(workers)
    return [t.tree for t in turns]
