"""`speculor toolbench`: tool calls and JSON schemas through OpenAI-compatible servers, with the openai client.

Sets (bfcl-eval's own question and possible-answer files; `pip install --no-deps bfcl-eval`, `make bfcl`):
    bfcl-simple    BFCL simple_python: one tool, one call
    bfcl-multiple  BFCL multiple: several tools, one call
    bfcl-parallel  BFCL parallel: one tool, several calls
    schema         response_format json_schema: the BFCL simple_python questions answered as {"name", "arguments"}
                   objects under the schema of their tool's call (an extraction schema as programs send them)

Each question goes out as BFCL sends it to an OpenAI-compatible model (its tools converted to JSON schema, greedy,
streamed, `tool_choice` auto), one at a time. Accuracy is BFCL's own rule (bfcl-eval's ast_checker: the name, every
required argument, each value among the allowed ones). Per answer: the calls parsed from `tool_calls` (what a client
gets), the calls read from the text by our parser (`read`: what the model's free text holds), whether every call
matches its tool's schema, time to first token, end to end, and decode speed (answer tokens after the first over
the time after the first token).
"""

from __future__ import annotations

import json
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from speculor.errors import SpeculorError
from speculor.grammar.tools import calls, read_tools

SETS = {"bfcl-simple": "simple_python", "bfcl-multiple": "multiple", "bfcl-parallel": "parallel",
        "schema": "simple_python"}
TYPES = {"dict": "object", "float": "number", "tuple": "array"}  # BFCL's type names -> JSON schema's


@dataclass(frozen=True)
class Question:
    set: str
    id: str
    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]]  # BFCL's own descriptions (the checker reads them)
    answer: list[dict[str, Any]]  # BFCL's possible answers

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                                  "parameters": schema(f["parameters"])}} for f in self.functions]


def schema(s: Any) -> Any:
    """A BFCL parameter description as JSON schema (as BFCL converts it for OpenAI-style models): its type names
    mapped, its `optional` flags dropped, through properties and items (a property may be named "type")."""
    if isinstance(s, list):
        return [schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: v for k, v in s.items() if k != "optional"}
    kind = out.get("type")
    if kind == "any":
        out.pop("type")
    elif isinstance(kind, str) and kind in TYPES:
        out["type"] = TYPES[kind]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: schema(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties", "anyOf", "oneOf"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = schema(out[key])
    return out


def load(name: str, limit: int) -> list[Question]:
    """The first `limit` questions of a set (SETS), with their possible answers."""
    if name not in SETS:
        raise SpeculorError(f"unknown tool set {name!r}: choose from {', '.join(SETS)}")
    try:
        data = resources.files("bfcl_eval") / "data"
    except ModuleNotFoundError as exc:
        raise SpeculorError("the BFCL sets need bfcl-eval's data files: `make bfcl` (pip install --no-deps "
                            "bfcl-eval)") from exc
    file = f"BFCL_v4_{SETS[name]}.json"
    rows = [json.loads(line) for line in (data / file).read_text().splitlines()[:limit]]
    answers = {r["id"]: r["ground_truth"] for r in (json.loads(line) for line in
                                                    (data / "possible_answer" / file).read_text().splitlines())}
    out = [Question(name, r["id"], r["question"][0], r["function"], answers[r["id"]]) for r in rows]
    for q in out:
        read_tools(q.tools)  # every question's tools convert (before any server starts)
    return out


def checker():
    """bfcl-eval's ast_checker, imported without its model handlers (their SDKs are not installed: the checker reads
    one model setting, whether a name's '_' stands for '.', which is False for every model served here)."""
    if "bfcl_eval.constants.model_config" not in sys.modules:
        stub = types.ModuleType("bfcl_eval.constants.model_config")
        stub.MODEL_CONFIG_MAPPING = _NoDots()
        sys.modules["bfcl_eval.constants.model_config"] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    def check(q: Question, found: list[dict[str, Any]]) -> bool:
        category = SETS[q.set] if q.set != "schema" else "simple_python"
        return bool(ast_checker(q.functions, found, q.answer, Language.PYTHON, category, "speculor")["valid"])

    return check


class _NoDots(dict):
    def __getitem__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)

    def __contains__(self, key: object) -> bool:
        return True


