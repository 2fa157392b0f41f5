"""`PendingRows`: the bookkeeping every request cache shares (the torch `KVCache`, llama.cpp's `LlamaCache`, a head's
`HeadCache`): `length` committed entries, then the pending rows of the blocks forwarded since, each with its parent
(a region index; -1 = the committed tip) and its depth below the tip. A cache stores its entries its own way and
calls these where its rows come, are kept and are forgotten."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PendingRows:
    """`length` committed entries and the pending rows' `parents` and `depth` (module docstring)."""

    def __init__(self) -> None:
        self.length = 0  # committed entries
        self.parents: list[int] = []  # pending rows: parent (region index, -1 = the committed tip)
        self.depth: list[int] = []  # ... depth below the committed tip (0 = a child of it)

    @property
    def pending(self) -> torch.Tensor:
        """The parents of the pending rows (region indices, -1 = the committed tip)."""
        return torch.tensor(self.parents, dtype=torch.long)

    def add(self, parents: Iterable[int]) -> int:
        """Append pending rows with these parents (each before its child); the region index of the first."""
        start = len(self.parents)
        for p in parents:
            p = int(p)
            assert -1 <= p < len(self.parents), "a row's parent comes before it"
            self.parents.append(p)
            self.depth.append(0 if p < 0 else self.depth[p] + 1)
        return start

    def is_path(self, rows: list[int]) -> bool:
        """Whether `rows` (ascending) form a path down from the committed tip."""
        return all(self.parents[r] == q for q, r in zip([-1] + rows[:-1], rows, strict=True))

    def kept(self, n: int) -> int:
        """How many pending rows forgetting every entry from slot n on leaves."""
        return min(max(n - self.length, 0), len(self.parents))

    def is_chain(self, k: int) -> bool:
        """Whether the first k pending rows form a chain from the committed tip."""
        return self.parents[:k] == list(range(-1, k - 1))

    def cut(self, n: int) -> None:
        """Forget every entry from slot n on in the bookkeeping: pending rows after the `kept(n)` first, and
        committed entries from n on."""
        keep = self.kept(n)
        del self.parents[keep:], self.depth[keep:]
        self.length = min(self.length, n)
