"""OpenAI `tools`, `tool_choice` and `response_format` as constraints, and the model's tool calls read back.

A call is written the way the embedded models' chat template (Qwen2.5's) asks for it:

    <tool_call>
    {"name": "<a tool's name>", "arguments": {<the tool's parameters>}}
    </tool_call>

and, as this model writes it when left free (measured on BFCL, docs/bench/grammar/README.md), as a Markdown block:

    ```json
    {"name": ..., "arguments": ...}
    ```

The call's JSON is constrained by the tools' schemas (one `anyOf` branch per tool, its name a constant). Under
`tool_choice` "auto" the text is free until it opens a call with either of the two openers (llguidance's lazy
lexemes: the opener is the trigger), then the call is constrained; "required" and a named function constrain from
the first token; "none" not at all. `calls(text)` reads the calls back: a block whose JSON does not parse as a call
of a given tool stays in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from speculor.errors import SpeculorError
from speculor.grammar.compile import JSON_STYLE, Constraint


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_tools(tools: Any) -> list[Tool]:
    """OpenAI's `tools` list checked: SpeculorError naming the first problem."""
    if not isinstance(tools, list) or not tools:
        raise SpeculorError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise SpeculorError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise SpeculorError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got "
                                f"{name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise SpeculorError(f"tools[{i}].function.parameters must be a JSON schema of type object")
        if name in (o.name for o in out):
            raise SpeculorError(f"tools[{i}]: two tools are named {name!r}")
        out.append(Tool(name, params))
    return out


def chosen(tools: list[Tool], tool_choice: Any) -> tuple[str, list[Tool]]:
    """(mode, the tools a call may name) of `tool_choice`: "auto" (default), "none", "required", or a named
    function ({"type": "function", "function": {"name": ...}}), which is "required" of that tool alone."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice or "auto", tools
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise SpeculorError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                            '{"name": ...}}')
    named = [t for t in tools if t.name == name]
    if not named:
        raise SpeculorError(f"tool_choice names {name!r}, which is not among the tools")
    return "required", named


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON of one call: {"name": a tool's name, "arguments": that tool's parameters}."""
    branches = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_constraint(tools: list[Tool], mode: str, parallel: bool = True, special_tags: bool = True
                    ) -> Constraint | None:
    """The constraint of a request with tools (module docstring); None for "none". special_tags: `<tool_call>` and
    `</tool_call>` are special tokens of the tokenizer (Qwen2.5's), named as such (they match no text)."""
    if mode == "none":
        return None
    body = "%json " + json.dumps({**call_schema(tools), "x-guidance": JSON_STYLE})
    open_, close = ("<tool_call>", "</tool_call>") if special_tags else ('"<tool_call>"', '"</tool_call>"')
    tag = f'{open_} "\\n" call "\\n" {close}'
    rules = [f"call: {body}"]
    if mode == "required":  # the template's own syntax, from the first token; then only more calls
        rules.append(f"start: {tag}" + (f' ("\\n" {tag})*' if parallel else ""))
        return Constraint("lark", "\n".join(rules))
    # auto: free text, where either opener starts a constrained call (the Markdown one a lazy lexeme: the text
    # ends at the first opener); then free text again
    rules += [f"start: block{'*' if parallel else '?'} TEXT", "TEXT: /(.|\\n)*/",
              'block: markdown_open call "\\n```" | TEXT ' + tag, 'markdown_open[lazy]: TEXT "```json\\n"']
    return Constraint("lark", "\n".join(rules))


def response_constraint(response_format: Any) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise SpeculorError("response_format.json_schema must be {\"name\": ..., \"schema\": {...}}")
        return Constraint.json_schema(spec.get("schema", {}))
    raise SpeculorError('response_format.type must be "text", "json_object" or "json_schema"')


BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>|```json\s*(\{.*?\})\s*```", re.S)


def calls(text: str, tools: list[Tool]) -> tuple[str | None, list[Call]]:
    """(the content left, the calls) of a complete answer: every block (either syntax) whose JSON is a call of a
    given tool (name and an arguments object) becomes a call; anything else stays in the content."""
    names = {t.name for t in tools}
    found: list[Call] = []
    kept, at = [], 0
    for m in BLOCK.finditer(text):
        call = _call(m.group(1) or m.group(2), names)
        if call is not None:
            kept.append(text[at:m.start()])
            at = m.end()
            found.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if found else text
    return (content or None), found


