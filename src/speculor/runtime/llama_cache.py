"""`LlamaCache`: one request's entries in a `LlamaModel`'s shared memory (runtime/llama.py): its base sequence id
for the committed entries, one more id per extra path of its pending tree, and the pending rows' bookkeeping."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speculor.runtime.llama import LlamaModel


class LlamaCache:
    """One request's entries in a `LlamaModel`'s memory (module docstring), with KVCache's interface: `length`
    committed entries, `pending` (the parents of the pending rows), `keep(rows)`, `trim(n)`."""

    def __init__(self, model: LlamaModel) -> None:
        self.model, self.mem, self.L = model, model.mem, model.L
        self.base = model.seq_id()
        self.length = 0
        self.parents: list[int] = []  # pending rows: parent (region index, -1 = the committed tip)
        self.depth: list[int] = []  # ... depth below the committed tip (0 = a child of it)
        self.own: list[int] = []  # ... the id of the row's own path
        self.extra: list[int] = []  # ids of this request's other paths
        self.pending = torch.zeros(0, dtype=torch.long)
        model.live += 1
        model.caches.add(self)
        weakref.finalize(self, model.dead.append, (self.base, self.extra))  # `extra` as it is then

    def new_id(self) -> int:
        s = self.model.seq_id()
        self.extra.append(s)
        return s

    def branched(self, p: int) -> bool:
        """Whether a path already continues from row p (or from the committed tip, p = -1)."""
        own = self.base if p < 0 else self.own[p]
        return any(self.parents[r] == p and self.own[r] == own for r in range(len(self.parents) - 1))

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (a path down from the committed tip, ascending); drop the rest."""
        if rows:
            assert all(self.parents[r] == q for q, r in zip([-1] + rows[:-1], rows, strict=True)), \
                "the rows kept form a path from the committed tip"
            own, end = self.own[rows[-1]], self.length + len(rows)
            if own != self.base:
                self.model.forget(self.base, self.length)
                self.L.llama_memory_seq_cp(self.mem, own, self.base, self.length, end)
            self.length = end
        self.trim(self.length)

    def trim(self, n: int) -> None:
        """Forget every entry from slot n on (pending rows included: only a chain's may be partly kept)."""
        if n >= self.length + len(self.parents):
            return
        keep = max(n - self.length, 0)  # pending rows kept
        chain = self.parents[:keep] == list(range(-1, keep - 1)) and set(self.own[:keep]) <= {self.base}
        assert chain, "only a chain's pending rows are partly kept"
        self.model.forget(self.base, n)
        self.model.drop(self.extra)
        self.extra.clear()
        del self.parents[keep:], self.depth[keep:], self.own[keep:]
        self.length = min(self.length, n)
        self.pending = torch.tensor(self.parents, dtype=torch.long)
