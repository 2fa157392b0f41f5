"""llama-server's own routes on the server (serving/llama_api.py), on the tiny random pair live on 127.0.0.1:
/completion answers what /v1/completions answers (the same job path) in llama-server's fields, whole or streamed;
its stop types; the server's default n_predict (-n) on every generation route; fields it does not implement refused by
name; /tokenize, /detokenize and /props. tests/test_integration_llama_server.py compares them with the real
llama-server on the same GGUF."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from support.server import CHAT_TEMPLATE, CONTEXT, live_server, tiny_pair

from speculor import Pair
from speculor.serving.app import create_app

PROMPT = "Hello, world!"


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_pair()


@pytest.fixture(scope="module")
def http(pair: Pair) -> Iterator[httpx.Client]:
    with live_server(create_app(pair, strategy="chain", max_batch=3)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        yield c


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_completion_answers_what_v1_completions_answers(http: httpx.Client) -> None:
    oa = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    out = http.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                         "return_tokens": True}).json()
    assert out["content"] == oa["choices"][0]["text"] and out["stop"] is True and out["stop_type"] == "limit"
    assert out["tokens_predicted"] == 12 == len(out["tokens"]) and out["tokens_evaluated"] == oa["usage"][
        "prompt_tokens"]
    assert out["prompt"] == PROMPT and out["model"] == "tiny-target" and out["truncated"] is False
    assert out["has_new_line"] == ("\n" in out["content"]) and out["stopping_word"] == ""
    assert out["tokens_cached"] == out["tokens_evaluated"] + 11 and out["timings"]["predicted_n"] == 12
    assert out["generation_settings"]["n_predict"] == 12 and out["generation_settings"]["temperature"] == 0
    ids = http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_ids = http.post("/completion", json={"prompt": ids, "n_predict": 12, "temperature": 0}).json()
    assert by_ids["content"] == out["content"] and by_ids["tokens"] == []  # tokens only when asked for
    alias = http.post("/completions", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0}).json()
    assert alias["content"] == out["content"]


def test_completion_streams_its_pieces_then_the_whole_answers_fields(http: httpx.Client) -> None:
    whole = http.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0,
                                           "return_tokens": True}).json()
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r)
    *pieces, last = chunks
    assert all(not c["stop"] for c in pieces) and last["stop"] is True and last["content"] == ""
    assert "".join(c["content"] for c in pieces) == whole["content"]
    assert [t for c in pieces for t in c["tokens"]] == whole["tokens"]
    assert [c["tokens_predicted"] for c in pieces] == sorted({c["tokens_predicted"] for c in pieces})
    assert last["tokens_predicted"] == 10 and last["stop_type"] == "limit"


def test_a_stop_word_ends_the_answer_before_it(http: httpx.Client) -> None:
    full = http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0}).json()["content"]
    word = full[5:7]
    out = http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                         "stop": ["never there", word]}).json()
    assert out["content"] == full[:full.index(word)] and out["stop_type"] == "word" and out["stopping_word"] == word
    assert out["tokens_predicted"] < 16
    streamed = events(http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                     "stop": [word], "stream": True}))
    assert streamed[-1]["stopping_word"] == word and "".join(c["content"] for c in streamed) == out["content"]


def test_fields_it_does_not_implement_are_refused_by_name(http: httpx.Client) -> None:
    for body, param in (({"mirostat": 2}, "mirostat"), ({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"repeat_penalty": 1.1}, "repeat_penalty"), ({"n_probs": 3}, "n_probs"),
                        ({"samplers": ["top_k"]}, "samplers"), ({"lora": []}, "lora"), ({"bogus": 1}, "bogus"),
                        ({"n_predict": 0}, "n_predict"), ({"n_predict": "8"}, "n_predict")):
        r = http.post("/completion", json={"prompt": PROMPT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    off = {"mirostat": 0, "presence_penalty": 0.0, "repeat_penalty": 1.0, "n_probs": 0, "typical_p": 1.0,
           "cache_prompt": True, "n_keep": 0, "repeat_last_n": 64, "seed": -1, "id_slot": -1}
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2, **off})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


def test_a_seed_makes_sampling_reproducible(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 1.0, "seed": 7}
    assert http.post("/completion", json=body).json()["content"] == http.post("/completion", json=body).json()[
        "content"]


def test_n_predict_is_every_routes_default(pair: Pair) -> None:
    with live_server(create_app(pair, strategy="chain", n_predict=5)) as url, httpx.Client(base_url=url,
                                                                                            timeout=60) as c:
        assert c.post("/completion", json={"prompt": PROMPT}).json()["tokens_predicted"] == 5
        assert c.post("/completion", json={"prompt": PROMPT, "n_predict": -1}).json()["tokens_predicted"] == 5
        assert c.post("/v1/completions", json={"prompt": PROMPT}).json()["usage"]["completion_tokens"] == 5
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["usage"]["completion_tokens"] == 5
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).json()["usage"][
            "completion_tokens"] == 3
        assert c.get("/props").json()["default_generation_settings"]["params"]["n_predict"] == 5


def test_tokenize_and_detokenize(http: httpx.Client, pair: Pair) -> None:
    text = "Hello <|im_end|> é"
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == pair.tokenizer(text, add_special_tokens=False)["input_ids"] and 2 in ids  # the special token
    split = http.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert 2 not in split and len(split) > len(ids)
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text and any(isinstance(p["piece"], list) for p in pieces)  # é: two byte tokens
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    r = http.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_props(http: httpx.Client) -> None:
    props = http.get("/props").json()
    assert props["total_slots"] == 3 and props["chat_template"] == CHAT_TEMPLATE
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == CONTEXT and settings["params"]["temperature"] == 0.8
    assert settings["params"]["top_k"] == 40 and settings["params"]["n_predict"] == -1
    assert props["model_alias"] == "tiny-target" and props["eos_token"] == "<|endoftext|>"
