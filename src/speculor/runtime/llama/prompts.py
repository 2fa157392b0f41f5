"""`Prompts`: a `LlamaModel`'s prompt memory (runtime/backend.py `PromptMemory`).

The cells of a prompt filled in chunks are read out of the shared memory when it is filled (their bytes, llama.cpp's
sequence state, runtime/llama/state.py) and kept on the host, the MAX_PROMPTS latest in PROMPT_CELLS cells at most,
the oldest forgotten first. A later prompt that starts with the same tokens has them copied in above every occupied
cell instead of computing them, as many as give the bits it would compute (`lendable`): its whole chunks, and within
the next one a multiple of 4 rows that leaves it a call of at least TILED rows (a prompt row's bits depend on its
call through the 4-row blocks of the repacked kernels and whether the call takes ggml's tiled matmul, which needs
TILED rows; docs/algorithms.md §10.5.2), never its last TILED rows (their call scores its last row) but to the same
prompt, which takes every cell and the root's logits kept with them. Kept out of the shared memory, they cost no
call a visit. (What a kept cell costs the host: docs/algorithms.md §10.5.2.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from speculor.runtime.backend import Rows
from speculor.runtime.llama import calls, state

if TYPE_CHECKING:
    from speculor.runtime.llama.cache import LlamaCache

MAX_PROMPTS = 16  # prompts kept (module docstring), in PROMPT_CELLS cells at most, the oldest out first
PROMPT_CELLS = 4096


def lendable(same: int, kept: int, wanted: int, chunk: int) -> int:
    """How many of the `same` first tokens a prompt of `wanted` shares with a kept prompt of `kept`, both filled in
    calls on the grid of `chunk`, it may take the cells of (module docstring): the whole chunks, and where both
    computed the next chunk whole, a multiple of 4 rows of it; never so many that the rest of `wanted` is not a call
    of TILED rows or more (the calls that would have computed it: its last row's logits included)."""
    g = same // chunk * chunk
    if min(kept, wanted) >= g + chunk:
        g += min(same - g, chunk - calls.TILED) // calls.QUAD * calls.QUAD
    return max(min(g, (wanted - calls.TILED) // calls.QUAD * calls.QUAD), 0)


class Prompts:
    """The kept prompts, oldest first: (chunk, *tokens) -> (their cells, the last call's result); `read(seq)` gives
    the shared memory's cells of an id as bytes."""

    def __init__(self, read: Callable[[int], np.ndarray]) -> None:
        self.read = read
        self.kept: dict[tuple[int, ...], tuple[state.State, Rows | None]] = {}

    def __len__(self) -> int:
        return len(self.kept)

    def clear(self) -> None:
        self.kept.clear()

    def cells(self) -> int:
        return sum(len(key) - 1 for key in self.kept)  # a key is (chunk, *tokens)

    def remember(self, cache: LlamaCache, tokens: list[int], chunk: int, ready: Rows | None = None) -> None:
        """Keep the cells of a prompt just filled in chunks of `chunk` from position 0 (`tokens`, all in the cache):
        their bytes, read out of the shared memory, and its last call's result (`ready`)."""
        key = (chunk, *tokens)
        if key in self.kept or not 0 < len(tokens) <= PROMPT_CELLS or cache.length != len(tokens) or cache.parents:
            return
        while self.kept and (len(self.kept) >= MAX_PROMPTS or self.cells() + len(tokens) > PROMPT_CELLS):
            del self.kept[next(iter(self.kept))]
        self.kept[key] = state.parse(self.read(cache.base)), ready

    def reuse(self, cache: LlamaCache, tokens: list[int], chunk: int) -> tuple[int, Rows | None]:
        """Into an empty cache, the kept cells of the longest start of `tokens` that a prompt filled in the same
        chunks may lend it (`lendable`; the same prompt: all, with its last call's result); how many positions it
        now holds, and that result where it holds them all."""
        lent, src = self._best(tokens, chunk)
        if src is None:
            return 0, None
        self.kept[src] = (kept, ready) = self.kept.pop(src)  # the latest used, forgotten last
        cache.lend(lent, lambda seq: state.write(kept, seq, trans=False, first=0, last=lent))
        return lent, Rows(ready.logits.clone()) if ready is not None and lent == len(tokens) else None

    def _best(self, tokens: list[int], chunk: int) -> tuple[int, tuple[int, ...] | None]:
        """(cells lent, the key of the kept prompt that lends them) of the kept prompt that lends `tokens` most."""
        best, src = 0, None
        for key in self.kept:
            if key[0] != chunk:
                continue
            kept = key[1:]
            same = next((i for i, (a, b) in enumerate(zip(kept, tokens, strict=False)) if a != b),
                        min(len(kept), len(tokens)))
            whole = same == len(kept) == len(tokens) and self.kept[key][1] is not None  # the same prompt
            if (lent := len(kept) if whole else lendable(same, len(kept), len(tokens), chunk)) > best:
                best, src = lent, key
        return best, src
