"""The llama.cpp backend's cell bookkeeping and call packing without a model (runtime/llama/cells.py, cache.py,
prompts.py, calls.py): `Cells` and `LlamaCache` over `Recorder`, a stand-in for llama.cpp's memory calls that places
and frees cells as llama.cpp does, and `pack` and `parts` on rows. Every property is a check function; the
negative controls plant one fault each (monkeypatch) and show that the same checks catch it. The rows' bits on the
real GGUF are tests/test_llama.py's."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from speculor.runtime.backend import Block, Rows
from speculor.runtime.llama import calls, cells, state
from speculor.runtime.llama.cache import LlamaCache
from speculor.runtime.llama.calls import QUAD, BlockRows, pack, parts
from speculor.runtime.llama.cells import GRAVEYARD, SLACK, Cells, due
from speculor.runtime.llama.prompts import Prompts

LIMIT, CHUNK = 3, 16  # a tree's calls (EXACT_ROWS) and a prompt's, small enough for short prompts to take several
SMALL_TILED = 8  # the tiled matmul's threshold here (ggml's as released): prompts of a few chunks in a 64-cell memory


@pytest.fixture(autouse=True)
def small_tiled(monkeypatch):
    """The rules are the same for any threshold of at most half a prompt chunk (calls.TILED is 32 under
    calls="exact"); this file's small memory and chunks take ggml's own 8."""
    monkeypatch.setattr(calls, "TILED", SMALL_TILED)


@dataclass
class Cell:
    pos: int
    token: int
    ids: set[int] = field(default_factory=set)


def in_range(pos: int, p0: int, p1: int) -> bool:
    return (p0 < 0 or pos >= p0) and (p1 < 0 or pos < p1)


class Recorder:
    """llama.cpp's memory as the backend uses it: a row goes to the lowest free cell, a cell no id holds is free,
    seq_cp gives an id to the cells of another in a position range, seq_rm takes it off; a sequence's state is real
    llama.cpp bytes (runtime/llama/state.py) whose keys carry the cells' tokens. Every call is recorded, and every
    row placed below an occupied cell."""

    def __init__(self, size: int) -> None:
        self.cells: list[Cell | None] = [None] * size
        self.log: list[tuple] = []
        self.below: list[int] = []  # rows placed below an occupied cell (their cell)

    def occupied(self) -> list[int]:
        return [i for i, c in enumerate(self.cells) if c is not None]

    def held(self, seq: int) -> list[Cell]:
        return [c for c in self.cells if c is not None and seq in c.ids]

    def place(self, pos: int, token: int, ids: set[int]) -> None:
        free = self.cells.index(None)
        if any(c is not None for c in self.cells[free:]):
            self.below.append(free)
        self.cells[free] = Cell(pos, token, ids)

    def decode(self, rows: list[tuple[int, int, list[int]]]) -> int:
        self.log.append(("decode", len(rows)))
        if sum(c is None for c in self.cells) < len(rows):
            return 1  # llama.cpp: no room in the memory
        for token, pos, ids in rows:
            self.place(pos, token, set(ids))
        return 0

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.log.append(("seq_cp", src, dst, p0, p1))
        for c in self.held(src):
            if in_range(c.pos, p0, p1):
                c.ids.add(dst)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.log.append(("seq_rm", seq, p0, p1))
        for i, c in enumerate(self.cells):
            if c is not None and seq in c.ids and in_range(c.pos, p0, p1):
                c.ids.discard(seq)
                if not c.ids:
                    self.cells[i] = None

    def seq_pos_max(self, seq: int) -> int:
        return max((c.pos for c in self.held(seq)), default=-1)

    def clear(self) -> None:
        self.log.append(("clear",))
        self.cells = [None] * len(self.cells)

    def state_get(self, seq: int) -> np.ndarray:
        cells = self.held(seq)
        tokens = np.array([c.token for c in cells], "<i4").view(np.uint8).reshape(len(cells), 4)
        values = np.zeros((len(cells), 1, 2), np.uint8)  # one F16 dimension
        return state.write(state.State(np.array([c.pos for c in cells], "<i4"), [(0, 4, tokens)], [(1, 2, values)]),
                           seq, trans=False)

    def state_set(self, buf: np.ndarray, seq: int) -> None:
        self.log.append(("state_set", seq))
        s = state.parse(buf)
        self.seq_rm(seq, -1, -1)
        for pos, token in zip(s.pos.tolist(), s.keys[0][2].copy().view("<i4").reshape(-1).tolist(), strict=True):
            self.place(pos, token, {seq})


class Request:
    """A cache and the tokens it should hold: committed, then pending (in region order)."""

    def __init__(self, owner: Cells) -> None:
        self.cache = LlamaCache(owner)
        self.committed: list[int] = []
        self.pending: list[int] = []

    def keep(self, rows: list[int]) -> None:
        self.cache.keep(rows)
        self.committed += [self.pending[r] for r in rows]
        self.pending = []


def forward(owner: Cells, mem: Recorder, work: list[tuple[Request, list[int], list[int] | None]]) -> list:
    """`LlamaModel.forward`'s bookkeeping on the stand-in: the blocks' rows packed into calls, each call decoded
    (no prompts' context: every prompt in the shared memory); the calls."""
    blocks = [Block(r.cache, tokens, None if parents is None else torch.tensor(parents)) for r, tokens, parents in work]
    owner.prepare(blocks)
    planned = []
    for i, (b, (req, tokens, _)) in enumerate(zip(blocks, work, strict=True)):
        rows = b.cache.rows(b)
        req.pending = tokens
        planned.append(BlockRows(i, rows, [True] * len(rows), b.parents is None and len(rows) > LIMIT))
    packed = pack(planned, LIMIT, CHUNK)
    for call in packed:
        rows = [row for _, piece, _ in call for row in piece]
        assert owner.call(len(rows), lambda rows=rows: mem.decode(rows)) == 0
    return packed


# the checks


def check_ids(owner: Cells, requests: list[Request]) -> None:
    """No id is held twice or held and free at once; the graveyard's and the pad rows' are never handed out."""
    held = [s for r in requests for s in [r.cache.base, *owner.branch_ids[r.cache.base]]]
    assert len(held) == len(set(held)), f"an id handed out twice: {sorted(held)}"
    assert len(owner.free_ids) == len(set(owner.free_ids)), "an id free twice"
    assert not set(held) & set(owner.free_ids), "an id held and free at once"
    assert not {GRAVEYARD} & (set(held) | set(owner.free_ids)), "a reserved id handed out"


def check_ids_back(owner: Cells, before: list[int]) -> None:
    assert sorted(owner.free_ids) == sorted(before), "an id did not come back"


def check_cells(owner: Cells, mem: Recorder) -> None:
    """No hole below an occupied cell, every row placed above every occupied one, `used` = the occupied cells."""
    occupied = mem.occupied()
    assert occupied == list(range(len(occupied))), f"a hole below an occupied cell: {occupied}"
    assert not mem.below, f"rows placed below an occupied cell: {mem.below}"
    assert owner.used == len(occupied), f"used {owner.used} but {len(occupied)} cells occupied"


def check_graveyard(owner: Cells, mem: Recorder, requests: list[Request]) -> None:
    """Every occupied cell is a live request's or the graveyard's, and every forgotten one the graveyard's."""
    live = {s for r in requests for s in [r.cache.base, *owner.branch_ids[r.cache.base]]}
    for c in (mem.cells[i] for i in mem.occupied()):
        assert c.ids & live or c.ids == {GRAVEYARD}, f"a cell held by {c.ids}: neither a live id nor the graveyard"


def check_order(mem: Recorder, requests: list[Request]) -> None:
    """Each request's base id holds its committed tokens at positions 0.. in cell order, then its pending chain."""
    for r in requests:
        got = [(c.pos, c.token) for c in mem.held(r.cache.base)]
        want = list(enumerate(r.committed))
        assert got[:len(want)] == want, f"a request's cells out of order or not its own: {got} != {want}"
        assert [p for p, _ in got] == sorted(p for p, _ in got), f"a request's positions out of cell order: {got}"


def check_all(owner: Cells, mem: Recorder, requests: list[Request]) -> None:
    check_ids(owner, requests)
    check_cells(owner, mem)
    check_graveyard(owner, mem, requests)
    check_order(mem, requests)


def check_packing(blocks: list[BlockRows], parents: dict[int, list[int]], packed: list, limit: int,
                  chunk: int) -> None:
    """Every row in exactly one call, a tree's ancestors before it, no packed call over `limit`, a prompt in calls
    of its own as `parts` cuts it: QUAD-aligned, at most `chunk` rows, the last of TILED rows or more where there
    are several."""
    placed = {}  # (block, row) -> its place (call, rank)
    for c, call in enumerate(packed):
        rank = 0
        for i, rows, _ in call:
            for row in rows:
                key = (i, blocks[i].rows.index(row))
                assert key not in placed, f"row {key} in two calls"
                placed[key], rank = (c, rank), rank + 1
    assert set(placed) == {(b.index, j) for b in blocks for j in range(len(b.rows))}, "a row in no call"
    for i, ps in parents.items():
        for j, p in enumerate(ps):
            assert p < 0 or placed[(i, p)] < placed[(i, j)], f"row {j} of block {i} before its parent {p}"
    prompts = {b.index for b in blocks if b.prompt}
    for call in packed:
        if {i for i, _, _ in call} & prompts:
            assert len(call) == 1, "a prompt's call shares it"
        else:
            assert sum(len(r) for _, r, _ in call) <= limit, f"a call over the limit: {[len(r) for _, r, _ in call]}"
    for i in prompts:
        check_prompt_calls([len(r) for call in packed for j, r, _ in call if j == i], chunk)


def check_prompt_calls(sizes: list[int], chunk: int) -> None:
    starts = np.cumsum([0] + sizes[:-1])
    assert all(0 < n <= chunk for n in sizes) and all(s % QUAD == 0 for s in starts), f"a prompt's calls {sizes}"
    assert len(sizes) == 1 or sizes[-1] >= calls.TILED, f"a prompt's last call under TILED rows: {sizes}"


# a workload


def session(size: int = 64) -> tuple[Cells, Recorder, list[int]]:
    mem = Recorder(size)
    owner = Cells(mem, size, reserve=4)
    return owner, mem, list(owner.free_ids)


TREE_PARENTS = [-1, 0, 0, 1, 1, 2]  # a root, its children a and b, a's c and d, b's e


def workload(owner: Cells, mem: Recorder, steps: int = 8) -> list[Request]:
    """Two prompts, trees verified and kept along a branch, a chain partly kept, a prompt lent by the prompt memory,
    a request finished and collected, then decoding until the memory is compacted: the checks after every step."""
    a, b = Request(owner), Request(owner)
    forward(owner, mem, [(a, list(range(100, 110)), None), (b, list(range(200, 207)), None)])
    a.keep(list(range(10)))
    b.keep(list(range(7)))
    check_all(owner, mem, [a, b])
    prompts = Prompts(owner.read)
    prompts.remember(a.cache, a.committed, CHUNK, Rows(torch.zeros(1, 4)))
    forward(owner, mem, [(a, [110, 111, 112, 113, 114, 115], TREE_PARENTS), (b, [207, 208, 209], None)])
    check_all(owner, mem, [a, b])
    a.keep([0, 2, 5])  # the path through b: its own id, taken on by the base
    b.cache.trim(b.cache.length + 2)  # the chain's first two rows stay pending
    b.pending = b.pending[:2]
    b.keep([0, 1])
    check_all(owner, mem, [a, b])
    c = Request(owner)
    lent, ready = prompts.reuse(c.cache, list(range(100, 110)), CHUNK)
    assert lent == 10 and ready is not None
    c.committed = list(range(100, 110))
    check_all(owner, mem, [a, b, c])
    del a
    gc.collect()
    for step in range(steps):
        forward(owner, mem, [(b, [300 + step, 301, 302, 303], [-1, 0, 0, 1]), (c, [400 + step], None)])
        b.keep([0, 2])
        c.keep([0])
        check_all(owner, mem, [b, c])
    return [b, c]


def test_the_cells_keep_their_promises():
    owner, mem, before = session()
    b, c = workload(owner, mem)
    assert ("clear",) in mem.log, "the memory filled and was compacted"
    del b, c
    gc.collect()
    owner.release()
    check_ids_back(owner, before)
    assert owner.used == 0 and not mem.occupied()  # the last request gone: the graveyard emptied


def test_forgotten_cells_past_slack_compact_the_memory(monkeypatch):
    """Forgotten cells that outnumber the kept ones and SLACK make a compaction due ('stale') long before the memory
    fills: each live request keeps its cells in order, the graveyard is dropped."""
    monkeypatch.setattr(cells, "SLACK", 4)
    owner, mem, _ = session(size=256)
    a, b, gone = Request(owner), Request(owner), Request(owner)
    forward(owner, mem, [(a, list(range(100, 112)), None), (gone, list(range(200, 240)), None),
                         (b, list(range(300, 306)), None)])
    a.keep(list(range(12)))
    b.keep(list(range(6)))
    del gone
    gc.collect()
    forward(owner, mem, [(a, [400, 401, 402], [-1, 0, 0])])
    assert ("clear",) in mem.log and mem.seq_pos_max(GRAVEYARD) < 0
    check_all(owner, mem, [a, b])
    assert owner.used == 12 + 6 + 3


def test_a_full_memory_inside_a_step_frees_the_graveyard():
    """A draft's tree grown by depth has rows pending, so no compaction: a call that finds the memory full frees
    the graveyard's cells and runs again. `used` then counts the live requests' pending rows, the call's own
    included, before adding the call's: it may count too many (an earlier compaction), never too few."""
    owner, mem, _ = session(size=22)
    a, b = Request(owner), Request(owner)
    forward(owner, mem, [(a, list(range(10)), None), (b, list(range(10, 18)), None)])
    a.keep(list(range(10)))
    b.cache.trim(2)  # 6 cells to the graveyard, 2 rows still pending: no compaction
    forward(owner, mem, [(a, [50, 51, 52], [-1, 0, 0])])
    rows = a.cache.rows(Block(a.cache, [53, 54, 55], torch.tensor([1, 1, 2]), append=True))
    assert owner.call(len(rows), lambda: mem.decode(rows)) == 0
    assert mem.seq_pos_max(GRAVEYARD) < 0 and len(mem.occupied()) == 10 + 2 + 6
    assert owner.used >= len(mem.occupied())


def test_ids_are_never_handed_out_twice_and_come_back():
    owner, mem, before = session()
    requests = [Request(owner) for _ in range(5)]
    forward(owner, mem, [(r, [1, 2, 3, 4, 5, 6], TREE_PARENTS) for r in requests])
    check_ids(owner, requests)
    del requests
    gc.collect()
    owner.release()
    check_ids_back(owner, before)


# packing

PACKED = [(1, None), (3, [-1, 0, 0]), (1, None), (20, None), (6, TREE_PARENTS), (2, None), (9, None)]


def packing(shape: list[tuple[int, list[int] | None]] = PACKED) -> tuple[list[BlockRows], dict[int, list[int]]]:
    blocks, parents = [], {}
    for i, (n, ps) in enumerate(shape):
        rows = [(1000 * i + j, j, [i]) for j in range(n)]
        blocks.append(BlockRows(i, rows, [True] * n, ps is None and n > LIMIT))
        parents[i] = list(range(-1, n - 1)) if ps is None else ps
    return blocks, parents


def test_packing_keeps_every_row_once_ancestors_first_and_calls_small():
    blocks, parents = packing()
    packed = pack(blocks, LIMIT, CHUNK)
    check_packing(blocks, parents, packed, LIMIT, CHUNK)
    assert [sum(len(r) for _, r, _ in call) for call in packed] == [3, 2, 12, 8, 3, 3, 2, 9]  # the prompts: own calls


def test_packing_is_pure():
    blocks, _ = packing()
    copy = [BlockRows(b.index, list(b.rows), list(b.want), b.prompt) for b in blocks]
    assert pack(blocks, LIMIT, CHUNK) == pack(copy, LIMIT, CHUNK) and blocks == copy


@pytest.mark.parametrize("n", [1, 7, 8, 32, 100, 511, 512, 513, 519, 520, 1024, 1027, 1100])
def test_a_prompt_blocks_calls_start_at_multiples_of_4_and_the_last_has_8_rows(n):
    """Calls of at most 512 rows covering 0..n in order, each starting at a multiple of 4, the last of TILED rows or
    more whenever there are two (513 rows: 504 + 9, not 512 + 1); one call alone may be shorter."""
    cut = parts(n, 512)
    assert [i for r in cut for i in r] == list(range(n))
    check_prompt_calls([len(r) for r in cut], 512)
    assert len(cut) == -(-n // 512)


@pytest.mark.parametrize("kept", [0, 10, SLACK // 2, SLACK, 3 * SLACK])
def test_forgotten_cells_make_a_compaction_due_once_they_outnumber_the_kept(kept):
    capacity = 100 * SLACK
    bound = max(kept, SLACK)
    assert due(kept + bound, kept, 1, capacity) is None
    assert due(kept + bound + 1, kept, 1, capacity) == "stale"
    assert due(kept, kept, 1, capacity) is None  # nothing forgotten: nothing to gain


def test_rows_that_would_not_fit_make_it_due_first():
    assert due(900, 850, 200, 1000) == "full"
    assert due(900, 850, 100, 1000) is None
    assert due(900, 900, 200, 1000) is None  # full of kept cells: a compaction would not free one


# negative controls: one fault planted each, caught by the checks above


def forget_frees(self, seq, p0):
    self.memory.seq_rm(seq, p0, -1)


def peek_id(self):
    return self.free_ids[-1]


def drop_keeps_ids(self, ids):
    for seq in ids:
        self.forget(seq, -1)


def compact_reversed(self):
    bases = [c.base for c in self.caches]
    states = [self.memory.state_get(s) for s in bases]
    self.memory.clear()
    for seq, buf in zip(bases, reversed(states), strict=True):
        self.memory.state_set(buf, seq)
    self.used = self.live_cells()


def uncounted(copy_in):
    def copy(self, *args):
        used = self.used
        copy_in(self, *args)
        self.used = used
    return copy


CELL_FAULTS = {
    "forget frees the cells": (lambda m: m.setattr(Cells, "forget", forget_frees), "hole|below|used"),
    "an id still in use handed out": (lambda m: m.setattr(Cells, "take_id", peek_id), "handed out twice"),
    "ids not given back": (lambda m: m.setattr(Cells, "drop", drop_keeps_ids), "did not come back"),
    "compaction writes the caches back reversed": (lambda m: m.setattr(Cells, "compact", compact_reversed),
                                                   "out of order or not its own"),
    "copy-in not counted": (lambda m: m.setattr(Cells, "copy_in", uncounted(Cells.copy_in)), "used"),
}


@pytest.mark.parametrize("fault", CELL_FAULTS)
def test_a_planted_cell_fault_is_caught(monkeypatch, fault):
    plant, said = CELL_FAULTS[fault]
    plant(monkeypatch)
    owner, mem, before = session()
    with pytest.raises(AssertionError, match=said):
        workload(owner, mem)
        gc.collect()
        owner.release()
        check_ids_back(owner, before)


def child_first(pack_rows):
    def packed(blocks, limit, chunk):
        return [[(i, rows[::-1], want[::-1]) for i, rows, want in call] for call in pack_rows(blocks, limit, chunk)]
    return packed


PACKING_FAULTS = {
    "a call over the limit": (lambda m: m.setattr(calls, "space_left", lambda call, limit: limit + 1 - sum(
        len(r) for _, r, _ in call)), "over the limit"),
    "a child before its parent": (lambda m: m.setattr(calls, "pack", child_first(calls.pack)), "before its parent"),
    "a prompt's last call under TILED": (lambda m: m.setattr(calls, "parts", lambda n, size: [
        range(a, min(a + size, n)) for a in range(0, n, size)]), "under TILED"),
}


@pytest.mark.parametrize("fault", PACKING_FAULTS)
def test_a_planted_packing_fault_is_caught(monkeypatch, fault):
    plant, said = PACKING_FAULTS[fault]
    plant(monkeypatch)
    blocks, parents = packing()
    with pytest.raises(AssertionError, match=said):
        check_packing(blocks, parents, calls.pack(blocks, LIMIT, CHUNK), LIMIT, CHUNK)


def test_a_trim_below_the_cells_copied_out_is_remembered():
    """The prompts' context holds a request's first cells while none of them was forgotten (runtime/llama/fill.py):
    the lowest position a request forgot since it last copied them out."""
    owner, mem, _ = session()
    r = Request(owner)
    forward(owner, mem, [(r, list(range(12)), None)])
    assert owner.forgotten_from(r.cache.base) == math.inf
    r.keep(list(range(12)))
    assert owner.forgotten_from(r.cache.base) == 12  # the pending rows' bookkeeping cut at the kept length
    r.cache.trim(9)
    r.cache.trim(10)
    assert owner.forgotten_from(r.cache.base) == 9
    owner.mark_copied(r.cache.base)
    assert owner.forgotten_from(r.cache.base) == math.inf


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 513, 540, 543, 544, 1100])
def test_parts_keep_the_last_call_at_32_rows_under_calls_exact(monkeypatch, n):
    """The same rule with calls="exact"'s threshold (32): a prompt's calls start at multiples of 4 and its last one has
    32 rows or more wherever there are several."""
    monkeypatch.setattr(calls, "TILED", 32)
    cut = parts(n, 512)
    assert [i for r in cut for i in r] == list(range(n))
    check_prompt_calls([len(r) for r in cut], 512)
    assert all(len(r) >= 32 for r in cut[:-1]) and len(cut) == -(-n // 512)
