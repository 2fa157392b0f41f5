"""calls="padded" (runtime/llama/padded.py): every row in the 4-row kernels' blocks, so a row's bits are the same in
calls of any size and with anything beside it. Its checks run in a fresh interpreter (tests/support/padded.py): ggml
reads its tiled-matmul switch once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculor.runtime.llama.padded import PAD, pad

SCRIPT = Path(__file__).parent / "support" / "padded.py"


@pytest.mark.parametrize("rows", range(1, 40))
def test_pad_aligns_a_call_and_its_outputs(rows):
    for outputs in range(rows + 1):
        flips, pads = pad(rows, outputs)
        assert (rows + pads) % PAD == 0 and (outputs + flips + pads) % PAD == 0
        assert 0 <= flips <= rows - outputs and 0 <= pads < PAD


def checks(*args: str) -> dict:
    root = SCRIPT.parent.parent.parent  # the support package beside the sources
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_padded_rows_keep_their_bits_in_any_call():
    got = checks("--negative")
    assert got["draft_calls"] == "exact"  # the draft's cheapest load-free class
    assert got["tree"] and got["tree_long"]  # a tree in one call = each path a token a call, short and long context
    assert got["beside"]  # beside another request's tree and a prompt chunk
    assert got["last"]  # a row's output asked alone: the call's outputs are padded too
    assert got["speculative"] and got["batched"]  # lossless, and the same in a batch
    assert got["classes_differ"]  # it is another class of bits than calls="exact"
    assert not got["tree_unpadded"]  # negative controls: the same calls unpadded, and with outputs unpadded
    assert not got["last_unpadded"]
