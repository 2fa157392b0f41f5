"""`LlamaMemory`: llama.cpp's calls on one context's memory, the `Memory` the cells owner talks to
(runtime/llama/cells.py)."""

from __future__ import annotations

import numpy as np

from speculor.runtime.llama import state


class LlamaMemory:
    """The memory of context `ctx` (llama_cpp `lib`) through the calls `cells.Memory` names."""

    def __init__(self, lib, ctx) -> None:
        self.lib, self.ctx, self.mem = lib, ctx, lib.llama_get_memory(ctx)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return self.lib.llama_memory_seq_pos_max(self.mem, seq)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, False)

    def state_get(self, seq: int) -> np.ndarray:
        return state.get_seq(self.lib, self.ctx, seq)

    def state_set(self, buf: np.ndarray, seq: int) -> None:
        state.set_seq(self.lib, self.ctx, buf, seq)
