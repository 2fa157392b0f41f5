"""`LlamaCache`: one request's entries in a `LlamaModel`'s shared memory (runtime/llama.py): its base sequence id
for the committed entries, one more id per extra path of its pending tree, and the pending rows' bookkeeping."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch

from speculor.runtime.pending import PendingRows

if TYPE_CHECKING:
    from speculor.runtime.backend import Block
    from speculor.runtime.llama import LlamaModel


class LlamaCache(PendingRows):
    """One request's entries in a `LlamaModel`'s memory (module docstring), a `Cache` (runtime/backend.py): `length`
    committed entries, the pending rows' bookkeeping (runtime/pending.py), `keep(rows)`, `trim(n)`."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model, self.mem, self.L = model, model.mem, model.L
        self.base = model.seq_id()
        self.own: list[int] = []  # pending rows: the id of the row's own path
        self.extra: list[int] = []  # ids of this request's other paths
        self.forgot = math.inf  # the lowest position forgotten since the prompts' context last copied its cells
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
            if not self.branched(p):  # the first child continues its parent's path
                own = self.base if p < 0 else self.own[p]
            else:  # another path: its id on the in-block ancestors, copied onto the cells of the rest
                own = self.new_id()
                a = p
                while a >= start:
                    ids[a - start].append(own)
                    a = self.parents[a]
                src, upto = (self.base, self.length) if a < 0 else (self.own[a], self.length + self.depth[a] + 1)
                self.L.llama_memory_seq_cp(self.mem, src, own, 0, upto)
            self.own.append(own)
            ids.append([own])
        return [(t, self.length + self.depth[start + i], ids[i]) for i, t in enumerate(tokens)]

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (a path down from the committed tip, ascending); drop the rest."""
        if rows:
            assert self.is_path(rows), "the rows kept form a path from the committed tip"
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
        self.forgot = min(self.forgot, n)
        keep = self.kept(n)
        chain = self.is_chain(keep) and set(self.own[:keep]) <= {self.base}
        assert chain, "only a chain's pending rows are partly kept"
        self.model.forget(self.base, n)
        self.model.drop(self.extra)
        self.extra.clear()
        del self.own[keep:]
        self.cut(n)
