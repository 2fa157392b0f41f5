"""calls="padded" (runtime/llama/model.py; docs/algorithms.md §10.5.3): every llama_decode call, and the rows of it
whose outputs are asked for, a multiple of PAD rows, so that every row is computed by the repacked kernels' 4-row
blocks."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from speculor.errors import SpeculorError

PAD = 4  # rows the repacked kernels multiply at once


def pad(rows: int, outputs: int) -> tuple[int, int]:
    """(flips, pads) that make a call of `rows` rows, `outputs` of them with outputs, PAD-aligned in both: flips
    rows without an output given one, and pads rows added with one. (rows + pads) % PAD = (outputs + flips + pads)
    % PAD = 0, so flips = (rows - outputs) % PAD: never more than the rows without one."""
    return (rows - outputs) % PAD, -rows % PAD


class Decoder(Protocol):
    """What `check` needs of a model: one call decoded (`LlamaModel.decode`), and its memory and timing reset."""

    def decode(self, call: list, out: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None: ...

    def reset(self) -> None: ...


def check(model: Decoder) -> None:
    """The padded class holds on this build and process: PAD rows alone and the same rows at the head of a
    3 PAD-row call get the same bits (they would not with ggml's tiled matmul on, or other kernels)."""
    rows = [(t, p, [0]) for p, t in enumerate(range(100, 100 + 3 * PAD))]
    got = []
    for n in (PAD, 3 * PAD):
        out: list[list[np.ndarray]] = [[]]
        model.decode([(0, rows[:n], [True] * n)], out, [[]])
        got.append(np.stack(out[0][:PAD]))
        model.reset()
    if not np.array_equal(*got):
        raise SpeculorError("calls='padded' is not exact with this llama.cpp build or in this process (a row "
                            "differs in calls of 4 and 12 rows: ggml's tiled matmul was already on?): use "
                            "calls='exact'")
