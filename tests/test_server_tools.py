"""Tool calls and structured output through the live server, driven by the official openai client: calls parsed and
valid against their tools' schemas, streamed as OpenAI streams them, identical to plain constrained decoding and to
their one-client answers under concurrency, and every bad input a 400 naming it. The pair is tiny and random
(support/server.py): under a constraint its text is whatever the grammar leaves it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.server import live_server, tiny_pair

from speculor import Pair
from speculor.grammar.tools import CallStream, Tool, calls, read_tools
from speculor.serving.app import create_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "unit": {"enum": ["celsius", "fahrenheit"]},
                                                "days": {"enum": [1, 2, 3]}},
                                                "required": ["unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok", "level"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_pair()


@pytest.fixture(scope="module")
def url(pair: Pair) -> Iterator[str]:
    with live_server(create_app(pair, strategy="chain", queue_size=64)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def valid_weather(args: dict) -> bool:
    return set(args) == {"unit", "days"} and args["unit"] in ("celsius", "fahrenheit") and args["days"] in (1, 2, 3)


def answer(message) -> tuple:
    """A message's content and calls (name, arguments): the ids are fresh each time."""
    return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def ask(client, **kw):
    return client.chat.completions.create(model="m", messages=kw.pop("messages", ASK), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 96), **kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_is_parsed_and_matches_its_schema(client, choice):
    r = ask(client, tools=[WEATHER, TIME], tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict) or call.function.name == "get_weather":
            assert call.function.name == "get_weather" and valid_weather(args)
        else:
            assert call.function.name == "get_time" and args["zone"] in ("utc", "local")


def test_streamed_calls_are_the_whole_answers_calls(client):
    whole = ask(client, tools=[WEATHER], tool_choice="required").choices[0]
    parts: dict[int, dict] = {}
    finish, pieces = None, 0
    for chunk in ask(client, tools=[WEATHER], tool_choice="required", stream=True):
        pieces += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
        for d in chunk.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            p["id"] = d.id or p["id"]
            p["name"] = (d.function.name if d.function and d.function.name else p["name"])
            p["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(p["id"] for p in parts.values())
    assert pieces > 2 * len(parts)  # the arguments came in several pieces


def test_constrained_speculation_equals_plain_constrained_decoding(client):
    for kw in ({"tools": [WEATHER, TIME], "tool_choice": "required"},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}):
        spec = ask(client, **kw)
        plain = ask(client, extra_body={"speculative": {"strategy": "plain"}}, **kw)
        assert answer(spec.choices[0].message) == answer(plain.choices[0].message)
        assert spec.usage.completion_tokens == plain.usage.completion_tokens


def test_concurrent_answers_are_their_one_client_answers(client):
    bodies = [{"tools": [WEATHER], "tool_choice": "required"}, {"response_format": {"type": "json_object"}},
              {"tools": [WEATHER, TIME], "tool_choice": "required"},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}]
    alone = [answer(ask(client, **b).choices[0].message) for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: answer(ask(client, **b).choices[0].message), bodies))
    assert together == alone


def test_response_format_json_schema_and_json_object(client):
    r = ask(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA,
                                                                            "strict": True}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"ok", "level"} and isinstance(obj["ok"], bool) and obj["level"] in ("low", "high")
    r = ask(client, response_format={"type": "json_object"}, max_tokens=400)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_a_schema_keeps_its_order_of_properties(http):
    """The object comes out in the schema's order of properties (llguidance keeps it): nothing reorders them."""
    for order in (["ok", "level"], ["level", "ok"]):
        schema = {**SCHEMA, "properties": {k: SCHEMA["properties"][k] for k in order}}
        r = http.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 60, "temperature": 0,
                                               "json_schema": schema}).json()
        assert list(json.loads(r["choices"][0]["text"])) == order


