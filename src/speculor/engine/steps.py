"""A request's part of a step, shared by the single-stream driver (engine/loop.py) and the batched step
(engine/batch.py): start it (prefill), give its block, settle its verdict, emit its tokens.

    start(target, drafter, prompt, cfg)  -> Request, its prompt in the target's cache (or waiting for chunks)
    block(req, tree)                      -> Block(cache, [root] + tree.tokens, block parents), None where the
                                             prompt's call scored the root (`root_result`)
    settle(req, tree, rows)               -> Verdict: the request's logits adjusted and masked, verified, the
                                             accepted path committed, the drafter told
    emit(req, tree, verdict, eos_ids)     -> (tokens, done): the path, the recovered/bonus token, a forced run

Where the backend scores the root in the prompt's last call (`Traits.root_in_prompt`), the root's result is
`root_result` for the first step, which drafts nothing and forwards nothing: its token is the prompt call's. A
grammar's
forced tokens join the sequence with no decision and wait for a fill (`refill`), computed alike in plain and
speculative decoding, so both stay identical.
"""

from __future__ import annotations

import time

import torch

from speculor.config import SamplingConfig
from speculor.core.logits import adjusted, token_logprobs
from speculor.core.sampling import check_finite, warp
from speculor.core.tree import DraftTree, block_parents
from speculor.core.verify import Verdict, verify_greedy, verify_sampled
from speculor.drafters.base import Drafter
from speculor.engine.request import PREFILL_CHUNK, Request, Stats, Step, Token, check_prompt
from speculor.grammar.state import GrammarState, masked
from speculor.runtime.backend import Backend, Block, PromptMemory, Rows, forward1


def start(target: Backend, drafter: Drafter | None, prompt: list[int], cfg: SamplingConfig,
          stats: Stats | None = None, prefill: bool = True, grammar: GrammarState | None = None,
          chunk: int = PREFILL_CHUNK) -> Request:
    """A request after its prompt prefill: the target's cache holds every prompt token and the root's logits are
    `root_result` for the first step, where the backend scores the root in the prompt's last call (`root_in_prompt`);
    else the cache holds every prompt token but the root, which the first step scores. With prefill=False the
    batched steps fill the cache `chunk` tokens at a time (engine/batch.py), and a backend with a prompt memory
    lends it the cells of the chunks it starts with now, at its admission. Under a `grammar`, the tokens it forces
    first join the prompt's fill and are emitted with the first step's."""
    check_prompt(prompt, cfg, target)
    stats = stats if stats is not None else Stats()
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    t0 = time.perf_counter()
    req = Request(list(prompt), cfg, target.new_cache(), drafter, generator, stats, chunk=chunk, grammar=grammar,
                  root_in_prompt=target.traits.root_in_prompt)
    if drafter is not None:
        drafter.reset()
    if grammar is not None:  # one token at least is the first step's
        req.pending = [append_forced(req, t) for t in grammar.forced_run(cfg.max_new_tokens - 1)]
    refill(req)
    if prefill and req.unfilled:
        fill(target, req)
    elif not prefill and req.unfilled and isinstance(target, PromptMemory) and not reads_features(req):
        _borrow(target, req)
    stats.prefill_s = time.perf_counter() - t0
    return req


def _borrow(memory: PromptMemory, req: Request) -> None:
    """The cells a prompt memory lends the request's prompt on its chunks' grid (the same prompt: all of them, and
    its last call's result, the root's: its first token comes at its first step, with no call)."""
    lent, root_result = memory.reuse(req.cache, req.prompt, req.chunk)
    req.unfilled -= lent
    if root_result is not None and req.fill == len(req.seq):
        req.root_result = root_result


def fill(target: Backend, req: Request) -> None:
    """Forward the tokens waiting for the cache (a prompt, or a forced run: `refill`) in one block."""
    done = req.fill - req.unfilled
    out = forward1(target, req.cache, req.seq[done:req.fill], last=True, hidden=prompt_features(target, req))
    filled(req, out, req.unfilled)


def refill(req: Request) -> None:
    """The tokens the cache lacks wait for a fill (the prompt; after a forced run, the last decided token and the
    run), whose last call scores the root where the target's prompt calls do (`root_in_prompt`)."""
    req.fill = len(req.seq) - (not req.root_in_prompt)
    req.unfilled = req.fill - req.cache.length


