"""llama-server's rows of `speculor bench` (`--strategies llama-server,llama-server:ngram-mod,...`): the spellings,
the /completion request and its reading, the servers' life (one per configuration, started at its first request,
warmed up, started anew each round, stopped at the end), ÷ llama-server's best configuration per set, and a whole
run on the tiny pair against a fake llama-server (a small Python script that streams canned token ids). No model
and no real llama-server here."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from support.bench import bench_config
from support.fake_server import install
from support.server import TEXTS, tiny_pair

from speculor import cli
from speculor.bench import peer_server, peers
from speculor.bench import run as bench
from speculor.bench.prompts import Prompt
from speculor.bench.specs import parse_strategies
from speculor.bench.summary import format_table, server_best, summarize
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError

FAKE = textwrap.dedent('''\
    #!{python}
    """A fake llama-server: /health answers 200 after a 503; POST /completion streams, one event a token, the ids
    (last prompt id + 1 + i) % 50 + 10 for i < n_predict, then a last event with stop and timings (draft counts
    where it speculates). argv and pid go to <FAKE_DIR>/argv-<port>.json, each body to bodies-<port>.jsonl."""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    here = Path(os.environ["FAKE_DIR"])
    (here / f"argv-{{port}}.json").write_text(json.dumps({{"argv": argv, "pid": os.getpid()}}))
    polls = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            polls[0] += 1
            self.send_response(200 if polls[0] > 1 else 503)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with (here / f"bodies-{{port}}.jsonl").open("a") as f:
                f.write(json.dumps(body) + "\\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            ids = [(body["prompt"][-1] + 1 + i) % 50 + 10 for i in range(body["n_predict"])]
            events = [{{"content": "t", "tokens": [t], "stop": False}} for t in ids]
            timings = {{"prompt_ms": 1.0, "predicted_ms": 2.0}}
            if "--spec-type" in argv or "-md" in argv:
                timings |= {{"draft_n": 6, "draft_n_accepted": 4}}
            events.append({{"content": "", "tokens": [], "stop": True, "timings": timings}})
            for e in events:
                self.wfile.write(f"data: {{json.dumps(e)}}\\n\\n".encode())
                self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Path:
    return install(FAKE, tmp_path, monkeypatch)


@pytest.fixture
def ggufs(tmp_path) -> tuple[Path, Path]:
    files = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    for f in files:
        f.write_bytes(b"GGUF")
    return files


def _started(tmp_path: Path) -> list[dict]:
    """Every fake server started, by start time: argv, pid, the bodies it was asked."""
    out = []
    for path in sorted(tmp_path.glob("argv-*.json"), key=os.path.getmtime):
        rec = json.loads(path.read_text())
        bodies = tmp_path / f"bodies-{path.stem.split('-')[1]}.jsonl"
        rec["bodies"] = [json.loads(b) for b in bodies.read_text().splitlines()] if bodies.exists() else []
        out.append(rec)
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ------------------------------------------------------------------------------------------- spellings


def test_strategies_name_llama_servers_configurations() -> None:
    specs = parse_strategies("chain:k=2,llama-server,llama-server:ngram-mod,llama-server:draft,llama-server:plain")
    assert [(s.label, s.name, s.options) for s in specs] == [
        ("plain", "plain", {}), ("chain:k=2", "chain", {"k": 2}), ("llama-server", "llama-server", {}),
        ("llama-server:ngram-mod", "llama-server:ngram-mod", {}), ("llama-server:draft", "llama-server:draft", {})]
    every = [s.label for s in parse_strategies("llama-server:all")][1:]
    assert every == [peer_server.label(c) for c in peer_server.CONFIGS] and set(every) <= set(peers.PEERS)
    with pytest.raises(SpeculorError, match="unknown llama-server configuration 'ngram'"):
        parse_strategies("plain,llama-server:ngram")


def test_bench_refuses_a_bad_configuration_or_binary_before_loading(tmp_path, capsys) -> None:
    assert cli.main(["bench", "--strategies", "plain,llama-server:eagle3"]) == 2
    assert "unknown llama-server configuration 'eagle3' in 'llama-server:eagle3'; known: plain, ngram-mod" in (
        capsys.readouterr().err)
    assert cli.main(["bench", "--strategies", "plain,llama-server", "--llama-server", str(tmp_path / "no")]) == 2
    assert "no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- one request


def test_the_completion_request() -> None:
    greedy = peer_server.completion_body([1, 2, 3], SamplingConfig(max_new_tokens=16))
    assert greedy == {"prompt": [1, 2, 3], "n_predict": 16, "stream": True, "return_tokens": True,
                      "cache_prompt": False, "ignore_eos": False, "repeat_penalty": 1.0, "temperature": 0.0,
                      "top_k": 1}
    sampled = peer_server.completion_body([5], SamplingConfig(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=8))
    assert sampled | {"prompt": None} == {"prompt": None, "n_predict": 8, "stream": True, "return_tokens": True,
                                          "cache_prompt": False, "ignore_eos": False, "repeat_penalty": 1.0,
                                          "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "seed": 3}


def test_servers_one_per_configuration(fake, ggufs, tmp_path) -> None:
    target, draft = ggufs
    cfg = SamplingConfig(max_new_tokens=5)
    with peer_server.Servers(fake, target, draft, threads=2, context=4096, log_dir=tmp_path / "logs") as servers:
        first = servers.generate("plain", list(range(20)), cfg, frozenset({32}))
        again = servers.generate("plain", [7, 8], cfg, frozenset())
        spec = servers.generate("draft", [7, 8], cfg, frozenset())
        assert len(_started(tmp_path)) == 2  # one server per configuration, kept between requests
        servers.forget()
        servers.generate("draft", [7, 8], cfg, frozenset())
    assert first["token_ids"] == [30, 31] and again["token_ids"] == [19, 20, 21, 22, 23]  # cut before the eos 32
    assert 0 < first["prefill_s"] <= first["wall_s"] and first["server_timings"] == {"prompt_ms": 1.0,
                                                                                     "predicted_ms": 2.0}
    assert spec["server_timings"]["draft_n_accepted"] == 4
    if Path("/proc/self/stat").exists():
        assert first["server_cpu_s"] >= 0 and 0 < first["peak_memory_gib"] < 1
    started = _started(tmp_path)
    with_draft = ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "3"]
    assert [s["argv"][s["argv"].index("--port") + 2:] for s in started] == [[], with_draft, with_draft]
    assert all(s["argv"][:10] == ["-m", str(target), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1"]
               and "--jinja" not in s["argv"] and _gone(s["pid"]) for s in started)
    warm = started[0]["bodies"][0]  # each start's first request: the prompt's first 16 ids, 4 tokens, untimed
    assert warm["prompt"] == list(range(16)) and warm["n_predict"] == 4
    assert [len(s["bodies"]) for s in started] == [3, 2, 2]
    assert (tmp_path / "logs" / "llama-server-draft.log").exists()


# ------------------------------------------------------------------------------------------- ÷ the best per set


def _rec(label: str, set_: str, rnd: int, tokens: int, wall: float) -> dict:
    return {"strategy": label, "set": set_, "round": rnd, "new_tokens": tokens, "wall_s": wall, "temperature": 0.0,
            "prompt_id": f"{set_}/1", "category": set_, "greedy_identical": True, "token_ids": [0] * tokens}


def test_divided_by_llama_servers_best_configuration_per_set() -> None:
    """On mtbench the draft configuration is llama-server's best, on humaneval ngram-mod; every row's ratio is per
    round ÷ that set's best in the same round, the median over rounds."""
    records = []
    for rnd, slow in ((0, 1.0), (1, 2.0)):  # round 1 twice as slow for every row: the ratios stay
        records += [_rec("plain", "mtbench", rnd, 10, 1.0 * slow), _rec("plain", "humaneval", rnd, 10, 1.0 * slow),
                    _rec("llama-server", "mtbench", rnd, 10, 2.0 * slow),
                    _rec("llama-server", "humaneval", rnd, 10, 2.0 * slow),
                    _rec("llama-server:draft", "mtbench", rnd, 10, 0.5 * slow),
                    _rec("llama-server:draft", "humaneval", rnd, 10, 4.0 * slow),
                    _rec("llama-server:ngram-mod", "mtbench", rnd, 10, 1.0 * slow),
                    _rec("llama-server:ngram-mod", "humaneval", rnd, 10, 0.8 * slow)]
    assert server_best(records, 0.0) == {"mtbench": "llama-server:draft", "humaneval": "llama-server:ngram-mod"}
    labels = ["plain", "llama-server", "llama-server:draft", "llama-server:ngram-mod"]
    summary = summarize(records, labels, [0.0])
    got = {label: {s: (v["best"], v["ratio"]) for s, v in summary[label]["vs_llama_server_best"].items()}
           for label in labels}
    assert got["plain"] == {"mtbench": ("llama-server:draft", 0.5), "humaneval": ("llama-server:ngram-mod", 0.8)}
    assert got["llama-server"] == {"mtbench": ("llama-server:draft", 0.25),
                                   "humaneval": ("llama-server:ngram-mod", 0.4)}
    assert got["llama-server:draft"]["mtbench"][1] == 1.0 and got["llama-server:ngram-mod"]["humaneval"][1] == 1.0
    table = format_table(summary).splitlines()
    assert "| ÷ llama-server best (mtbench) | ÷ llama-server best (humaneval) |" in table[0]
    assert all(line.count("|") == table[0].count("|") for line in table[:6])
    assert "| 0.50x | 0.80x |" in table[2] and "| 0.25x | 0.40x |" in table[3]
    assert table[-1] == ("llama-server's best configuration (most tokens/s) per set: mtbench T=0.0: "
                         "llama-server:draft; humaneval T=0.0: llama-server:ngram-mod")


