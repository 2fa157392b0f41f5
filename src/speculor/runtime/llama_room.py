"""When and how a `LlamaModel`'s shared memory is compacted (runtime/llama.py's module docstring).

The cells a request forgets stay occupied (by the graveyard) until a compaction, and ggml's flash attention visits
every occupied cell for every row of every call, a masked one skipped one at a time: a forgotten cell costs every
later call a little (docs/bench/cpu-room). So the memory is compacted at a step's boundary when the rows would not
fit above its occupied cells, and also as soon as the forgotten cells outnumber both the kept ones (live requests'
and the prompt memory's) and SLACK: a compaction copies each kept cell once, and at least as many forgotten cells
have been shed since the last one, so its copies are paid by cells every call no longer visits."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from speculor.errors import SpeculorError

if TYPE_CHECKING:
    from speculor.runtime.llama import LlamaModel

SLACK = 1024  # forgotten cells a memory may hold before they alone make a compaction due
PROMPT_CELLS = 4096  # cells the prompt memory keeps at most (every call visits them too), the oldest prompt first out


def due(used: int, kept: int, need: int, room: int) -> str | None:
    """Why the memory is to be compacted before `need` more rows: 'full' when they would not fit in `room` cells
    above the `used` ones, 'stale' when the forgotten cells (used - kept) outnumber the kept and SLACK; else None."""
    if used == kept:
        return None
    if used + need > room:
        return "full"
    return "stale" if used - kept > max(kept, SLACK) else None


def compact(model: LlamaModel, prompts: bool) -> None:
    """Read every live request's cells out (llama.cpp's sequence state: their bits), and the prompt memory's if
    `prompts` (else it is forgotten), clear the memory and write them back from cell 0 up in the order they held."""
    L, ctx = model.L, model.ctx
    if not prompts:
        model.drop(list(model.prompts.values()))
        model.prompts.clear()
    ids = [c.base for c in model.caches] + list(model.prompts.values())
    states = []
    for s in ids:
        n = L.llama_state_seq_get_size(ctx, s)
        buf = (ctypes.c_uint8 * n)()
        states.append((s, buf, L.llama_state_seq_get_data(ctx, buf, n, s)))
    L.llama_memory_clear(model.mem, False)
    for s, buf, n in states:
        if L.llama_state_seq_set_data(ctx, buf, n, s) != n:
            raise SpeculorError("llama.cpp could not write a request's cells back while compacting its memory")
    model.used = model.kept_cells()
