"""calls="padded" (runtime/llama.py; docs/algorithms.md §10.5.3): every llama_decode call, and the rows of it whose
outputs are asked for, a multiple of PAD rows, so that every row is computed by the repacked kernels' 4-row blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from speculor.errors import SpeculorError

if TYPE_CHECKING:
    from speculor.runtime.llama import LlamaModel

PAD = 4  # rows the repacked kernels multiply at once


def pad(rows: int, outputs: int) -> tuple[int, int]:
    """(flips, pads) that make a call of `rows` rows, `outputs` of them with outputs, PAD-aligned in both: flips
    rows without an output given one, and pads rows added with one. (rows + pads) % PAD = (outputs + flips + pads)
    % PAD = 0, so flips = (rows - outputs) % PAD: never more than the rows without one."""
    return (rows - outputs) % PAD, -rows % PAD


def check(model: LlamaModel) -> None:
    """The padded class holds on this build and process: PAD rows alone and the same rows at the head of a
    3 PAD-row call get the same bits (they would not with ggml's tiled matmul on, or other kernels)."""
    L, rows = model.L, [(t, p, [0]) for p, t in enumerate(range(100, 100 + 3 * PAD))]
    got = []
    for n in (PAD, 3 * PAD):
        out: list[list[np.ndarray]] = [[]]
        model._decode([(0, rows[:n], [True] * n)], out, [[]])
        got.append(np.stack(out[0][:PAD]))
        L.llama_memory_clear(model.mem, False)
    model.used, model.kernel_s = 0, 0.0
    if not np.array_equal(*got):
        raise SpeculorError("calls='padded' is not exact with this llama.cpp build or in this process (a row "
                            "differs in calls of 4 and 12 rows: ggml's tiled matmul was already on?): use "
                            "calls='exact'")
