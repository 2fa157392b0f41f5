"""The OpenAI request fields beyond sampling, through the real openai client against a live server of the tiny
pair: logprobs (checked against a plain forward of the target), n choices, logit_bias, penalties, unknown and
unsupported fields refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from support.server import live_server, tiny_pair

from speculor import Pair, SamplingConfig, Speculor
from speculor.serving.app import create_app

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_pair()


@pytest.fixture(scope="module")
def client(pair: Pair) -> Iterator[openai.OpenAI]:
    with live_server(create_app(pair)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def plain_logprobs(pair: Pair, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log softmax of the target's logits at every answer position, from one plain full forward [len(answer), V]."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = pair.target.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_completion_logprobs_are_the_targets(pair: Pair, client: openai.OpenAI) -> None:
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    sp = Speculor(pair)
    ref = sp.generate(sp.encode(PROMPT), SamplingConfig(max_new_tokens=12))
    lp = plain_logprobs(pair, sp.encode(PROMPT), ref.token_ids)
    got = out.choices[0].logprobs
    assert "".join(got.tokens) == out.choices[0].text == ref.text
    assert got.token_logprobs == pytest.approx([float(lp[i, t]) for i, t in enumerate(ref.token_ids)], abs=1e-4)
    for i, alts in enumerate(got.top_logprobs):
        top = torch.topk(lp[i], 3)
        want: dict[str, float] = {}
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            want.setdefault(pair.tokenizer.decode([t]), v)
        assert alts == pytest.approx(want, abs=1e-4)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]


def test_chat_logprobs_streamed_and_whole(pair: Pair, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello, world!"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = whole.choices[0].logprobs.content
    sp = Speculor(pair)
    prompt = sp.encode_chat(messages)
    ids = [sp.encode(c.token) for c in content]  # each entry's token text
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    lp = plain_logprobs(pair, prompt, sp.generate(prompt, SamplingConfig(max_new_tokens=10)).token_ids)
    assert [c.logprob for c in content] == pytest.approx(lp.max(dim=-1).values.tolist(), abs=1e-4)  # greedy
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content) and ids
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


def test_n_choices_are_independent_seeded_samples(pair: Pair, client: openai.OpenAI) -> None:
    """n choices run together in one batch; choice i is what seed + i gives alone (a seeded request sizes its
    tree as if alone under the batch-aware default)."""
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    sp = Speculor(pair)  # the server's default, batch-aware
    for i, choice in enumerate(out.choices):
        alone = sp.generate(sp.encode(PROMPT), SamplingConfig(temperature=1.0, seed=11 + i, max_new_tokens=16))
        assert choice.text == alone.text
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 48
    stream = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11, n=3,
                                            stream=True))
    texts = ["".join(ch.choices[0].text for ch in stream if ch.choices and ch.choices[0].index == i)
             for i in range(3)]
    assert texts == [c.text for c in out.choices]


def test_logit_bias_and_penalties_change_the_answer(pair: Pair, client: openai.OpenAI) -> None:
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    first = Speculor(pair).encode(greedy.choices[0].logprobs.tokens[0])[0]
    banned = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text[:1] and not banned.choices[0].text.startswith(greedy.choices[0].logprobs.tokens[0])
    ids = Speculor(pair).encode(greedy.choices[0].text)
    assert len(set(ids)) < len(ids)  # the greedy answer repeats tokens ...
    for field in ("frequency_penalty", "presence_penalty"):
        penalised = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                              **{field: 2.0})
        assert penalised.choices[0].text != greedy.choices[0].text, field  # ... which the penalties discourage
    penalised = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"repetition_penalty": 3.0})
    assert penalised.choices[0].text != greedy.choices[0].text


def test_unknown_and_unsupported_fields_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="function_call"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       function_call="auto")
    ok = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, user="me",
                                   extra_body={"metadata": {"k": "v"}, "store": False})
    assert ok.usage.completion_tokens == 2
