"""`speculor loadtest`: latency and throughput of a running server at several client concurrencies.

For each concurrency c, c clients stream chat completions at once (each `requests` in a row, greedy, a fixed
prompt per request from the MT-Bench/HumanEval sets) and we record per request the time to the first content
chunk (TTFT), the whole latency, the completion tokens and the server's tau (`usage`). Throughput is all
completion tokens ÷ the wall time of the round. The server runs one generation at a time per model pair, so
latency grows with c while throughput stays about that of one stream: the numbers say how far.

With peers (`--peer llama-server,llama-server:ngram-mod,...`, bench/peer_server.py: llama-server in each
configuration named, one after another), the same rounds then run against each peer's OpenAI endpoint (no
`speculative` field), its rows tagged with its name, and every row gets its tokens/s ÷ each peer's at the same
client count, and ÷ the best of them there (`versus`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from speculor.errors import SpeculorError


@dataclass(frozen=True)
class Result:
    ttft_s: float
    latency_s: float
    tokens: int
    tau: float | None
    text: str


async def stream_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      speculative: dict[str, Any] | None) -> Result:
    """One streaming chat completion, read as server-sent events until `data: [DONE]`."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if speculative:
        body["speculative"] = speculative
    t0, ttft, usage, parts = time.perf_counter(), None, {}, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SpeculorError(f"server answered {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SpeculorError(f"server error mid-stream: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice["delta"]["content"])
    latency = time.perf_counter() - t0
    return Result(ttft if ttft is not None else latency, latency, int(usage.get("completion_tokens", 0)),
                  usage.get("tau"), "".join(parts))


def ask(url: str, prompt: str, max_tokens: int, speculative: dict[str, Any] | None = None,
        timeout: float = 300.0) -> Result:
    """One streaming chat completion from synchronous code."""
    async def one() -> Result:
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await stream_chat(client, url, prompt, max_tokens, speculative)

    with _reaching(url):
        return asyncio.run(one())


@contextmanager
def _reaching(url: str) -> Iterator[None]:
    """Turn httpx's connection failures (no server, a timeout, a dropped connection) into a SpeculorError."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise SpeculorError(f"cannot connect to {url} ({exc}); is `speculor serve` running there?") from None
    except httpx.TransportError as exc:
        raise SpeculorError(f"the connection to {url} failed: {type(exc).__name__}: {exc or 'no detail'}") from None


async def _round(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
                 speculative: dict[str, Any] | None,
                 timeout: float) -> tuple[list[tuple[str, Result]], float]:
    """(prompt, result) of every request of a round, client by client, and the round's wall time."""
    # a connection per request: llama-server closes kept-alive ones at its own pace, racing the next request
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def one_client(c: int) -> list[tuple[str, Result]]:
            asked = [prompts[(c * requests + r) % len(prompts)] for r in range(requests)]
            return [(p, await stream_chat(client, url, p, max_tokens, speculative)) for p in asked]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(clients)))
        return [pr for prs in per_client for pr in prs], time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank: the value below which a share q of them lie; q = 0.99 is p99)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.999999) - 1))]


def summarize(results: list[Result], wall: float, clients: int) -> dict[str, Any]:
    """A round's throughput (all completion tokens ÷ its wall time) and per-request latency: time to the first
    token (TTFT), time per output token after it (TPOT = (latency - TTFT) / (tokens - 1)), medians and p99."""
    lat = sorted(r.latency_s for r in results)
    tokens = sum(r.tokens for r in results)
    taus = [r.tau for r in results if r.tau is not None]
    ttft = [r.ttft_s for r in results]
    tpot = [(r.latency_s - r.ttft_s) / max(r.tokens - 1, 1) for r in results]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "throughput_tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_median_s": statistics.median(ttft), "ttft_p99_s": quantile(ttft, 0.99),
            "tpot_median_s": statistics.median(tpot), "tpot_p99_s": quantile(tpot, 0.99),
            "latency_median_s": statistics.median(lat), "latency_max_s": lat[-1],
            "tau_mean": statistics.mean(taus) if taus else None}


