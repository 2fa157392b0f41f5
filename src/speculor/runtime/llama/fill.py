"""`PromptContext`: prompts filled without flash attention, in a side context of a `LlamaModel`.

ggml's CPU flash attention computes one row at a time; without it llama.cpp computes attention as matrix products,
faster over a long prompt (docs/algorithms.md §10.5.2, docs/bench/cpu-never-slower). A prompt's rows have calls of
their own, so they may take other numerics as long as every prompt takes the same ones. A prompt block (a chain of
more rows than a tree's call holds) is computed in a second context over the same weights, without flash attention,
that holds only that request's cells: cells 0..n-1 at positions 0..n-1, in the shared memory's order. Its new cells
are then copied into the shared memory (`Cells.copy_in`). A row's bits depend on its tokens, the cells before it and
its call's rows: its request's own.

Without flash attention llama.cpp keeps the values transposed, and its sequence state refuses a copy between the
two layouts, so the copies go through runtime/llama/state.py's `parse` and `write`. The context remembers whose first
cells it holds, so that a prompt filled chunk by chunk is copied in once: they are copied again when it held
another request's, or the request forgot some of them since (`Cells.forgotten_from`)."""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from speculor.errors import SpeculorError
from speculor.runtime.llama import calls, state

if TYPE_CHECKING:
    from speculor.runtime.llama.cache import LlamaCache
    from speculor.runtime.llama.cells import Cells

CELLS = 8192  # the side context's cells at most (a shared memory's if fewer): a prompt block ending past them is
# filled in the shared memory instead


class Weights(Protocol):
    """What the side context takes of its model: llama_cpp (`lib`), the loaded weights and their sizes."""

    lib: Any
    model: Any  # the llama_model
    path: Path
    threads: int
    n_vocab: int
    hidden_size: int


class PromptContext:
    """The side context of a `LlamaModel` (module docstring): flash attention off, the shared memory's KV types,
    one sequence (id 0), `cells` cells."""

    def __init__(self, weights: Weights, kv_types: tuple[int, int], cells: int, n_batch: int, n_ubatch: int
                 ) -> None:
        lib = self.lib = weights.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = cells, n_batch, n_ubatch, 1
        cp.n_threads = cp.n_threads_batch = weights.threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = kv_types
        self.ctx = lib.llama_init_from_model(weights.model, cp)
        if not self.ctx:
            raise SpeculorError(f"llama.cpp could not make the prompt context for {weights.path} (out of memory?)")
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.n_batch, self.n_vocab, self.hidden_size = n_batch, weights.n_vocab, weights.hidden_size
        self.embeddings = False
        self.holds: tuple[weakref.ref | None, int] = (None, 0)  # (the cache whose first cells it holds, how many)

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def fill(self, cells: Cells, cache: LlamaCache, rows: list, want: list[bool], out: list, hidden: list,
             embeddings: bool) -> float:
        """The prompt block's rows (token, position, ids) computed here, in calls of n_batch rows from its first,
        their wanted rows' logits (and hidden states) appended to out (hidden), their cells copied under the
        cache's base id into the shared memory, above every occupied cell; the seconds its calls took."""
        lib, start, end = self.lib, rows[0][1], rows[-1][1] + 1
        (owner, n), self.holds = self.holds, (None, 0)  # (held again once every call succeeded)
        if owner is None or owner() is not cache or n != start or cells.forgotten_from(cache.base) < n:
            self._take(cells, cache.base, start)
        if embeddings != self.embeddings:
            lib.llama_set_embeddings(self.ctx, embeddings)
            self.embeddings = embeddings
        t0 = time.perf_counter()
        for part in calls.parts(len(rows), self.n_batch):
            self._decode([rows[i] for i in part], [want[i] for i in part], out, hidden, embeddings, end)
        seconds = time.perf_counter() - t0
        self.holds = (weakref.ref(cache), end)
        cells.mark_copied(cache.base)
        kept = state.parse(state.get_seq(lib, self.ctx, 0))
        cells.copy_in(cache.base, end - start, lambda seq: state.write(kept, seq, trans=False, first=start, last=end))
        return seconds

    def _take(self, cells: Cells, base: int, start: int) -> None:
        """This context cleared, then holding the first `start` cells of id base in the shared memory."""
        self.lib.llama_memory_clear(self.mem, True)
        if start:
            s = state.parse(cells.read(base))
            if not np.array_equal(s.pos, np.arange(start)):
                raise SpeculorError("a prompt block continues a sequence whose cells are not its positions")
            state.set_seq(self.lib, self.ctx, state.write(s, 0, trans=True), 0)

    def _decode(self, rows: list, want: list[bool], out: list, hidden: list, embeddings: bool, end: int) -> None:
        """One call of these rows under id 0; the wanted rows' logits (and hidden states) appended."""
        lib, b = self.lib, self.batch
        for k, (row, w) in enumerate(zip(rows, want, strict=True)):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = row[0], row[1], 1, w
            b.seq_id[k][0] = 0
        b.n_tokens = len(rows)
        if lib.llama_decode(self.ctx, b) != 0:
            raise SpeculorError(f"llama_decode failed on a prompt of {end} tokens")
        for k in (k for k, w in enumerate(want) if w):
            out.append(np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, k), shape=(self.n_vocab,)).copy())
            if embeddings:
                hidden.append(np.ctypeslib.as_array(lib.llama_get_embeddings_ith(self.ctx, k),
                                                    shape=(self.hidden_size,)).copy())
