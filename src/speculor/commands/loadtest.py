"""`speculor loadtest`: latency and throughput of a running server at several concurrencies (no torch)."""

from __future__ import annotations

import json
import os
import sys

from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
    from pathlib import Path

    from speculor.bench import loadtest, peer_server, prompts  # httpx and the prompt sets: no torch

    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise SpeculorError(f"--clients takes comma-separated integers, got {args.clients!r}") from None
    if args.threads is not None and args.threads < 1:
        raise SpeculorError("--threads must be >= 1")
    if args.peer:  # found before our rounds, started after them
        binary, gguf = peer_server.find_binary(args.llama_server), peer_server.target_gguf(args.gguf)
        draft = peer_server.target_gguf(args.draft_gguf, role="draft") if "draft" in args.peer else None
    texts = [p.text for p in prompts.load(args.sets.split(","), args.limit)]
    kw = dict(requests=args.requests, max_tokens=args.max_tokens)
    rows, ours = loadtest.series(args.url, texts, clients, args.strategy, reference=args.reference or bool(args.peer),
                                 **kw)
    if args.strategy and "," in args.strategy:
        print("note: the series ran one after another on one server: from the second on, its prompts were already "
              "in the server's prompt memory (their one-by-one TTFT is no fresh prefill); a server per series "
              "compares prefill", file=sys.stderr)
    peak = loadtest.peak_memory_gib(args.url)  # after every round: the server's peak through them
    rows = [r | {"peak_memory_gib": peak} for r in rows]
    if args.peer:
        rows = loadtest.versus(rows, _peer_rounds(args, (binary, gguf, draft), texts, clients, ours, kw))
    print(loadtest.format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        loadtest.plot_rows(rows, Path(args.out).with_suffix(".png"))


def _peer_rounds(args: Args, files: tuple, texts: list[str], clients: list[int], ours: dict[str, str],
                 kw: dict) -> list[dict]:
    """The same rounds against llama-server in each configuration of --peer in turn (each its own server, stopped
    before the next starts; its log beside --out): their rows. Says on stderr how many one-client answers equal
    ours."""
    from pathlib import Path

    from speculor.bench import loadtest, peer_server

    binary, gguf, draft = files
    threads = args.threads or os.cpu_count() or 1
    rows: list[dict] = []
    for config in args.peer:
        name = peer_server.label(config)
        log = Path(args.out).with_suffix(f".{name.replace(':', '-')}.log") if args.out else None
        peer_rows, theirs = peer_server.rounds(config, binary, gguf, texts, clients, threads=threads, log=log,
                                               draft=draft, **kw)
        rows += peer_rows
        same, asked = loadtest.same_answers(ours, theirs)
        print(f"one-client answers equal between speculor and {name}: {same} of {asked} prompts "
              f"({gguf.name}, {threads} threads)", file=sys.stderr)
    return rows