def run(url: str, prompts: list[str], concurrencies: list[int], *, requests: int = 1, max_tokens: int = 32,
        speculative: dict[str, Any] | None = None, timeout: float = 1800.0,
        reference: bool = False, answers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One round per concurrency; every answer must equal the first answer seen for its prompt. With `reference`,
    a first round asks every prompt the rounds will use alone, one after another (one client): every answer is
    then compared with its one-client answer, and that round gives the one-client throughput. `answers`, if given,
    receives each prompt's first answer (e.g. to compare servers)."""
    if not prompts or not concurrencies or min(concurrencies) < 1 or requests < 1 or max_tokens < 1:
        raise SpeculorError("loadtest needs prompts, concurrencies >= 1, requests >= 1 and max_tokens >= 1")
    url = url.rstrip("/")
    answers_of: dict[str, str] = answers if answers is not None else {}
    rows = []
    if reference:
        used = list(dict.fromkeys(prompts[i % len(prompts)] for i in range(max(concurrencies) * requests)))
        with _reaching(url):
            got, wall = asyncio.run(_round(url, used, 1, len(used), max_tokens, speculative, timeout))
        answers_of.update((p, r.text) for p, r in got)
        rows.append(summarize([r for _, r in got], wall, 1) | {"answers_differing": 0, "reference": True})
    for c in concurrencies:
        with _reaching(url):
            got, wall = asyncio.run(_round(url, prompts, c, requests, max_tokens, speculative, timeout))
        mismatches = sum(answers_of.setdefault(prompt, r.text) != r.text for prompt, r in got)
        rows.append(summarize([r for _, r in got], wall, c) | {"answers_differing": mismatches})
    return rows


def series(url: str, prompts: list[str], concurrencies: list[int], strategies: str | None, *, requests: int,
           max_tokens: int, reference: bool) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`run` once per comma-separated strategy (None or "default": the server's default), rows tagged with it; and
    the first series' first answer to each prompt."""
    rows: list[dict[str, Any]] = []
    first: dict[str, str] = {}
    for i, name in enumerate(strategies.split(",") if strategies else [None]):
        spec = {"strategy": name} if name and name != "default" else None
        rows += [r | {"strategy": name} for r in run(url, prompts, concurrencies, requests=requests,
                                                     max_tokens=max_tokens, speculative=spec, reference=reference,
                                                     answers=None if i else first)]
    return rows, first


def peak_memory_gib(url: str) -> float | None:
    """The server's peak memory since it started, from its /metrics (`speculor_peak_memory_gib`; a Ray Serve
    replica's or another server's may not say: None)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=30.0).text
    except httpx.HTTPError:
        return None
    peak = next((s.value for f in text_string_to_metric_families(text) if f.name == "speculor_peak_memory_gib"
                 for s in f.samples), None)
    return peak if peak == peak else None  # NaN: the OS did not say


def label(row: dict[str, Any]) -> str:
    """A row's series: the peer server's name, else the requests' strategy, else the server's default."""
    return row.get("peer") or row.get("strategy") or "server default"


def level(row: dict[str, Any]) -> tuple[int, bool]:
    """A round's level: its client count, and whether it is the one-by-one round."""
    return row["clients"], bool(row.get("reference"))


def versus(rows: list[dict[str, Any]], peer_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows`, then `peer_rows`, each with `vs_peers`: its tokens/s ÷ each peer's at the same level (client count;
    the one-by-one round with the peers' one-by-one rounds), and `vs_peer`: ÷ the best peer's there, the one with
    the most tokens/s (`peer_best` names it). With one peer, its own rows get none (they would be ÷ themselves)."""
    theirs: dict[tuple[int, bool], dict[str, float]] = {}
    for r in peer_rows:
        theirs.setdefault(level(r), {})[r["peer"]] = r["throughput_tokens_per_s"]
    several = len({r["peer"] for r in peer_rows}) > 1
    out = []
    for r in rows + peer_rows:
        at = {peer: tps for peer, tps in theirs.get(level(r), {}).items() if tps > 0}
        if not at or (r.get("peer") and not several):
            out.append(r)
            continue
        best = max(at, key=lambda peer: at[peer])
        vs = {peer: r["throughput_tokens_per_s"] / tps for peer, tps in at.items()}
        out.append(r | {"vs_peers": vs, "vs_peer": vs[best], "peer_best": best})
    return out


def same_answers(ours: dict[str, str], theirs: dict[str, str]) -> tuple[int, int]:
    """How many prompts asked of both got the same answer from both, and how many were asked of both."""
    both = ours.keys() & theirs.keys()
    return sum(ours[p] == theirs[p] for p in both), len(both)


def ratio_columns(rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The table's ratio columns, (header, cell of a row): with one peer, ÷ it; with several, ÷ the best at the
    row's level (named) and ÷ llama-server's plain decoding where that ran."""
    peers = list(dict.fromkeys(r["peer"] for r in rows if r.get("peer")))
    if len(peers) == 1:
        return [(f"÷ {peers[0]}", lambda r: f"{r['vs_peer']:.2f}" if r.get("vs_peer") is not None else "-")]
    if not peers:
        return []

    def best(r: dict[str, Any]) -> str:
        return f"{r['vs_peer']:.2f} ({r['peer_best']})" if r.get("vs_peer") is not None else "-"

    columns = [("÷ llama-server best", best)]
    if "llama-server" in peers:
        columns.append(("÷ llama-server", lambda r: f"{r['vs_peers']['llama-server']:.2f}"
                        if "llama-server" in r.get("vs_peers", {}) else "-"))
    return columns


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A markdown table, one row per round; with peer rows, the server column and the ratio columns
    (`ratio_columns`: tokens/s ÷ the peer's, or ÷ the best peer's and ÷ llama-server's plain decoding)."""
    peer = any(r.get("peer") for r in rows)
    ratios = ratio_columns(rows)
    cols = ["strategy", "clients", "requests", "tokens", "wall s", "tokens/s"] + [h for h, _ in ratios] + [
        "TTFT p50 / p99 s", "TPOT p50 / p99 s", "latency p50 / max s", "tau", "same answers", "peak GiB"]
    lines = ["| " + " | ".join(["server"] * peer + cols) + " |", "|" + "---|" * (len(cols) + peer)]
    for r in rows:
        tau = f"{r['tau_mean']:.2f}" if r["tau_mean"] is not None else "-"
        clients = f"{r['clients']} (one by one)" if r.get("reference") else r["clients"]
        same = "-" if r.get("reference") else f"{r['requests'] - r['answers_differing']} / {r['requests']}"
        cells = ([r.get("peer") or "speculor"] if peer else []) + [
            r.get("strategy") or ("-" if r.get("peer") else "server default"), clients, r["requests"], r["tokens"],
            f"{r['wall_s']:.1f}", f"{r['throughput_tokens_per_s']:.2f}"] + [cell(r) for _, cell in ratios]
        cells += [f"{r['ttft_median_s']:.2f} / {r['ttft_p99_s']:.2f}",
                  f"{r['tpot_median_s']:.3f} / {r['tpot_p99_s']:.3f}",
                  f"{r['latency_median_s']:.1f} / {r['latency_max_s']:.1f}", tau, same,
                  f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") is not None else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot_rows(rows: list[dict[str, Any]], path: Any) -> None:
    """Throughput, median TTFT and median TPOT against concurrency, one line per strategy or peer (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name in dict.fromkeys(label(r) for r in rows):
        mine = [r for r in rows if label(r) == name and not r.get("reference")]
        xs = [r["clients"] for r in mine]
        for ax, key, ylabel in zip(axes, ("throughput_tokens_per_s", "ttft_median_s", "tpot_median_s"),
                                  ("tokens/s (all requests)", "TTFT median (s)", "time per output token, median (s)"),
                                  strict=True):
            ax.plot(xs, [r[key] for r in mine], "o-", label=name)
            ax.set(xlabel="concurrent clients", ylabel=ylabel, xscale="log", xticks=xs, xticklabels=xs)
    axes[0].legend(fontsize=8)
    fig.suptitle("speculor serve under load" + (" beside its peer" if any(r.get("peer") for r in rows) else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

