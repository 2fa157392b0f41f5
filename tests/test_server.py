"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client and httpx.

The model pair is tiny and random (support/server.py: Qwen2 architecture, with a byte-level BPE tokenizer trained on
a few strings), so nothing is downloaded. The draft is the target with slightly perturbed output weights: most draft
tokens are accepted, some are not. The end-of-sequence row of both output layers is zeroed so that greedy
generations run to max_tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from support.server import (
    CONTEXT,
    TEXTS,
    hold_target,
    live_server,
    post_together,
    prebuild,
    queued,
    tiny_pair,
    wait_for,
)

from speculor import Pair, SamplingConfig, Speculor, SpeculorError
from speculor.api import Generation
from speculor.bench import loadtest
from speculor.serving.app import create_app


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_pair()


@pytest.fixture(scope="module")
def url(pair: Pair) -> Iterator[str]:
    with live_server(create_app(pair, strategy="chain", queue_size=64)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def reference(pair: Pair, prompt: str | list[dict[str, str]], max_tokens: int, **sampling) -> Generation:
    """The library's own output (the server fixture's strategy, chain; greedy unless told); a list of messages
    means chat."""
    sp = Speculor(pair, strategy="chain")
    ids = sp.encode_chat(prompt) if isinstance(prompt, list) else sp.encode(prompt)
    return sp.generate(ids, SamplingConfig(max_new_tokens=max_tokens, **sampling))


def metrics(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics as {(name, sorted labels): value}."""
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def assert_serving(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


# ------------------------------------------------------------------------------------------- the basics

def test_models_and_health(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-target"]
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["queue_depth"] == 0 and body["queue_size"] == 64


def test_peak_memory_in_health_and_metrics(http: httpx.Client) -> None:
    """The process's peak resident set (runtime/memory.py), in /health and as a Prometheus gauge."""
    from speculor.runtime.memory import peak_memory_gib

    peak = http.get("/health").json()["peak_memory_gib"]
    gauge = metrics(http)[("speculor_peak_memory_gib", ())]
    if not Path("/proc/self/status").exists():  # not Linux: unknown
        assert peak is None and gauge != gauge
        return
    assert 0.05 < peak <= gauge <= peak_memory_gib(torch.device("cpu"))  # in GiB, read when asked, never falling


def test_completion_greedy_equals_library(pair: Pair, client: openai.OpenAI) -> None:
    ref = reference(pair, "The quick brown fox", 16)
    out = client.completions.create(model="tiny-target", prompt="The quick brown fox", max_tokens=16,
                                    temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    usage = out.usage
    assert usage.prompt_tokens == len(Speculor(pair).encode("The quick brown fox"))
    assert usage.completion_tokens == len(ref.token_ids) == 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.tau == pytest.approx(ref.tau, abs=1e-3) and usage.tau > 1
    assert 0 < usage.accepted_tokens < 16


def test_chat_greedy_equals_library(pair: Pair, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
    ref = reference(pair, messages, 12)
    out = client.chat.completions.create(model="tiny-target", messages=messages, max_tokens=12, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(Speculor(pair).encode_chat(messages))
    assert out.usage.completion_tokens == 12


def test_chat_content_parts(pair: Pair, http: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world!"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == reference(
        pair, [{"role": "user", "content": "Hello, world!"}], 8).text


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    args = {"model": "tiny-target", "prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.tau == whole.usage.tau


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    args = {"model": "tiny-target", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 20,
            "temperature": 0}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].delta.content is None


def test_sse_wire_format(http: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]


def test_stop_strings(pair: Pair, client: openai.OpenAI) -> None:
    full = reference(pair, "Hello, world!", 24)
    stop = full.text[6:9]
    ref = reference(pair, "Hello, world!", 24, stop=(stop, "\x00never"))
    out = client.completions.create(model="m", prompt="Hello, world!", max_tokens=24, temperature=0,
                                    stop=[stop, "\x00never"])
    assert out.choices[0].text == ref.text == full.text[:full.text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt="Hello, world!", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_strategies_are_lossless(pair: Pair, client: openai.OpenAI) -> None:
    ref = reference(pair, "Speculative decoding", 16)
    for spec, check in [({"strategy": "plain"}, lambda u: u.tau == 1 and u.accepted_tokens == 0),
                        ({"strategy": "chain", "k": 2}, lambda u: 1 < u.tau <= 3),
                        ({"k": 6}, lambda u: u.tau > 1)]:
        out = client.completions.create(model="m", prompt="Speculative decoding", max_tokens=16, temperature=0,
                                        extra_body={"speculative": spec})
        assert out.choices[0].text == ref.text, spec
        assert check(out.usage), (spec, out.usage)


def test_seeded_sampling_equals_library(pair: Pair, client: openai.OpenAI) -> None:
    ref = reference(pair, "The lazy dog", 16, temperature=0.8, top_p=0.9, seed=7)
    outs = [client.completions.create(model="m", prompt="The lazy dog", max_tokens=16, temperature=0.8, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2)]
    assert outs == [ref.text, ref.text]


# ------------------------------------------------------------------------------------------- bad input

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 400  # > CONTEXT tokens

BAD = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', None, "json_invalid"),
    ("/v1/completions", b"not json at all", None, "json_invalid"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", None),
    ("/v1/completions", {"prompt": 42}, "prompt", None),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt", None),
    ("/v1/completions", {"prompt": [1, 10**9]}, "prompt", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt", None),
    ("/v1/completions", [1, 2, 3], None, None),
    ("/v1/completions", {"prompt": ""}, "prompt", None),
    ("/v1/completions", {"prompt": "   "}, "prompt", None),
    ("/v1/completions", {"prompt": []}, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "top_k": -1}, "top_k", None),
    ("/v1/completions", {"prompt": "hi", "seed": "7"}, "seed", None),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed", None),
    ("/v1/completions", {"prompt": "hi", "n": 9}, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", None),
    ("/v1/completions", {"prompt": "hi", "best_of_luck": 1}, "best_of_luck", "extra_forbidden"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "unsupported_field"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, None, None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions",
     "unsupported_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages", None),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 1]}, "stop", None),
    ("/v1/completions", {"prompt": "hi", "speculative": {"strategy": "nope"}}, "speculative", None),
    ("/v1/completions", {"prompt": "hi", "speculative": {"k": 0}}, "speculative", None),
    ("/v1/completions", {"prompt": "hi", "speculative": {"k": "4"}}, "speculative", None),
    ("/v1/completions", {"prompt": "hi", "speculative": {"width": 3}}, "speculative", None),
    ("/v1/completions", {"prompt": "hi", "speculative": "chain"}, "speculative", None),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature",
     None),
]


@pytest.mark.parametrize("path,body,param,code", BAD, ids=[f"{i}-{b[0][4:]}" for i, b in enumerate(BAD)])
def test_bad_input_gives_400(http: httpx.Client, path: str, body, param: str | None, code: str | None) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in r.text
    if param:
        assert error["param"] == param, error
    if code:
        assert error["code"] == code, error
    assert_serving(http)


def test_bad_input_through_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", temperature=-1)
    assert info.value.status_code == 400 and "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[], stream=True)
    assert client.completions.create(model="m", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_unknown_route_and_method(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert_serving(http)


# --------------------------------------------------------------------------------------------- load

def test_concurrent_streaming_clients(pair: Pair, client: openai.OpenAI) -> None:
    """16 clients stream at once; each gets exactly its own greedy answer, whole."""
    n = 16
    prompts = [f"Client {i}: {TEXTS[i % len(TEXTS)][: 10 + i]}" for i in range(n)]
    expected = [reference(pair, [{"role": "user", "content": p}] if i % 2 else p, 16).text
                for i, p in enumerate(prompts)]

    def ask(i: int) -> str:
        if i % 2:
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=16, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream)
        stream = client.completions.create(model="m", prompt=prompts[i], max_tokens=16, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ask, i) for i in range(n)]
        got = [f.result(timeout=max(1.0, 60 - (time.monotonic() - t0))) for f in futures]
    assert got == expected


def test_loadtest_rounds(pair: Pair, url: str) -> None:
    """`speculor loadtest` against the live server: every answer whole and equal to the library's."""
    prompts = [f"Load {i}: {t[:12]}" for i, t in enumerate(TEXTS)]
    rows = loadtest.run(url, prompts, [1, 4], requests=2, max_tokens=12)
    assert [(r["clients"], r["requests"], r["tokens"]) for r in rows] == [(1, 2, 24), (4, 8, 96)]
    assert all(r["answers_differing"] == 0 and r["throughput_tokens_per_s"] > 0 for r in rows)
    assert all(0 < r["ttft_median_s"] <= r["latency_median_s"] <= r["latency_max_s"] for r in rows)
    one = loadtest.ask(url, prompts[0], 12, timeout=60)
    assert one.text == reference(pair, [{"role": "user", "content": prompts[0]}], 12).text and one.tokens == 12
    with pytest.raises(SpeculorError, match="400"):
        loadtest.ask(url, prompts[0], 12, {"strategy": "no-such-strategy"}, timeout=60)


def test_loadtest_reference_round_and_plot(url: str, tmp_path) -> None:
    """--reference: every prompt alone first (one client, one after another), then the concurrent round is checked
    against those answers; TTFT and TPOT medians and p99; a plot per strategy."""
    prompts = [f"Ref {i}: {t[:10]}" for i, t in enumerate(TEXTS)]
    rows = loadtest.run(url, prompts, [3], max_tokens=8, reference=True)
    assert [(r["clients"], r["requests"], r.get("reference", False)) for r in rows] == [(1, 3, True), (3, 3, False)]
    assert rows[1]["answers_differing"] == 0
    for r in rows:
        assert 0 < r["ttft_median_s"] <= r["ttft_p99_s"] and 0 < r["tpot_median_s"] <= r["tpot_p99_s"]
    assert loadtest.quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and loadtest.quantile([1.0, 2.0], 0.99) == 2.0
    assert "(one by one)" in loadtest.format_rows(rows)
    loadtest.plot_rows([r | {"strategy": "chain"} for r in rows], tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------- queue and cancel

def test_requests_are_served_in_arrival_order(pair: Pair, http: httpx.Client, caplog) -> None:
    """Jobs queued behind a held engine join the batch first-come first-served, each with its own answer."""
    caplog.set_level("INFO", logger="speculor.serving.app")
    prompts = [f"Order {i}" for i in range(5)]
    expected = [reference(pair, p, 6).text for p in prompts]
    answers: dict[int, dict] = {}

    def post(i: int) -> None:
        answers[i] = http.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 6,
                                                        "temperature": 0}).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(prompts))]
    with hold_target(pair):
        for i, t in enumerate(threads):
            t.start()
            wait_for(lambda i=i: queued(http) == (True, i), f"request {i} to queue")
    for t in threads:
        t.join(30)
    assert [answers[i]["choices"][0]["text"] for i in range(len(prompts))] == expected
    ids = [answers[i]["id"].removeprefix("cmpl-") for i in range(len(prompts))]
    admitted = [r.getMessage().split()[1] for r in caplog.records
                if r.getMessage().startswith("generation ") and " admitted " in r.getMessage()]
    assert [job for job in admitted if job in ids] == ids  # joined the running batch in arrival order


