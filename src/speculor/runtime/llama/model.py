"""`LlamaModel`: the llama.cpp backend (runtime/backend.py) over llama-cpp-python's low-level API: a GGUF model on
its own quantized kernels, every request's rows in llama_decode calls on ONE shared context. This module holds the
context and `forward`; a request's cache is a set of sequence ids in the context's unified KV memory
(runtime/llama/cache.py), whose cells have one owner (runtime/llama/cells.py).

Same bits as plain decoding, in two parts:
- the rows: ggml's CPU kernels as released give a row different bits in calls of different sizes (the repacked Q4_K
  kernels multiply 4 rows at a time by a gemm and the rest of a call by a vector kernel that sums in another order;
  ggml's tiled matmul takes 8 rows or more of the K-quant weights it does not repack; attention differs unless flash
  attention is on, and when keys and values have one type, F16 (F32 is cast to F16 first), ggml's flash attention
  splits a one-row call over 512 cells or more across threads and tiles a call of 64 rows or more). calls="exact":
  llama.cpp built with patches/llama.cpp (the vector kernel sums in the gemm's order; the tiled matmul from TILED
  rows on), flash attention on over Q8_0 keys and F16 values (two types: every call takes the row-by-row path): a row
  gets the bits of a one-row call in any call of fewer than TILED rows (runtime/llama/bits.py, checked at load: where
  it fails, as on ggml as released, calls="vector"). So tree and chain blocks (decoding, verification, drafting) of
  every request are packed into calls of up to TILED - 1 rows (runtime/llama/calls.py). calls="vector" gets the
  same bits on ggml as released from calls of at most EXACT_ROWS rows (the vector kernels). Either way a prompt (a
  chain of more rows) gets calls of its own, the same whatever shares the batch, in a second context without flash
  attention that holds its request's cells alone (runtime/llama/fill.py), its cells then copied into the memory.
- the order: attention sums over a request's cells in cell order, which the cells owner keeps
  (runtime/llama/cells.py: the graveyard, compaction).

The prompt memory (runtime/llama/prompts.py) lends a later prompt the cells of a kept one that give it the bits it
would compute. docs/algorithms.md §10.5.1-10.5.3 state the argument and its measurements.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from speculor.errors import SpeculorError
from speculor.runtime.backend import Block, Rows, Traits, fit_vocab
from speculor.runtime.call_times import CallTimes
from speculor.runtime.gguf_rows import GGUFRows
from speculor.runtime.llama import bits, fill
from speculor.runtime.llama.cache import LlamaCache
from speculor.runtime.llama.calls import TILED, BlockRows, Piece, pack
from speculor.runtime.llama.cells import MAX_SEQ, Cells
from speculor.runtime.llama.memory import LlamaMemory
from speculor.runtime.llama.prompts import Prompts

EXACT_ROWS = 3  # calls="vector": the most rows a call may hold for each row to get the bits of a one-row call on
# ggml's kernels as released (module docstring)
N_BATCH = 512  # rows a llama_decode call takes at most (a longer prompt: several calls)
N_UBATCH = 256  # rows llama.cpp computes at once (its compute buffer holds their logits: N_UBATCH x vocabulary)
CALLS = {"exact": (TILED - 1, N_BATCH), "vector": (EXACT_ROWS, N_BATCH), "batched": (N_BATCH, N_BATCH)}
# (most rows of a call of packed blocks, rows of a prompt's own calls). exact: every row the bits of a one-row call
# in any call under TILED rows (patches/llama.cpp, checked at load; else "vector"); vector: the same bits from
# calls of at most 3 rows, on ggml as released; batched: llama.cpp's own sizes on ggml as released: a row's bits
# then depend on its call, so an answer can depend on what shares its batch and speculation on plain decoding's low
# bits
KV_TYPES = ("Q8_0", "F16")  # keys in Q8_0, values in F16: two types, so ggml's flash attention never splits a row
# nor tiles a call (module docstring); Q8_0 values were as exact, and slower (docs/bench/cpu-never-slower)
N_CTX = 16384  # cells of the shared memory: every live request's context (each request's limit too)
RESERVE = N_BATCH  # cells kept free above a compaction, for the rest of a step (a draft's rounds)


logger = logging.getLogger("speculor")


def _silence(level, text, user_data):  # llama.cpp's log: printed by default, every load and every context
    return None


try:
    import llama_cpp as _llama_cpp

    _quiet = _llama_cpp.llama_log_callback(_silence)
except ImportError:
    _llama_cpp = _quiet = None

_init_lock = threading.Lock()
_initialized = False


def _lib():
    """llama_cpp, its backend initialized and its logging silenced once."""
    global _initialized
    if _llama_cpp is None:
        raise SpeculorError("the llama.cpp backend needs llama-cpp-python: pip install llama-cpp-python "
                            "(it compiles llama.cpp, ~10 minutes), or use --backend torch")
    with _init_lock:
        if not _initialized:
            _llama_cpp.llama_backend_init()
            _llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
            _initialized = True
    return _llama_cpp


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    return _llama_cpp is not None


class LlamaModel:
    """A GGUF model on llama.cpp, shared by every request: the `Backend` of runtime/backend.py."""

    def __init__(self, path: str | Path, *, threads: int, vocab_size: int | None = None, n_ctx: int = N_CTX,
                 calls: str = "exact") -> None:
        if calls not in CALLS:
            raise SpeculorError(f"calls must be one of {', '.join(CALLS)}, got {calls!r}")
        if calls == "exact":  # read once per process by ggml, at its first matmul (module docstring)
            os.environ["GGML_CPU_TILED_MM_MIN_ROWS"] = str(TILED)
        lib = _lib()
        self.lib, self.path, self.threads, self.calls = lib, Path(path), threads, calls
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise SpeculorError(f"llama.cpp could not read {path} (corrupt, or a GGUF this llama.cpp does not "
                                f"support: llama-cpp-python {lib.__version__})")
        self.ctx = self._context(n_ctx)
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.eos_ids = frozenset(t for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if t >= 0)
        self.vocab_size = vocab_size or self.n_vocab
        self.context_length = n_ctx
        self.size = lib.llama_n_ctx(self.ctx)  # cells of the memory
        self.memory = LlamaMemory(lib, self.ctx)
        self.cell_state = Cells(self.memory, self.size, RESERVE)  # the one owner of the memory's cells
        self.prompts = Prompts(self.cell_state.read)  # the prompt memory (runtime/llama/prompts.py)
        self.hidden_size = lib.llama_model_n_embd(self.model)
        self.embeddings = False  # llama.cpp's embeddings output (`_embeddings`)
        self.kernel_s = 0.0  # seconds spent inside llama_decode so far (the rest of a step is host time)
        self.call_times = None  # a tree's calls by rows, where they are few (runtime/cost.py): below
        self.device, self.weights = torch.device("cpu"), "gguf"  # what the cost profile's key reads
        # t(n) grows with n; a prompt's last call has TILED rows at least (`parts`); its last row keeps its bits in
        # any calls on the grid (`lendable`); live requests' contexts hold the memory's cells but RESERVE together
        self.traits = Traits(cells=self.size - RESERVE, cheap_rows=False, min_chunk=TILED, fill_rows=N_BATCH,
                             root_in_prompt=True)
        self.batch = lib.llama_batch_init(N_BATCH, 0, MAX_SEQ)
        self.prompt_contexts: list[fill.PromptContext] = []  # the prompts' context, made at the first prompt
        weakref.finalize(self, _free, lib, self.model, self.ctx, self.batch, self.prompt_contexts)
        if calls == "exact" and (sizes := bits.check(self)):
            logger.warning("speculor: llama.cpp's rows differ in calls of %s rows from one-row calls on %s (ggml "
                           "without patches/llama.cpp, or its tiled matmul already on in this process): calls of "
                           "at most %d rows instead, slower for long drafts", sizes, self.path.name, EXACT_ROWS)
            self.calls = "vector"
        if self.calls in ("exact", "vector"):
            self.call_times = CallTimes(CALLS[self.calls][0])  # its calls of 1..limit rows (runtime/cost.py)

    def _context(self, n_ctx: int):
        """The shared context: one unified memory, flash attention on, KV_TYPES (module docstring)."""
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, N_BATCH, N_UBATCH, MAX_SEQ
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = True  # one memory for every sequence: a cell may belong to several (tree paths)
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # a row's attention then does not depend on its call
        cp.type_k, cp.type_v = self.kv = tuple(getattr(lib, f"GGML_TYPE_{t}") for t in KV_TYPES)  # unequal: no split
        ctx = lib.llama_init_from_model(self.model, cp)
        if not ctx:
            lib.llama_model_free(self.model)
            raise SpeculorError(f"llama.cpp could not make a context for {self.path} (n_ctx={n_ctx}: out of memory?)")
        return ctx

    @property
    def shared(self) -> LlamaModel:
        return self

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """e(ids): rows of the GGUF's token embedding, dequantised (the input llama.cpp's first layer reads)."""
        return GGUFRows(self.path, ["token_embd.weight"])

    def new_cache(self) -> LlamaCache:
        self.cell_state.release()
        return LlamaCache(self.cell_state)

    def remember(self, cache: LlamaCache, tokens: list[int], chunk: int, ready: Rows | None = None) -> None:
        """The prompt memory keeps a prompt just filled in chunks (runtime/llama/prompts.py)."""
        self.prompts.remember(cache, tokens, chunk, ready)

    def reuse(self, cache: LlamaCache, tokens: list[int], chunk: int) -> tuple[int, Rows | None]:
        """The prompt memory lends an empty cache what it may of `tokens` (runtime/llama/prompts.py)."""
        return self.prompts.reuse(cache, tokens, chunk)

    @property
    def cost_key(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, buf, 256)
        kv = "/".join(KV_TYPES).lower()
        rows = f"{self.calls}{CALLS[self.calls][0]}"
        return f"llama.cpp {self.lib.__version__} {buf.value.decode()} x{self.threads} {rows} kv {kv}"

    def vocabulary(self) -> list[bytes]:
        """Every token's text (to check that a draft shares the target's vocabulary)."""
        vocab = self.lib.llama_model_get_vocab(self.model)
        return [self.lib.llama_vocab_get_text(vocab, i) for i in range(self.n_vocab)]

    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]:
        """Per block its `Rows`: logits [n, V] (fp32, host), or [1, V] with `last`; with `hidden` the hidden states
        of the same rows. Tree blocks' rows packed in order into calls of CALLS[calls][0] rows at most (a block across
        two where it fills one), a prompt in calls of its own (module docstring; runtime/llama/calls.py): `apart`
        (rows computed apart from the others of their call) holds always."""
        self.cell_state.prepare(blocks)
        limit, chunk = CALLS[self.calls]
        planned = []
        for i, b in enumerate(blocks):
            rows = b.cache.rows(b)
            want = [not b.last or j == len(rows) - 1 for j in range(len(rows))]
            planned.append(BlockRows(i, rows, want, b.parents is None and len(rows) > limit))
        aside = {p.index for p in planned if p.prompt and self._fills(blocks[p.index], p.rows)}
        out: list[list[np.ndarray]] = [[] for _ in blocks]
        hidden: list[list[np.ndarray]] = [[] for _ in blocks]
        for i in sorted(aside):  # in the prompts' context (runtime/llama/fill.py)
            self.kernel_s += self.prompt_contexts[0].fill(self.cell_state, blocks[i].cache, planned[i].rows,
                                                          planned[i].want, out[i], hidden[i], blocks[i].hidden)
        for call in pack([p for p in planned if p.index not in aside], limit, chunk):
            # llama.cpp outputs every row of a call with embeddings on: only where a row's are wanted
            self._embeddings(any(blocks[i].hidden and any(want) for i, _, want in call))
            self.decode(call, out, hidden)
        logits = [fit_vocab(torch.from_numpy(rows_of(x)), self.vocab_size) for x in out]
        return [Rows(lg, torch.from_numpy(rows_of(h)) if b.hidden else None)
                for b, lg, h in zip(blocks, logits, hidden, strict=True)]

    def _fills(self, b: Block, rows: list) -> bool:
        """Whether a prompt block is filled in the prompts' context: in the exact and vector classes, a chain on the
        base id ending within its cells (made here the first time)."""
        cells = min(fill.CELLS, self.size) if self.calls in ("exact", "vector") else 0
        if rows[-1][1] >= cells or any(ids != [b.cache.base] for _, _, ids in rows):
            return False
        if not self.prompt_contexts:  # a call in one ubatch, as llama.cpp
            self.prompt_contexts.append(fill.PromptContext(self, self.kv, cells, N_BATCH, N_BATCH))
        return True

    def _embeddings(self, on: bool) -> None:
        """llama.cpp's embeddings output on or off: with pooling none, the last hidden state after the final norm
        of every row whose logits are wanted (the target's features; the logits are the same bits either way,
        tests/test_llama.py). While on, llama.cpp computes the logits of every row of a call (a prompt's 512 rows
        through the output matrix), so it is on only for the calls that hold a wanted row of a block that asks."""
        if on != self.embeddings:
            self.lib.llama_set_embeddings(self.ctx, on)
            self.embeddings = on

    def decode(self, call: list[Piece], out: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None:
        """One llama_decode over the call's rows (`calls.pack`); the wanted rows' logits appended to out[block] (and
        their hidden states to hidden[block] while the embeddings output is on)."""
        n = self._batch(call)
        t0 = time.perf_counter()
        rc = self.cell_state.call(n, lambda: self.lib.llama_decode(self.ctx, self.batch))
        self.kernel_s += (dt := time.perf_counter() - t0)
        if self.call_times is not None and rc == 0:
            self.call_times.add(n, dt)
        if rc != 0:
            raise SpeculorError(f"llama_decode failed (code {rc}: "
                                f"{'no room in the KV memory' if rc == 1 else 'error'}; context {self.context_length})")
        k = 0
        for i, _, want in call:
            for w in want:
                if w:
                    out[i].append(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, k),
                                                        shape=(self.n_vocab,)).copy())
                    if self.embeddings:
                        hidden[i].append(np.ctypeslib.as_array(self.lib.llama_get_embeddings_ith(self.ctx, k),
                                                               shape=(self.hidden_size,)).copy())
                k += 1

    def _batch(self, call: list[Piece]) -> int:
        """The call's rows written into the batch; their number."""
        b, k = self.batch, 0
        for _, rows, want in call:
            for (tok, pos, ids), w in zip(rows, want, strict=True):
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, len(ids), w
                for m, s in enumerate(ids):
                    b.seq_id[k][m] = s
                k += 1
        b.n_tokens = k
        return k

    def reset(self) -> None:
        """The memory cleared and the time counted so far forgotten (calls="exact"'s check at load)."""
        self.cell_state.clear()
        self.kernel_s = 0.0


def rows_of(rows: list[np.ndarray]) -> np.ndarray:
    """The rows as one [n, V] array: a view of a lone row (a decoding step's), a stack of several."""
    return rows[0][None] if len(rows) == 1 else np.stack(rows)


def quiet_llama(path: str | Path, *, threads: int, n_ctx: int, seed: int = 0, **options):
    """llama-cpp-python's high-level `Llama` over a GGUF file, as a user starts it (its own defaults, and `options`
    such as a draft_model), quiet."""
    lib = _lib()
    return lib.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, seed=seed,
                     verbose=False, **options)


def _free(lib, model, ctx, batch, prompt_contexts) -> None:
    for context in prompt_contexts:
        context.free()
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
