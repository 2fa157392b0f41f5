"""The decoding loop: one step = propose a draft tree, one target forward over it, verify, commit.

    drafter.propose(seq) -> DraftTree                                  (its draft forwards: engine/drafting.py)
    target.forward([Block(cache, [root] + tree.tokens, tree parents)]) -> Rows: logits per node
                                                                (none where the prompt's last call scored the root,
                                                                `Request.ready`: that step drafts nothing)
    verify_greedy / verify_sampled -> accepted path + recovered/bonus token
    cache.keep(root + path)      drafter.observe(verdict)      yield Token ...

A `Request` holds everything that belongs to one generation: the committed sequence, the target's KV cache, the
drafter (its own draft cache and adaptive state), the sampling config and the random generator seeded from the
request's seed. The target model is shared and holds no request state. `stream` yields each emitted token with
a flag saying whether it was a draft token; `Stats` collects one `Step` per target forward. Plain decoding is the
same loop with no drafter (an empty tree).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from speculor.config import SamplingConfig
from speculor.core.logits import adjusted, token_logprobs
from speculor.core.sampling import check_finite, warp
from speculor.core.tree import DraftTree, block_parents
from speculor.core.verify import Verdict, verify_greedy, verify_sampled
from speculor.drafters.base import Drafter
from speculor.errors import SpeculorError
from speculor.grammar.state import GrammarState, Walk, masked
from speculor.runtime.backend import Backend, Block, Cache, Rows, forward1


@dataclass(frozen=True)
class Token:
    id: int
    from_draft: bool  # an accepted draft token (else the recovered/bonus token of its step)
    logprob: float | None = None  # with cfg.logprobs: its log-probability under the distribution it was chosen from
    top: tuple[tuple[int, float], ...] = ()  # and the cfg.logprobs most likely tokens there, with theirs


@dataclass(frozen=True)
class Step:
    accepted: int  # draft tokens accepted
    drafted: int  # draft tokens sent to the target (tree size)
    draft_forwards: int
    draft_s: float
    verify_s: float  # target forward
    overhead_s: float  # acceptance and bookkeeping
    drafter_stats: dict[str, float] | None = None  # the drafter's own numbers of the step (its `stats` dict, if any)


@dataclass
class Stats:
    prefill_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    forced: int = 0  # tokens a grammar forced: emitted with no decision, their rows filled (`refill`)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (bonus included; plain decoding has 1)."""
        return sum(s.accepted + 1 for s in self.steps) / max(len(self.steps), 1)


def check_prompt(prompt: list[int], cfg: SamplingConfig, target: Backend) -> None:
    if not prompt:
        raise SpeculorError("the prompt is empty")
    for t in prompt:  # numpy's ints are not ints
        if not (isinstance(t, int) and 0 <= t < target.vocab_size):
            raise SpeculorError(f"the prompt holds {t!r} ({type(t).__name__}): token ids are ints in "
                                f"[0, {target.vocab_size}) (a tokenizer's output object is not a list of ids)")
    if len(prompt) + cfg.max_new_tokens > target.context_length:
        raise SpeculorError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
            f"context length ({target.context_length})")
    if any(t >= target.vocab_size for t, _ in cfg.logit_bias):
        raise SpeculorError(f"logit_bias names token ids outside the vocabulary [0, {target.vocab_size})")


@dataclass
class Request:
    """One generation's state: seq = prompt + tokens emitted so far (seq[-1] is the root of the next tree)."""

    seq: list[int]
    cfg: SamplingConfig
    cache: Cache
    drafter: Drafter | None
    generator: torch.Generator | None
    stats: Stats
    produced: int = 0
    fill: int = 0  # prompt tokens the prefill puts in the target's cache: all, or all but the root (`start`)
    unfilled: int = 0  # of those, the ones not yet in the cache: chunked prefill (batch.py)
    ready: Rows | None = None  # the root's result from the prompt's last call: the first step's (`settle`)
    scores: list | None = None  # the last step's (logprob, top) per emitted token, with cfg.logprobs (`settle`)
    grammar: GrammarState | None = None  # its constraint's state (grammar/state.py), None: unconstrained
    walk: Walk | None = None  # this step's tree as the grammar sees it: its masks, and the drafter's node indices
    pending: list[Token] = field(default_factory=list)  # forced tokens not yet emitted (the ones before the first)
    root_in_prompt: bool = False  # the target's: whether a fill's last call scores its last token (`refill`)


