"""OpenAI-compatible HTTP server: `create_app(pair)` builds a FastAPI app, `serve(pair)` runs it with uvicorn.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events in the OpenAI format), GET /v1/models, GET /health, GET /metrics (Prometheus text format).

Request fields follow the OpenAI API, with these choices:

* `temperature` defaults to 1.0 as in OpenAI (0 = greedy); `top_p` to 1.0; `top_k` (extension) to 0 = off.
* `max_tokens` defaults to 16 for /v1/completions (as in OpenAI) and, for chat, to the rest of the context.
* `stop` is a string or a list of up to 16 strings; `seed` makes sampling reproducible; only `n = 1`.
* `speculative` (extension): `{"strategy": "chain", "k": 4, ...}`; a request that names no strategy uses
  the server's strategy and options, overridden by the options it gives.
* `model` is accepted and ignored: the server serves one model, the one GET /v1/models lists.
* Unknown fields are ignored; fields of the wrong type are refused (strict validation, no coercion).
* `usage` adds `tau` (tokens per target forward) and `accepted_tokens` (emitted tokens that were draft
  tokens accepted by verification) to the OpenAI counts.

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 for bad input
(a `SpeculorError` from the library included), 404/405 for unknown routes, 429 when the queue is full,
500 (with no details) only for a server bug.

Concurrency: the engine keeps KV caches inside the pair's models, so it is NOT re-entrant: one generation
runs at a time per pair. Requests become jobs in a FIFO queue served by one worker thread (the event
loop never runs the model); `queue_size` bounds the jobs waiting behind the running one, and a request
that finds the queue full gets 429 at once. The worker checks a job's cancel flag after every token: a
streaming client that disconnects (or a non-streaming one that hangs up) stops its generation at the
next token, and the worker moves on to the next job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jinja2
import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speculor import engine
from speculor.api import Detokenizer, Speculor
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.models import LM, Pair
from speculor.strategies import make_drafter

logger = logging.getLogger("speculor.server")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


# ---------------------------------------------------------------------------------------------- requests

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculativeOptions(BaseModel):
    """`{"strategy": name, **options}`; the options are checked by the strategy's builder."""

    model_config = ConfigDict(strict=True, extra="allow")
    strategy: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: str | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False
    logprobs: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def flat(self) -> dict[str, str]:
        """The message as the chat template expects it: text parts joined, None as ''."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(exc: SpeculorError, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, str(exc), param=param, code=code)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A pydantic error location without 'body' and cut at the first union-member tag ('str', 'list[int]')."""
    path: list[str] = []
    for part in loc:
        text = str(part)
        if part == "body" and not path:
            continue
        if isinstance(part, str) and ("[" in text or text in {"str", "int", "float", "bool", "none"}
                                      or text[:1].isupper()):
            break
        path.append(text)
    return path


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first invalid field as a 400 (the messages of all union branches for it); malformed JSON apart."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"malformed JSON in the request body: {detail}", code="json_invalid")
    path = _field_path(first.get("loc", ()))
    if not path and first.get("type") == "model_attributes_type":
        return APIError(400, "the request body must be a JSON object", code="invalid_body")
    msgs = list(dict.fromkeys(e["msg"] for e in errors if _field_path(e.get("loc", ())) == path))
    msg = msgs[0] + "".join(f", or {m[:1].lower()}{m[1:]}" for m in msgs[1:])
    where = ".".join(path) or "request body"
    return APIError(400, f"{where}: {msg}", param=path[0] if path else None, code=first.get("type"))


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; an unexpected exception is logged and answered 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(SpeculorError)
    async def _speculor(request: Request, exc: SpeculorError) -> JSONResponse:
        return bad_request(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", type="server_error").response()


# ----------------------------------------------------------------------------------------------- metrics

class Metrics:
    """Prometheus metrics of one app, in a registry of its own (several apps may live in one process)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter("speculor_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.latency = prom.Histogram("speculor_request_latency_seconds",
                                      "HTTP request latency, to the end of the response body", ["endpoint"],
                                      registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.generations = prom.Counter("speculor_generations", "generations by outcome (completed, cancelled, "
                                        "failed)", ["outcome"], registry=r)
        self.tokens = prom.Counter("speculor_generated_tokens", "tokens generated (cancelled generations "
                                   "included)", registry=r)
        self.accepted = prom.Counter("speculor_accepted_draft_tokens", "generated tokens that were accepted "
                                     "draft tokens", registry=r)
        self.tau = prom.Histogram("speculor_tau", "tokens per target forward of each completed generation",
                                  registry=r, buckets=TAU_BUCKETS)
        self.queue_depth = prom.Gauge("speculor_queue_depth", "requests waiting for the engine", registry=r)
        self.running = prom.Gauge("speculor_running_generations", "generations running (0 or 1)", registry=r)

    def render(self) -> Response:
        return Response(prom.generate_latest(self.registry), media_type=prom.CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status and times it to the end of its body (streams too)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = 500
        t0 = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


# -------------------------------------------------------------------------------------------- scheduling

@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop", "length" or "cancelled"
    usage: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    error: APIError


Event = Delta | Done | Failed


@dataclass
class Job:
    """One generation request. The worker thread fills `events` (an asyncio queue of the request's loop)
    and ends it with exactly one Done or Failed; setting `cancel` stops the job at its next token."""

    prompt: list[int]
    cfg: SamplingConfig
    strategy: str | None
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's event loop (thread-safe; dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self.cancel.set()

    async def stream(self) -> AsyncIterator[Event]:
        """The job's events up to and including its Done or Failed; leaving early cancels the job."""
        try:
            while True:
                event = await self.events.get()
                yield event
                if not isinstance(event, Delta):
                    return
        finally:
            self.cancel.set()


_LOCKS: weakref.WeakKeyDictionary[LM, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


@contextmanager
def engine_lock(pair: Pair) -> Iterator[None]:
    """Hold the pair's models (target, then draft) exclusively: the server holds this while it generates.

    Code that drives the same pair outside the server in the same process (tests, a notebook) must hold
    it too, since the models' KV caches are shared state.
    """
    lms = [lm for lm in (pair.target, pair.draft) if lm is not None]
    with _LOCKS_GUARD:
        locks = [_LOCKS.setdefault(lm, threading.Lock()) for lm in lms]
    for lock in locks:
        lock.acquire()
    try:
        yield
    finally:
        for lock in reversed(locks):
            lock.release()


class Scheduler:
    """A bounded FIFO of jobs and the one worker thread that runs them, one at a time, on `sp`."""

    def __init__(self, sp: Speculor, queue_size: int, metrics: Metrics) -> None:
        if not isinstance(queue_size, int) or queue_size < 1:
            raise SpeculorError(f"queue_size must be a positive integer, got {queue_size!r}")
        self.sp, self.metrics, self.queue_size = sp, metrics, queue_size
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._start_guard = threading.Lock()
        self.running: Job | None = None
        metrics.queue_depth.set_function(self.depth)
        metrics.running.set_function(lambda: 0 if self.running is None else 1)

    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job behind the others; APIError 429 when `queue_size` jobs already wait."""
        self._ensure_started()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy: {self.queue_size} requests are already waiting; retry "
                           "later", type="rate_limit_error", code="queue_full") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, fail the waiting ones (503) and end the worker thread."""
        if self.running is not None:
            self.running.cancel.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(Failed(APIError(503, "the server is shutting down", type="server_error")))
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _ensure_started(self) -> None:
        with self._start_guard:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="speculor-engine", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            self.running = job
            try:
                self._run(job)
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        """Run one job to its end and emit its final event; never raises."""
        t0 = time.perf_counter()
        stats = engine.Stats()
        progress = _Progress()
        try:
            with engine_lock(self.sp.pair):
                outcome = self._generate(job, stats, progress)
        except SpeculorError as exc:
            job.emit(Failed(bad_request(exc)))
            outcome = "failed"
        except Exception:  # a bug: keep serving, tell the client nothing more than that
            logger.exception("generation %s failed", job.id)
            job.emit(Failed(APIError(500, "internal server error during generation", type="server_error")))
            outcome = "failed"
        self._account(job, outcome, stats, progress, time.perf_counter() - t0)

    def _generate(self, job: Job, stats: engine.Stats, progress: _Progress) -> str:
        """Stream the job's text into its events, checking `cancel` before it starts and after every token;
        ends with a Done event and returns the outcome ("completed" or "cancelled")."""
        if job.cancel.is_set():  # the client left while the job waited
            job.emit(Done("cancelled", progress.usage(job, stats)))
            return "cancelled"
        detok = Detokenizer(self.sp.pair.tokenizer, job.cfg.stop)
        tokens = self.sp.tokens(job.prompt, job.cfg, strategy=job.strategy, stats=stats, **job.options)
        try:
            for tok in tokens:
                progress.add(tok)
                delta = detok.add(tok)
                if delta:
                    job.emit(Delta(delta))
                if detok.stopped:
                    break
                if job.cancel.is_set():
                    job.emit(Done("cancelled", progress.usage(job, stats)))
                    return "cancelled"
            else:
                if delta := detok.flush():
                    job.emit(Delta(delta))
        finally:
            tokens.close()
        stopped = detok.stopped or (progress.last in self.sp.eos_ids)
        job.emit(Done("stop" if stopped else "length", progress.usage(job, stats)))
        return "completed"

    def _account(self, job: Job, outcome: str, stats: engine.Stats, progress: _Progress, seconds: float) -> None:
        m = self.metrics
        m.generations.labels(outcome).inc()
        m.tokens.inc(progress.tokens)
        m.accepted.inc(progress.accepted)
        if outcome == "completed" and stats.steps:
            m.tau.observe(stats.tau)
        logger.info("generation %s %s: %d of max %d tokens, tau %.2f, %.3f s", job.id, outcome, progress.tokens,
                    job.cfg.max_new_tokens, stats.tau, seconds)


@dataclass
class _Progress:
    tokens: int = 0
    accepted: int = 0
    last: int | None = None

    def add(self, tok: engine.Token) -> None:
        self.tokens += 1
        self.accepted += tok.from_draft
        self.last = tok.id

    def usage(self, job: Job, stats: engine.Stats) -> dict[str, Any]:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(job.prompt) + self.tokens, "tau": round(stats.tau, 4),
                "accepted_tokens": self.accepted}


# --------------------------------------------------------------------------------------------- responses

@dataclass
class _Format:
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


async def _sse_stream(job: Job, fmt: _Format, include_usage: bool) -> AsyncIterator[str]:
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


class _JobStream(StreamingResponse):
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


async def _collect(job: Job, request: Request) -> tuple[str, Done]:
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


# ----------------------------------------------------------------------------------------------- the app

@dataclass
class _Server:
    """What the endpoints share: the engine, its scheduler, metrics and the served model's name."""

    sp: Speculor
    scheduler: Scheduler
    metrics: Metrics
    model: str

    def context_length(self) -> int:
        return self.sp.pair.target.context_length

    def check_ids(self, ids: list[int]) -> None:
        emb = self.sp.pair.target.model.get_input_embeddings()
        vocab = getattr(emb, "num_embeddings", self.sp.pair.target.vocab_size)
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            self.check_ids(prompt)
            ids = prompt
        else:
            try:
                ids = self.sp.encode(prompt)
            except SpeculorError as exc:
                raise bad_request(exc, "prompt") from exc
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    def encode_messages(self, messages: list[ChatMessage]) -> list[int]:
        try:
            ids = self.sp.encode_chat([m.flat() for m in messages])
        except (ValueError, jinja2.TemplateError) as exc:  # no chat template, or the template refused them
            raise APIError(400, f"cannot apply the chat template to these messages: {exc}",
                           param="messages") from exc
        if not ids:
            raise APIError(400, "the chat template produced an empty prompt", param="messages")
        return ids

    def make_job(self, req: _GenerationRequest, ids: list[int], max_tokens: int | None, param: str) -> Job:
        """Validate sampling, context and strategy; a Job for them. Raises APIError 400."""
        room = self.context_length() - len(ids)
        if room <= 0:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room for new tokens in the model's "
                           f"context length ({self.context_length()})", param=param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                           f"context length ({self.context_length()})", param="max_tokens",
                           code="context_length_exceeded")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if not all(stop):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        try:
            cfg = SamplingConfig(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                 max_new_tokens=max_tokens or room, stop=stop)
            engine.check_prompt(ids, cfg, self.sp.pair.target)
        except SpeculorError as exc:
            raise bad_request(exc) from exc
        strategy, options = self._strategy(req.speculative)
        return Job(ids, cfg, strategy, options, asyncio.get_running_loop())

    def _strategy(self, spec: SpeculativeOptions | None) -> tuple[str | None, dict[str, Any]]:
        """(strategy or None for the server's, options) of a request, checked by building a drafter."""
        if spec is None:
            return None, {}
        options = dict(spec.model_extra or {})
        merged = options if spec.strategy else {**self.sp.options, **options}
        try:
            make_drafter(spec.strategy or self.sp.strategy, self.sp.pair, **merged)
        except SpeculorError as exc:
            raise bad_request(exc, "speculative") from exc
        return spec.strategy, options

    async def respond(self, request: Request, req: _GenerationRequest, job: Job, chat: bool) -> Response:
        """Queue the job (429 if full) and answer with a stream or, once done, a whole response."""
        self.scheduler.submit(job)
        fmt = _Format(chat, self.model, job.id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _JobStream(job, _sse_stream(job, fmt, include_usage))
        text, done = await _collect(job, request)
        return JSONResponse(fmt.full(text, done.finish_reason, done.usage))


def _routes(app: FastAPI, srv: _Server) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ids = srv.encode_prompt(req.prompt)
        return await srv.respond(request, req, srv.make_job(req, ids, req.max_tokens, "prompt"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        ids = srv.encode_messages(req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await srv.respond(request, req, srv.make_job(req, ids, max_tokens, "messages"), chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0,
                                            "owned_by": "speculor"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": srv.model, "queue_depth": srv.scheduler.depth(),
                "queue_size": srv.scheduler.queue_size, "running": srv.scheduler.running is not None}

    @app.get("/metrics")
    async def metrics() -> Response:
        return srv.metrics.render()


def create_app(pair: Pair, strategy: str = "chain", queue_size: int = 64, **options: Any) -> FastAPI:
    """A FastAPI app serving `pair` with a default `strategy` and its `options` (e.g. k=4).

    At most one generation runs at a time on the pair (the engine is not re-entrant); `queue_size` (>= 1)
    requests may wait behind it, more get 429. The worker thread starts with the first request and stops
    at the app's shutdown. Raises SpeculorError for a bad strategy or queue size.
    """
    sp = Speculor(pair, strategy=strategy, **options)
    metrics = Metrics()
    srv = _Server(sp, Scheduler(sp, queue_size, metrics), metrics, pair.target_name or "speculor")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(srv.scheduler.stop)

    app = FastAPI(title="speculor", version="0.1.0", lifespan=lifespan)
    app.state.server = srv
    _install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    _routes(app, srv)
    return app


def serve(pair: Pair, host: str = "127.0.0.1", port: int = 8000, strategy: str = "chain", queue_size: int = 64,
          **options: Any) -> None:
    """Serve `pair` over HTTP until interrupted (see `create_app`)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(pair, strategy=strategy, queue_size=queue_size, **options)
    logger.info("serving %s with strategy %r on http://%s:%d/v1", pair.target_name or "speculor", strategy,
                host, port)
    uvicorn.run(app, host=host, port=port, log_level="info")
