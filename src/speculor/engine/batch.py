"""Batched decoding: every active request proposes its own tree, ONE target forward verifies all of them, and each
request is verified, compacted and streamed on its own (docs/algorithms.md §11).

    for each request i:  tree_i = drafter_i.propose(seq_i)           (its own draft cache and generator)
    target.forward_batch([(cache_i, [root_i] + tree_i) for i])       (stacked rows, attention per request)
    for each request i:  verdict_i = verify(tree_i, p_i, generator_i); cache_i.keep(root + path_i); observe

A request's rows meet other requests' rows only in the linear layers, whose per-row arithmetic does not depend on
the other rows (runtime/batched.py), and its random numbers come from its own generator: its output is what it
would emit alone with the same trees. Requests join (`start`, which runs their prefill) and leave (`done`) between
steps. A drafter that sizes its tree for the batch (`batch_aware`) is told, before it proposes, what the requests
before it in the step have already drafted (`BatchLedger`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from speculor.config import SamplingConfig
from speculor.drafters.base import BatchLedger, Drafter
from speculor.engine.loop import Request, Stats, Token, block, emit, propose, record, settle, start
from speculor.runtime.model import Model


@dataclass
class Active:
    """A request in the batch; `done` once it reached max_new_tokens or an end-of-sequence token."""

    req: Request
    eos_ids: frozenset[int]
    done: bool = False


def step(target: Model, batch: Sequence[Active]) -> list[list[Token]]:
    """One batched step over the active requests; the tokens each one emits (already appended to its seq)."""
    trees, draft_s = [], []
    ledger = BatchLedger(pending=len(batch))
    for a in batch:
        ledger.pending -= 1
        drafter = a.req.drafter
        if drafter is not None and getattr(drafter, "batch_aware", False):
            drafter.ledger = ledger
        t = time.perf_counter()
        trees.append(propose(a.req))
        draft_s.append(time.perf_counter() - t)
        ledger.rows += 1 + len(trees[-1])
        ledger.tokens += float(getattr(drafter, "expected_tokens", 1.0))
        ledger.draft_s += draft_s[-1]
    t1 = time.perf_counter()
    all_logits = target.forward_batch([block(a.req, tree) for a, tree in zip(batch, trees, strict=True)])
    t2 = time.perf_counter()
    emitted = []
    for a, tree, logits, d_s in zip(batch, trees, all_logits, draft_s, strict=True):
        t = time.perf_counter()
        verdict = settle(a.req, tree, logits)
        tokens, a.done = emit(a.req, tree, verdict, a.eos_ids)
        emitted.append(tokens)
        a.req.stats.steps.append(record(a.req.drafter, verdict, tree, d_s, t2 - t1, time.perf_counter() - t))
    return emitted


def generate(target: Model, entries: Sequence[tuple[Drafter | None, list[int], SamplingConfig]],
             eos_ids: frozenset[int] = frozenset(), stats: Sequence[Stats] | None = None
             ) -> Iterator[tuple[int, list[Token]]]:
    """Decode several requests together: yields (request index, tokens it emitted this step) until all are done.
    Each entry is (its drafter, its prompt, its sampling config); prefills run one request at a time, first.
    `stats[i]`, if given, collects request i's prefill time and steps."""
    batch = [Active(start(target, drafter, prompt, cfg, stats[i] if stats else None), eos_ids)
             for i, (drafter, prompt, cfg) in enumerate(entries)]
    index = {id(a): i for i, a in enumerate(batch)}
    active = list(batch)
    while active:
        for a, toks in zip(active, step(target, active), strict=True):
            yield index[id(a)], toks
        active = [a for a in active if not a.done]
