"""`speculor loadtest --peer llama-server`: the options, the binary's lookup, the table with a peer, and the peer's
whole life (found, started, waited for, asked, stopped) against a fake llama-server: a small Python script that
serves /health and a canned streaming /v1/chat/completions. No model and no real llama-server here."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.fake_server import install

from speculor import cli
from speculor.bench import loadtest, peer_server, prompts
from speculor.errors import SpeculorError

FAKE = textwrap.dedent('''\
    #!{python}
    """A fake llama-server: /health answers 503 twice (loading), then 200; /v1/chat/completions streams a canned
    answer (the prompt's first word, one chunk a token) and its usage. Each request body is appended to
    <log dir>/bodies-<port>.jsonl, its argv and pid to <log dir>/argv-<port>.json."""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    if os.environ.get("FAKE_DIE"):
        print("boom: cannot load the model", flush=True)
        sys.exit(3)
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    here = Path(os.environ["FAKE_DIR"])
    (here / f"argv-{{port}}.json").write_text(json.dumps({{"argv": argv, "pid": os.getpid()}}))
    polls = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/metrics":  # as speculor serve's: its peak memory
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"# TYPE speculor_peak_memory_gib gauge\\nspeculor_peak_memory_gib 1.25\\n")
                return
            polls[0] += 1
            code = 200 if self.path == "/health" and polls[0] > 2 else 503
            self.send_response(code)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with (here / f"bodies-{{port}}.jsonl").open("a") as f:
                f.write(json.dumps(body) + "\\n")
            words = ["echo", body["messages"][-1]["content"].split()[0], "done"][:body["max_tokens"]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            events = [{{"choices": [{{"index": 0, "delta": {{"role": "assistant", "content": None}}}}]}}]
            events += [{{"choices": [{{"index": 0, "delta": {{"content": w + " "}}}}]}} for w in words]
            events += [{{"choices": [], "usage": {{"completion_tokens": len(words), "prompt_tokens": 5}}}}]
            for e in events:
                self.wfile.write(f"data: {{json.dumps(e)}}\\n\\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\\n\\n")

    print("fake llama-server listening", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Path:
    """An executable fake llama-server; its records go to tmp_path."""
    return install(FAKE, tmp_path, monkeypatch)


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "target.gguf"
    path.write_bytes(b"GGUF")
    return path


def _records(tmp_path: Path, port: int) -> tuple[dict, list[dict]]:
    argv = json.loads((tmp_path / f"argv-{port}.json").read_text())
    bodies = [json.loads(line) for line in (tmp_path / f"bodies-{port}.jsonl").read_text().splitlines()]
    return argv, bodies


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ------------------------------------------------------------------------------------------- options and lookup


def test_peer_options_parse() -> None:
    args = cli._parser().parse_args(["loadtest", "--peer", "llama-server", "--llama-server", "/x/llama-server",
                                     "--gguf", "t.gguf", "--threads", "2"])
    assert (args.peer, args.llama_server, args.gguf, args.threads) == (["plain"], "/x/llama-server", "t.gguf", 2)
    args = cli._parser().parse_args(["loadtest"])
    assert (args.peer, args.llama_server, args.gguf, args.threads, args.draft_gguf) == (
        None, None, "default", None, "default")
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["loadtest", "--peer", "vllm"])


@pytest.mark.parametrize(("given", "configs"), [
    ("llama-server", ["plain"]),
    ("llama-server,llama-server:ngram-mod,llama-server:draft", ["plain", "ngram-mod", "draft"]),
    ("llama-server:draft, llama-server:plain,llama-server", ["draft", "plain"]),  # once each, in the order given
    ("llama-server:all", ["plain", "ngram-mod", "draft", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
                          "ngram-cache"]),
])
def test_peer_spellings(given, configs) -> None:
    assert cli._parser().parse_args(["loadtest", "--peer", given]).peer == configs
    labels = [peer_server.label(c) for c in configs]
    assert labels[0] == ("llama-server" if configs[0] == "plain" else f"llama-server:{configs[0]}")
    assert [peer_server.config_of(name) for name in labels] == configs


@pytest.mark.parametrize(("given", "said"), [
    ("llama-server:ngram-modd", "unknown llama-server configuration 'ngram-modd' in 'llama-server:ngram-modd'; "
                                "known: plain, ngram-mod, draft, ngram-simple"),
    ("llama-server,vllm", "unknown peer 'vllm': give llama-server or llama-server:CONFIG"),
    (",", "no peer given"),
])
def test_a_bad_peer_is_refused_with_exit_2(given, said, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--url", "http://127.0.0.1:9", "--peer", given])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --peer:" in err and said in err


def test_no_binary_says_make_llama_server(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on it
    with pytest.raises(SpeculorError, match="make llama-server"):
        peer_server.find_binary()
    with pytest.raises(SpeculorError, match="no such file"):
        peer_server.find_binary(str(tmp_path / "nowhere"))
    # through the command: refused before any round, the server at --url never asked
    assert cli.main(["loadtest", "--url", "http://127.0.0.1:9", "--peer", "llama-server", "--clients", "1"]) == 2
    assert "make llama-server" in capsys.readouterr().err


def test_binary_lookup_order(tmp_path, monkeypatch, fake) -> None:
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert peer_server.find_binary() == fake  # on PATH
    built = peer_server.built_binary()
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert peer_server.find_binary() == built  # what `make llama-server` built comes first
    assert peer_server.find_binary(str(fake)) == fake  # then --llama-server before both


def test_target_gguf(gguf, tmp_path) -> None:
    assert peer_server.target_gguf(str(gguf)) == gguf
    with pytest.raises(SpeculorError, match="--gguf"):
        peer_server.target_gguf(str(tmp_path / "model.bin"))


def test_command_is_what_users_run(gguf) -> None:
    cmd = peer_server.command(Path("/b/llama-server"), gguf, threads=2, parallel=16, port=8123)
    assert cmd == ["/b/llama-server", "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "32768", "-np", "16",
                   "--jinja", "--port", "8123"]


CONFIG_ARGS = {  # each configuration's own arguments, after the common ones, exactly
    "plain": [],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "draft": ["--spec-type", "draft-simple", "-md", "/m/draft.gguf", "--spec-draft-n-max", "3"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


@pytest.mark.parametrize("config", list(CONFIG_ARGS))
def test_each_configuration_command_line(config, gguf) -> None:
    """Every configuration on the same GGUF, threads, context and slots; bench's (chat=False, its own context,
    one slot) without --jinja."""
    assert list(peer_server.CONFIGS) == list(CONFIG_ARGS)
    draft = Path("/m/draft.gguf")
    common = ["/b/llama-server", "-m", str(gguf), "-t", "4", "-tb", "4", "-c", "32768", "-np", "8", "--jinja",
              "--port", "9000"]
    assert peer_server.command(Path("/b/llama-server"), gguf, threads=4, parallel=8, port=9000, config=config,
                               draft=draft) == common + CONFIG_ARGS[config]
    bench = peer_server.command(Path("/b/llama-server"), gguf, threads=2, parallel=1, port=9001, config=config,
                                draft=draft, context=4096, chat=False)
    assert bench == ["/b/llama-server", "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1",
                     "--port", "9001"] + CONFIG_ARGS[config]


def test_configuration_errors() -> None:
    with pytest.raises(SpeculorError, match="needs a draft model's GGUF file"):
        peer_server.config_args("draft")
    with pytest.raises(SpeculorError, match="unknown llama-server configuration 'eagle'"):
        peer_server.config_args("eagle")
    assert peer_server.fitting_context(100, 128) == 4096 and peer_server.fitting_context(4000, 512) == 5120


# ------------------------------------------------------------------------------------------- rows and table


def _row(clients: int, tps: float, **extra) -> dict:
    return {"clients": clients, "requests": clients, "tokens": 10 * clients, "wall_s": 2.0,
            "throughput_tokens_per_s": tps, "ttft_median_s": 0.5, "ttft_p99_s": 0.9, "tpot_median_s": 0.1,
            "tpot_p99_s": 0.2, "latency_median_s": 1.5, "latency_max_s": 2.0, "tau_mean": None,
            "answers_differing": 0} | extra


def test_rows_with_a_peer_get_the_ratio_and_the_server_column() -> None:
    ours = [_row(1, 6.0, reference=True, strategy=None, tau_mean=2.5), _row(4, 12.0, strategy=None,
                                                                               answers_differing=1)]
    theirs = [_row(1, 4.0, reference=True, peer="llama-server"), _row(4, 8.0, peer="llama-server")]
    rows = loadtest.versus(ours, theirs)
    assert [r.get("vs_peer") for r in rows] == [1.5, 1.5, None, None]
    table = loadtest.format_rows(rows).splitlines()
    assert table[0].startswith("| server | strategy | clients |") and "| ÷ llama-server |" in table[0]
    assert len(table) == 6 and all(line.count("|") == table[0].count("|") for line in table)
    assert table[2].startswith("| speculor | server default | 1 (one by one) |") and "| 1.50 |" in table[2]
    assert "| 2.50 | - |" in table[2]  # tau; no same-answer count for the one-by-one round
    assert "| 0.50 / 0.90 | 0.100 / 0.200 |" in table[3] and table[3].endswith("| 3 / 4 | - |")  # no peak memory given
    assert table[5].startswith("| llama-server | - | 4 |") and "| 8.00 | - |" in table[5]
    assert table[5].endswith("| - | 4 / 4 | - |")
    assert [loadtest.label(r) for r in rows] == ["server default"] * 2 + ["llama-server"] * 2


def test_rows_without_a_peer_keep_the_table_as_it_was() -> None:
    table = loadtest.format_rows([_row(2, 3.0, strategy="chain")]).splitlines()
    assert table[0].startswith("| strategy | clients |") and "server" not in table[0].split("|")[1]
    assert "÷" not in table[0] and table[2].startswith("| chain | 2 | 2 | 20 | 2.0 | 3.00 |")


def test_several_peers_divide_by_the_best_at_each_level() -> None:
    """Three configurations: at one client (one by one) ngram-mod is the best, at 4 clients plain is; every row,
    ours and theirs, gets ÷ each and ÷ the best of its own level, and the table names the best."""
    ours = [_row(1, 6.0, reference=True, strategy=None), _row(4, 12.0, strategy=None)]
    theirs = [_row(1, 4.0, reference=True, peer="llama-server"), _row(4, 10.0, peer="llama-server"),
              _row(1, 5.0, reference=True, peer="llama-server:ngram-mod"), _row(4, 8.0, peer="llama-server:ngram-mod"),
              _row(1, 3.0, reference=True, peer="llama-server:draft"), _row(4, 0.0, peer="llama-server:draft")]
    rows = loadtest.versus(ours, theirs)
    assert [(r.get("peer"), r["clients"], r["peer_best"], round(r["vs_peer"], 3)) for r in rows] == [
        (None, 1, "llama-server:ngram-mod", 1.2), (None, 4, "llama-server", 1.2),
        ("llama-server", 1, "llama-server:ngram-mod", 0.8), ("llama-server", 4, "llama-server", 1.0),
        ("llama-server:ngram-mod", 1, "llama-server:ngram-mod", 1.0),
        ("llama-server:ngram-mod", 4, "llama-server", 0.8),
        ("llama-server:draft", 1, "llama-server:ngram-mod", 0.6), ("llama-server:draft", 4, "llama-server", 0.0)]
    assert rows[0]["vs_peers"] == {"llama-server": 1.5, "llama-server:ngram-mod": 1.2, "llama-server:draft": 2.0}
    assert "llama-server:draft" not in rows[1]["vs_peers"]  # no tokens at that level: no ratio by it
    table = loadtest.format_rows(rows).splitlines()
    assert "| tokens/s | ÷ llama-server best | ÷ llama-server | TTFT" in table[0]
    assert all(line.count("|") == table[0].count("|") for line in table) and len(table) == 2 + 8
    assert "| 6.00 | 1.20 (llama-server:ngram-mod) | 1.50 |" in table[2]
    assert "| 12.00 | 1.20 (llama-server) | 1.20 |" in table[3]
    assert table[6].startswith("| llama-server:ngram-mod | - | 1 (one by one) |")
    assert "| 1.00 (llama-server:ngram-mod) |" in table[6]


def test_the_plain_column_needs_plain_among_the_peers() -> None:
    theirs = [_row(1, 4.0, peer="llama-server:ngram-mod"), _row(1, 5.0, peer="llama-server:draft")]
    table = loadtest.format_rows(loadtest.versus([_row(1, 10.0, strategy="chain")], theirs)).splitlines()
    assert "| ÷ llama-server best |" in table[0] and "| ÷ llama-server |" not in table[0]
    assert "| 10.00 | 2.00 (llama-server:draft) |" in table[2]


def test_same_answers_counts_prompts_asked_of_both() -> None:
    assert loadtest.same_answers({"a": "x", "b": "y", "c": "z"}, {"a": "x", "b": "q", "d": "w"}) == (1, 2)


# ------------------------------------------------------------------------------------------- the peer's life


def test_peer_lifecycle_against_a_fake_llama_server(fake, gguf, tmp_path) -> None:
    log = tmp_path / "peer.log"
    with peer_server.llama_server(fake, gguf, threads=2, parallel=3, log=log) as url:
        port = int(url.rsplit(":", 1)[1])
        answers: dict[str, str] = {}
        rows = loadtest.run(url, ["alpha one", "beta two"], [1, 3], max_tokens=2, reference=True, answers=answers)
    argv, bodies = _records(tmp_path, port)
    assert argv["argv"] == ["-m", str(gguf), "-t", "2", "-tb", "2", "-c", "32768", "-np", "3", "--jinja", "--port",
                            str(port)]
    assert _gone(argv["pid"]), "llama-server is still running"
    assert "fake llama-server listening" in log.read_text()
    assert answers == {"alpha one": "echo alpha ", "beta two": "echo beta "}
    assert [(r["clients"], r["requests"], r["tokens"], r["answers_differing"]) for r in rows] == [
        (1, 2, 4, 0), (1, 1, 2, 0), (3, 3, 6, 0)]
    assert len(bodies) == 6 and not any("speculative" in b for b in bodies)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
               for b in bodies)


def test_a_peer_that_dies_is_reported_with_its_log(fake, gguf, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_DIE", "1")
    with pytest.raises(SpeculorError, match="exited with code 3") as err:
        with peer_server.llama_server(fake, gguf, threads=1, parallel=1, log=tmp_path / "dead.log"):
            pytest.fail("a dead peer was yielded")
    assert "boom: cannot load the model" in str(err.value)


@contextmanager
def our_server(fake: Path, tmp_path: Path) -> Iterator[int]:
    """The fake started as our own server (the loadtest's --url), healthy; its port. Stopped after."""
    port = peer_server.free_port()
    ours = subprocess.Popen([str(fake), "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        peer_server.wait_healthy(ours, f"http://127.0.0.1:{port}", tmp_path / "none.log", 30)
        yield port
    finally:
        peer_server.stop(ours)


def test_loadtest_with_the_peer_end_to_end(fake, gguf, tmp_path, monkeypatch, capsys) -> None:
    """Our server (the fake again, started here) and the peer through `speculor loadtest --peer llama-server`."""
    monkeypatch.setattr(prompts, "load", lambda sets, limit: [prompts.Prompt(f"p{i}", "mtbench", "writing", text,
                                                                            True) for i, text in
                                                              enumerate(["alpha one", "beta two", "gamma"])])
    with our_server(fake, tmp_path) as port:
        out = tmp_path / "load.json"
        code = cli.main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--clients", "1,2", "--max-tokens", "3",
                         "--strategy", "chain", "--peer", "llama-server", "--llama-server", str(fake),
                         "--gguf", str(gguf), "--threads", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(out.read_text())
    assert [(r.get("peer"), r["clients"], bool(r.get("reference"))) for r in rows] == [
        (None, 1, True), (None, 1, False), (None, 2, False),
        ("llama-server", 1, True), ("llama-server", 1, False), ("llama-server", 2, False)]
    assert all(r["vs_peer"] > 0 for r in rows[:3]) and not any("vs_peer" in r for r in rows[3:])
    assert "one-client answers equal between speculor and llama-server: 2 of 2 prompts" in captured.err
    assert "| ÷ llama-server |" in captured.out and out.with_suffix(".png").exists()
    assert all(r["peak_memory_gib"] == 1.25 for r in rows[:3])  # from our server's /metrics
    assert all(0 < r["peak_memory_gib"] < 1 for r in rows[3:])  # the peer's own peak resident set (a small script)
    assert "| peak GiB |" in captured.out
    peer_log = out.with_suffix(".llama-server.log")
    assert "fake llama-server listening" in peer_log.read_text()
    _, our_bodies = _records(tmp_path, port)
    assert all(b["speculative"] == {"strategy": "chain"} for b in our_bodies)
    peer_port = next(int(p.stem.split("-")[1]) for p in tmp_path.glob("argv-*.json") if p.stem != f"argv-{port}")
    argv, peer_bodies = _records(tmp_path, peer_port)
    assert argv["argv"][argv["argv"].index("-np") + 1] == "2" and _gone(argv["pid"])
    assert len(peer_bodies) == len(our_bodies) and not any("speculative" in b for b in peer_bodies)


def test_loadtest_with_two_configurations_end_to_end(fake, gguf, tmp_path, monkeypatch, capsys) -> None:
    """`--peer llama-server:ngram-mod,llama-server:draft`: each configuration's own server in turn (its arguments,
    its log beside --out, stopped before the next), the same rounds against each, the table ÷ the best."""
    monkeypatch.setattr(prompts, "load", lambda sets, limit: [prompts.Prompt("p0", "mtbench", "writing", "alpha one",
                                                                            True)])
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    with our_server(fake, tmp_path) as port:
        out = tmp_path / "load.json"
        code = cli.main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--clients", "1", "--max-tokens", "3",
                         "--peer", "llama-server:ngram-mod,llama-server:draft", "--llama-server", str(fake),
                         "--gguf", str(gguf), "--draft-gguf", str(draft), "--threads", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(out.read_text())
    assert [(r.get("peer"), bool(r.get("reference"))) for r in rows] == [
        (None, True), (None, False), ("llama-server:ngram-mod", True), ("llama-server:ngram-mod", False),
        ("llama-server:draft", True), ("llama-server:draft", False)]
    assert all(set(r["vs_peers"]) == {"llama-server:ngram-mod", "llama-server:draft"} for r in rows)
    for name in ("llama-server:ngram-mod", "llama-server:draft"):
        assert f"one-client answers equal between speculor and {name}: 1 of 1 prompts" in captured.err
        assert "fake llama-server listening" in out.with_suffix(f".{name.replace(':', '-')}.log").read_text()
    assert "| ÷ llama-server best |" in captured.out and "| ÷ llama-server |" not in captured.out
    started = [json.loads(a.read_text()) for a in tmp_path.glob("argv-*.json") if a.stem != f"argv-{port}"]
    assert sorted(a["argv"][a["argv"].index("--port") + 2:] for a in started) == sorted([
        ["--spec-type", "ngram-mod"], ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "3"]])
    assert all(_gone(a["pid"]) for a in started)


def test_series_sends_no_strategy_for_the_servers_default(monkeypatch) -> None:
    """`--strategy default,plain`: the first series asks nothing of the server (its default), the second plain; the
    answers kept are the first series'."""
    asked = []

    def fake_run(url, prompts, concurrencies, *, speculative, answers, **kw):
        asked.append(speculative)
        if answers is not None:
            answers["p"] = "first"
        return [{"clients": 1}]

    monkeypatch.setattr(loadtest, "run", fake_run)
    rows, first = loadtest.series("u", ["p"], [1], "default,plain", requests=1, max_tokens=4, reference=False)
    assert asked == [None, {"strategy": "plain"}]
    assert [r["strategy"] for r in rows] == ["default", "plain"] and first == {"p": "first"}


def test_several_series_say_that_they_share_the_servers_prompt_memory(monkeypatch, capsys) -> None:
    from speculor.commands import loadtest as command

    monkeypatch.setattr(loadtest, "series", lambda *a, **k: ([], {}))
    monkeypatch.setattr(loadtest, "peak_memory_gib", lambda url: None)
    monkeypatch.setattr(loadtest, "format_rows", lambda rows: "table")
    for strategies, said in (("default,plain", True), ("plain", False), (None, False)):
        command.run(Namespace(clients="1", threads=None, peer=None, sets="mtbench", limit=1, requests=1,
                              max_tokens=4, url="u", strategy=strategies, reference=False, out=None))
        assert ("prompt memory" in capsys.readouterr().err) == said