def start(target: Backend, drafter: Drafter | None, prompt: list[int], cfg: SamplingConfig,
          stats: Stats | None = None, prefill: bool = True, grammar: GrammarState | None = None) -> Request:
    """A request after its prompt prefill: the target's cache holds every prompt token and the root's logits are
    `ready` for the first step, where the backend scores the root in the prompt's last call (`root_in_prompt`):
    that step drafts nothing and forwards nothing, its token the prompt call's; else the cache holds every prompt
    token but the root, which the first step scores. With prefill=False the cache starts empty and the batched step
    (engine/batch.py) fills it chunk by chunk. Under a `grammar`, the tokens it forces first join the prompt's fill
    and are emitted with the first step's."""
    check_prompt(prompt, cfg, target)
    stats = stats if stats is not None else Stats()
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    t0 = time.perf_counter()
    req = Request(list(prompt), cfg, target.new_cache(), drafter, generator, stats, grammar=grammar,
                  root_in_prompt=target.root_in_prompt)
    if drafter is not None:
        drafter.reset()
    if grammar is not None:  # one token at least is the first step's
        req.pending = [_append_forced(req, t) for t in grammar.forced_run(cfg.max_new_tokens - 1)]
    refill(req)
    if prefill and req.unfilled:
        fill(target, req)
    stats.prefill_s = time.perf_counter() - t0
    return req


def fill(target: Backend, req: Request) -> None:
    """Forward the tokens waiting for the cache (a prompt, or a forced run: `refill`) in one block."""
    done = req.fill - req.unfilled
    out = forward1(target, req.cache, req.seq[done:req.fill], last=True, hidden=prompt_features(target, req))
    filled(req, out, req.unfilled)


def refill(req: Request) -> None:
    """The tokens the cache lacks wait for a fill (the prompt; after a forced run, the last decided token and the
    run), whose last call scores the root where the target's prompt calls do (`root_in_prompt`). Plain and
    speculative decoding compute a forced run's rows alike, so both stay identical."""
    req.fill = len(req.seq) - (not req.root_in_prompt)
    req.unfilled = req.fill - req.cache.length


def _append_forced(req: Request, token: int) -> Token:
    """Append a forced token to the request's sequence; its event: probability 1 under the masked target
    (log-probability 0, no alternative)."""
    req.seq.append(token)
    req.produced += 1
    req.stats.forced += 1
    return Token(token, False, 0.0 if req.cfg.logprobs is not None else None)


def _ends(req: Request, token: int, eos_ids: frozenset[int]) -> bool:
    """Whether the request is done once `token` is appended: max_new_tokens, or an end-of-sequence token."""
    return req.produced >= req.cfg.max_new_tokens or (req.cfg.stop_on_eos and token in eos_ids)


def prompt_features(target: Backend, req: Request) -> bool:
    """Whether a prompt's calls give the target's features: where the drafter reads them and the calls do not score
    the root (llama.cpp would output every row of the call, the root's through other kernels than a lone output
    row's: plain decoding's); a drafter then drafts once the root's parent has a feature (drafters/eagle.py)."""
    return reads_features(req) and not target.root_in_prompt


def filled(req: Request, out: Rows, n: int) -> None:
    """Commit a prompt block of `n` rows just forwarded (`out`: its last row's logits, with its features where the
    drafter reads them); when it ends the prompt with the root, the root's logits wait for the first step."""
    # the features of the block's rows, or of its last rows alone (llama.cpp computes only the wanted ones)
    end = req.fill - req.unfilled + n
    keep_features(req, end - len(out.hidden) if out.hidden is not None else 0, out)
    req.cache.keep(list(range(n)))
    req.unfilled -= n
    if not req.unfilled and req.fill == len(req.seq):
        req.ready = Rows(out.logits[-1:])


def stream(target: Backend, drafter: Drafter | None, prompt: list[int], cfg: SamplingConfig,
           eos_ids: frozenset[int] = frozenset(), stats: Stats | None = None,
           grammar: GrammarState | None = None) -> Iterator[Token]:
    """Generate after `prompt`, yielding tokens as they are accepted; fills `stats` if given; under `grammar`'s
    constraint if given."""
    req = start(target, drafter, prompt, cfg, stats, grammar=grammar)
    while True:
        verdict, tree, step = _step(target, req)
        req.stats.steps.append(step)
        tokens, done = emit(req, tree, verdict, eos_ids)
        yield from tokens
        if done:
            return
        if req.unfilled:  # a forced run
            fill(target, req)


def propose(req: Request) -> DraftTree:
    """The request's draft tree after its sequence (the empty tree for plain decoding and where the root's result
    is `ready`; under a grammar, as it walked it), drafted with the kernels a batched step gives it
    (engine/drafting.py), so a seed gives the same output alone and in a batch."""
    from speculor.engine.drafting import propose_all  # drafting builds on this module's Request

    return propose_all([req])[0][0]


