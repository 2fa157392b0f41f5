"""A request's KV cache: preallocated per layer, written by position, compacted by moving only accepted rows.

Layout of every layer (keys and values alike, [1, H, capacity, D]):

    [0, length)                 committed entries: the prompt and the accepted tokens
    [length, length + pending)  the pending region: rows of the last block(s) forwarded, not yet committed
    [length + pending, capacity) free

`pending` holds the parents of the pending rows as region indices (-1 = attends only to the committed
entries), so a draft tree can grow one depth per forward (`Model.forward(..., append=True)`). `keep(rows)`
commits the pending rows `rows` and drops the rest: row rows[i] moves to slot length + i, which touches
only those rows; `trim(n)` forgets everything from slot n on. Neither copies the committed prefix. The
buffers double when full. A cache belongs to one request; the model that fills it is shared (`Model`).
It is a transformers `Cache`, so the model's own attention code writes into it (no modeling file patched).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from speculor.runtime.pending import PendingRows

CAPACITY = 256  # slots allocated at first; doubled whenever a forward would overflow them


class SlotLayer(DynamicLayer):
    """One layer's keys and values in preallocated buffers; `keys` / `values` are views of the first `n` slots."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new rows at slots n .. n + m - 1; return the views of slots 0 .. n + m - 1."""
        m = key_states.shape[-2]
        if self.k_buf is None:
            self.is_initialized = True
            self.dtype, self.device = key_states.dtype, key_states.device
            self.k_buf, self.v_buf = (x.new_empty(*x.shape[:-2], max(CAPACITY, m), x.shape[-1])
                                      for x in (key_states, value_states))
        elif self.n + m > self.k_buf.shape[-2]:
            self._grow(self.n + m)
        self.k_buf[..., self.n:self.n + m, :] = key_states
        self.v_buf[..., self.n:self.n + m, :] = value_states
        self._set(self.n + m)
        return self.keys, self.values

    def _grow(self, need: int) -> None:
        cap = self.k_buf.shape[-2]
        while cap < need:
            cap *= 2
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:-2], cap, old.shape[-1])
            new[..., :self.n, :] = old[..., :self.n, :]
            setattr(self, name, new)

    def _set(self, n: int) -> None:
        self.n = n
        self.keys, self.values = self.k_buf[..., :n, :], self.v_buf[..., :n, :]

    def get_seq_length(self) -> int:
        return self.n

    @torch.inference_mode()  # the buffers are inference tensors: written by the model's forward
    def move(self, src: torch.Tensor, dst: int) -> None:
        """Slots src (ascending, all >= dst) to dst, dst + 1, ...; the gather copies first, so overlaps are safe."""
        for buf in (self.k_buf, self.v_buf):
            buf[..., dst:dst + len(src), :] = buf.index_select(-2, src)

    def trim(self, n: int) -> None:
        if self.k_buf is not None:
            self._set(min(self.n, n))


class KVCache(Cache, PendingRows):
    """The KV cache of one request for one model (see the module docstring); `length` and the pending rows are
    `PendingRows`' bookkeeping."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=SlotLayer)
        PendingRows.__init__(self)

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (region indices, ascending) after the committed entries; drop the rest."""
        if rows != list(range(len(rows))):
            src = None
            for layer in self.layers:
                if src is None:
                    src = (self.length + torch.tensor(rows, dtype=torch.long)).to(layer.k_buf.device)
                layer.move(src, self.length)
        self.length += len(rows)
        self.trim(self.length)

    def trim(self, n: int) -> None:
        """Forget every entry from slot n on (pending rows included)."""
        self.cut(n)
        for layer in self.layers:
            layer.trim(n)
