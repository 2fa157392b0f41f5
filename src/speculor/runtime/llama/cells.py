"""`Cells`: the one owner and only writer of a shared llama.cpp memory's cell state: the pool of sequence ids, the
graveyard id, the count of used cells, the live caches and those collected since, and compaction. Every other part
of the backend changes the memory's cells through it; it talks to llama.cpp through `Memory` (runtime/llama/memory.py
is llama.cpp's; tests/test_llama_cells.py gives it a recording stand-in).

The contract: attention sums over a request's cells in cell order, and llama.cpp places a row in the lowest free cell.
A freed cell below a live one would be refilled by a later row, putting a new token before an older one and changing
its request's bits (docs/algorithms.md §10.5.2, "Own cells, in order"). So:
- the cells a request forgets (rejected rows, a finished request's) are not freed: they take the graveyard id
  GRAVEYARD. No cell is freed below a live one, and llama.cpp places every row above every occupied cell.
- the graveyard is emptied when no cache is left, and by a compaction: each live request's cells are read out
  (llama.cpp's sequence state: their bits, copied), the memory cleared, and written back from cell 0 up in the order
  they held, the graveyard dropped.
- a compaction runs at a step's boundary (no request has rows pending), when the rows of a forward would not fit
  above the occupied cells, and also as soon as the forgotten cells outnumber both the kept ones and SLACK: ggml's
  flash attention visits every occupied cell for every row of every call (a masked one skipped one at a time), so a
  forgotten cell costs every later call a little (docs/bench/cpu-room); a compaction copies each kept cell once, and
  at least as many forgotten cells have been shed since the last one, so its copies are paid by cells every call no
  longer visits.
- only a draft model's tree grown by depth can meet a full memory inside a step (its rows pending, no compaction):
  the graveyard is then freed at once (`call`), and that draft's order (its proposals, never the target's rows) is
  no longer guaranteed.
- `used` counts the occupied cells, from cell 0 up without a hole: live requests' and the graveyard's.

Ids are llama.cpp's sequence ids: a request's base id holds its committed cells, one more id per extra path of its
pending tree (runtime/llama/cache.py)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from speculor.errors import SpeculorError

if TYPE_CHECKING:
    from speculor.runtime.backend import Block

MAX_SEQ = 64  # sequence ids of the shared context: a request's base id and one per extra path of its trees
GRAVEYARD = MAX_SEQ - 1  # holds the cells requests forget, so that no later row fills a hole (module docstring)
SLACK = 1024  # forgotten cells a memory may hold before they alone make a compaction due (module docstring)


class Memory(Protocol):
    """The llama.cpp calls on a context's memory that `Cells` makes (positions p0 <= pos < p1; -1: open end)."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give id dst to the cells of id src at positions p0..p1."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Take id seq off its cells at positions p0..p1 (a cell no id holds is free)."""

    def seq_pos_max(self, seq: int) -> int:
        """The highest position of the cells of id seq, -1 where it holds none."""
        ...

    def clear(self) -> None:
        """Free every cell."""

    def state_get(self, seq: int) -> np.ndarray:
        """The cells of id seq as bytes (llama.cpp's sequence state)."""
        ...

    def state_set(self, buf: np.ndarray, seq: int) -> None:
        """Cells read back from `state_get`'s bytes under id seq (its earlier cells removed first)."""


class Holder(Protocol):
    """A live request's cache as `Cells` reads it: its base id, committed length and pending rows."""

    base: int
    length: int
    parents: list[int]

    def trim(self, n: int) -> None: ...


def due(used: int, kept: int, need: int, capacity: int) -> str | None:
    """Why the memory is to be compacted before `need` more rows: 'full' when they would not fit in `capacity` cells
    above the `used` ones, 'stale' when the forgotten cells (used - kept) outnumber the kept and SLACK; else None."""
    if used == kept:
        return None
    if used + need > capacity:
        return "full"
    return "stale" if used - kept > max(kept, SLACK) else None


