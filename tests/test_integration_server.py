"""Integration group: the OpenAI-compatible server on the embedded real pair, live on 127.0.0.1, driven by the
official `openai` client and by `speculor loadtest`: greedy answers equal the library's, also under 4 concurrent
streaming clients."""

from __future__ import annotations

import openai
import pytest
from support.server import live_server

from speculor import SamplingConfig, Speculor
from speculor.bench import loadtest
from speculor.serving.app import create_app

pytestmark = pytest.mark.integration
PROMPTS = ["Write a Python function that reverses a string.", "What is a KV cache? Answer in one sentence."]


@pytest.fixture(scope="module")
def url(real_pair):
    with live_server(create_app(real_pair, strategy="chain", queue_size=8)) as base:
        yield base


def library_answer(real_sp: Speculor, prompt: str, max_tokens: int) -> str:
    ids = real_sp.encode(prompt, chat=True)
    return real_sp.generate(ids, SamplingConfig(max_new_tokens=max_tokens)).text


def test_chat_greedy_equals_library(real_sp: Speculor, url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    out = client.chat.completions.create(model="qwen2.5-coder-1.5b-instruct", max_tokens=24, temperature=0,
                                         messages=[{"role": "user", "content": PROMPTS[0]}],
                                         extra_body={"speculative": {"strategy": "dyspec"}})
    assert out.choices[0].message.content == library_answer(real_sp, PROMPTS[0], 24)
    assert out.usage.completion_tokens == 24 and out.usage.model_extra["tau"] > 1


def test_concurrent_streams_equal_library(real_sp: Speculor, url: str) -> None:
    rows = loadtest.run(url, PROMPTS, [1, 4], max_tokens=16)
    assert [r["tokens"] for r in rows] == [16, 64] and all(r["answers_differing"] == 0 for r in rows)
    assert loadtest.ask(url, PROMPTS[0], 16).text == library_answer(real_sp, PROMPTS[0], 16)
