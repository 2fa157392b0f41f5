"""llama-server, llama.cpp's own OpenAI-compatible server, as a peer of `speculor loadtest --peer llama-server`:
found, started the way its users start it, waited for until healthy, stopped.

    llama-server -m <target gguf> -t T -tb T -c 32768 -np N --port P

with T the threads given, N the largest client count of the run. The binary is `--llama-server PATH`, else the
one `make llama-server` builds from the llama.cpp source that the installed llama-cpp-python vendors
(``<cache>/bin/llama-server``), else `llama-server` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.assets import cache_dir
from speculor.runtime.memory import peak_rss_gib

CONTEXT = 32768  # -c: the KV cells of all slots together, as its users start it


def built_binary() -> Path:
    """Where `make llama-server` puts the binary."""
    return cache_dir() / "bin" / "llama-server"


def find_binary(explicit: str | None = None) -> Path:
    """The llama-server to run: `explicit`, else the one `make llama-server` built, else the one on PATH."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise SpeculorError(f"--llama-server {explicit}: no such file")
        return path
    if built_binary().is_file():
        return built_binary()
    if on_path := shutil.which("llama-server"):
        return Path(on_path)
    raise SpeculorError(f"no llama-server binary: run `make llama-server` (builds it into {built_binary()} from the "
                        "llama.cpp source of the installed llama-cpp-python), put one on PATH, or give "
                        "--llama-server PATH")


def target_gguf(spec: str = "default") -> Path:
    """The GGUF file the peer serves: 'default' (the embedded target), an embedded model's name, or a .gguf file."""
    name, _ = embedded.named(spec, None)
    if name in embedded.EMBEDDED:
        return embedded.ensure_gguf(name, download=True)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise SpeculorError(f"--gguf {spec!r}: give 'default', an embedded model's name or a .gguf file")


def command(binary: Path, gguf: Path, *, threads: int, parallel: int, port: int) -> list[str]:
    """The command line of a llama-server as its users start it."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT),
            "-np", str(parallel), "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def llama_server(binary: Path, gguf: Path, *, threads: int, parallel: int, log: Path | None = None,
                 ready_timeout: float = 600.0, peaks: list[float | None] | None = None) -> Iterator[str]:
    """A llama-server started in its own process group (stdout and stderr to `log`, a temporary file if none), its
    URL yielded once GET /health answers 200, then stopped (terminated, killed if it lingers); its peak resident
    set appended to `peaks` (if given) just before."""
    port = free_port()
    if log is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log = Path(name)
    with log.open("wb") as out:
        proc = subprocess.Popen(command(binary, gguf, threads=threads, parallel=parallel, port=port),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, ready_timeout)
        yield url
    finally:
        if peaks is not None:
            peaks.append(peak_rss_gib(proc.pid))
        stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll GET /health until it answers 200; a SpeculorError with the log's tail if the process ends or the
    timeout passes first (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SpeculorError(f"llama-server exited with code {proc.returncode} before it was ready; the end of "
                                f"{log}:\n{tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SpeculorError(f"llama-server was not ready after {timeout:.0f} s; the end of {log}:\n{tail(log)}")


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate the process by its pid, kill it if it has not ended after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rounds(name: str, binary: Path, gguf: Path, prompts: list[str], concurrencies: list[int], *, threads: int,
           log: Path | None, requests: int, max_tokens: int) -> tuple[list[dict], dict[str, str]]:
    """loadtest's rounds (a one-by-one round first) against llama-server started for them: its rows, tagged with
    `name`, and its first answer to each prompt."""
    from speculor.bench import loadtest

    theirs: dict[str, str] = {}
    peaks: list[float | None] = []
    with llama_server(binary, gguf, threads=threads, parallel=max(concurrencies), log=log, peaks=peaks) as url:
        rows = [r | {"peer": name} for r in loadtest.run(url, prompts, concurrencies, requests=requests,
                                                          max_tokens=max_tokens, reference=True, answers=theirs)]
    return [r | {"peak_memory_gib": peaks[0]} for r in rows], theirs
