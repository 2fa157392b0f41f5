"""Prompts filled without flash attention: a `LlamaModel`'s side context (runtime/llama.py's module docstring).

ggml's CPU flash attention computes one row at a time; without it llama.cpp computes attention as matrix products,
~10-25% faster over a long prompt (docs/bench/cpu-never-slower). A prompt's rows have calls of their own, so they may
take other numerics as long as every prompt takes the same ones. A prompt block (a chain of more rows than a tree's
call holds) is computed in a second context over the same weights, without flash attention, that holds only that
request's cells: cells 0..n-1 at positions 0..n-1, in the shared memory's order. Its new cells are then copied into
the shared memory. A row's bits depend on its tokens, the cells before it and its call's rows: its request's own.

Without flash attention llama.cpp keeps the values transposed (a row per dimension, a column per cell), and its
sequence state refuses a copy between the two layouts, so the copies go through `parse` and `write`, which read a
state's bytes in one layout and write them in the other (both are plain arrays of one element type: F16 values).
"""

from __future__ import annotations

import ctypes
import math
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from speculor.errors import SpeculorError
from speculor.runtime import llama_padded as padded

if TYPE_CHECKING:
    from speculor.runtime.llama import LlamaModel
    from speculor.runtime.llama_cache import LlamaCache

TILED = 8  # the fewest rows for which ggml takes its tiled matmul (tiled.cpp) over the weights it does not repack
CELLS = 8192  # the side context's cells at most (a shared memory's if fewer): a prompt block ending past them is
# filled in the shared memory instead
MAGIC = 0xAF143CD8  # a sequence state's first 4 bytes (llama-context.cpp, io_magic)
ELEMENT = {0: 4, 1: 2, 30: 2}  # bytes of an element of the ggml types values may have without flash attention
META = np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])  # a cell of one sequence's state: position, 1 id


@dataclass
class State:
    """One sequence's cells as llama.cpp's sequence state holds them: positions, and per layer the keys' type,
    row size and rows [n, k_row] and the values' type, element size and array, [n, dims, el] bytes."""

    pos: np.ndarray
    keys: list[tuple[int, int, np.ndarray]]
    values: list[tuple[int, int, np.ndarray]]


