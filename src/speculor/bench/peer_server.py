"""llama-server, llama.cpp's own OpenAI-compatible server, as a peer of `speculor loadtest --peer llama-server` and
`speculor bench --strategies llama-server`: found, started the way its users start it, in one of its configurations
(plain decoding or one of its own kinds of speculation), waited for until healthy, stopped.

    llama-server -m <target gguf> -t T -tb T -c C -np N [--jinja] --port P <the configuration's arguments>

with T the threads given, N the largest client count of the run (one for bench), C 32768 for loadtest (the run's
longest prompt and answer for bench), --jinja where its chat endpoint is asked (loadtest). The configurations
(CONFIGS): `plain` (no speculation), `ngram-mod`, `ngram-simple`, `ngram-map-k`, `ngram-map-k4v` and `ngram-cache`
(`--spec-type <that type>`, model-free: drafts from the context), and `draft` (`--spec-type draft-simple -md <draft
gguf> --spec-draft-n-max 3`: a draft model, llama-server's default 3 drafts a step). `-md` alone loads the draft but
drafts nothing with this llama.cpp: it infers the type from the draft GGUF's metadata, which names none for a plain
model such as the embedded 0.5B, so that needs `--spec-type draft-simple` (with `-md` alone its logs had no `draft
acceptance` line). Spelled `llama-server` (plain), `llama-server:CONFIG`, or `llama-server:all`. The binary is
`--llama-server PATH`, else the one `make llama-server` builds from the llama.cpp source that the installed
llama-cpp-python vendors (``<cache>/bin/llama-server``), else `llama-server` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.assets import cache_dir
from speculor.runtime.memory import peak_rss_gib

SERVER = "llama-server"
CONTEXT = 32768  # -c of loadtest's peer: the KV cells of all slots together, as its users start it
DRAFT_TOKENS = 3  # the draft model's drafts a step: llama-server's default (--spec-draft-n-max 3), spelled out
DRAFT = "<draft gguf>"  # where a configuration takes the draft model's file
# name -> llama-server's own arguments for it: its plain decoding and each kind of speculation it runs on a CPU with
# no file besides the models (the draft-eagle3/-mtp/-dflash/-dspark types need their own draft heads)
CONFIGS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "ngram-mod": ("--spec-type", "ngram-mod"),
    "draft": ("--spec-type", "draft-simple", "-md", DRAFT, "--spec-draft-n-max", str(DRAFT_TOKENS)),
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
    "ngram-map-k4v": ("--spec-type", "ngram-map-k4v"),
    "ngram-cache": ("--spec-type", "ngram-cache"),
}


def label(config: str) -> str:
    """A configuration's name as a peer: `llama-server` for plain decoding, else `llama-server:CONFIG`."""
    return SERVER if config == "plain" else f"{SERVER}:{config}"


def config_of(peer: str) -> str:
    """The configuration of a peer label (`label`'s inverse; `llama-server:plain` is `plain` too)."""
    _, _, config = peer.partition(":")
    return config or "plain"


