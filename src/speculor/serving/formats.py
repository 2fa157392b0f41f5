"""OpenAI response objects and how a job's events reach the client.

Contract: `Format` builds the OpenAI bodies of one request (text or chat completion, one choice per job, whole
or as stream chunks, log-probabilities and usage included); `sse_stream` turns the jobs' events into the
server-sent-events body that ends with `data: [DONE]`, sent by `EventStream`, which cancels the jobs however the
response ends; `collect` waits for whole generations, cancelling them if the client hangs up, and raises a
job's APIError if it failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from speculor.engine.request import Token
from speculor.grammar import tools as tool_calls
from speculor.grammar.tools import Call, CallStream, Tool
from speculor.serving.errors import APIError
from speculor.serving.scheduler import Delta, Done, Event, Failed, Job


@dataclass
class Format:
    """OpenAI response objects of one request: text or chat completions, one choice per job (`n`); with
    `logprobs` (None: off; else the number of alternatives) each choice carries its tokens' log-probabilities in
    the endpoint's own layout. `piece(id)` is a token's text."""

    chat: bool
    model: str
    job_id: str
    piece: Callable[[int], str] = str
    logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    tools: list[Tool] = field(default_factory=list)  # a chat request's tools: its calls are read from its text

    @property
    def id(self) -> str:
        """The response id: the first job's id (as in the server log) with OpenAI's prefix."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.job_id

    def _obj(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, answers: list[tuple[str, str, list[Token]]], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole response: answers[i] = (text, finish reason, tokens) of choice i."""
        choices = []
        for i, (text, finish, tokens) in enumerate(answers):
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": self._logprobs(tokens)}
            if self.chat and self.tools:
                content, calls = tool_calls.calls(text, self.tools)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [c.openai() for c in calls]
                    choice["finish_reason"] = "tool_calls" if finish == "stop" else finish
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._obj(choices, chunk=False), "usage": usage}

    def chunk(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              tokens: tuple[Token, ...] = ()) -> dict[str, Any]:
        """A stream chunk of choice `index` with `text` (None: no content, as in the final chunk), its tokens'
        log-probabilities and the finish reason."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish,
                                  "logprobs": self._logprobs(tokens) if tokens else None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._obj([choice], chunk=True)

    def call_chunk(self, index: int, n: int, call: Call | None = None, arguments: str = "") -> dict[str, Any]:
        """A tool-call chunk of choice `index` for its n-th call, as OpenAI streams one: the call's id and name as
        it opens (`call`), then pieces of its arguments."""
        d: dict[str, Any] = {"index": n, "function": {"arguments": arguments}}
        if call is not None:
            d = {"index": n, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return self._obj([{"index": index, "finish_reason": None, "logprobs": None, "delta": {"tool_calls": [d]}}],
                         chunk=True)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._obj([], chunk=True), "usage": usage}

    def _logprobs(self, tokens: list[Token] | tuple[Token, ...]) -> dict[str, Any] | None:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: {tokens, token_logprobs,
        top_logprobs, text_offset}."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._entry(t.id, t.logprob),
                                 "top_logprobs": [self._entry(i, lp) for i, lp in t.top]} for t in tokens]}
        pieces = [self.piece(t.id) for t in tokens]
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        return {"tokens": pieces, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [self._alternatives(t) for t in tokens], "text_offset": offsets}

    def _alternatives(self, token: Token) -> dict[str, float]:
        """{text: logprob} of a token's alternatives, most likely first (two ids with one text: the likelier)."""
        alts: dict[str, float] = {}
        for i, lp in token.top:
            alts.setdefault(self.piece(i), lp)
        return alts

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def combined(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a request with several choices: the prompt once, the generations' counts summed."""
    if len(usages) == 1:
        return usages[0]
    total = {k: sum(u[k] for u in usages) for k in ("completion_tokens", "accepted_tokens", "steps", "drafted_tokens",
                                                    "forced_tokens")}
    prompt = usages[0]["prompt_tokens"]
    per_step = round(total["completion_tokens"] / total["steps"], 4) if total["steps"] else 0.0
    return {"prompt_tokens": prompt, "completion_tokens": total["completion_tokens"],
            "total_tokens": prompt + total["completion_tokens"], "tau": per_step,
            "accepted_tokens": total["accepted_tokens"], "steps": total["steps"],
            "drafted_tokens": total["drafted_tokens"], "forced_tokens": total["forced_tokens"],
            "tokens_per_step": per_step}


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every job as they come; each job's stream ends with its Done or Failed."""
    if len(jobs) == 1:
        async for event in jobs[0].stream():
            yield 0, event
        return
    out: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        async for event in job.stream():
            await out.put((i, event))
        await out.put(None)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        live = len(jobs)
        while live:
            item = await out.get()
            if item is None:
                live -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def sse_stream(jobs: list[Job], fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: per choice, content chunks and a chunk with its finish reason; then [usage,] `data: [DONE]`.

    An error after the headers went out becomes an `{"error": ...}` event (and ends the stream). Closing the
    stream early (the client disconnected) cancels the jobs through `Job.stream`.
    """
    if fmt.chat:
        for i in range(len(jobs)):
            yield sse(fmt.chunk(i, "", role=True))
    usages = []
    reading = [CallStream(fmt.tools) for _ in jobs] if fmt.chat and fmt.tools else None
    async for i, event in _merged(jobs):
        if isinstance(event, Delta) and reading is None:
            yield sse(fmt.chunk(i, event.text, tokens=event.tokens))
        elif isinstance(event, Delta):
            for chunk in _read(fmt, i, reading[i].add(event.text), event.tokens):
                yield sse(chunk)
        elif isinstance(event, Done):
            finish = event.finish_reason
            if reading is not None:
                for chunk in _read(fmt, i, reading[i].flush(), ()):
                    yield sse(chunk)
                finish = "tool_calls" if reading[i].made and finish == "stop" else finish
            yield sse(fmt.chunk(i, None, finish))
            usages.append(event.usage)
        else:
            yield sse(event.error.body())
            break
    if include_usage and len(usages) == len(jobs):
        yield sse(fmt.usage_chunk(combined(usages)))
    yield sse("[DONE]")


def _read(fmt: Format, i: int, events: list[tuple[str, Any]], tokens: tuple[Token, ...]) -> list[dict[str, Any]]:
    """The chunks of choice i's text read for calls (grammar/tools.py `CallStream`): content, a call's opening and its
    arguments' pieces; the delta's log-probabilities ride on its first chunk."""
    out = []
    for kind, value in events:
        if kind == "content":
            out.append(fmt.chunk(i, value, tokens=tokens))
        elif kind == "call":
            out.append(fmt.call_chunk(i, value[0], call=value[1]))
        else:
            out.append(fmt.call_chunk(i, value[0], arguments=value[1]))
        tokens = ()
    if tokens and fmt.logprobs is not None:
        out.append(fmt.chunk(i, "", tokens=tokens))
    return out


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, client gone, or never started (it cancels
    the jobs behind the events: this process's, or a Ray Serve replica's)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # a no-op once the generation has ended


async def watch_disconnect(request: Request, jobs: list[Job]) -> None:
    """Cancel the jobs when the client hangs up (the body was read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel.set()


async def collect(jobs: list[Job], request: Request | None = None
                  ) -> tuple[list[tuple[str, str, list[Token]]], dict[str, Any]]:
    """Wait for whole generations: (text, finish reason, tokens) per job and the combined usage; the client
    hanging up (`request`, where there is one) or this coroutine being cancelled cancels them. Raises the APIError
    of a job that failed."""
    watcher = asyncio.create_task(watch_disconnect(request, jobs)) if request is not None else None
    try:
        results = await asyncio.gather(*(_one(job) for job in jobs))
    except BaseException:
        for job in jobs:  # one failed (or the request was cancelled): the others stop too
            job.cancel.set()
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    return ([(text, done.finish_reason, tokens) for text, done, tokens in results],
            combined([done.usage for _, done, _ in results]))


async def _one(job: Job) -> tuple[str, Done, list[Token]]:
    parts: list[str] = []
    tokens: list[Token] = []
    async for event in job.stream():
        if isinstance(event, Delta):
            parts.append(event.text)
            tokens.extend(event.tokens)
        elif isinstance(event, Failed):
            raise event.error
        else:
            return "".join(parts), event, tokens
    raise APIError(500, "the generation ended without a result", type="server_error")  # unreachable