def parse(buf: np.ndarray) -> State:
    """A sequence state's bytes (llama_state_seq_get_data: one stream, one id) as a `State`, either layout."""
    at = 0

    def take(dtype, n=1):
        nonlocal at
        if at + np.dtype(dtype).itemsize * n > len(buf):
            raise SpeculorError(f"a llama.cpp sequence state of {len(buf)} bytes ended early")
        a = np.frombuffer(buf, dtype, n, at)
        at += a.nbytes
        return a

    if take("<u4")[0] != MAGIC or take("<u4", 2)[1] != 1:  # the magic, the id it was read from, the streams
        raise SpeculorError("a llama.cpp sequence state of one stream was expected")
    n = int(take("<u4")[0])
    meta = take(META, n)
    if n and (meta["n"] != 1).any():
        raise SpeculorError("a llama.cpp sequence state of one id per cell was expected")
    trans, layers = take("<u4", 2)
    keys = []
    for _ in range(layers):
        kt, row = int(take("<i4")[0]), int(take("<u8")[0])
        keys.append((kt, row, take(np.uint8, n * row).reshape(n, row)))
    values = []
    for _ in range(layers):
        vt = int(take("<i4")[0])
        if trans:
            el, dims = (int(x) for x in take("<u4", 2))
            values.append((vt, el, take(np.uint8, dims * n * el).reshape(dims, n, el).transpose(1, 0, 2)))
        else:
            row, el = int(take("<u8")[0]), ELEMENT.get(vt, 0)
            if not el:
                raise SpeculorError(f"values of ggml type {vt} cannot be transposed (F32, F16 or BF16 only)")
            values.append((vt, el, take(np.uint8, n * row).reshape(n, row // el, el)))
    if at != len(buf):
        raise SpeculorError(f"a llama.cpp sequence state of {len(buf)} bytes was read to {at}: a format this "
                            "speculor does not know")
    return State(meta["pos"].copy(), keys, values)


def write(s: State, seq: int, trans: bool, first: int = 0, last: int | None = None) -> np.ndarray:
    """The bytes of a sequence state holding cells first..last of `s` under id `seq`, values in the layout `trans`."""
    cells = slice(first, last)
    pos = s.pos[cells]
    meta = np.empty(len(pos), META)
    meta["pos"], meta["n"], meta["seq"] = pos, 1, seq
    parts = [_bytes("<u4", MAGIC, seq, 1, len(pos)), meta.tobytes(), _bytes("<u4", int(trans), len(s.keys))]
    for kt, row, k in s.keys:
        parts += [_bytes("<i4", kt), _bytes("<u8", row), k[cells].tobytes()]
    for vt, el, v in s.values:
        v = v[cells]
        head = _bytes("<u4", el, v.shape[1]) if trans else _bytes("<u8", v.shape[1] * el)
        parts += [_bytes("<i4", vt), head, (v.transpose(1, 0, 2) if trans else v).tobytes()]
    return np.frombuffer(b"".join(parts), np.uint8)


def _bytes(dtype: str, *values: int) -> bytes:
    return np.array(values, dtype).tobytes()


def state_of(L, ctx, seq: int) -> np.ndarray:
    n = L.llama_state_seq_get_size(ctx, seq)
    buf = np.empty(n, np.uint8)
    if L.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq) != n:
        raise SpeculorError("llama.cpp could not read a request's cells")
    return buf


def set_state(L, ctx, buf: np.ndarray, seq: int) -> None:
    if L.llama_state_seq_set_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(buf), seq) != len(buf):
        raise SpeculorError("llama.cpp could not write a request's cells")


class Fill:
    """The side context of a `LlamaModel` (module docstring): flash attention off, the shared memory's KV types,
    one sequence (id 0), `cells` cells; it remembers whose first cells it holds, so that a prompt filled chunk by
    chunk is copied in once."""

    def __init__(self, model: LlamaModel, kv_types: tuple[int, int], cells: int, n_batch: int, n_ubatch: int
                 ) -> None:
        L = self.L = model.L
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = cells, n_batch, n_ubatch, 1
        cp.n_threads = cp.n_threads_batch = model.threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = kv_types
        self.ctx = L.llama_init_from_model(model.model, cp)
        if not self.ctx:
            raise SpeculorError(f"llama.cpp could not make the prompt context for {model.path} (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch
        self.embeddings = False
        self.holds: tuple[weakref.ref | None, int] = (None, 0)  # (the cache whose first cells it holds, how many)

    def free(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)

    def fill(self, model: LlamaModel, cache: LlamaCache, rows: list, want: list[bool], out: list, hidden: list,
             embeddings: bool) -> None:
        """The prompt block's rows (token, position, ids) computed here, in calls of n_batch rows from its first,
        their wanted rows' logits (and hidden states) appended to out (hidden), their cells copied under the
        cache's base id into the shared memory, above every occupied cell."""
        L, start, end = self.L, rows[0][1], rows[-1][1] + 1
        (owner, n), self.holds = self.holds, (None, 0)  # (held again once every call succeeded)
        if owner is None or owner() is not cache or n != start or cache.forgot < n:  # its first cells, copied in
            L.llama_memory_clear(self.mem, True)
            if start:
                s = parse(state_of(L, model.ctx, cache.base))
                if not np.array_equal(s.pos, np.arange(start)):
                    raise SpeculorError("a prompt block continues a sequence whose cells are not its positions")
                set_state(L, self.ctx, write(s, 0, trans=True), 0)
        if embeddings != self.embeddings:
            L.llama_set_embeddings(self.ctx, embeddings)
            self.embeddings = embeddings
        b, t0 = self.batch, time.perf_counter()
        for part in parts(len(rows), self.n_batch):
            for k, i in enumerate(part):
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = rows[i][0], rows[i][1], 1, want[i]
                b.seq_id[k][0] = 0
            b.n_tokens = len(part)
            if L.llama_decode(self.ctx, b) != 0:
                raise SpeculorError(f"llama_decode failed on a prompt of {end} tokens")
            for k in (k for k, i in enumerate(part) if want[i]):
                out.append(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, k), shape=(model.n_vocab,)).copy())
                if embeddings:
                    hidden.append(np.ctypeslib.as_array(L.llama_get_embeddings_ith(self.ctx, k),
                                                        shape=(model.hidden_size,)).copy())
        model.kernel_s += time.perf_counter() - t0
        self.holds, cache.forgot = (weakref.ref(cache), end), math.inf
        copy_in(model, parse(state_of(L, self.ctx, 0)), cache.base, start, end)


def parts(n: int, size: int) -> list[range]:
    """A prompt block's n rows as calls of `size` rows (a multiple of 4), the last one of TILED rows or more where n
    allows (its start moved back by 4s): a row's bits depend on its call only through the 4-row blocks the repacked
    kernels take from the call's first row and whether the call has TILED rows (docs/algorithms.md §10.5.2), so
    every split of this kind, the server's 32-row chunks included, gives a prompt the same cells."""
    cuts = list(range(0, n, size))
    if len(cuts) > 1 and n - cuts[-1] < TILED:
        cuts[-1] -= math.ceil((TILED - (n - cuts[-1])) / padded.PAD) * padded.PAD
    return [range(a, b) for a, b in zip(cuts, cuts[1:] + [n], strict=True)]


def lendable(same: int, kept: int, wanted: int, chunk: int) -> int:
    """How many of the `same` first tokens a prompt of `wanted` shares with a kept prompt of `kept`, both filled in
    calls on the grid of `chunk`, it may take the cells of (runtime/llama.py's prompt memory): the whole chunks, and
    where both computed the next chunk whole, a multiple of 4 rows of it; never so many that the rest of `wanted` is
    not a call of TILED rows or more (the calls that would have computed it: its last row's logits included)."""
    g = same // chunk * chunk
    if min(kept, wanted) >= g + chunk:
        g += min(same - g, chunk - TILED) // padded.PAD * padded.PAD
    return max(min(g, (wanted - TILED) // padded.PAD * padded.PAD), 0)


def copy_in(model: LlamaModel, s: State, base: int, first: int, last: int) -> None:
    """Cells first..last of `s` into the shared memory under the id `base`, above every occupied cell (through
    a spare id: llama.cpp first empties the id it writes to, and the base's earlier cells stay)."""
    L, temp = model.L, model.seq_id()
    set_state(L, model.ctx, write(s, temp, trans=False, first=first, last=last), temp)
    L.llama_memory_seq_cp(model.mem, temp, base, -1, -1)
    L.llama_memory_seq_rm(model.mem, temp, -1, -1)
    model.free_ids.append(temp)
    model.used += last - first