def append_forced(req: Request, token: int) -> Token:
    """Append a forced token to the request's sequence; its event: probability 1 under the masked target
    (log-probability 0, no alternative)."""
    req.seq.append(token)
    req.produced += 1
    req.stats.forced += 1
    return Token(token, False, 0.0 if req.cfg.logprobs is not None else None)


def ends(req: Request, token: int, eos_ids: frozenset[int]) -> bool:
    """Whether the request is done once `token` is appended: max_new_tokens, or an end-of-sequence token."""
    return req.produced >= req.cfg.max_new_tokens or (req.cfg.stop_on_eos and token in eos_ids)


def prompt_features(target: Backend, req: Request) -> bool:
    """Whether a prompt's calls give the target's features: where the drafter reads them and the calls do not score
    the root (llama.cpp would output every row of the call, the root's through other kernels than a lone output
    row's: plain decoding's); a drafter then drafts once the root's parent has a feature (drafters/eagle.py)."""
    return reads_features(req) and not target.traits.root_in_prompt


def filled(req: Request, out: Rows, n: int) -> None:
    """Commit a prompt block of `n` rows just forwarded (`out`: its last row's logits, with its features where the
    drafter reads them); when it ends the prompt with the root, the root's logits wait for the first step."""
    # the features of the block's rows, or of its last rows alone (llama.cpp computes only the wanted ones)
    end = req.fill - req.unfilled + n
    keep_features(req, end - len(out.hidden) if out.hidden is not None else 0, out)
    req.cache.keep(list(range(n)))
    req.unfilled -= n
    if not req.unfilled and req.fill == len(req.seq):
        req.root_result = Rows(out.logits[-1:])


def block(req: Request, tree: DraftTree) -> Block | None:
    """What the target forwards for a request: its cache, [root] + the tree's tokens, their block parents (and
    its last hidden states, for a drafter that reads them); None where the prompt's call scored the root
    (`root_result`: no tree)."""
    if req.root_result is not None:
        return None
    return Block(req.cache, torch.cat([torch.tensor(req.seq[-1:]), tree.tokens]), block_parents(tree.parents),
                 hidden=reads_features(req))


def reads_features(req: Request) -> bool:
    """Whether the request's drafter reads the target's features (a `store`: drafters/eagle.py) and still will."""
    return req.drafter is not None and req.drafter.store is not None and req.drafter.reads_features


def keep_features(req: Request, start: int, out: Rows, rows: list[int] | None = None) -> None:
    """A target forward's hidden states, if its result has them (`rows` of them, all by default), to the drafter's
    store as the features of positions start, start + 1, ..."""
    if out.hidden is not None:
        req.drafter.store.put(start, out.hidden if rows is None else out.hidden[rows])
def settle(req: Request, tree: DraftTree, out: Rows | None) -> Verdict:
    """Verify a request's tree against the target's logits for it (`out`: the block's result), commit the accepted
    path, give the drafter the target's features of the root and the path (where it reads them), tell it. Where
    the root's result came with the prompt (`root_result`; out None, the empty tree): its token, committed already,
    told to no drafter."""
    scored, req.root_result = req.root_result, None  # the prompt's call scored the root
    out = scored if scored is not None else out
    logits = out.logits
    check_finite(logits, "target")
    cfg = req.cfg
    logits = adjusted(logits, cfg, req.seq, req.produced, tree)  # the request's bias and penalties, row by row
    walk, req.walk = req.walk, None
    if req.grammar is not None:  # the grammar's mask at every row (the root's alone where the prompt scored it)
        logits = masked(logits, walk.masks if walk is not None else req.grammar.allowed()[None])
    verdict = verify_greedy(tree, logits) if cfg.greedy else verify_sampled(tree, warp(logits, cfg), req.generator)
    rows = [0] + [i + 1 for i in verdict.path]  # the root and the accepted path, in block rows
    keep_features(req, len(req.seq) - 1, out, rows)
    if cfg.logprobs is not None:  # token path[j] was chosen at the row of its parent, the last token below the path
        req.scores = token_logprobs(logits, cfg, rows, [int(tree.tokens[j]) for j in verdict.path] + [verdict.token])
    if scored is None:  # else the root is committed and no drafter proposed
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
        if ends(req, tok, eos_ids):
            return out, True
        if req.grammar is not None:
            req.grammar.advance(tok)
    if req.grammar is None:
        return out, False
    run = req.grammar.forced_run(req.cfg.max_new_tokens - req.produced)
    for tok in run:
        out.append(append_forced(req, tok))
        if ends(req, tok, eos_ids):
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