@dataclass
class Answer:
    set: str
    id: str
    server: str
    text: str
    calls: list[dict[str, Any]]  # [{name: arguments}] from tool_calls (or, for `schema`, the JSON content)
    read: list[dict[str, Any]]  # [{name: arguments}] read from the text by our parser
    tokens: int
    ttft_s: float
    total_s: float
    finish: str | None
    correct: bool = False
    read_correct: bool = False
    valid: bool = False  # every call matches its tool's schema (names a tool; required arguments present)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / (self.total_s - self.ttft_s) if self.tokens > 1 and self.total_s > self.ttft_s \
            else 0.0


def ask(client: Any, q: Question, server: str, max_tokens: int, extra: dict[str, Any] | None = None,
        tool_choice: str = "auto") -> Answer:
    """One question, streamed, greedy; its calls (tool_calls deltas accumulated, as the openai client's users do)."""
    kw: dict[str, Any] = {"tools": q.tools, "tool_choice": tool_choice}
    if q.set == "schema":
        fn = q.tools[0]["function"]
        call = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
        kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": call,
                                                                          "strict": True}}}
    t0 = time.perf_counter()
    first, text, parts, tokens, finish, usage = None, [], {}, 0, None, {}
    stream = client.chat.completions.create(model="m", messages=q.messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=extra or {}, **kw)
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            usage = {k: v for k, v in (chunk.usage.model_extra or {}).items() if k in ("steps", "forced_tokens")}
        for c in chunk.choices:
            d = c.delta
            if (d.content or d.tool_calls) and first is None:
                first = time.perf_counter()
            text.append(d.content or "")
            for tc in d.tool_calls or []:
                p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                p["name"] += (tc.function.name or "") if tc.function else ""
                p["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    total = time.perf_counter() - t0
    whole = "".join(text)
    found = [_as_call(p["name"], p["arguments"]) for _, p in sorted(parts.items())]
    if q.set == "schema":
        obj = _json(whole)
        found = [_as_call(obj.get("name", ""), json.dumps(obj.get("arguments"))) if isinstance(obj, dict) else {}]
    read = [{c.name: json.loads(c.arguments)} for c in calls(whole, read_tools(q.tools))[1]]
    return Answer(q.set, q.id, server, whole, found, read, tokens, (first or time.perf_counter()) - t0, total,
                  finish, extra=dict(usage))  # our server's steps and forced tokens


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _as_call(name: str, arguments: str) -> dict[str, Any]:
    args = _json(arguments)
    return {name: args} if isinstance(args, dict) else {}


def valid(q: Question, found: list[dict[str, Any]]) -> bool:
    """Every call names one of the tools, with its required arguments and no unknown one (what the schema says)."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in q.tools}
    for c in found:
        if len(c) != 1:
            return False
        (name, args), = c.items()
        spec = tools.get(name)
        if spec is None or not set(spec.get("required", [])) <= set(args) or \
                not set(args) <= set(spec.get("properties", {})):
            return False
    return bool(found)


def score(answers: list[Answer], questions: dict[tuple[str, str], Question]) -> None:
    check = checker()
    for a in answers:
        q = questions[(a.set, a.id)]
        a.valid = valid(q, a.calls)
        a.correct = a.valid and check(q, a.calls)
        a.read_correct = bool(a.read) and check(q, a.read)


def save(answers: list[Answer], path: str) -> None:
    with open(path, "w") as f:
        for a in answers:
            f.write(json.dumps(asdict(a) | {"decode_tps": a.decode_tps}) + "\n")