def block(req: Request, tree: DraftTree) -> Block | None:
    """What the target forwards for a request: its cache, [root] + the tree's tokens, their block parents (and
    its last hidden states, for a drafter that reads them); None where the root's result is `ready` (no tree)."""
    if req.ready is not None:
        return None
    return Block(req.cache, torch.cat([torch.tensor(req.seq[-1:]), tree.tokens]), block_parents(tree.parents),
                 hidden=reads_features(req))


def reads_features(req: Request) -> bool:
    """Whether the request's drafter reads the target's features (a `store`: drafters/eagle.py) and still will."""
    return getattr(req.drafter, "store", None) is not None and getattr(req.drafter, "reads_features", True)


def keep_features(req: Request, start: int, out: Rows, rows: list[int] | None = None) -> None:
    """A target forward's hidden states, if its result has them (`rows` of them, all by default), to the drafter's
    store as the features of positions start, start + 1, ..."""
    if out.hidden is not None:
        req.drafter.store.put(start, out.hidden if rows is None else out.hidden[rows])


def settle(req: Request, tree: DraftTree, out: Rows | None) -> Verdict:
    """Verify a request's tree against the target's logits for it (`out`: the block's result), commit the accepted
    path, give the drafter the target's features of the root and the path (where it reads them), tell it. Where
    the root's result is `ready` (out None, the empty tree): its token, committed already, told to no drafter."""
    ready, req.ready = req.ready, None
    out = ready if ready is not None else out
    logits = out.logits
    check_finite(logits, "target")
    cfg = req.cfg
    logits = adjusted(logits, cfg, req.seq, req.produced, tree)  # the request's bias and penalties, row by row
    walk, req.walk = req.walk, None
    if req.grammar is not None:  # the grammar's mask at every row (the root's alone where its result was ready)
        logits = masked(logits, walk.masks if walk is not None else req.grammar.allowed()[None])
    verdict = verify_greedy(tree, logits) if cfg.greedy else verify_sampled(tree, warp(logits, cfg), req.generator)
    rows = [0] + [i + 1 for i in verdict.path]  # the root and the accepted path, in block rows
    keep_features(req, len(req.seq) - 1, out, rows)
    if cfg.logprobs is not None:  # token path[j] was chosen at the row of its parent, the last token below the path
        req.scores = token_logprobs(logits, cfg, rows, [int(tree.tokens[j]) for j in verdict.path] + [verdict.token])
    if ready is None:  # else the root is committed and no drafter proposed
        req.cache.keep(rows)
        if req.drafter is not None and (walk is None or walk.drafted):  # told in its own tree's indices
            req.drafter.observe(len(req.seq), verdict if walk is None else
                                Verdict([walk.origin[j] for j in verdict.path], verdict.token))
    return verdict


def emit(req: Request, tree: DraftTree, verdict: Verdict, eos_ids: frozenset[int]) -> tuple[list[Token], bool]:
    """Append the step's tokens (accepted path, then the recovered/bonus token; under a grammar, then the tokens it
    forces) to the request's sequence, up to max_new_tokens or an end-of-sequence token; (those tokens, whether
    the request is done). A forced run waits for its fill (`refill`)."""
    out, req.pending = req.pending, []
    for i, tok in enumerate([int(tree.tokens[j]) for j in verdict.path] + [verdict.token]):
        req.seq.append(tok)
        req.produced += 1
        out.append(Token(tok, i < len(verdict.path), *(req.scores[i] if req.scores is not None else (None, ()))))
        if _ends(req, tok, eos_ids):
            return out, True
        if req.grammar is not None:
            req.grammar.advance(tok)
    if req.grammar is None:
        return out, False
    run = req.grammar.forced_run(req.cfg.max_new_tokens - req.produced)
    for tok in run:
        out.append(_append_forced(req, tok))
        if _ends(req, tok, eos_ids):
            return out, True
    if run:
        refill(req)
    return out, False


def record(drafter: Drafter | None, verdict: Verdict, tree: DraftTree, draft_s: float, verify_s: float,
           overhead_s: float) -> Step:
    """The step's numbers: accepted and drafted tokens, draft forwards, the time split, the drafter's own stats."""
    own = drafter.stats if drafter is not None else None
    return Step(len(verdict.path), len(tree), drafter.forwards if drafter is not None else 0, draft_s, verify_s,
                overhead_s, dict(own) if own is not None else None)


def _step(target: Backend, req: Request) -> tuple[Verdict, DraftTree, Step]:
    t0 = time.perf_counter()
    tree = propose(req)
    t1 = time.perf_counter()
    b = block(req, tree)
    out = target.forward([b])[0] if b is not None else None
    t2 = time.perf_counter()
    verdict = settle(req, tree, out)
    return verdict, tree, record(req.drafter, verdict, tree, t1 - t0, t2 - t1, time.perf_counter() - t2)
