"""`speculor loadtest --peer llama-server`: the options, the binary's lookup, the table with a peer, and the peer's
whole life (found, started, waited for, asked, stopped) against a fake llama-server: a small Python script that
serves /health and a canned streaming /v1/chat/completions. No model and no real llama-server here."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest

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
    path = tmp_path / "llama-server"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return path


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
    assert (args.peer, args.llama_server, args.gguf, args.threads) == ("llama-server", "/x/llama-server", "t.gguf", 2)
    args = cli._parser().parse_args(["loadtest"])
    assert (args.peer, args.llama_server, args.gguf, args.threads) == (None, None, "default", None)
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["loadtest", "--peer", "vllm"])


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
                   "--port", "8123"]


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
    assert argv["argv"] == ["-m", str(gguf), "-t", "2", "-tb", "2", "-c", "32768", "-np", "3", "--port", str(port)]
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


def test_loadtest_with_the_peer_end_to_end(fake, gguf, tmp_path, monkeypatch, capsys) -> None:
    """Our server (the fake again, started here) and the peer through `speculor loadtest --peer llama-server`."""
    monkeypatch.setattr(prompts, "load", lambda sets, limit: [prompts.Prompt(f"p{i}", "mtbench", "writing", text,
                                                                            True) for i, text in
                                                              enumerate(["alpha one", "beta two", "gamma"])])
    port = peer_server.free_port()
    ours = subprocess.Popen([str(fake), "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        peer_server.wait_healthy(ours, f"http://127.0.0.1:{port}", tmp_path / "none.log", 30)
        out = tmp_path / "load.json"
        code = cli.main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--clients", "1,2", "--max-tokens", "3",
                         "--strategy", "chain", "--peer", "llama-server", "--llama-server", str(fake),
                         "--gguf", str(gguf), "--threads", "2", "--out", str(out)])
    finally:
        peer_server.stop(ours)
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
