"""OpenAI response objects and how a job's events reach the client.

Contract: `Format` builds the OpenAI bodies of one request (text or chat completion, whole or as stream
chunks, usage included); `sse_stream` turns a job's events into the server-sent-events body that ends with
`data: [DONE]`, sent by `JobStream`, which cancels the job however the response ends; `collect` waits for a
whole generation, cancelling it if the client hangs up, and raises the job's APIError if it failed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from speculor.serving.errors import APIError
from speculor.serving.scheduler import Delta, Done, Failed, Job


@dataclass
class Format:
    """OpenAI response objects of one request: text completions or chat completions."""

    chat: bool
    model: str
    job_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        """The response id: the job id (as in the server log) with OpenAI's prefix."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.job_id

    def _obj(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._obj([choice], chunk=False), "usage": usage}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        """A stream chunk with `text` (None: no content, as in the final chunk) and the finish reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._obj([choice], chunk=True)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._obj([], chunk=True), "usage": usage}


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def sse_stream(job: Job, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: content chunks, a chunk with the finish reason, [usage,] `data: [DONE]`.

    An error after the headers went out becomes an `{"error": ...}` event. Closing the stream early (the
    client disconnected) cancels the job through `Job.stream`.
    """
    if fmt.chat:
        yield _sse(fmt.chunk("", role=True))
    async for event in job.stream():
        if isinstance(event, Delta):
            yield _sse(fmt.chunk(event.text))
        elif isinstance(event, Done):
            yield _sse(fmt.chunk(None, event.finish_reason))
            if include_usage:
                yield _sse(fmt.usage_chunk(event.usage))
        else:
            yield _sse(event.error.body())
    yield _sse("[DONE]")


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however it ends: finished, client gone, or never started."""

    def __init__(self, job: Job, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()  # a no-op once the job has ended


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client hangs up (the body was read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def collect(job: Job, request: Request) -> tuple[str, Done]:
    """Wait for a whole generation; the client hanging up cancels it. Raises APIError if it failed."""
    watcher = asyncio.create_task(_watch_disconnect(request, job.cancel))
    parts: list[str] = []
    try:
        async for event in job.stream():
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Failed):
                raise event.error
            else:
                return "".join(parts), event
    finally:
        watcher.cancel()
    raise APIError(500, "the generation ended without a result", type="server_error")  # unreachable
