"""Whether a row's bits depend on the call it is computed in: `differences` measures it, `check` is the load-time
test of calls="exact" (runtime/llama/model.py; docs/algorithms.md §10.5.3).

A row here is one token of a chain after `context` tokens of its own; its logits computed in a call of n rows (it
and the chain's next n - 1 tokens) are compared with the same row computed in a call of its own, every row of the
call. With ggml's repacked Q4_K kernels as released, a call's first n - n % 4 rows take the 4-row gemm and the rest
the vector kernel, whose float sums fall in another order: rows differ from n = 4 on. patches/llama.cpp makes the
vector kernel sum in the gemm's order and lets ggml's tiled matmul (8 rows or more of the K-quant weights it does
not repack, as released) start at calls.TILED rows instead. Then every n under TILED gives every row the bits of a
one-row call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

CHECKED = range(1, 21)  # call sizes the load-time check compares
CONTEXT = 10  # the load-time check's context


class Memory(Protocol):
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...


class Decoder(Protocol):
    """What is needed of a model: one call decoded (`LlamaModel.decode`), its memory, and a reset."""

    memory: Memory

    def decode(self, call: list, out: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None: ...

    def reset(self) -> None: ...


def _rows(model: Decoder, tokens: Sequence[int], start: int) -> list[np.ndarray]:
    """The logits of every row of one call over `tokens` at positions start.. (sequence 0)."""
    out: list[list[np.ndarray]] = [[]]
    rows = [(t, start + i, [0]) for i, t in enumerate(tokens)]
    model.decode([(0, rows, [True] * len(rows))], out, [[]])
    return out[0]


def differences(model: Decoder, context: int, sizes: Iterable[int], chunk: int = 256) -> dict[int, float]:
    """Per call size n, max |logits of a row in a call of n rows - the same row alone| over the call's rows, for a
    chain after `context` tokens (filled in calls of `chunk` rows, the same every time). 0.0: the same bits."""
    sizes = list(sizes)
    tokens = [(97 + 31 * i) % 4096 + 10 for i in range(context + max(sizes))]  # fixed ids of ordinary tokens
    model.reset()
    try:
        for a in range(0, context, chunk):
            out: list[list[np.ndarray]] = [[]]
            rows = [(tokens[p], p, [0]) for p in range(a, min(a + chunk, context))]
            model.decode([(0, rows, [False] * len(rows))], out, [[]])
        alone = [_rows(model, [tokens[p]], p)[0] for p in range(context, len(tokens))]
        got = {}
        for n in sizes:
            model.memory.seq_rm(0, context, -1)
            rows = _rows(model, tokens[context:context + n], context)
            got[n] = max(float(np.abs(r - a).max()) for r, a in zip(rows, alone, strict=False))
        return got
    finally:
        model.reset()


def check(model: Decoder) -> list[int]:
    """The call sizes in CHECKED whose rows do not get the bits of a one-row call (empty: calls="exact" holds)."""
    return [n for n, d in differences(model, CONTEXT, CHECKED).items() if d != 0.0]