def parse_peers(text: str) -> list[str]:
    """'llama-server,llama-server:ngram-mod' -> ['plain', 'ngram-mod']: the configurations named, in order, once
    each (`llama-server:all`: every one); a SpeculorError for another peer or an unknown configuration."""
    out: list[str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, config = item.partition(":")
        if name != SERVER:
            raise SpeculorError(f"unknown peer {item!r}: give {SERVER} or {SERVER}:CONFIG")
        if config and config != "all" and config not in CONFIGS:
            raise SpeculorError(f"unknown llama-server configuration {config!r} in {item!r}; known: "
                                f"{', '.join(CONFIGS)} (or all)")
        out += list(CONFIGS) if config == "all" else [config or "plain"]
    if not out:
        raise SpeculorError(f"no peer given: {SERVER} or {SERVER}:CONFIG, comma-separated")
    return list(dict.fromkeys(out))


def config_args(config: str, draft: Path | None = None) -> list[str]:
    """The arguments a configuration adds to llama-server's command line (the draft's file in place of DRAFT)."""
    if config not in CONFIGS:
        raise SpeculorError(f"unknown llama-server configuration {config!r}; known: {', '.join(CONFIGS)}")
    if DRAFT in CONFIGS[config] and draft is None:
        raise SpeculorError(f"llama-server's {config!r} configuration needs a draft model's GGUF file")
    return [str(draft) if a == DRAFT else a for a in CONFIGS[config]]


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


def target_gguf(spec: str = "default", role: str = "target") -> Path:
    """The GGUF file the peer serves (role 'draft': the one its `draft` configuration drafts with): 'default' (the
    embedded target's, or draft's), an embedded model's name, or a .gguf file."""
    target, draft = embedded.named(spec, spec)
    name = draft if role == "draft" else target
    if name in embedded.EMBEDDED:
        return embedded.ensure_gguf(name, download=True)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    flag = "--draft-gguf" if role == "draft" else "--gguf"
    raise SpeculorError(f"{flag} {spec!r}: give 'default', an embedded model's name or a .gguf file")


def command(binary: Path, gguf: Path, *, threads: int, parallel: int, port: int, config: str = "plain",
            draft: Path | None = None, context: int = CONTEXT, chat: bool = True) -> list[str]:
    """The command line of a llama-server in `config` as its users start it (--jinja: its chat template, where
    chat completions are asked)."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
            "-np", str(parallel)] + ["--jinja"] * chat + ["--port", str(port)] + config_args(config, draft)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(binary: Path, gguf: Path, *, log: Path | None = None, ready_timeout: float = 600.0,
          **how: Any) -> tuple[subprocess.Popen, str]:
    """A llama-server (`command`'s, `how` its threads, parallel, config, draft, context, chat) started in its own
    process group, stdout and stderr to `log` (a temporary file if none), and its URL, once GET /health answers
    200; stopped again if it does not get there (a SpeculorError with its log's end)."""
    port = free_port()
    if log is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log = Path(name)
    with log.open("wb") as out:
        proc = subprocess.Popen(command(binary, gguf, port=port, **how), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, ready_timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, url


@contextmanager
def llama_server(binary: Path, gguf: Path, *, log: Path | None = None, ready_timeout: float = 600.0,
                 peaks: list[float | None] | None = None, **how: Any) -> Iterator[str]:
    """`start`'s llama-server, its URL yielded, then stopped (terminated, killed if it lingers); its peak resident
    set appended to `peaks` (if given) just before."""
    proc, url = start(binary, gguf, log=log, ready_timeout=ready_timeout, **how)
    try:
        yield url
    finally:
        if peaks is not None:
            peaks.append(peak_rss_gib(proc.pid))
        stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll GET /health until it answers 200; a SpeculorError with the log's tail if the process ends or the
    timeout passes first (llama-server answers 503 while it loads the model)."""
    import httpx  # here, not at the top: the command line reads CONFIGS at every start

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


def rounds(config: str, binary: Path, gguf: Path, prompts: list[str], concurrencies: list[int], *, threads: int,
           log: Path | None, requests: int, max_tokens: int,
           draft: Path | None = None) -> tuple[list[dict], dict[str, str]]:
    """loadtest's rounds (a one-by-one round first) against llama-server started in `config` for them: its rows,
    tagged with the configuration's peer label, and its first answer to each prompt."""
    from speculor.bench import loadtest

    theirs: dict[str, str] = {}
    peaks: list[float | None] = []
    with llama_server(binary, gguf, threads=threads, parallel=max(concurrencies), config=config, draft=draft,
                      log=log, peaks=peaks) as url:
        rows = [r | {"peer": label(config)} for r in loadtest.run(url, prompts, concurrencies, requests=requests,
                                                                   max_tokens=max_tokens, reference=True,
                                                                   answers=theirs)]
    return [r | {"peak_memory_gib": peaks[0]} for r in rows], theirs


# ------------------------------------------------------------------------------------ bench: one request at a time

WARM_UP = (16, 4)  # a started server's first, untimed request: the prompt's first 16 ids, 4 new tokens


def completion_body(ids: list[int], cfg: SamplingConfig) -> dict[str, Any]:
    """The /completion request of a bench generation: the prompt's token ids as they are (llama-server adds no BOS
    to a list of ids), no prompt cache (every generation prefills its prompt, as ours do), the tokens streamed with
    their ids; greedy at T = 0, else our sampling's filters and nothing else (llama-server's default top-k 40 and
    min-p 0.05 off)."""
    body: dict[str, Any] = {"prompt": ids, "n_predict": cfg.max_new_tokens, "stream": True, "return_tokens": True,
                            "cache_prompt": False, "ignore_eos": not cfg.stop_on_eos, "repeat_penalty": 1.0}
    if cfg.greedy:
        return body | {"temperature": 0.0, "top_k": 1}
    return body | {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "min_p": cfg.min_p,
                   "seed": cfg.seed if cfg.seed is not None else -1}


def complete(url: str, ids: list[int], cfg: SamplingConfig, eos_ids: frozenset[int],
             timeout: float = 1800.0) -> dict[str, Any]:
    """One generation through llama-server's /completion, timed here: {token_ids, wall_s (request to last event),
    prefill_s (to the first token), server_timings (its own `timings`: prompt_ms, predicted_ms, draft_n,
    draft_n_accepted where it speculates)}; the ids end before the first end-of-sequence token."""
    import httpx

    tokens: list[int] = []
    first, timings = None, {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/completion", json=completion_body(ids, cfg), timeout=timeout) as resp:
        if resp.status_code != 200:
            raise SpeculorError(f"llama-server answered {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SpeculorError(f"llama-server error mid-stream: {event['error']}")
            if event.get("tokens"):
                first = first if first is not None else time.perf_counter() - t0
                tokens += event["tokens"]
            timings = event.get("timings") or timings
    wall = time.perf_counter() - t0
    if cfg.stop_on_eos:
        tokens = tokens[:next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))]
    return {"token_ids": tokens[:cfg.max_new_tokens], "wall_s": wall,
            "prefill_s": first if first is not None else wall, "server_timings": timings}


def cpu_s(pid: int) -> float | None:
    """CPU seconds a process has spent so far, all its threads (user + system; None off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Servers:
    """`speculor bench`'s llama-servers: one per configuration, each started at its first generation (one slot, no
    chat template: the prompts are token ids; the same GGUF, threads and context for all), warmed up, then kept:
    until `forget` (a new round: as our strategies forget the last round's answers, so must llama-server's n-gram
    pools) or `close`."""

    def __init__(self, binary: Path, gguf: Path, draft: Path | None, *, threads: int, context: int,
                 log_dir: Path | None = None) -> None:
        self.binary, self.gguf, self.draft = binary, gguf, draft
        self.threads, self.context, self.log_dir = threads, context, log_dir
        self.running: dict[str, tuple[subprocess.Popen, str]] = {}

    def generate(self, config: str, ids: list[int], cfg: SamplingConfig, eos_ids: frozenset[int]) -> dict[str, Any]:
        """`complete` against the configuration's server (started first where it is not running), with the
        server's CPU seconds during it (`server_cpu_s`: ours, not another process's) and its peak resident set."""
        proc, url = self.server(config, ids)
        _reset_peak(proc.pid)
        before = cpu_s(proc.pid)
        out = complete(url, ids, cfg, eos_ids)
        after = cpu_s(proc.pid)
        return out | {"server_cpu_s": None if before is None or after is None else after - before,
                      "peak_memory_gib": peak_rss_gib(proc.pid)}

    def server(self, config: str, ids: list[int]) -> tuple[subprocess.Popen, str]:
        """The configuration's running server, started and warmed up (untimed) where there is none."""
        if config not in self.running:
            log = self.log_dir / f"llama-server-{config}.log" if self.log_dir else None
            if log:
                log.parent.mkdir(parents=True, exist_ok=True)
            self.running[config] = start(self.binary, self.gguf, log=log, threads=self.threads, parallel=1,
                                         config=config, draft=self.draft, context=self.context, chat=False)
            n, new = WARM_UP
            complete(self.running[config][1], ids[:n], SamplingConfig(max_new_tokens=new), frozenset())
        return self.running[config]

    def forget(self) -> None:
        """Stop every server (by its pid): the next generation starts its configuration's anew."""
        while self.running:
            stop(self.running.popitem()[1][0])

    close = forget

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reset_peak(pid: int) -> None:
    """Start a new high-water mark of a process's resident set (where the OS lets us)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def fitting_context(longest_prompt: int, new_tokens: int) -> int:
    """-c of bench's servers (one slot): the run's longest prompt and answer and room for a draft, rounded up to a
    multiple of 1024, at least 4096."""
    return max(4096, -(-(longest_prompt + new_tokens + 128) // 1024) * 1024)
