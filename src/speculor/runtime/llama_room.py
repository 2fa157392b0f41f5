"""When and how a `LlamaModel`'s shared memory is compacted (runtime/llama.py's module docstring).

The cells a request forgets stay occupied (by the graveyard) until a compaction, and ggml's flash attention visits
every occupied cell for every row of every call, a masked one skipped one at a time: a forgotten cell costs every
later call a little (docs/bench/cpu-room). So the memory is compacted at a step's boundary when the rows would not
fit above its occupied cells, and also as soon as the forgotten cells outnumber both the kept ones (live requests')
and SLACK: a compaction copies each kept cell once, and at least as many forgotten cells have been shed since the
last one, so its copies are paid by cells every call no longer visits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculor.runtime import llama_fill as fill

if TYPE_CHECKING:
    from speculor.runtime.llama import LlamaModel

SLACK = 1024  # forgotten cells a memory may hold before they alone make a compaction due


def due(used: int, kept: int, need: int, room: int) -> str | None:
    """Why the memory is to be compacted before `need` more rows: 'full' when they would not fit in `room` cells
    above the `used` ones, 'stale' when the forgotten cells (used - kept) outnumber the kept and SLACK; else None."""
    if used == kept:
        return None
    if used + need > room:
        return "full"
    return "stale" if used - kept > max(kept, SLACK) else None


def compact(model: LlamaModel) -> None:
    """Read every live request's cells out (llama.cpp's sequence state: their bits), clear the memory and write them
    back from cell 0 up in the order they held."""
    states = [(c.base, fill.state_of(model.L, model.ctx, c.base)) for c in model.caches]
    model.L.llama_memory_clear(model.mem, False)
    for s, buf in states:
        fill.set_state(model.L, model.ctx, buf, s)
    model.used = model.live_cells()
