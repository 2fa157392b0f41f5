"""llama.cpp's sequence state (runtime/llama/state.py): the bytes rewritten between the two layouts of values, against
the byte layout llama-kv-cache.cpp's state_write_data writes, a state of another format refused, and a llama-cpp-python
whose format it does not know refused by name; the prompts' context on the real GGUF is in tests/test_llama.py."""

from __future__ import annotations

import numpy as np
import pytest

from speculor.errors import SpeculorError
from speculor.runtime.llama import state
from speculor.runtime.llama.state import MAGIC, State, parse, write


def u4(*x):
    return np.array(x, "<u4").tobytes()


def llama_state(trans: bool, seq: int = 7) -> bytes:
    """Two cells (positions 4, 5) of one layer: keys of 3-byte rows, values of 3 F16 dimensions, written in the order
    llama.cpp writes them (values transposed: every dimension's cells in a row)."""
    head = u4(MAGIC, seq, 1, 2) + u4(4, 1, seq) + u4(5, 1, seq) + u4(int(trans), 1)
    keys = np.array([1], "<i4").tobytes() + np.array([3], "<u8").tobytes() + bytes([10, 11, 12, 20, 21, 22])
    v = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "<f2")  # [cell, dimension]
    values = np.array([1], "<i4").tobytes() + (u4(2, 3) + v.T.tobytes() if trans
                                                else np.array([6], "<u8").tobytes() + v.tobytes())
    return head + keys + values


@pytest.mark.parametrize("trans", [False, True])
def test_a_state_is_read_in_either_layout_and_written_in_the_other(trans):
    s = parse(np.frombuffer(llama_state(trans), np.uint8))
    assert s.pos.tolist() == [4, 5]
    assert s.values[0][2].reshape(2, 6).view("<f2").tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert write(s, 7, not trans).tobytes() == llama_state(not trans)
    assert write(s, 7, trans).tobytes() == llama_state(trans)


def test_the_cells_from_first_on_are_written_under_the_id_asked():
    s = parse(np.frombuffer(llama_state(True), np.uint8))
    t = parse(write(s, 3, trans=False, first=1))
    assert t.pos.tolist() == [5]
    assert t.keys[0][2].tobytes() == bytes([20, 21, 22])
    assert t.values[0][2].reshape(1, 6).view("<f2").tolist() == [[4.0, 5.0, 6.0]]
    assert write(s, 3, trans=False, first=1)[4:8].view("<u4")[0] == 3


@pytest.mark.parametrize("bad", [lambda b: b + b"\0", lambda b: b[:-1], lambda b: u4(1) + b[4:],
                                 lambda b: b[:8] + u4(2) + b[12:]])
def test_a_state_of_another_format_is_refused(bad):
    with pytest.raises(SpeculorError):
        parse(np.frombuffer(bad(llama_state(True)), np.uint8))


def test_values_of_a_block_type_are_refused():
    s = bytearray(llama_state(False))
    s[-24:-20] = np.array([8], "<i4").tobytes()  # Q8_0 values: no element to transpose
    with pytest.raises(SpeculorError, match="transposed"):
        parse(np.frombuffer(bytes(s), np.uint8))
    assert isinstance(parse(np.frombuffer(llama_state(False), np.uint8)), State)


def test_the_installed_llama_cpp_python_is_one_whose_format_is_known():
    """The version the integration tests run (tests/test_llama.py reads and writes real states) is in KNOWN."""
    assert state.version() is None or state.version() in state.KNOWN


def test_an_unknown_llama_cpp_python_is_refused_at_the_first_parse(monkeypatch):
    """Bytes from a llama.cpp this module does not know are not read: the error names the version and what to do;
    writing bytes (no parse) is not refused, and a known version reads them again."""
    good = np.frombuffer(llama_state(True), np.uint8)
    monkeypatch.setattr(state, "version", lambda: "0.3.99")
    said = r"llama-cpp-python 0\.3\.99 is installed.*pip install llama-cpp-python=="
    with pytest.raises(SpeculorError, match=said) as e:
        parse(good)
    assert "--backend torch" in str(e.value) and "state.KNOWN" in str(e.value)
    assert write(State(np.arange(0), [], []), 1, trans=False).size
    monkeypatch.setattr(state, "version", lambda: state.KNOWN[0])
    assert parse(good).pos.tolist() == [4, 5]
