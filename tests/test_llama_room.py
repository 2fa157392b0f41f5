"""When the llama.cpp backend compacts its shared memory (runtime/llama/cells.py): the rule alone; the rows' bits
across a compaction made due by forgotten cells are in tests/test_llama.py."""

from __future__ import annotations

import pytest

from speculor.runtime.llama.cells import SLACK, due


@pytest.mark.parametrize("kept", [0, 10, SLACK // 2, SLACK, 3 * SLACK])
def test_forgotten_cells_make_a_compaction_due_once_they_outnumber_the_kept(kept):
    room = 100 * SLACK
    bound = max(kept, SLACK)
    assert due(kept + bound, kept, 1, room) is None
    assert due(kept + bound + 1, kept, 1, room) == "stale"
    assert due(kept, kept, 1, room) is None  # nothing forgotten: nothing to gain


def test_rows_that_would_not_fit_make_it_due_first():
    assert due(900, 850, 200, 1000) == "full"
    assert due(900, 850, 100, 1000) is None
    assert due(900, 900, 200, 1000) is None  # full of kept cells: a compaction would not free one
