"""`LlamaModel`: the llama.cpp backend (runtime/backend.py) over llama-cpp-python's low-level API: a GGUF model on
its own quantized kernels, every request's rows in llama_decode calls on ONE shared context.

A request's cache is a set of sequence ids in the context's unified KV memory. The committed entries carry the
request's base id; a draft tree's mask is llama.cpp's own sequence mask: every root-to-leaf path is one sequence
id, a row carries the ids of the paths through it, positions are committed length + depth. A row sees exactly the
cells of its first id at positions <= its own: its ancestors and the committed prefix. A new path branching off at
a row p that is already in the memory gets its id by `seq_cp(id(p), new, 0, pos(p) + 1)` (the cells of p's path),
one branching off inside the block by carrying the id on its in-block ancestors. `keep(path)` compacts to the
accepted path: the path's cells take the base id (`seq_cp`), every other id of the request is removed.

Same bits as plain decoding, in two parts:
- the rows: ggml's CPU kernels give a row different bits in calls of different sizes (the repacked Q4_K kernels
  multiply 4 rows at a time, 1 to 3 rows by a vector kernel; attention differs unless flash attention is on, and
  when keys and values have one type, F16 (F32 is cast to F16 first), ggml's flash attention splits a one-row
  call over 512 cells or more across threads and tiles a call of 64 rows or more, a call of 2 rows neither). A row
  computed in a call of at most EXACT_ROWS rows, flash attention on over Q8_0 keys and F16 values (two types:
  every call takes the row-by-row path), gets the bits of a one-row call at any context length
  (tests/test_llama.py, with the negative control), so tree and chain blocks (decoding, verification, drafting)
  run in calls of at most EXACT_ROWS rows, packed with other requests' blocks; a prompt (a chain of more rows)
  gets calls of its own, the same whatever shares the batch, in a second context without flash attention that
  holds its request's cells alone (runtime/llama_fill.py: ~10-25% faster), its cells then copied into the memory.
  calls="padded" takes the other class: every call padded to a multiple of 4 rows, its output rows too (llama_padded),
  and ggml's tiled matmul off (it takes 8 rows or more of the unpacked K-quant weights), every row is computed by
  the 4-row kernels, in calls of any size up to N_UBATCH (one ubatch: the output rows of each are padded), packed
  with anything, prompts included (checked at load; tests/test_llama.py with negative controls).
  A lone step then costs t(4) (1.8 t(1)), but rows 2-4 are free and a call of 16 rows costs 4.6 t(1):
  the class for load and for long drafts (docs/bench/cpu-padded). Its bits are not the one-row class's.
- the order: attention sums over a request's cells in cell order. Freed cells would be refilled by later rows
  (llama.cpp places a row in the lowest free cell), putting a new token before an older one; so the cells a
  request forgets (rejected rows, finished requests) keep the graveyard id GRAVE, no cell is ever freed below a
  live one, and llama.cpp places every row above every occupied cell. When the rows of a forward would not fit
  above them, or the forgotten cells outnumber the kept ones (runtime/llama_room.py: every call visits them), the
  memory is compacted at the step's boundary: each request's cells are read out (llama.cpp's sequence state:
  their bits, copied), the memory cleared, and written back from cell 0 up in the order they held, the graveyard
  dropped. Only a draft model's tree grown by depth can meet a full memory inside a step:
  the graveyard is then freed at once, and that draft's order (its proposals, never the target's rows) is no
  longer guaranteed.

Prompt memory: the cells of a prompt filled in chunks are read out of the memory (their bytes, llama.cpp's sequence
state) when it is filled and kept on the host (the MAX_PROMPTS latest, oldest forgotten first); a later prompt that
starts with the same tokens has them copied in above every occupied cell instead of computing them, as many as give
the bits it would compute (`fill.lendable`): its whole chunks, and within the next one a multiple of 4 rows that leaves
it a call of at least fill.TILED rows (a prompt row's bits depend on its call through the 4-row blocks of the repacked
kernels and whether the call takes ggml's tiled matmul, which needs fill.TILED rows; docs/algorithms.md §10.5.2),
never its last fill.TILED rows (their call scores its last row) but to the same prompt, which takes every cell and
the root's logits kept with them. Kept out of the shared memory, they cost no call a visit.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from speculor.errors import SpeculorError
from speculor.runtime import llama_fill as fill
from speculor.runtime import llama_padded as padded
from speculor.runtime import llama_room as room
from speculor.runtime.backend import Block, Rows, fit_vocab
from speculor.runtime.call_times import CallTimes
from speculor.runtime.gguf_rows import GGUFRows
from speculor.runtime.llama_cache import LlamaCache

EXACT_ROWS = 3  # the most rows a call may hold for each row to get the bits of a one-row call (module docstring)
N_BATCH = 512  # rows a llama_decode call takes at most (a longer prompt: several calls)
N_UBATCH = 256  # rows llama.cpp computes at once (its compute buffer holds their logits: 150 MB at 256)
CALLS = {"exact": (EXACT_ROWS, N_BATCH), "padded": (N_UBATCH, N_UBATCH), "batched": (N_BATCH, N_BATCH)}
# (most rows of a call of packed blocks, rows of a prompt's own calls). exact: the module docstring's bits; padded:
# every row in the 4-row kernels' blocks, one ubatch a call (the other class of bits, module docstring); batched:
# llama.cpp's own sizes: a row's bits then depend on its call, so an answer can depend on what shares its batch and
# speculation on plain decoding's low bits
KV_TYPES = ("Q8_0", "F16")  # keys in Q8_0, values in F16: two types, so ggml's flash attention never splits a row
# nor tiles a call (module docstring); Q8_0 values were as exact, and slower (docs/bench/cpu-never-slower)
N_CTX = 16384  # cells of the shared memory: every live request's context (each request's limit too)
MAX_SEQ = 64  # sequence ids of the shared context: a request's base id and one per extra path of its trees
GRAVE = MAX_SEQ - 1  # holds the cells a request forgets, so that no later row fills a hole (module docstring)
PADDING = MAX_SEQ - 2  # the pad rows' id (positions 0..2, alone); their cells go to the graveyard at once
MAX_PROMPTS = 16  # prompts kept in the prompt memory (module docstring), in PROMPT_CELLS cells at most, oldest out
PROMPT_CELLS = 4096  # (host memory: 22 KB a cell for the 1.5B target, 0.6 MB a prompt's root logits)
RESERVE = N_BATCH  # cells kept free above a compaction, for the rest of a step (a draft's rounds)

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
        if calls == "padded":  # read once per process by ggml, at its first matmul (module docstring)
            os.environ["GGML_CPU_TILED_MM"] = "0"
        L = _lib()
        self.L, self.path, self.threads, self.calls = L, Path(path), threads, calls
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SpeculorError(f"llama.cpp could not read {path} (corrupt, or a GGUF this llama.cpp does not "
                                f"support: llama-cpp-python {L.__version__})")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, N_BATCH, N_UBATCH, MAX_SEQ
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # one memory for every sequence: a cell may belong to several (tree paths)
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # a row's attention then does not depend on its call
        cp.type_k, cp.type_v = self.kv = tuple(getattr(L, f"GGML_TYPE_{t}") for t in KV_TYPES)  # unequal: no split
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise SpeculorError(f"llama.cpp could not make a context for {path} (n_ctx={n_ctx}: out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.eos_ids = frozenset(t for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0)
        self.vocab_size = vocab_size or self.n_vocab
        self.context_length = n_ctx
        self.size = L.llama_n_ctx(self.ctx)  # cells of the memory
        self.cells = self.size - RESERVE  # what live requests' contexts may hold together (a server admits by it)
        self.used = 0  # cells occupied, from cell 0 up without a hole: live requests' and the graveyard's
        self.caches: weakref.WeakSet[LlamaCache] = weakref.WeakSet()  # the live ones
        self.prompts: dict[tuple[int, ...], tuple[fill.State, Rows | None]] = {}  # (chunk, *tokens) -> cells, root
        self.hidden_size = L.llama_model_n_embd(self.model)
        self.embeddings = False  # llama.cpp's embeddings output (`_embeddings`)
        self.kernel_s = 0.0  # seconds spent inside llama_decode so far (the rest of a step is host time)
        self.call_times = CallTimes(EXACT_ROWS) if calls == "exact" else None  # a tree's calls (runtime/cost.py)
        self.device, self.weights = torch.device("cpu"), "gguf"  # what the cost profile's key reads
        self.cheap_rows, self.min_chunk, self.fill_rows = False, fill.TILED, N_BATCH  # t(n) grows with n; `fill.parts`
        self.root_in_prompt = True  # the prompt's last row keeps its bits in any calls on the grid (`fill.lendable`)
        self.free_ids = list(range(PADDING - 1, -1, -1))
        self.live = 0  # caches not yet released: the graveyard is emptied when none is left
        self.dead: list[tuple[int, list[int]]] = []  # (base, extra ids) of caches collected since
        self.batch = L.llama_batch_init(N_BATCH, 0, MAX_SEQ)
        self.sides: list[fill.Fill] = []  # the prompts' context (runtime/llama_fill.py), made at the first prompt
        weakref.finalize(self, _free, L, self.model, self.ctx, self.batch, self.sides)
        if calls == "padded":
            padded.check(self)

    @property
    def shared(self) -> LlamaModel:
        return self

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """e(ids): rows of the GGUF's token embedding, dequantised (the input llama.cpp's first layer reads)."""
        return GGUFRows(self.path, ["token_embd.weight"])

    def new_cache(self) -> LlamaCache:
        self.release()
        return LlamaCache(self)

    def release(self) -> None:
        """The ids of collected caches back to the pool, their cells to the graveyard (emptied when no cache is
        left). Run here, by the thread that decodes, never by the garbage collector's: llama.cpp's memory is not
        to be touched during a decode, which other threads may run into while ctypes has the GIL released."""
        while self.dead:
            base, extra = self.dead.pop()
            self.drop([base, *extra])
            self.live -= 1
            if self.live == 0:
                self.bury_none()

    @property
    def cost_key(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.L.llama_model_desc(self.model, buf, 256)
        kv = "/".join(KV_TYPES).lower()
        rows = f"padded{padded.PAD}" if self.calls == "padded" else f"{self.calls}{CALLS[self.calls][0]}"
        return f"llama.cpp {self.L.__version__} {buf.value.decode()} x{self.threads} {rows} kv {kv}"

    def vocabulary(self) -> list[bytes]:
        """Every token's text (to check that a draft shares the target's vocabulary)."""
        vocab = self.L.llama_model_get_vocab(self.model)
        return [self.L.llama_vocab_get_text(vocab, i) for i in range(self.n_vocab)]

    def seq_id(self) -> int:
        if not self.free_ids:
            self.release()
        if not self.free_ids:
            raise SpeculorError(f"the llama.cpp context has no free sequence id ({MAX_SEQ}): too many requests "
                                "or too wide trees at once")
        return self.free_ids.pop()

    def forget(self, s: int, p0: int) -> None:
        """Remove id s from the cells at positions >= p0; they stay occupied, by the graveyard."""
        self.L.llama_memory_seq_cp(self.mem, s, GRAVE, p0, -1)
        self.L.llama_memory_seq_rm(self.mem, s, p0, -1)

    def drop(self, ids: list[int]) -> None:
        """Forget every cell of these ids (to the graveyard) and give the ids back to the pool."""
        for s in ids:
            self.forget(s, -1)
        self.free_ids.extend(ids)

    def bury_none(self) -> bool:
        """Free the graveyard's cells; whether it held any."""
        had = self.L.llama_memory_seq_pos_max(self.mem, GRAVE) >= 0
        self.L.llama_memory_seq_rm(self.mem, GRAVE, -1, -1)
        self.used = self.live_cells()
        return had

    def remember(self, cache: LlamaCache, tokens: list[int], chunk: int, ready: Rows | None = None) -> None:
        """Keep the cells of a prompt just filled in chunks of `chunk` from position 0 (`tokens`, all in the cache):
        their bytes, read out of the shared memory (module docstring), and its last call's result (`ready`)."""
        key = (chunk, *tokens)
        if key in self.prompts or not 0 < len(tokens) <= PROMPT_CELLS or cache.length != len(tokens) or cache.parents:
            return
        while self.prompts and (len(self.prompts) >= MAX_PROMPTS
                                or self.prompt_cells() + len(tokens) > PROMPT_CELLS):
            del self.prompts[next(iter(self.prompts))]
        self.prompts[key] = fill.parse(fill.state_of(self.L, self.ctx, cache.base)), ready

    def reuse(self, cache: LlamaCache, tokens: list[int], chunk: int) -> tuple[int, Rows | None]:
        """Into an empty cache, the kept cells of the longest start of `tokens` that a prompt filled in the same
        chunks may lend it (`fill.lendable`; the same prompt: all, with its last call's result); how many positions it
        now holds, and that result where it holds them all."""
        best, src = 0, None
        for key in self.prompts:
            if key[0] != chunk:
                continue
            kept = key[1:]
            same = next((i for i, (a, b) in enumerate(zip(kept, tokens, strict=False)) if a != b),
                        min(len(kept), len(tokens)))
            whole = same == len(kept) == len(tokens) and self.prompts[key][1] is not None  # the same prompt
            if (lent := len(kept) if whole else fill.lendable(same, len(kept), len(tokens), chunk)) > best:
                best, src = lent, key
        if src is None:
            return 0, None
        assert cache.length == 0 and not cache.parents, "a prompt is lent to an empty cache"
        self.prompts[src] = (state, ready) = self.prompts.pop(src)  # the latest used, forgotten last
        fill.copy_in(self, state, cache.base, 0, best)
        cache.length = best
        return best, Rows(ready.logits.clone()) if ready is not None and best == len(tokens) else None

    def live_cells(self) -> int:
        return sum(c.length + len(c.parents) for c in self.caches)

    def prompt_cells(self) -> int:
        return sum(len(key) - 1 for key in self.prompts)  # a key is (chunk, *tokens)

    def make_room(self, blocks: Sequence[Block]) -> None:
        """Compact the memory (runtime/llama_room.py) when it is due and no request has rows pending (a step's
        boundary)."""
        if room.due(self.used, self.live_cells(), sum(len(b.tokens) for b in blocks), self.size - RESERVE) is None:
            return
        for b in blocks:
            if not b.append:
                b.cache.trim(b.cache.length)
        if not any(c.parents for c in self.caches):
            room.compact(self)

    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]:
        """Per block its `Rows`: logits [n, V] (fp32, host), or [1, V] with `last`; with `hidden` the hidden states
        of the same rows. Tree blocks' rows packed in order into calls of EXACT_ROWS rows (a block across two where it
        fills one), a prompt in calls of its own (module docstring): `apart` holds always. calls="padded": calls of up
        to N_UBATCH rows, each padded (`pad`); "batched": of up to N_BATCH rows, as llama.cpp batches."""
        self.release()
        self.make_room(blocks)
        calls: list[list[tuple[int, list, list[bool]]]] = [[]]
        side: list[tuple[int, list, list[bool]]] = []
        limit, chunk = CALLS[self.calls]
        for i, b in enumerate(blocks):
            rows = b.cache.rows(b)
            want = [not b.last or j == len(rows) - 1 for j in range(len(rows))]
            if b.parents is None and len(rows) > limit:  # a prompt (chunk): calls of its own
                if self._fills(b, rows):  # in the prompts' context (runtime/llama_fill.py)
                    side.append((i, rows, want))
                    continue
                calls += [[(i, rows[r.start:r.stop], want[r.start:r.stop])] for r in fill.parts(len(rows), chunk)]
                calls.append([])
                continue
            j = 0
            while j < len(rows):  # a tree: ancestors first, each call filled to `limit` rows (a row's bits are its own)
                room = limit - sum(len(r) for _, r, _ in calls[-1])
                if room == 0:
                    calls.append([])
                    continue
                calls[-1].append((i, rows[j:j + room], want[j:j + room]))
                j += room
        out: list[list[np.ndarray]] = [[] for _ in blocks]
        hidden: list[list[np.ndarray]] = [[] for _ in blocks]
        for i, rows, want in side:
            self.sides[0].fill(self, blocks[i].cache, rows, want, out[i], hidden[i], blocks[i].hidden)
        for call in calls:
            if call:  # llama.cpp outputs every row of a call with embeddings on: only where a row's are wanted
                self._embeddings(any(blocks[i].hidden and any(want) for i, _, want in call))
                self._decode(call, out, hidden)
        logits = [fit_vocab(torch.from_numpy(rows_of(x)), self.vocab_size) for x in out]
        return [Rows(lg, torch.from_numpy(rows_of(h)) if b.hidden else None)
                for b, lg, h in zip(blocks, logits, hidden, strict=True)]

    def _fills(self, b: Block, rows: list) -> bool:
        """Whether a prompt block is filled in the prompts' context: in the exact class, a chain on the base id
        ending within its cells (made here the first time)."""
        cells = min(fill.CELLS, self.size) if self.calls == "exact" else 0
        if rows[-1][1] >= cells or any(ids != [b.cache.base] for _, _, ids in rows):
            return False
        if not self.sides:
            self.sides.append(fill.Fill(self, self.kv, cells, N_BATCH, N_BATCH))  # a call in one ubatch, as llama.cpp
        return True

    def _embeddings(self, on: bool) -> None:
        """llama.cpp's embeddings output on or off: with pooling none, the last hidden state after the final norm
        of every row whose logits are wanted (the target's features; the logits are the same bits either way,
        tests/test_llama.py). While on, llama.cpp computes the logits of every row of a call (a prompt's 512 rows
        through the output matrix), so it is on only for the calls that hold a wanted row of a block that asks."""
        if on != self.embeddings:
            self.L.llama_set_embeddings(self.ctx, on)
            self.embeddings = on

    def _decode(self, call: list[tuple[int, list, list[bool]]], out: list[list[np.ndarray]],
                hidden: list[list[np.ndarray]]) -> None:
        """One llama_decode over the call's rows; the wanted rows' logits appended to out[block] (and their hidden
        states to hidden[block] while the embeddings output is on)."""
        L, b, k = self.L, self.batch, 0
        n = sum(len(rows) for _, rows, _ in call)
        flips, pads = padded.pad(n, sum(sum(w) for _, _, w in call)) if self.calls == "padded" else (0, 0)
        for _, rows, want in call:
            for (tok, pos, ids), w in zip(rows, want, strict=True):
                if not w and flips:  # an output computed and not read: the call's outputs a multiple of 4
                    w, flips = True, flips - 1
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, len(ids), w
                for m, s in enumerate(ids):
                    b.seq_id[k][m] = s
                k += 1
        for p in range(pads):  # rows of their own (positions 0.., id PADDING), with outputs
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = 0, p, 1, True
            b.seq_id[k][0] = PADDING
            k += 1
        b.n_tokens = k
        t0 = time.perf_counter()
        rc = L.llama_decode(self.ctx, b)
        if rc == 1 and self.bury_none():  # full: the graveyard's cells freed (the order is then not guaranteed)
            rc = L.llama_decode(self.ctx, b)
        self.kernel_s += (dt := time.perf_counter() - t0)
        if self.call_times is not None and rc == 0:
            self.call_times.add(k, dt)
        self.used += k if rc == 0 else 0
        if rc != 0:
            raise SpeculorError(f"llama_decode failed (code {rc}: "
                                f"{'no room in the KV memory' if rc == 1 else 'error'}; context {self.context_length})")
        if pads:
            self.forget(PADDING, -1)  # to the graveyard: no hole below a live cell
        k = 0
        for i, _, want in call:
            for w in want:
                if w:
                    out[i].append(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, k), shape=(self.n_vocab,))
                                  .copy())
                    if self.embeddings:
                        hidden[i].append(np.ctypeslib.as_array(L.llama_get_embeddings_ith(self.ctx, k),
                                                               shape=(self.hidden_size,)).copy())
                k += 1


def rows_of(rows: list[np.ndarray]) -> np.ndarray:
    """The rows as one [n, V] array: a view of a lone row (a decoding step's), a stack of several."""
    return rows[0][None] if len(rows) == 1 else np.stack(rows)


def quiet_llama(path: str | Path, *, threads: int, n_ctx: int, seed: int = 0, **options):
    """llama-cpp-python's high-level `Llama` over a GGUF file, as a user starts it (its own defaults, and `options`
    such as a draft_model), quiet."""
    L = _lib()
    return L.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, seed=seed,
                   verbose=False, **options)


def _free(L, model, ctx, batch, sides) -> None:
    for side in sides:
        side.free()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


