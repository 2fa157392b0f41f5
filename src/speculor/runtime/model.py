"""`Model`: a causal LM shared by every request, run one *block* at a time against a request's `KVCache`.

A block is a list of new tokens with parents inside the block (-1 = attends only to the cache): a chain
for a prompt, [root] + nodes for a draft tree. `Model.forward` runs one block with the tree mask and
depth-based positions; the cache's `keep` commits the chosen block rows and drops the rest. The
uncommitted entries after the committed ones form the *pending region*; `forward(..., append=True)`
extends it instead of replacing it, so a draft tree can be grown one depth per forward, each new row
attending to its ancestors among the earlier pending entries. The model holds weights only: every
request brings its own cache. Masks and positions are arguments of the forward call; no modeling file
is patched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from speculor.core.tree import attention_mask, position_ids
from speculor.runtime import batched
from speculor.runtime.cache import KVCache
from speculor.runtime.lean import LeanDecoder
from speculor.runtime.lean import Rows as LeanRows

Block = tuple[KVCache, "torch.Tensor | list[int]", "torch.Tensor | None"]  # (a request's cache, tokens, parents)


class Model:
    """A transformers causal LM shared by every request: runs a block of tokens against a request's `KVCache`."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, *,
                 lean: bool = False, device: str | torch.device | None = None) -> None:
        """lean=True: run `forward` through lean.py's forward (the same logits up to summation order, less overhead;
        for a draft; one matmul per group of projections `lean.fuse_projections` joined). device: where the forward
        runs, by default where the weights are (offloaded weights are meta tensors: their forward runs on the GPU
        given)."""
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()  # an nn.Linear, or a packed one without its fp32 weight (kernels.py)
        self.vocab_size = vocab_size or getattr(head, "out_features", None) or head.weight.shape[0]
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.batched = batched.enable(model)  # one forward for several requests' blocks (`forward_batch`)
        self.lean = LeanDecoder(model) if lean else None

    @staticmethod
    def new_cache() -> KVCache:
        return KVCache()

    @torch.inference_mode()
    def forward(self, cache: KVCache, tokens: torch.Tensor | list[int], parents: torch.Tensor | None = None,
                hidden: bool = False, *, append: bool = False,
                last: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] (fp32, on the host) for a block of n tokens after the cache's committed entries ([1, V], the
        last row's, with last=True: the vocabulary projection, 1/7 of the target's flops, is then made for one row).

        The block's rows become pending entries b..b+n-1 of the pending region, where b = 0 (the region is
        emptied first) unless append=True (b = entries already pending). parents[i] is the region index of
        row i's parent (< b + i), -1 = none: a row attends to the committed cache, its ancestors and itself,
        at position length + depth. append=False with parents=None is a chain; with append=True parents=None
        continues the last pending entry. With hidden=True also returns the last hidden states [n, H].
        """
        route = getattr(_routes, "hook", None)
        if route is not None and self.lean is not None:  # a request proposing under engine/drafting.py
            return route(self, Call(cache, tokens, parents, hidden, append, last))
        if self.lean is not None:
            return self.forward_many([Call(cache, tokens, parents, hidden, append, last)])[0]
        tokens, region, b = _open(cache, tokens, parents, append)
        out = self.model(
            input_ids=tokens[None].to(self.device),
            position_ids=position_ids(region, cache.length)[:, b:].to(self.device),
            attention_mask=attention_mask(region, cache.length, self.dtype)[:, :, b:].to(self.device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=1 if last else 0,
        )
        cache.pending = region
        logits = _fit_vocab(out.logits[0].float(), self.vocab_size)
        return (logits, out.hidden_states[-1][0]) if hidden else logits

    @torch.inference_mode()
    def forward_many(self, calls: Sequence[Call], *, apart: bool = False) -> list:
        """What `forward(*call)` returns for each call (each on its own request's cache), from ONE lean forward over
        the stacked rows; apart=True computes every row of the linear layers from that row alone (kernels.py), so
        a call's result does not depend on the calls beside it. A model without the lean forward runs them in turn.
        """
        if self.lean is None:
            return [self.forward(c.cache, c.tokens, c.parents, c.hidden, append=c.append, last=c.last) for c in calls]
        rows, ids, positions, regions, start = [], [], [], [], 0
        for c in calls:
            tokens, region, b = _open(c.cache, c.tokens, c.parents, c.append)
            mask = attention_mask(region, c.cache.length, self.dtype)[0, 0, b:]  # [n, kv]
            rows.append(LeanRows(c.cache, start, start + len(tokens), mask.to(self.device) if mask.any() else None,
                                 c.last))
            ids.append(tokens)
            positions.append(position_ids(region, c.cache.length)[0, b:])
            regions.append(region)
            start += len(tokens)
        logits, hidden = self.lean.forward(rows, torch.cat(ids).to(self.device), torch.cat(positions).to(self.device),
                                           hidden=any(c.hidden for c in calls), apart=apart)
        out = []
        for c, region, lg, h in zip(calls, regions, logits, hidden, strict=True):
            c.cache.pending = region
            lg = _fit_vocab(lg.float(), self.vocab_size)
            out.append((lg, h) if c.hidden else lg)
        return out

    @torch.inference_mode()
    def forward_batch(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """Logits [n_i, V] for each request's block (cache_i, tokens_i, parents_i), as `forward(cache_i, tokens_i,
        parents_i)` gives them, from ONE forward over the stacked rows when the model can batch (runtime/batched.py:
        linear layers over all rows, attention per request); one forward per block otherwise."""
        if not self.batched or self.lean is not None or len(blocks) == 1:
            return [self.forward(cache, tokens, parents) for cache, tokens, parents in blocks]
        segments, ids, positions, regions, start = [], [], [], [], 0
        for cache, tokens, parents in blocks:
            tokens, region, _ = _open(cache, tokens, parents, append=False)  # the block is the whole region
            mask = attention_mask(region, cache.length, self.dtype).to(self.device)
            segments.append(batched.Segment(cache, start, start + len(tokens), mask))
            ids.append(tokens)
            positions.append(position_ids(region, cache.length))
            regions.append(region)
            start += len(tokens)
        batch = batched.Batch(tuple(segments))
        out = self.model(input_ids=torch.cat(ids)[None].to(self.device),
                         position_ids=torch.cat(positions, dim=1).to(self.device),
                         attention_mask={"full_attention": batch}, past_key_values=batched.BatchWriter(batch),
                         use_cache=True)
        logits = _fit_vocab(out.logits[0].float(), self.vocab_size)
        for s, region in zip(segments, regions, strict=True):
            s.cache.pending = region
        return [logits[s.start:s.stop] for s in segments]


@dataclass(frozen=True)
class Call:
    """The arguments of one `Model.forward` call (its request's cache, block, flags)."""

    cache: KVCache
    tokens: torch.Tensor | list[int]
    parents: torch.Tensor | None = None
    hidden: bool = False
    append: bool = False
    last: bool = False


_routes = threading.local()  # .hook: where this thread's lean forwards go while it proposes (`routed`)


@contextmanager
def routed(hook: Callable[[Model, Call], object]) -> Iterator[None]:
    """Within the block, `forward` calls of lean models made by this thread return hook(model, call): the drafting
    rendezvous (engine/drafting.py) collects a step's draft forwards there to run them together."""
    before = getattr(_routes, "hook", None)
    _routes.hook = hook
    try:
        yield
    finally:
        _routes.hook = before


def _open(cache: KVCache, tokens: torch.Tensor | list[int], parents: torch.Tensor | None,
          append: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens, region, b) of a block about to be forwarded: region = the parents of the whole pending region with
    the block's rows at b.. (b = 0 unless append; parents None: a chain continuing the last pending entry)."""
    if not append:
        cache.trim(cache.length)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    b, n = len(cache.pending), len(tokens)
    if parents is None:
        parents = torch.arange(b - 1, b + n - 1)
    return tokens, torch.cat([cache.pending, torch.as_tensor(parents, dtype=torch.long)]), b


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The logits on the host, the last dimension cut or padded (with -inf, i.e. zero probability) to `vocab_size`.

    Verification, sampling and every drafter's choice run on the host, with each request's CPU generator, over this
    one copy per forward: on a GPU that is one transfer a forward, not a sync for every token read (a no-op on CPU).
    """
    v = logits.shape[-1]
    logits = logits[..., :vocab_size].cpu()
    if v >= vocab_size:
        return logits
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