def _call(body: str, names: set[str]) -> Call | None:
    """A block's JSON as a call of a given tool, or None; its arguments as written where the block opens the way
    the grammar writes a call (what `CallStream` streams), else re-serialized."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
        return None
    head = HEAD.match(body)
    raw = body[head.end():].rstrip()[:-1] if head is not None else None
    args = raw if raw is not None and _parses(raw) else json.dumps(obj.get("arguments", {}), ensure_ascii=False)
    return Call("call_" + uuid.uuid4().hex[:24], obj["name"], args)


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as the template reads them: an assistant's tool_calls with their arguments as objects; every
    `tool` message answering a call made before it (SpeculorError otherwise)."""
    out, made = [], set()
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            rendered = []
            for c in m["tool_calls"]:
                try:
                    args = json.loads(c["function"]["arguments"])
                except (json.JSONDecodeError, TypeError) as exc:
                    raise SpeculorError(f"messages[{i}].tool_calls: arguments must be a JSON object text") from exc
                rendered.append({"type": "function", "id": c["id"],
                                 "function": {"name": c["function"]["name"], "arguments": args}})
                made.add(c["id"])
            m["tool_calls"] = rendered
        if m.get("role") == "tool" and m.get("tool_call_id") not in made:
            raise SpeculorError(f"messages[{i}] (role tool) answers tool_call_id {m.get('tool_call_id')!r}, which "
                                "no earlier assistant message called")
        out.append(m)
    return out


OPEN = re.compile(r"<tool_call>|```json")
OPENERS = ("<tool_call>", "```json")
CLOSERS = {"<tool_call>": "</tool_call>", "```json": "```"}
HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_.\-]{1,64})", "arguments": ')  # a call as the grammar writes it


class CallStream:
    """A streamed answer's text read as it comes, calls streamed as OpenAI streams them. `add(text)` gives events in
    order: ("content", text); ("call", (n, Call)) when the answer's n-th call opens (its id and name, arguments
    still empty); ("arguments", (n, text)) as its arguments come. A call's arguments go out as they are written
    (less the last characters, which may be the call's own closing brace); a block that does not open as a call of a
    given tool (the head `{"name": ..., "arguments": ` the grammar writes) goes out as content once it closes.
    `flush()` gives what is still held (a call cut by max_tokens ends where it was cut)."""

    def __init__(self, tools: list[Tool]) -> None:
        self.names = {t.name for t in tools}
        self.held = ""
        self.made = 0  # calls opened
        self.opener: str | None = None  # the opener of the block being read
        self.sent: int | None = None  # of a call being streamed: the characters of its arguments sent

    def add(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        out: list[tuple[str, Any]] = []
        while self._advance(out):
            pass
        return out

    def _advance(self, out: list[tuple[str, Any]]) -> bool:
        """One move of the reader; whether another may follow."""
        if self.opener is None:
            m = OPEN.search(self.held)
            if m is None:  # hold back what may begin an opener
                keep = max((k for o in OPENERS for k in range(1, len(o)) if self.held.endswith(o[:k])), default=0)
                self._content(out, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return False
            self._content(out, self.held[:m.start()])
            self.opener, self.held = m.group(0), self.held[m.start():]
            return True
        body = self.held[len(self.opener):]
        closer = CLOSERS[self.opener]
        if self.sent is None:  # not yet known to be a call
            head = HEAD.match(body)
            if head is not None and head.group(1) in self.names:
                out.append(("call", (self.made, Call("call_" + uuid.uuid4().hex[:24], head.group(1), ""))))
                self.made += 1
                self.held, self.sent = self.opener + body[head.end():], 0
                return True
            end = body.find(closer)
            if end < 0:
                return False
            self._content(out, self.held[:len(self.opener) + end + len(closer)])  # closed, not a call: content
            self.held, self.opener = body[end + len(closer):], None
            return True
        end = body.find(closer)
        args = body if end < 0 else body[:end].rstrip()
        ready = len(args) - (1 + len(closer) + 2) if end < 0 else len(args) - 1  # the call's own "}" stays out
        if ready > self.sent:
            out.append(("arguments", (self.made - 1, args[self.sent:ready])))
            self.sent = ready
        if end < 0:
            return False
        self.held, self.opener, self.sent = body[end + len(closer):], None, None
        return True

    def flush(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.sent is not None:
            args = self.held[len(self.opener):]
            if len(args) > self.sent:
                out.append(("arguments", (self.made - 1, args[self.sent:])))
        else:
            self._content(out, self.held)
        self.held, self.opener, self.sent = "", None, None
        return out

    @staticmethod
    def _content(out: list[tuple[str, Any]], text: str) -> None:
        if text:
            out.append(("content", text))
