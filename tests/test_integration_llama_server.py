"""Integration: `speculor serve` as a drop-in for llama-server. The real llama-server (built from the llama.cpp source
llama-cpp-python vendors: `make llama-server`) and then `speculor serve`, each started with llama-server's command line

    llama-server   -m target.gguf              -c 8192 -np 4 -t 2 --port P --jinja
    speculor serve -m target.gguf -md draft.gguf -c 8192 -np 4 -t 2 --port P --jinja --backend llama.cpp \
                   --strategy chain --k 4

on the embedded GGUF pair, one after the other (never both at once), asked the same things: /tokenize gives the same
ids and pieces, /detokenize the same text, greedy /completion (n_predict 16) the same content, stop type and counts,
and the openai client's greedy chat the same answer. llama-server decodes plainly; ours decodes speculatively with the
draft, which is lossless against our llama.cpp backend's plain decoding. `--backend llama.cpp` is named because the
comparison is with llama.cpp's own decoding (left to auto, the backend would be chosen by measuring this pair first),
and `--strategy chain --k 4` because the default strategy's auto budget profiles this machine's forward times at its
first request (minutes, hour-long on a loaded machine; cached after); every strategy is lossless, the answers are the
same. Each server's answers are written to answers.json in the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from speculor.bench import peer_server
from speculor.errors import SpeculorError
from speculor.runtime import embedded

pytestmark = pytest.mark.integration

TEXTS = ["Hello world, café!", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
         "<|im_start|>user\n😀 𝔘nicode 漢字<|im_end|>", "  leading spaces\tand tabs\n\n"]
PROMPTS = ["def fib(n):", "The capital of France is", [14582, 264, 13027, 729, 429]]
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
LINE = ["-c", "8192", "-np", "4", "-t", "2", "--jinja"]


@contextmanager
def started(cmd: list[str], port: int, log: Path) -> Iterator[str]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    url = f"http://127.0.0.1:{port}"
    try:
        peer_server.wait_healthy(proc, url, log, 900)
        yield url
    finally:
        peer_server.stop(proc)


def ask(url: str) -> dict:
    """Everything the comparison reads from one server."""
    out: dict = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        out["tokenize"] = [c.post("/tokenize", json={"content": t}).json()["tokens"] for t in TEXTS]
        out["pieces"] = [c.post("/tokenize", json={"content": t, "with_pieces": True}).json()["tokens"]
                         for t in TEXTS]
        out["no_special"] = [c.post("/tokenize", json={"content": t, "parse_special": False}).json()["tokens"]
                             for t in TEXTS]
        out["detokenize"] = [c.post("/detokenize", json={"tokens": ids}).json()["content"] for ids in out["tokenize"]]
        out["completion"] = [c.post("/completion", json={"prompt": p, "n_predict": 16, "temperature": 0}).json()
                             for p in PROMPTS]
        out["stop"] = c.post("/completion", json={"prompt": PROMPTS[0], "n_predict": 16, "temperature": 0,
                                                  "stop": ["return"]}).json()
        out["stream"] = c.post("/completion", json={"prompt": PROMPTS[1], "n_predict": 16, "temperature": 0,
                                                    "stream": True}).text
        out["props"] = c.get("/props").json()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=16, temperature=0)
    out["chat"] = (chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.completion_tokens)
    return out


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[dict, dict]:
    """(llama-server's answers, ours), the servers started one after the other."""
    try:
        binary = peer_server.find_binary()
    except SpeculorError as exc:
        pytest.skip(str(exc))
    target, draft = (embedded.ensure_gguf(n, download=True) for n in embedded.named("default", "default"))
    logs = tmp_path_factory.mktemp("logs")
    port = peer_server.free_port()
    with started([str(binary), "-m", str(target), *LINE, "--port", str(port)], port, logs / "llama-server.log") as url:
        theirs = ask(url)
    (logs / "llama-server.json").write_text(json.dumps(theirs, indent=1))
    port = peer_server.free_port()
    ours_cmd = [sys.executable, "-m", "speculor.cli", "serve", "-m", str(target), "-md", str(draft), *LINE, "--port",
                str(port), "--backend", "llama.cpp", "--strategy", "chain", "--k", "4"]
    with started(ours_cmd, port, logs / "speculor.log") as url:
        ours = ask(url)
    (logs / "speculor.json").write_text(json.dumps(ours, indent=1))
    return theirs, ours


def test_tokenize_and_detokenize_as_llama_server(answers) -> None:
    theirs, ours = answers
    assert ours["tokenize"] == theirs["tokenize"]
    assert ours["pieces"] == theirs["pieces"]
    assert ours["no_special"] == theirs["no_special"]
    assert ours["detokenize"] == theirs["detokenize"]


def test_greedy_completion_as_llama_server(answers) -> None:
    theirs, ours = answers
    for t, o in zip(theirs["completion"], ours["completion"], strict=True):
        assert o["content"] == t["content"], (t["prompt"], t["content"], o["content"])
        for name in ("stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated", "has_new_line",
                     "truncated", "prompt", "tokens_cached"):
            assert o[name] == t[name], name
        assert set(t) - set(o) <= {"id_slot"} and o["timings"]["predicted_n"] == 16
    for name in ("content", "stop_type", "stopping_word", "tokens_predicted"):
        assert ours["stop"][name] == theirs["stop"][name], name


def test_streamed_completion_as_llama_server(answers) -> None:
    def chunks(text: str) -> list[dict]:
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]

    theirs, ours = chunks(answers[0]["stream"]), chunks(answers[1]["stream"])
    assert "".join(c["content"] for c in ours) == "".join(c["content"] for c in theirs)
    assert [t for c in ours for t in c["tokens"]] == [t for c in theirs for t in c["tokens"]]
    assert ours[-1]["stop"] is theirs[-1]["stop"] is True and ours[-1]["stop_type"] == theirs[-1]["stop_type"]


def test_props_and_the_openai_clients_chat_as_llama_server(answers) -> None:
    theirs, ours = answers
    assert ours["props"]["total_slots"] == theirs["props"]["total_slots"] == 4
    assert ours["props"]["chat_template"] == theirs["props"]["chat_template"]
    assert ours["chat"] == theirs["chat"]
