"""The llama.cpp backend (runtime/backend.py's `Backend`) over llama-cpp-python's low-level API: a GGUF model on its
own quantized kernels, every request's rows in llama_decode calls on ONE shared context, each row with the bits of a
one-row call (docs/algorithms.md §10.5). Its modules, by role:

- model.py: `LlamaModel`, the context and `forward` (which calls a row may take, and why).
- cells.py: `Cells`, the one owner and only writer of the shared memory's cell state (sequence ids, the graveyard,
  the used cells, compaction, cells copied in), over the `Memory` interface; memory.py: llama.cpp's.
- cache.py: `LlamaCache`, one request's sequence ids and pending rows, changing cells only through `Cells`.
- calls.py: a forward's rows packed into llama_decode calls (`pack`, pure) and a prompt's calls (`parts`).
- fill.py: `PromptContext`, the side context that fills prompts without flash attention.
- prompts.py: `Prompts`, the prompt memory: kept prompts' cells on the host, lent to a later prompt.
- state.py: llama.cpp's sequence-state bytes, for the llama-cpp-python versions whose format it knows.
- bits.py: whether a row's bits depend on its call (calls="exact"'s load check).

The names the rest of speculor and its scripts use are exported here."""

from speculor.runtime.llama.cache import LlamaCache
from speculor.runtime.llama.calls import QUAD, TILED, pack, parts
from speculor.runtime.llama.cells import GRAVEYARD, MAX_SEQ, SLACK, Cells, due
from speculor.runtime.llama.model import (
    CALLS,
    EXACT_ROWS,
    KV_TYPES,
    N_BATCH,
    N_CTX,
    N_UBATCH,
    LlamaModel,
    _lib,
    available,
    quiet_llama,
)
from speculor.runtime.llama.prompts import MAX_PROMPTS, PROMPT_CELLS, Prompts, lendable
from speculor.runtime.llama.state import KNOWN, MAGIC, State, parse, write

__all__ = ["CALLS", "EXACT_ROWS", "GRAVEYARD", "KNOWN", "KV_TYPES", "MAGIC", "MAX_PROMPTS", "MAX_SEQ", "N_BATCH",
           "N_CTX", "N_UBATCH", "PROMPT_CELLS", "QUAD", "SLACK", "TILED", "Cells", "LlamaCache",
           "LlamaModel", "Prompts", "State", "_lib", "available", "due", "lendable", "pack", "parse", "parts",
           "quiet_llama", "write"]
