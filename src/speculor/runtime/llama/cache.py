"""`LlamaCache`: one request's entries in a `LlamaModel`'s shared memory: its base sequence id for the committed
entries, one more id per extra path of its pending tree, and the pending rows' bookkeeping. It changes the memory's
cells only through the cells owner (runtime/llama/cells.py).

A draft tree's mask is llama.cpp's own sequence mask: every root-to-leaf path is one sequence id, a row carries the
ids of the paths through it, positions are committed length + depth. A row sees exactly the cells of its first id at
positions <= its own: its ancestors and the committed prefix. A new path branching off at a row p that is already in
the memory gets its id on the cells of p's path (`Cells.branch`: `seq_cp(id(p), new, 0, pos(p) + 1)`), one branching
off inside the block by carrying the id on its in-block ancestors. `keep(path)` compacts to the accepted path: the
path's cells take the base id, every other id of the request is forgotten (`Cells.commit`, `Cells.trim`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from speculor.runtime.pending import PendingRows

if TYPE_CHECKING:
    from speculor.runtime.backend import Block
    from speculor.runtime.llama.cells import Cells


class LlamaCache(PendingRows):
    """One request's entries in a `LlamaModel`'s memory (module docstring), a `Cache` (runtime/backend.py): `length`
    committed entries, the pending rows' bookkeeping (runtime/pending.py), `keep(rows)`, `trim(n)`."""

    def __init__(self, cells: Cells) -> None:
        super().__init__()
        self.cells = cells
        self.base = cells.open(self)
        self.path_ids: list[int] = []  # pending rows: the id of the row's own path

    def path_continues(self, p: int) -> bool:
        """Whether a pending row already continues the path of row p (or of the committed tip, p = -1)."""
        path = self.base if p < 0 else self.path_ids[p]
        return any(self.parents[r] == p and self.path_ids[r] == path for r in range(len(self.parents) - 1))

    def rows(self, b: Block) -> list[tuple[int, int, list[int]]]:
        """The block's rows as (token, position, sequence ids), the pending rows' bookkeeping updated."""
        if not b.append:
            self.trim(self.length)
        tokens = [int(t) for t in (b.tokens.tolist() if torch.is_tensor(b.tokens) else b.tokens)]
        start = len(self.parents)
        parents = (list(range(start - 1, start + len(tokens) - 1)) if b.parents is None
                   else [int(p) for p in torch.as_tensor(b.parents).tolist()])
        ids: list[list[int]] = []
        for p in parents:
            self.add([p])
            if not self.path_continues(p):  # the first child continues its parent's path
                path = self.base if p < 0 else self.path_ids[p]
            else:  # another path: its id on the in-block ancestors, copied onto the cells of the rest
                path = self._branch(p, start, ids)
            self.path_ids.append(path)
            ids.append([path])
        return [(t, self.length + self.depth[start + i], ids[i]) for i, t in enumerate(tokens)]

    def _branch(self, p: int, start: int, ids: list[list[int]]) -> int:
        """The id of a new path through row p: on p's ancestors in this block (their `ids`), and on the cells in
        the memory of the rest of its path."""
        a, inside = p, []
        while a >= start:
            inside.append(a - start)
            a = self.parents[a]
        src, upto = (self.base, self.length) if a < 0 else (self.path_ids[a], self.length + self.depth[a] + 1)
        path = self.cells.branch(self.base, src, upto)
        for k in inside:
            ids[k].append(path)
        return path

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (a path down from the committed tip, ascending); drop the rest."""
        if rows:
            assert self.is_path(rows), "the rows kept form a path from the committed tip"
            end = self.length + len(rows)
            self.cells.commit(self.base, self.path_ids[rows[-1]], self.length, end)
            self.length = end
        self.trim(self.length)

    def trim(self, n: int) -> None:
        """Forget every entry from slot n on (pending rows included: only a chain's may be partly kept)."""
        if n >= self.length + len(self.parents):
            return
        keep = self.kept(n)
        chain = self.is_chain(keep) and set(self.path_ids[:keep]) <= {self.base}
        assert chain, "only a chain's pending rows are partly kept"
        self.cells.trim(self.base, n)
        del self.path_ids[keep:]
        self.cut(n)

    def lend(self, n: int, state_under: Callable[[int], np.ndarray]) -> None:
        """Into this empty cache, n committed cells copied in (`Cells.copy_in`): a kept prompt's
        (runtime/llama/prompts.py)."""
        assert self.length == 0 and not self.parents, "a prompt is lent to an empty cache"
        self.cells.copy_in(self.base, n, state_under)
        self.length = n
