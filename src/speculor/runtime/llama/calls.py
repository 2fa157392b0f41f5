"""Which llama_decode calls a forward's rows take: `pack`, a pure function of the blocks' rows and the limits, and
`parts`, a prompt block's calls of its own.

A row's bits depend on its call (runtime/llama/model.py's module docstring): a tree or chain block's rows go into
calls of at most `limit` rows, packed in order with other requests' blocks (a block continues in the next call where
the last one is full, so its ancestors always come first), and a prompt block (a chain longer than `limit`) gets
calls of its own, cut by `parts`, the same whatever shares the forward."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

TILED = 32  # the fewest rows for which ggml takes its tiled matmul (tiled.cpp) over the weights it does not repack:
# patches/llama.cpp's GGML_CPU_TILED_MM_MIN_ROWS, which calls="exact" sets (8 on ggml as released: a rule for 32
# holds there too, every call it allows having 32 rows or more, or all of a prompt's)
QUAD = 4  # rows the repacked kernels' gemm multiplies at once (as released: the rest of a call by the gemv)

Row = tuple[int, int, list[int]]  # (token, position, sequence ids)
Piece = tuple[int, list[Row], list[bool]]  # (block index, its rows in the call, whether each one's output is read)


class BlockRows(NamedTuple):
    """A block of a forward as `pack` takes it."""

    index: int  # its place in the forward
    rows: list[Row]  # ancestors first
    want: list[bool]  # whether each row's output is read
    prompt: bool  # a prompt block: calls of its own (`parts`)


def pack(blocks: Sequence[BlockRows], limit: int, chunk: int) -> list[list[Piece]]:
    """The calls of the blocks' rows, in order: a prompt block's in calls of its own, `parts(rows, chunk)`; a tree or
    chain block's in the current call up to `limit` rows, the rest in the next ones (module docstring)."""
    calls: list[list[Piece]] = [[]]
    for b in blocks:
        if b.prompt:
            calls += [[(b.index, b.rows[r.start:r.stop], b.want[r.start:r.stop])] for r in parts(len(b.rows), chunk)]
            calls.append([])
            continue
        j = 0
        while j < len(b.rows):
            space = space_left(calls[-1], limit)
            if space <= 0:
                calls.append([])
                continue
            calls[-1].append((b.index, b.rows[j:j + space], b.want[j:j + space]))
            j += space
    return [call for call in calls if call]


def space_left(call: list[Piece], limit: int) -> int:
    """The rows a call may still take."""
    return limit - sum(len(rows) for _, rows, _ in call)


def parts(n: int, size: int) -> list[range]:
    """A prompt block's n rows as calls of `size` rows (a multiple of 4), the last one of TILED rows or more where n
    allows (its start moved back by 4s): a row's bits depend on its call only through the 4-row blocks the repacked
    kernels take from the call's first row and whether the call has TILED rows (docs/algorithms.md §10.5.2), so
    every split of this kind, the server's 32-row chunks included, gives a prompt the same cells."""
    cuts = list(range(0, n, size))
    if len(cuts) > 1 and n - cuts[-1] < TILED:
        cuts[-1] -= math.ceil((TILED - (n - cuts[-1])) / QUAD) * QUAD
    return [range(a, b) for a, b in zip(cuts, cuts[1:] + [n], strict=True)]
