"""The batch goodput rule (docs/algorithms.md §11.1): the expected tokens per second of one step, from its target
rows, its expected tokens and its draft seconds, given this machine's cost curve.

    rate = tokens / (draft_s + t_target(rows))          tokens = Σ_requests (1 + Σ node values), rows = Σ (1 + |tree|)

A draft token is worth making when the step's rate with it beats the rate without: DySpec's draws and depths
(`drafters/values.worth`), Sequoia's tree for the batch (`SequoiaPlans.for_batch`), the joint draft rounds
(`engine/drafting.settle`) and the model-free cuts of ngram and suffix (`best_prefix`) all ask this one question.
Pure: no model, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from speculor.core import priors

# how much better than plain a draft must be predicted to be where the curve is extrapolated (a draft model's
# forwards alone, `chain_can_pay`; other requests' rows, `best_prefix`): the bench's band of model error, set by hand
# (data/priors.json "goodput.margin" says from what)
MARGIN = priors.value("goodput.margin")


class Costs(Protocol):
    """Seconds of a target forward over n rows and of a draft forward over w rows (runtime/cost.CostModel)."""

    def t_target(self, n: int) -> float: ...

    def t_draft(self, w: int) -> float: ...


@dataclass
class BatchLedger:
    """What the other requests of a batched step commit the batch to, as one batch-aware drafter sees it: target
    rows (1 + tree size each, a prompt chunk's rows), expected tokens (1 + Σ node values each, 1 where unknown),
    their rows in each of the step's batched draft forwards, and `pending` requests counted as a root row and a
    token each; `filling`: some request's prompt chunk is in the step. The batched engine hands out a live one
    (engine/drafting.py `PlanView`) that the drafter tells how far its own tree has grown (`publish`); this one is
    fixed.
    """

    rows: int = 0
    tokens: float = 0.0
    draft_rows: Sequence[int] = ()
    pending: int = 0
    filling: bool = False  # prompt chunks share the step: their requests wait for it, so nothing drafts

    def publish(self, rows: int, tokens: float) -> None:
        """The drafter's own tree so far: `rows` target rows (root included), `tokens` expected tokens."""

    def draft_s(self, t_draft: Callable[[int], float]) -> float:
        """Seconds of the others' draft forwards, t_draft(rows) each."""
        return sum(t_draft(r) for r in self.draft_rows if r > 0)

    def round(self, cost: Costs, gain: float, nodes: int, draft_rows: int,
              once: float = 0.0) -> Generator[Any, Any, bool | None]:
        """Joint decision on a draft forward of `draft_rows` rows (plus `once` seconds charged to this step) that
        would add `nodes` target rows of expected value `gain`: the batched engine's `PlanView` yields it as a bid,
        weighed with every other request's bid for the same draft round (engine/drafting.py `settle`). None here: a
        fixed ledger has no round, the drafter decides alone."""
        return None
        yield  # a generator that asks nothing


def rate(cost: Costs, tokens: float, rows: int, draft_s: float = 0.0) -> float:
    """Expected tokens per second of a step of `rows` target rows worth `tokens`, after `draft_s` of drafting."""
    return tokens / (draft_s + cost.t_target(rows))


def best_prefix(cost: Costs, values: Iterable[float], batch: BatchLedger | None = None) -> int:
    """How many of a best-first list of draft tokens to verify, each worth `values[i]` expected tokens (its chance of
    acceptance): the n with the highest rate (1 + Σ_{i<n} v_i) / t_target(n + 1), 0 = none (ties: the longer).
    In a batch (a `BatchLedger`) the step is the batch's: the others' tokens T_o, rows R_o and draft seconds D_o
    join every n's rate, (T_o + 1 + Σ_{i<n} v_i) / (D_o + t_target(R_o + n + 1)), so a row must pay for the whole
    batch's forward growing, and the best n must beat the plain step by MARGIN: the curve is one request's, and
    priced from it other requests' rows and host time were off by more than the gain (docs/algorithms.md §15,
    docs/bench/cpu-room/batch-aware); nothing beside a prompt chunk (its request waits for the step)."""
    if batch is not None and batch.filling:
        return 0
    t_o, r_o, d_o = rest_of_batch(batch, cost)
    tokens = t_o + 1.0
    plain = best = (rate(cost, tokens, r_o + 1, d_o), 0)
    for n, v in enumerate(values, 1):
        tokens += v
        best = max(best, (rate(cost, tokens, r_o + n + 1, d_o), n))
    return best[1] if not r_o or best[0] > MARGIN * plain[0] else 0


def chain_can_pay(cost: Costs, depth: int, margin: float) -> bool:
    """Could a chain of k <= depth draft tokens beat plain decoding by `margin` even if every one were accepted?
    Its catch-up feeds the last accepted token and the bonus (two rows), then k - 1 single rows:

        (k + 1) / (t_draft(2) + (k - 1) t_draft(1) + t_target(k + 1))  >  margin / t_target(1)

    Where a draft forward costs a good part of a target step and rows are not free (a 0.5B draft on llama.cpp's
    two-core kernels), none can: the request decodes plainly, and its draft model is never fed."""
    return any((k + 1) / (cost.t_draft(2) + (k - 1) * cost.t_draft(1) + cost.t_target(k + 1))
               > margin / cost.t_target(1) for k in range(1, depth + 1))


def rest_of_batch(ledger: BatchLedger | None, cost: Costs) -> tuple[float, int, float]:
    """(tokens, rows, draft seconds) the rest of the batch brings to the step (a `BatchLedger`; a request still to
    propose counts as its root: one row, one token); nothing when drafting alone."""
    if ledger is None:
        return 0.0, 0, 0.0
    return ledger.tokens + ledger.pending, ledger.rows + ledger.pending, ledger.draft_s(cost.t_draft)