def test_llama_server_fields_on_completions(http):
    r = http.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 40, "temperature": 0,
                                           "grammar": 'root ::= "yes" | "no" | "maybe"'}).json()
    assert r["choices"][0]["text"] in ("yes", "no", "maybe")
    r = http.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 60, "temperature": 0,
                                           "json_schema": SCHEMA}).json()
    assert set(json.loads(r["choices"][0]["text"])) == {"ok", "level"}


def test_tool_choice_none_reads_no_call(client):
    r = ask(client, tools=[WEATHER], tool_choice="none", max_tokens=6).choices[0]
    assert r.message.tool_calls is None and r.finish_reason == "length"


def test_a_call_cut_by_max_tokens_is_length_with_its_text(client):
    c = ask(client, tools=[WEATHER], tool_choice="required", max_tokens=5).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content


def test_an_agent_loop_runs_through_tool_messages(client):
    first = ask(client, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    r = ask(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools", "compile"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "nope"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 3}}}},
     "response_format", "compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "combined"),
    ({"grammar": "root ::= ("}, "grammar", "gbnf"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages", "call_x"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD, ids=[b[2] + "-" + b[1] for b in BAD])
def test_bad_structured_input_is_a_400_naming_it(http, body, param, says):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says.lower() in err["message"].lower(), err


# ---------------------------------------------------------------- reading calls back (pure)

TOOLS = read_tools([WEATHER, TIME])
CALL = '{"name": "get_time", "arguments": {"zone": "utc"}}'


def test_text_that_only_looks_like_a_call_stays_content():
    text = ('Try ```json\n{"name": "get_time", "arguments": {"zone": \n``` or '
            '<tool_call>\n{"name": "nope"}\n</tool_call>')
    content, found = calls(text, TOOLS)
    assert found == [] and content == text
    content, found = calls(f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n```json\n{CALL}\n```", TOOLS)
    assert content == "Sure." and [c.name for c in found] == ["get_time", "get_time"]


@pytest.mark.parametrize("cut", [1, 3, 7, 200])
def test_call_stream_streams_the_calls_of_the_whole_text_in_any_pieces(cut):
    text = (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\nthen ```json\n{{\"bad\": 1}}\n``` and "
            f"```json\n{CALL}\n```!")
    stream = CallStream(TOOLS)
    events = [e for i in range(0, len(text), cut) for e in stream.add(text[i:i + cut])] + stream.flush()
    content = "".join(v for k, v in events if k == "content")
    opened = [v for k, v in events if k == "call"]
    args = {n: "".join(a for m, a in (v for k, v in events if k == "arguments") if m == n) for n, _ in opened}
    assert [n for n, _ in opened] == [0, 1] and [c.name for _, c in opened] == ["get_time", "get_time"]
    assert args == {0: '{"zone": "utc"}', 1: '{"zone": "utc"}'}
    assert content == "Let me check.\n\nthen ```json\n{\"bad\": 1}\n``` and !"
    assert [c.arguments for c in calls(text, TOOLS)[1]] == [args[0], args[1]]


def test_a_streamed_call_arrives_in_pieces_before_it_closes():
    stream = CallStream(TOOLS)
    head = stream.add('<tool_call>\n{"name": "get_time", "arguments": {"zone": "ut')
    assert [k for k, _ in head] == ["call"]
    more = stream.add('c", "more": "xxxxxxxxxxxxxx')
    assert more and more[0][0] == "arguments"  # sent before the block closed
    assert isinstance(TOOLS[0], Tool)


def test_the_library_returns_the_servers_calls(pair, client):
    from speculor import SamplingConfig, Speculor

    sp = Speculor(pair, strategy="chain")
    out = sp.generate(ASK, SamplingConfig(max_new_tokens=96), tools=[WEATHER, TIME], tool_choice="required")
    served = ask(client, tools=[WEATHER, TIME], tool_choice="required").choices[0].message
    assert out.finish_reason == "tool_calls" and out.tool_calls
    assert (out.content, [(c.name, c.arguments) for c in out.tool_calls]) == answer(served)
    js = sp.generate("Say:", SamplingConfig(max_new_tokens=60), response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert set(json.loads(js.text)) == {"ok", "level"}