class Cells:
    """The cell state of one shared memory of `size` cells, `reserve` of them kept free above a compaction for the
    rest of a step (module docstring)."""

    def __init__(self, memory: Memory, size: int, reserve: int) -> None:
        self.memory = memory
        self.size, self.capacity = size, size - reserve
        self.free_ids = list(range(GRAVEYARD - 1, -1, -1))  # handed out from the end: 0 first
        self.used = 0  # cells occupied, from cell 0 up without a hole
        self.caches: weakref.WeakSet[Holder] = weakref.WeakSet()  # the live ones
        self.live = 0  # caches not yet released: the graveyard is emptied when none is left
        self.collected: list[int] = []  # base ids of the caches collected since (appended by the garbage collector)
        self.branch_ids: dict[int, list[int]] = {}  # base id -> the ids of its request's other paths
        self.forgotten: dict[int, float] = {}  # base id -> the lowest position forgotten since `mark_copied`

    # ids

    def take_id(self) -> int:
        """A sequence id no one holds (the collected caches' released first where none is free)."""
        if not self.free_ids:
            self.release()
        if not self.free_ids:
            raise SpeculorError(f"the llama.cpp context has no free sequence id ({MAX_SEQ}): too many requests "
                                "or too wide trees at once")
        return self.free_ids.pop()

    def open(self, cache: Holder) -> int:
        """A new live cache: its base id."""
        base = self.take_id()
        self.live += 1
        self.caches.add(cache)
        self.branch_ids[base], self.forgotten[base] = [], math.inf
        weakref.finalize(cache, self.collected.append, base)
        return base

    def release(self) -> None:
        """The ids of collected caches back to the pool, their cells to the graveyard (emptied when no cache is
        left). Run by the thread that decodes, never by the garbage collector's: llama.cpp's memory is not to be
        touched during a decode, which other threads may run into while ctypes has the GIL released."""
        while self.collected:
            base = self.collected.pop()
            self.drop([base, *self.branch_ids.pop(base)])
            del self.forgotten[base]
            self.live -= 1
            if self.live == 0:
                self.free_graveyard()

    # a request's cells

    def branch(self, base: int, src: int, upto: int) -> int:
        """A new id for another path of base's tree, given to the cells of id src at positions 0..upto."""
        seq = self.take_id()
        self.branch_ids[base].append(seq)
        self.memory.seq_cp(src, seq, 0, upto)
        return seq

    def commit(self, base: int, path: int, start: int, end: int) -> None:
        """The cells of id `path` at positions start..end become base's committed cells (base's own from start on
        forgotten first, unless they are the path)."""
        if path != base:
            self.forget(base, start)
            self.memory.seq_cp(path, base, start, end)

    def trim(self, base: int, n: int) -> None:
        """Forget base's cells from position n on and every other path of its request (their ids back to the pool)."""
        self.forgotten[base] = min(self.forgotten[base], n)
        self.forget(base, n)
        self.drop(self.branch_ids[base])
        self.branch_ids[base].clear()

    def forget(self, seq: int, p0: int) -> None:
        """Take id seq off its cells at positions >= p0; they stay occupied, by the graveyard."""
        self.memory.seq_cp(seq, GRAVEYARD, p0, -1)
        self.memory.seq_rm(seq, p0, -1)

    def drop(self, ids: list[int]) -> None:
        """Forget every cell of these ids (to the graveyard) and give the ids back to the pool."""
        for seq in ids:
            self.forget(seq, -1)
        self.free_ids.extend(ids)

    def forgotten_from(self, base: int) -> float:
        """The lowest position base forgot since `mark_copied` (inf: none): the prompts' context holds a request's
        first cells only while they were not forgotten (runtime/llama/fill.py)."""
        return self.forgotten[base]

    def mark_copied(self, base: int) -> None:
        self.forgotten[base] = math.inf

    def read(self, seq: int) -> np.ndarray:
        """The cells of id seq as llama.cpp's sequence state (bytes)."""
        return self.memory.state_get(seq)

    def copy_in(self, base: int, n: int, state_under: Callable[[int], np.ndarray]) -> None:
        """n cells into the memory under id base, above every occupied cell: `state_under(seq)` gives their bytes
        under id seq. Through a spare id: llama.cpp first empties the id it writes to, and base's earlier cells
        stay."""
        temp = self.take_id()
        self.memory.state_set(state_under(temp), temp)
        self.memory.seq_cp(temp, base, -1, -1)
        self.memory.seq_rm(temp, -1, -1)
        self.free_ids.append(temp)
        self.used += n

    # calls

    def call(self, rows: int, decode: Callable[[], int]) -> int:
        """One llama_decode call of `rows` rows (`decode`, its return code): counted where it placed them; where the
        memory was full, run again once the graveyard's cells are freed (module docstring: only a draft's tree
        grown by depth meets a full memory)."""
        rc = decode()
        if rc == 1 and self.free_graveyard():
            rc = decode()
        if rc == 0:
            self.used += rows
        return rc

    def clear(self) -> None:
        """Every cell freed (only while no cache lives: the load check of calls="exact")."""
        assert not self.caches, "the memory is cleared only while no cache lives"
        self.memory.clear()
        self.used = 0

    # the graveyard and compaction

    def free_graveyard(self) -> bool:
        """Free the graveyard's cells; whether it held any."""
        had = self.memory.seq_pos_max(GRAVEYARD) >= 0
        self.memory.seq_rm(GRAVEYARD, -1, -1)
        self.used = self.live_cells()
        return had

    def live_cells(self) -> int:
        return sum(c.length + len(c.parents) for c in self.caches)

    def prepare(self, blocks: Sequence[Block]) -> None:
        """Before a forward of these blocks: the collected caches released, the memory compacted where due."""
        self.release()
        self.compact_if_due(blocks)

    def compact_if_due(self, blocks: Sequence[Block]) -> None:
        """Compact the memory where it is due (`due`) before these blocks and no request has rows pending (a step's
        boundary): the blocks that do not append drop their pending rows first."""
        if due(self.used, self.live_cells(), sum(len(b.tokens) for b in blocks), self.capacity) is None:
            return
        for b in blocks:
            if not b.append:
                b.cache.trim(b.cache.length)
        if not any(c.parents for c in self.caches):
            self.compact()

    def compact(self) -> None:
        """Read every live request's cells out (llama.cpp's sequence state: their bits), clear the memory and write
        them back from cell 0 up in the order they held, the graveyard dropped."""
        states = [(c.base, self.memory.state_get(c.base)) for c in self.caches]
        self.memory.clear()
        for seq, buf in states:
            self.memory.state_set(buf, seq)
        self.used = self.live_cells()
