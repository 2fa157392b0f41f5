"""Batched decoding: every active request proposes its own tree, ONE target forward verifies all of them, and each
request is verified, compacted and streamed on its own (docs/algorithms.md §11).

    trees = propose_all(requests)                                     (engine/drafting.py: each request's
                                                                      propose, draft forwards batched by round)
    target.forward([Block(cache_i, [root_i] + tree_i) for i])        (stacked rows, attention per request)
    for each request i:  verdict_i = verify(tree_i, p_i, generator_i); cache_i.keep(root + path_i); observe

A request's rows meet other requests' rows only in the linear layers, whose per-row arithmetic does not depend on
the other rows (runtime/batched.py), and its random numbers come from its own generator: its output is what it
would emit alone with the same trees. Requests join (`start`; with prefill=False their prompts are filled chunk by
chunk inside the steps) and leave (`done`) between steps. A drafter that sizes its tree for the batch
(drafters/base.py `BatchAware`) sees, while it proposes, what the other requests of the step have drafted so far,
the prompt chunks included (`drafting.PlanView`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from speculor.config import SamplingConfig
from speculor.core.tree import EMPTY
from speculor.drafters.base import Drafter
from speculor.engine.drafting import BatchPlan, propose_all
from speculor.engine.request import Request, Stats, Token
from speculor.engine.steps import block, emit, filled, prompt_features, record, settle, start
from speculor.runtime.backend import Backend, Block, PromptMemory


@dataclass
class Active:
    """A request in the batch; `done` once it reached max_new_tokens or an end-of-sequence token."""

    req: Request
    eos_ids: frozenset[int]
    done: bool = False


def step(target: Backend, batch: Sequence[Active]) -> list[list[Token]]:
    """One batched step over the active requests; the tokens each one emits (already appended to its seq).

    A request still filling its prompt (`unfilled`, started with prefill=False) adds its next `chunk` prompt tokens
    to the same forward instead of a tree and emits nothing this step, but its first token where its last chunk
    scored the root (`Request.root_result`): a joining request slows the running ones by a chunk's rows a step instead
    of stopping them for its whole prefill; while none decodes, the fillers share the backend's `fill_rows` in
    whole chunks. The calls start and end on one grid whatever else is in the batch. A backend with a prompt memory
    (runtime/backend.py `PromptMemory`) keeps each prompt once filled (and lent the chunks a new prompt starts
    with at its admission: engine/steps.py `start`)."""
    memory = target if isinstance(target, PromptMemory) else None
    filling = [a for a in batch if a.req.unfilled]
    decoding = [a for a in batch if not a.req.unfilled]
    # while none decodes, the fillers share the backend's fill_rows in whole chunks (calls on the grid all the same)
    traits = target.traits
    chunks = {id(a): _chunk(a.req, traits.min_chunk, 1 if decoding else
                            max(1, traits.fill_rows // max(len(filling), 1) // a.req.chunk)) for a in filling}
    plan = BatchPlan(len(decoding), extra=sum(len(c) for c in chunks.values()))
    trees, draft_s = propose_all([a.req for a in decoding], plan)
    drafted = [a.req.drafter is not None and a.req.root_result is None for a in decoding]
    share = draft_s / max(sum(drafted), 1)  # the drafting was shared
    # a chunk's logits: only its last row's (the root's, read by the first step, where the chunk ends with it), or
    # every row's hidden states for a drafter that reads them
    blocks = [Block(a.req.cache, chunks[id(a)], hidden=prompt_features(target, a.req),
                    last=not prompt_features(target, a.req)) for a in filling]
    own = [block(a.req, tree) for a, tree in zip(decoding, trees, strict=True)]  # None: scored by the prompt
    t1 = time.perf_counter()
    results = iter(target.forward(blocks + [b for b in own if b is not None]))
    t2 = time.perf_counter()
    emitted: dict[int, list[Token]] = {}
    for a, out in zip(filling, results, strict=False):
        filled(a.req, out, len(chunks[id(a)]))
        if not a.req.produced:  # a prompt's chunk (a forced run's fill, steps.refill, is no prompt: it is neither
            # prefill time nor cells to lend)
            a.req.stats.prefill_s += t2 - t1
            if memory and not a.req.unfilled:
                memory.remember(a.req.cache, a.req.prompt, a.req.chunk, a.req.root_result)
        emitted[id(a)] = []
    settled = [(a, tree, next(results) if b is not None else None, share if d else 0.0, t2 - t1)
               for a, tree, b, d in zip(decoding, trees, own, drafted, strict=True)]
    # a prompt whose last call scored its root: its first token in this step (no draft, no call: steps.settle)
    settled += [(a, EMPTY, None, 0.0, 0.0) for a in filling if a.req.root_result is not None]
    for a, tree, out, d_s, v_s in settled:
        t = time.perf_counter()
        verdict = settle(a.req, tree, out)
        emitted[id(a)], a.done = emit(a.req, tree, verdict, a.eos_ids)
        a.req.stats.steps.append(record(a.req.drafter, verdict, tree, d_s, v_s, time.perf_counter() - t))
    return [emitted[id(a)] for a in batch]


def _chunk(req: Request, least: int = 1, n: int = 1) -> list[int]:
    """The next prompt tokens to prefill: from the first one not in the cache to the n-th next multiple of the
    request's `chunk` (the chunks' grid, from position 0 whatever a prompt memory lent), or to the prompt's end when
    fewer than `least` would be left after it (the backend's `min_chunk`)."""
    done, end = req.fill - req.unfilled, req.fill
    grid = (done // req.chunk + n) * req.chunk
    return req.seq[done:grid if end - grid >= least else end]


def generate(target: Backend, entries: Sequence[tuple[Drafter | None, list[int], SamplingConfig]],
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
