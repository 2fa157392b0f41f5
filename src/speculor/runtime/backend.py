"""The seam between the engine and whatever runs a model's forward passes: a `Backend`.

Everything above `runtime/` (drafters, engine, serving, bench) talks to a model through this protocol only:

    backend.forward(blocks)  -> per block: logits [n, V] (fp32, on the host), or (logits, hidden [n, H])
    backend.new_cache()      -> a request's cache (`keep(rows)` commits pending rows, `trim(n)` forgets from n on)
    backend.context_length, backend.vocab_size, backend.eos_ids (its end tokens)
    backend.cost_key (what its measured cost curve depends on)

A `Block` is one request's new rows against that request's cache: tokens with parents inside the block (-1 =
attends only to the cache), a chain for a prompt, [root] + nodes for a draft tree. One call may carry many
requests' blocks; how they are run (one stacked forward, or one after the other) is the backend's own choice, and
a block's result never depends on the blocks beside it at temperature > 0 (`apart`). A single request is a batch
of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from speculor.runtime.cache import KVCache


@dataclass(frozen=True)
class Block:
    """One request's rows in a forward. The rows become pending entries b..b+n-1 of the cache's pending region,
    b = 0 (the region emptied first) unless `append` (b = entries already pending); parents[i] is the region index
    of row i's parent (< b + i, -1 = none), None = a chain (continuing the last pending entry with `append`).
    hidden: also the last hidden states [n, H]; last: only the last row's logits ([1, V])."""

    cache: KVCache
    tokens: torch.Tensor | list[int]
    parents: torch.Tensor | None = None
    hidden: bool = False
    append: bool = False
    last: bool = False


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a stacked forward belong to `cache`; `mask` is their additive tree mask against that
    cache (None: every row sees every entry); last: only the last row's logits are wanted."""

    cache: KVCache
    start: int
    stop: int
    mask: torch.Tensor | None
    last: bool = False


class Backend(Protocol):
    """Runs forward passes of one model over blocks of rows against per-request caches (module docstring)."""

    context_length: int
    vocab_size: int
    eos_ids: frozenset[int]  # the model's own end-of-sequence tokens

    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list: ...

    def new_cache(self) -> KVCache: ...

    @property
    def cost_key(self) -> str: ...


@runtime_checkable
class PromptMemory(Protocol):
    """A backend that keeps the cells of the prompts it filled chunk by chunk and lends them to a later prompt that
    starts with the same chunks (llama.cpp's shared memory): the same calls over the same tokens, so the same bits."""

    def remember(self, cache: KVCache, tokens: list[int], chunk: int) -> None: ...

    def reuse(self, cache: KVCache, tokens: list[int], chunk: int) -> int: ...


def forward1(backend: Backend, cache: KVCache, tokens: torch.Tensor | list[int], parents: torch.Tensor | None = None,
             **flags: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The result of one block: `backend.forward([Block(cache, tokens, parents, **flags)])[0]`."""
    return backend.forward([Block(cache, tokens, parents, **flags)])[0]


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
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
