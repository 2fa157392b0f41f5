"""The fake llama-servers of the peer tests (test_loadtest_peer.py, test_bench_server_peers.py): a Python script
written as an executable that records its argv and request bodies under $FAKE_DIR."""

from __future__ import annotations

import stat
import sys
from pathlib import Path


def install(script: str, tmp_path: Path, monkeypatch) -> Path:
    """`script` (its `{python}` filled with this interpreter) as the executable tmp_path/llama-server, its records
    going to tmp_path."""
    path = tmp_path / "llama-server"
    path.write_text(script.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return path
