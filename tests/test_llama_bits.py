"""calls="exact" on llama.cpp built with patches/llama.cpp: a row computed in a call of any size has the bits of the
same row in a call of its own (runtime/llama/bits.py; docs/algorithms.md §10.5.3), on both embedded GGUFs, after a
short and a long context. The negative control loads ggml's CPU backend as released (the Makefile builds it beside
the cache: STOCK_GGML) in place of the patched one: its rows differ from 4 rows on, and the load check falls back to
calls="vector". Each side runs in a fresh interpreter (tests/support/bits.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculor.runtime.assets import cache_dir

SCRIPT = Path(__file__).parent / "support" / "bits.py"


def stock_ggml() -> Path:
    from importlib.metadata import version

    return cache_dir() / "lib" / f"ggml-stock-{version('llama_cpp_python')}"


def run(preload: Path | None = None) -> dict:
    root = SCRIPT.parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop("GGML_CPU_TILED_MM", None)
    if preload is not None:
        env["LD_PRELOAD"] = f"{preload / 'libggml-base.so'}:{preload / 'libggml-cpu.so'}"
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_rows_have_one_set_of_bits_in_calls_of_any_size():
    got = run()
    for name, model in got.items():
        assert model["calls"] == "exact", name  # the load check passed
        for context in ("10", "700"):
            differ = {n: d for n, d in model[context].items() if d != 0.0}
            assert len(model[context]) == 24 and not differ, (name, context, differ)


@pytest.mark.integration
def test_the_unpatched_kernel_is_caught():
    stock = stock_ggml()
    assert (stock / "libggml-cpu.so").exists(), f"ggml as released is not built: make {stock}/libggml-cpu.so"
    got = run(stock)
    for name, model in got.items():
        assert model["calls"] == "vector", name  # the load check saw it and fell back
        for context in ("10", "700"):
            d = {int(n): v for n, v in model[context].items()}
            assert all(d[n] == 0.0 for n in (1, 2, 3)), (name, context, d)  # what calls="vector" rests on
            assert all(d[n] > 0.0 for n in range(4, 25)), (name, context, d)  # caught at every size from 4