def test_no_llama_server_rows_no_column() -> None:
    summary = summarize([_rec("plain", "mtbench", 0, 10, 1.0)], ["plain"], [0.0])
    assert "vs_llama_server_best" not in summary["plain"] and "llama-server" not in format_table(summary)


# ------------------------------------------------------------------------------------------- a whole run


def test_bench_run_with_llama_servers_rows(fake, ggufs, tmp_path, monkeypatch, capsys) -> None:
    """The tiny pair beside two llama-server configurations, two sets, two rounds: a server per configuration per
    round (started at its first request, stopped at the round's end and at the run's), records with the server's
    timings and whether the tokens equal our plain decoding's, the table ÷ the best per set."""
    prompts = [Prompt("mtbench/1", "mtbench", "writing", TEXTS[0], True),
               Prompt("HumanEval/0", "humaneval", "code", TEXTS[1], False)]
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: prompts[:limit])
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peers, "server_ggufs", lambda pair: ggufs)  # the tiny pair has no GGUF files
    out = tmp_path / "run"
    args = bench_config("--strategies", "plain,llama-server,llama-server:ngram-mod", "--limit", "2",
                        "--max-new-tokens", "6", "--rounds", "2", "--out", str(out), "--llama-server", str(fake))
    summary = bench.run(args, tiny_pair)
    assert list(summary) == ["plain", "llama-server", "llama-server:ngram-mod"]
    started = _started(tmp_path)
    assert len(started) == 4 and all(_gone(s["pid"]) for s in started)  # 2 configurations x 2 rounds
    assert all(len(s["bodies"]) == 1 + 2 for s in started)  # the warm-up, then each prompt once
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    theirs = [r for r in records if r["strategy"].startswith("llama-server")]
    assert len(theirs) == 2 * 2 * 2 and all(r["new_tokens"] == 6 and r["steps"] is None for r in theirs)
    assert all("greedy_identical" in r and r["server_timings"]["predicted_ms"] == 2.0 for r in theirs)
    assert all("server_cpu_s" not in r for r in theirs)  # counted as ours in others_cores, not kept
    assert set(summary["plain"]["vs_llama_server_best"]) == {"mtbench", "humaneval"}
    table = (out / "table.md").read_text()
    assert "÷ llama-server best (mtbench)" in table and "| llama-server:ngram-mod | 0.0 |" in table
    assert "llama-server's best configuration (most tokens/s) per set: mtbench T=0.0: llama-server" in table
    assert (out / "llama-server-ngram-mod.log").exists()
    assert summary["llama-server:ngram-mod"]["server_drafted"] == 2 * 2 * 6 and "server_drafted" not in summary["plain"]
    assert ("llama-server's own drafts at the first temperature (accepted / drafted): llama-server:ngram-mod 16 / 24"
            in capsys.readouterr().out)


def test_a_configuration_that_drafted_nothing_is_said() -> None:
    from speculor.bench.summary import drafts_note

    summary = {"plain": {}, "llama-server": {"server_drafted": 0, "server_accepted": 0},
               "llama-server:draft": {"server_drafted": 0, "server_accepted": 0},
               "llama-server:ngram-mod": {"server_drafted": 10, "server_accepted": 7}}
    assert drafts_note(summary) == ("llama-server's own drafts at the first temperature (accepted / drafted): "
                                    "llama-server:draft drafted nothing, llama-server:ngram-mod 7 / 10")
    assert drafts_note({"plain": {}}) is None
