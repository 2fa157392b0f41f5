"""llama.cpp's sequence-state bytes (llama_state_seq_get_data / set_data: one stream, one sequence id): `parse` reads
them as a `State`, `write` writes a `State`'s cells back as bytes; `get_seq` and `set_seq` read and write a context's
sequence.

The format is llama.cpp's private one (llama-context.cpp and llama-kv-cache.cpp's state_write_data), which a
llama.cpp release may change without notice. `parse` and `write` know it as the llama.cpp of the llama-cpp-python
releases in KNOWN write it, and `parse` refuses to read bytes from any other one (`check_version`) with an error that
names the version and what to do, rather than give cells that are silently wrong.

Two layouts: with flash attention llama.cpp keeps a cell's values as a row, without it transposed (a row per
dimension, a column per cell), and its sequence state refuses a copy between the two. `parse` reads either and
`write` writes either (both are plain arrays of one element type: F16 values), which is how the prompts' context
(runtime/llama/fill.py, flash attention off) and the shared memory (on) exchange cells."""

from __future__ import annotations

import ctypes
import importlib.metadata
import sys
from dataclasses import dataclass

import numpy as np

from speculor.errors import SpeculorError

KNOWN = ("0.3.36",)  # the llama-cpp-python releases whose llama.cpp writes the format below (checked by its tests)
MAGIC = 0xAF143CD8  # a sequence state's first 4 bytes (llama-context.cpp, io_magic)
ELEMENT = {0: 4, 1: 2, 30: 2}  # bytes of an element of the ggml types values may have without flash attention
META = np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])  # a cell of one sequence's state: position, 1 id

_checked: str | None = None  # the version `check_version` accepted


def version() -> str | None:
    """The llama-cpp-python this process runs (the loaded module's, else the installed one's); None: neither."""
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None and hasattr(loaded, "__version__"):
        return loaded.__version__
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    """Refuse to read a llama.cpp whose state format this module does not know (module docstring)."""
    global _checked
    found = version()
    if found is None or found == _checked:
        return
    if found not in KNOWN:
        raise SpeculorError(
            f"llama-cpp-python {found} is installed, and speculor's llama.cpp backend reads llama.cpp's private "
            f"sequence-state bytes (prompt chunks and the prompt memory) only as llama-cpp-python "
            f"{', '.join(KNOWN)} writes them: install it (pip install llama-cpp-python=={KNOWN[-1]}) or use "
            f"--backend torch; to support {found}, check runtime/llama/state.py against its llama.cpp's "
            "state_write_data, run tests/test_llama.py and add the version to state.KNOWN")
    _checked = found


@dataclass
class State:
    """One sequence's cells as llama.cpp's sequence state holds them: positions, and per layer the keys' type,
    row size and rows [n, k_row] and the values' type, element size and array, [n, dims, el] bytes."""

    pos: np.ndarray
    keys: list[tuple[int, int, np.ndarray]]
    values: list[tuple[int, int, np.ndarray]]


class _Reader:
    """Arrays taken one after another from a state's bytes."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.at = buf, 0

    def take(self, dtype, n: int = 1) -> np.ndarray:
        if self.at + np.dtype(dtype).itemsize * n > len(self.buf):
            raise SpeculorError(f"a llama.cpp sequence state of {len(self.buf)} bytes ended early")
        a = np.frombuffer(self.buf, dtype, n, self.at)
        self.at += a.nbytes
        return a


def parse(buf: np.ndarray) -> State:
    """A sequence state's bytes (llama_state_seq_get_data: one stream, one id) as a `State`, either layout."""
    check_version()
    r = _Reader(buf)
    if r.take("<u4")[0] != MAGIC or r.take("<u4", 2)[1] != 1:  # the magic, the id it was read from, the streams
        raise SpeculorError("a llama.cpp sequence state of one stream was expected")
    n = int(r.take("<u4")[0])
    meta = r.take(META, n)
    if n and (meta["n"] != 1).any():
        raise SpeculorError("a llama.cpp sequence state of one id per cell was expected")
    trans, layers = r.take("<u4", 2)
    keys = []
    for _ in range(layers):
        kt, row = int(r.take("<i4")[0]), int(r.take("<u8")[0])
        keys.append((kt, row, r.take(np.uint8, n * row).reshape(n, row)))
    values = [_values(r, n, bool(trans)) for _ in range(layers)]
    if r.at != len(buf):
        raise SpeculorError(f"a llama.cpp sequence state of {len(buf)} bytes was read to {r.at}: a format this "
                            "speculor does not know")
    return State(meta["pos"].copy(), keys, values)


def _values(r: _Reader, n: int, trans: bool) -> tuple[int, int, np.ndarray]:
    """One layer's values of n cells: (type, element size, [n, dims, el] bytes)."""
    vt = int(r.take("<i4")[0])
    if trans:
        el, dims = (int(x) for x in r.take("<u4", 2))
        return vt, el, r.take(np.uint8, dims * n * el).reshape(dims, n, el).transpose(1, 0, 2)
    row, el = int(r.take("<u8")[0]), ELEMENT.get(vt, 0)
    if not el:
        raise SpeculorError(f"values of ggml type {vt} cannot be transposed (F32, F16 or BF16 only)")
    return vt, el, r.take(np.uint8, n * row).reshape(n, row // el, el)


def write(s: State, seq: int, trans: bool, first: int = 0, last: int | None = None) -> np.ndarray:
    """The bytes of a sequence state holding cells first..last of `s` under id `seq`, values in the layout `trans`."""
    cells = slice(first, last)
    pos = s.pos[cells]
    meta = np.empty(len(pos), META)
    meta["pos"], meta["n"], meta["seq"] = pos, 1, seq
    parts = [_bytes("<u4", MAGIC, seq, 1, len(pos)), meta.tobytes(), _bytes("<u4", int(trans), len(s.keys))]
    for kt, row, k in s.keys:
        parts += [_bytes("<i4", kt), _bytes("<u8", row), k[cells].tobytes()]
    for vt, el, v in s.values:
        v = v[cells]
        head = _bytes("<u4", el, v.shape[1]) if trans else _bytes("<u8", v.shape[1] * el)
        parts += [_bytes("<i4", vt), head, (v.transpose(1, 0, 2) if trans else v).tobytes()]
    return np.frombuffer(b"".join(parts), np.uint8)


def _bytes(dtype: str, *values: int) -> bytes:
    return np.array(values, dtype).tobytes()


def get_seq(lib, ctx, seq: int) -> np.ndarray:
    """The cells of id seq in context ctx, as sequence-state bytes."""
    n = lib.llama_state_seq_get_size(ctx, seq)
    buf = np.empty(n, np.uint8)
    if lib.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq) != n:
        raise SpeculorError("llama.cpp could not read a request's cells")
    return buf


def set_seq(lib, ctx, buf: np.ndarray, seq: int) -> None:
    """Sequence-state bytes written into context ctx under id seq (llama.cpp removes seq's cells first)."""
    if lib.llama_state_seq_set_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(buf),
                                    seq) != len(buf):
        raise SpeculorError("llama.cpp could not write a request's cells")
