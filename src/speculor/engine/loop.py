"""The single-stream driver: one step = propose a draft tree, one target forward over it, verify, commit.

    drafter.propose(seq) -> DraftTree                                  (its draft forwards: engine/drafting.py)
    target.forward([Block(cache, [root] + tree.tokens, tree parents)]) -> Rows: logits per node
                                                                (none where the prompt's last call scored the root,
                                                                `Request.root_result`: that step drafts nothing)
    verify_greedy / verify_sampled -> accepted path + recovered/bonus token
    cache.keep(root + path)      drafter.observe(verdict)      yield Token ...

`stream` yields each emitted token with a flag saying whether it was a draft token; `Stats` collects one `Step` per
target forward. Plain decoding is the same loop with no drafter (an empty tree). The request's part of a step is
engine/steps.py's, the batched step engine/batch.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from speculor.config import SamplingConfig
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter
from speculor.engine.drafting import propose_all
from speculor.engine.request import Request, Stats, Step, Token
from speculor.engine.steps import block, emit, fill, record, settle, start
from speculor.grammar.state import GrammarState
from speculor.runtime.backend import Backend


def stream(target: Backend, drafter: Drafter | None, prompt: list[int], cfg: SamplingConfig,
           eos_ids: frozenset[int] = frozenset(), stats: Stats | None = None,
           grammar: GrammarState | None = None) -> Iterator[Token]:
    """Generate after `prompt`, yielding tokens as they are accepted; fills `stats` if given; under `grammar`'s
    constraint if given."""
    req = start(target, drafter, prompt, cfg, stats, grammar=grammar)
    while True:
        verdict, tree, step_ = one_step(target, req)
        req.stats.steps.append(step_)
        tokens, done = emit(req, tree, verdict, eos_ids)
        yield from tokens
        if done:
            return
        if req.unfilled:  # a forced run
            fill(target, req)


def propose(req: Request) -> DraftTree:
    """The request's draft tree after its sequence (the empty tree for plain decoding and where the root's result
    is `root_result`; under a grammar, as it walked it), drafted with the kernels a batched step gives it
    (engine/drafting.py), so a seed gives the same output alone and in a batch."""
    return propose_all([req])[0][0]


def one_step(target: Backend, req: Request) -> tuple[Verdict, DraftTree, Step]:
    """Propose, forward, settle: the step's verdict, its tree and its numbers (the tokens not yet emitted)."""
    t0 = time.perf_counter()
    tree = propose(req)
    t1 = time.perf_counter()
    b = block(req, tree)
    out = target.forward([b])[0] if b is not None else None
    t2 = time.perf_counter()
    verdict = settle(req, tree, out)
    return verdict, tree, record(req.drafter, verdict, tree, t1 - t0, t2 - t1, time.perf_counter() - t2)
