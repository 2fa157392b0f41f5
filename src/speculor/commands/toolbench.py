"""`speculor toolbench`: BFCL's tool calls and a JSON-schema set through `speculor serve` and llama-server, each
started the way its users start it, one after the other, the same questions to each (bench/toolcalls.py)."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from speculor.commands import Args
from speculor.errors import SpeculorError

# what each row runs: (server, request extra, tool_choice); servers: "speculor" or a llama-server flag set
ROWS = {
    "plain": ("speculor", {"speculative": {"strategy": "plain"}}, "auto"),  # our plain constrained decoding
    "default": ("speculor", {}, "auto"),  # our default strategy, the grammar drafting
    "suffix": ("speculor", {"speculative": {"strategy": "suffix"}}, "auto"),  # the grammar's and suffix's drafts
    "free": ("speculor", {"speculative": {"strategy": "plain"}}, "none"),  # unconstrained: the model's own text
    "llama-server": ("llama-server", {}, "auto"),
    "llama-server ngram-mod": ("llama-server --spec-type ngram-mod", {}, "auto"),
    "llama-server -md": ("llama-server -md", {}, "auto"),
}


def run(args: Args) -> None:
    import openai

    from speculor.bench import toolcalls
    from speculor.bench.peer_server import free_port, stop, wait_healthy

    rows = [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SpeculorError(f"unknown row {unknown[0]!r}: choose from {', '.join(ROWS)}")
    questions = [q for s in args.sets.split(",") for q in toolcalls.load(s.strip(), args.limit)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answers: list[toolcalls.Answer] = []
    for server in dict.fromkeys(ROWS[r][0] for r in rows):  # each server once, its rows in turn per question
        mine = [r for r in rows if ROWS[r][0] == server]
        port = free_port()
        log = out / f"{server.replace(' ', '_')}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(_command(server, port, args), stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", log, 900)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
            for q in questions[:2]:  # warm-up, not recorded
                toolcalls.ask(client, q, server, args.max_tokens, tool_choice="auto")
            order = random.Random(0)
            for rnd in range(args.rounds):
                for q in questions:
                    for name in order.sample(mine, len(mine)):
                        if name == "free" and rnd:
                            continue
                        _, extra, choice = ROWS[name]
                        a = _ask(client, q, name, args.max_tokens, extra, choice)
                        a.extra["round"] = rnd
                        answers.append(a)
                print(f"{server}: round {rnd + 1} of {args.rounds} done", file=sys.stderr)
            if args.clients > 1:  # the same questions from several clients at once
                answers += _together(client, questions, [r for r in mine if r != "free"], args)
        finally:
            stop(proc)
        toolcalls.save(answers, str(out / "answers.jsonl"))  # what was measured so far
    toolcalls.score(answers, {(q.set, q.id): q for q in questions})
    toolcalls.save(answers, str(out / "answers.jsonl"))
    table = summary(answers, rows)
    (out / "table.md").write_text(table + "\n")
    (out / "command.txt").write_text("speculor " + " ".join(args.argv) + "\n")
    print(table)


def _ask(client: Any, q: Any, name: str, max_tokens: int, extra: dict[str, Any], choice: str) -> Any:
    """One answer; a refusal (the server's 4xx) is recorded as an answer that finished with "error"."""
    import openai

    from speculor.bench import toolcalls

    try:
        return toolcalls.ask(client, q, name, max_tokens, extra, choice)
    except openai.APIStatusError as exc:
        return toolcalls.Answer(q.set, q.id, name, str(exc), [], [], 0, 0.0, 0.0, "error")


def _together(client: Any, questions: list[Any], rows: list[str], args: Args) -> list[Any]:
    """Each row's answers with `args.clients` clients asking at once (a row named `row@N`)."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial


    out = []
    for name in rows:
        _, extra, choice = ROWS[name]
        with ThreadPoolExecutor(args.clients) as pool:
            got = list(pool.map(partial(_ask, client, name=f"{name}@{args.clients}",
                                        max_tokens=args.max_tokens, extra=extra, choice=choice), questions))
        for a in got:
            a.extra["round"] = 0
        out += got
    return out


def _command(server: str, port: int, args: Args) -> list[str]:
    """How a user starts the server: `speculor serve` with its defaults, or llama-server on the same GGUF with its
    chat template (--jinja) and, per row, its own speculation."""
    if server == "speculor":
        exe = Path(sys.executable).parent / "speculor"
        return [str(exe), "serve", "--port", str(port), "--threads", str(args.threads)]
    from speculor.bench.peer_server import find_binary, target_gguf
    from speculor.runtime import embedded

    cmd = [str(find_binary(args.llama_server)), "-m", str(target_gguf()), "--jinja", "-c", "16384", "-np",
           str(args.clients), "-t",
           str(args.threads), "-tb", str(args.threads), "--port", str(port)]
    if "ngram-mod" in server:
        cmd += ["--spec-type", "ngram-mod"]
    if server.endswith("-md"):
        # -md alone loads the draft and never drafts with it (its log has no "draft acceptance"): draft-simple
        cmd += ["--spec-type", "draft-simple", "-md", str(embedded.ensure_gguf(embedded.DEFAULT_DRAFT, download=True)),
                "--spec-draft-n-max", "3"]
    return cmd


def summary(answers: list[Any], rows: list[str]) -> str:
    """Per set and row: accuracy (tool_calls, BFCL's rule), read accuracy (calls in the text), valid calls, answer
    tokens, decode tokens/s (median over answers), end to end s (median), and decode ÷ our plain constrained."""
    lines = ["| set | row | questions | accuracy | read as calls | schema-valid | tokens | decode tok/s | "
             "decode ÷ plain | e2e s | TTFT s | same as plain (row@N: as its 1 client) |", "|" + "---|" * 12]
    sets = list(dict.fromkeys(a.set for a in answers))
    rows = rows + [r for r in dict.fromkeys(a.server for a in answers) if "@" in r]
    for s in sets:
        plain = {(a.id, a.extra["round"]): a for a in answers if a.set == s and a.server == "plain"}
        for row in rows:
            mine = [a for a in answers if a.set == s and a.server == row]
            if not mine:
                continue
            ratio = [a.decode_tps / plain[(a.id, a.extra["round"])].decode_tps for a in mine
                     if (a.id, a.extra["round"]) in plain and plain[(a.id, a.extra["round"])].decode_tps > 0
                     and a.decode_tps > 0]
            ref = plain if "@" not in row else {(a.id, a.extra["round"]): a for a in answers
                                                 if a.set == s and a.server == row.split("@")[0]}
            same = sum(a.text == ref[(a.id, a.extra["round"])].text and a.calls == ref[(a.id, a.extra["round"])].calls
                       for a in mine if (a.id, a.extra["round"]) in ref)
            first = [a for a in mine if a.extra["round"] == 0]
            lines.append(
                f"| {s} | {row} | {len(first)} | {_pct(sum(a.correct for a in first), len(first))} | "
                f"{_pct(sum(a.read_correct for a in first), len(first))} | "
                f"{_pct(sum(a.valid for a in first), len(first))} | {statistics.mean(a.tokens for a in mine):.1f} | "
                f"{statistics.median(a.decode_tps for a in mine):.1f} | {_spread(ratio)} | "
                f"{statistics.median(a.total_s for a in mine):.2f} | {statistics.median(a.ttft_s for a in mine):.2f} | "
                f"{same}/{len(mine)} |")
    return "\n".join(lines)


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f}% ({k}/{n})" if n else "-"


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.2f}x [{q[0]:.2f}-{q[2]:.2f}]"