def test_full_queue_answers_429(pair: Pair) -> None:
    """queue_size=1: with the engine held, one job runs (blocked), one waits, the third gets 429."""
    with live_server(create_app(pair, queue_size=1)) as base, httpx.Client(base_url=base, timeout=60) as http:
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
        ref = reference(pair, "Hello", 8).text
        results: dict[str, httpx.Response] = {}

        def post(name: str) -> None:
            results[name] = http.post("/v1/completions", json=body)

        with hold_target(pair):
            first = threading.Thread(target=post, args=("first",))
            first.start()
            wait_for(lambda: http.get("/health").json()["running"], "the first job to start")
            second = threading.Thread(target=post, args=("second",))
            second.start()
            wait_for(lambda: http.get("/health").json()["queue_depth"] == 1, "the second job to queue")
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                oai.completions.create(model="m", prompt="Hello", max_tokens=8, stream=True)
        first.join(30)
        second.join(30)
        assert [results[k].json()["choices"][0]["text"] for k in ("first", "second")] == [ref, ref]
        counts = metrics(http)
        assert counts[("speculor_requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 2
        assert counts[("speculor_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2


def _cancelled(http: httpx.Client) -> float:
    return metrics(http).get(("speculor_generations_total", (("outcome", "cancelled"),)), 0.0)


def test_disconnect_cancels_generation(pair: Pair, url: str, http: httpx.Client, caplog) -> None:
    """A stream closed after a few chunks stops its generation early; the next request is served."""
    caplog.set_level("INFO", logger="speculor.serving.app")
    before, tokens_before = _cancelled(http), metrics(http)[("speculor_generated_tokens_total", ())]
    max_tokens = CONTEXT - 64
    body = {"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as own, own.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(3)]
    wait_for(lambda: _cancelled(http) == before + 1, "the cancelled generation to end")
    generated = metrics(http)[("speculor_generated_tokens_total", ())] - tokens_before
    assert 0 < generated < max_tokens // 4
    assert any("cancelled" in rec.getMessage() for rec in caplog.records)
    assert not http.get("/health").json()["running"]
    ref = reference(pair, "Hello", 8).text
    assert http.post("/v1/completions", json={**body, "max_tokens": 8, "stream": False}).json()[
        "choices"][0]["text"] == ref


def test_non_streaming_disconnect_cancels(url: str, http: httpx.Client) -> None:
    before = _cancelled(http)
    body = {"prompt": "Hello", "max_tokens": CONTEXT - 64, "temperature": 0}
    with httpx.Client(base_url=url, timeout=0.5) as own, pytest.raises(httpx.ReadTimeout):
        own.post("/v1/completions", json=body)
    wait_for(lambda: _cancelled(http) == before + 1, "the cancelled generation to end")
    assert_serving(http)


# ------------------------------------------------------------------------------------------------ metrics

def test_metrics(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    http.post("/v1/completions", json={"prompt": "", "max_tokens": 4})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metrics(http)
    assert m[("speculor_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    assert m[("speculor_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] >= 1
    assert m[("speculor_tau_count", ())] >= 1 and m[("speculor_tau_sum", ())] >= m[("speculor_tau_count", ())]
    assert m[("speculor_generated_tokens_total", ())] >= 4
    assert ("speculor_queue_depth", ()) in m and ("speculor_running_generations", ()) in m
    assert m[("speculor_request_latency_seconds_count", (("endpoint", "/v1/completions"),))] >= 2
    assert m[("speculor_generations_total", (("outcome", "completed"),))] >= 1


# ------------------------------------------------------------------------------------------- app setup

def test_create_app_and_serve_arguments(pair: Pair, monkeypatch) -> None:
    from speculor import SpeculorError
    from speculor.serving import app as server

    with pytest.raises(SpeculorError):
        create_app(pair, strategy="nope")
    with pytest.raises(SpeculorError):
        create_app(pair, queue_size=0)
    with pytest.raises(SpeculorError):
        create_app(pair, k=0)
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    server.serve(pair, host="127.0.0.1", port=8123, strategy="plain", queue_size=3)
    assert seen["port"] == 8123 and seen["host"] == "127.0.0.1"
    assert seen["app"].state.server.scheduler.queue_size == 3 and seen["app"].state.server.sp.strategy == "plain"


def test_concurrent_requests_share_one_batch(pair: Pair) -> None:
    """Continuous batching: requests that arrive together run in one batch (the batch-size histogram sees steps of
    several requests), each with its own strategy (a plain opt-out, chain with its own k, the server's default,
    prompt lookup) and sampling settings, and each answer is the one it gets alone."""
    specs = [{"strategy": "plain"}, {"k": 2}, None, {"strategy": "ngram"}]
    sampling = [{}, {"temperature": 0.8, "seed": 3}, {}, {}]
    app = create_app(pair, strategy="chain", max_batch=4)
    prebuild(app, specs)
    with live_server(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        answers: dict[int, dict] = {}

        def post(i: int) -> None:
            body = {"prompt": TEXTS[i], "max_tokens": 24, "temperature": 0, **sampling[i]}
            if specs[i] is not None:
                body["speculative"] = specs[i]
            answers[i] = http.post("/v1/completions", json=body).json()

        post_together(pair, http, post, 4, timeout=60)
        steps = metrics(http)
    sp = Speculor(pair, strategy="chain")  # the app's
    for i in range(4):
        want = sp.generate(sp.encode(TEXTS[i]), SamplingConfig(max_new_tokens=24, **sampling[i]),
                           **({} if specs[i] is None else specs[i])).text
        assert answers[i]["choices"][0]["text"] == want, i
        assert answers[i]["usage"]["steps"] >= 1 and answers[i]["usage"]["tokens_per_step"] >= 1
    assert answers[0]["usage"]["drafted_tokens"] == 0 and answers[1]["usage"]["drafted_tokens"] > 0
    count = steps[("speculor_batch_size_count", ())]
    alone = steps[("speculor_batch_size_bucket", (("le", "1.0"),))]
    assert count > alone > 0  # some steps ran several requests together
    assert steps[("speculor_rows_per_step_count", ())] == count


def test_waiting_jobs_join_the_batch_together(pair: Pair) -> None:
    """At a step's boundary the scheduler admits every waiting job that has room, not one a step: three requests
    queued behind the first one's step join the next step together, so no step decodes two requests (one by one,
    the batch would grow 1, 2, 3, 4 and shrink 3, 2, 1)."""
    with live_server(create_app(pair, strategy="plain", max_batch=4)) as base, \
            httpx.Client(base_url=base, timeout=60) as http:
        def post(i: int) -> None:
            http.post("/v1/completions", json={"prompt": TEXTS[0], "max_tokens": 8, "temperature": 0})

        post_together(pair, http, post, 4, timeout=60)
        steps = metrics(http)
    upto = {le: steps[("speculor_batch_size_bucket", (("le", f"{le}.0"),))] for le in (1, 2, 4)}
    assert upto[4] > upto[2] and upto[1] > 0  # steps of three or four, and the first request's own
    assert upto[2] == upto[1]  # none of two


def test_jobs_wait_for_room_in_a_shared_memory(pair: Pair, monkeypatch) -> None:
    """On a target whose requests share one memory of `cells` (llama.cpp's), a job joins the batch only when its
    prompt and longest answer fit beside the running jobs': with room for two, no step runs three, and every answer
    is the one it gets alone."""
    sp = Speculor(pair)
    ids = [sp.encode(t) for t in TEXTS[:4]]
    monkeypatch.setattr(pair.target, "traits", replace(pair.target.traits, cells=max(len(i) for i in ids) * 2 + 48))
    with live_server(create_app(pair, strategy="plain", max_batch=4)) as base, \
            httpx.Client(base_url=base, timeout=60) as http:
        answers: dict[int, str] = {}

        def post(i: int) -> None:
            body = {"prompt": TEXTS[i], "max_tokens": 24, "temperature": 0}
            answers[i] = http.post("/v1/completions", json=body).json()["choices"][0]["text"]

        post_together(pair, http, post, 4, timeout=60)
        steps = metrics(http)
    assert answers == {i: sp.generate(ids[i], SamplingConfig(max_new_tokens=24)).text for i in range(4)}
    count = steps[("speculor_batch_size_count", ())]
    assert steps[("speculor_batch_size_bucket", (("le", "2.0"),))] == count
    assert steps[("speculor_batch_size_bucket", (("le", "1.0"),))] < count  # two did run together


def test_a_requests_strategy_is_built_off_the_event_loop_between_steps(pair: Pair) -> None:
    """Building a strategy may run forwards (an auto budget timing a head): never on the event loop, never beside
    the worker's forwards on the same models (llama.cpp's shared context). Every build, the request's check and the
    worker's admission alike, runs outside any event loop with the scheduler's model lock held."""
    import asyncio

    app = create_app(pair, strategy="chain", queue_size=8)
    srv = app.state.server
    seen, build = [], srv.sp.strategy_for

    def recording(name: str, **options):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((name, on_loop, srv.scheduler._models.locked()))
        return build(name, **options)

    srv.sp.strategy_for = recording
    with live_server(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        for spec in ({"strategy": "chain", "k": 2}, {"strategy": "ngram"}, {"k": 3}):
            r = http.post("/v1/completions", json={"prompt": TEXTS[0], "max_tokens": 4, "temperature": 0,
                                                   "speculative": spec})
            assert r.status_code == 200, r.text
        assert http.post("/v1/completions", json={"prompt": "hi", "speculative": {"k": 0}}).status_code == 400
    assert {name for name, _, _ in seen} >= {"chain", "ngram"}
    assert all(not on_loop and locked for _, on_loop, locked in seen), seen
