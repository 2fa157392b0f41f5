"""OpenAI-compatible HTTP server: `create_app(pair)` builds a FastAPI app, `serve(pair)` runs it with uvicorn.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events in the OpenAI format), GET /v1/models, GET /health, GET /metrics (Prometheus text format); and llama-server's
own, answered as it answers them (serving/llama_api.py): POST /completion, POST /tokenize, POST /detokenize, GET /props.

Request fields follow the OpenAI API, with these choices:

* `temperature` defaults to 1.0 as in OpenAI (0 = greedy); `top_p` to 1.0; `top_k` (extension) to 0 = off.
* `max_tokens` defaults to the server's `n_predict` (llama-server's `-n`) where it has one, else to 16 for
  /v1/completions (as in OpenAI) and, for chat, to the rest of the context.
* `stop` is a string or a list of up to 16 strings; `seed` makes sampling reproducible; `n` up to 8
  independent choices (choice i seeded with seed + i).
* `presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI), `repetition_penalty` and `min_p` (extensions,
  as in vLLM) transform the target's distribution at every tree node, exactly (core/logits.py); `logprobs`
  (chat: `logprobs: true` and `top_logprobs`; completions: `logprobs: k`) reports each token's log-probability
  under the distribution it was chosen from (greedy: softmax of the transformed logits).
* `speculative` (extension): `{"strategy": "chain", "k": 4, ...}`; a request that names no strategy uses
  the server's strategy and options, overridden by the options it gives.
* `model` is accepted and ignored: the server serves one model, the one GET /v1/models lists.
* Structured output (grammar/): chat `tools` with `tool_choice` (auto, none, required, a named function) and
  `parallel_tool_calls`, rendered by the model's chat template and read back as `tool_calls` (streamed as
  `delta.tool_calls`, `finish_reason: "tool_calls"`); `response_format` (json_object, json_schema); llama-server's
  `json_schema` and `grammar` (GBNF). Exact: every verified row is masked by the constraint (core of the engine).
  A constraint that does not compile, a tool without a name or with parameters that are not a schema, a
  `tool_choice` naming no given tool and a `tool` message answering no call are 400s naming them.
* No field is silently ignored: an unknown field is a 400 naming it, and so are `functions` and the other fields
  this server does not implement; `user`, `metadata`, `store` and `service_tier` are accepted and have no effect.
  Fields of the wrong type are refused (strict validation, no coercion).
* `usage` adds `tau` (tokens per target forward) and `accepted_tokens` (emitted tokens that were draft
  tokens accepted by verification) to the OpenAI counts.

Network safety (serving/security.py, `Guard`, applied before any route): with API keys every route but /health needs
one (401 otherwise); a body over `max_body_bytes` is a 413, one that does not arrive within `timeout` a 408; a client
that does not read its answer for `timeout` is cut off and its generations cancelled. TLS: `serve`'s `ssl_keyfile`
and `ssl_certfile` (uvicorn's).

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 for bad input
(a `SpeculorError` from the library included), 404/405 for unknown routes, 429 when the queue is full,
500 (with no details) only for a server bug.

Concurrency: every generation has its own KV caches (the models hold weights only). Requests become jobs in a
FIFO queue served by one worker thread that decodes up to `max_batch` of them together, letting jobs join and
leave between steps (continuous batching, serving/scheduler.py); the event loop never runs the model, and a
request's strategy is built in a thread of its own between the worker's steps. `queue_size` bounds the jobs
waiting for a place in the batch, and a request that finds the queue full gets 429 at once. A job's cancel flag is
checked after every step: a streaming client that disconnects (or a non-streaming one that hangs up) leaves the
batch at the next step. Each greedy or seeded request gets the tokens it would get alone, whatever shares its batch
(docs/algorithms.md §11).

This module is the app itself: the endpoints (`build_app`, over a `Service`) and the engine side they call in this
process (`_Server`, made by `make_server`). The parts live beside it: `schemas` (request bodies), `errors`
(OpenAI-style error bodies and handlers), `metrics` (Prometheus), `scheduler` (the job queue and its worker thread),
`formats` (response objects and server-sent events) and `ray_serve` (the same app as a Ray Serve ingress in front
of replicas that each hold a `_Server`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from speculor import engine
from speculor.api import Speculor
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.grammar import tools as tool_calls
from speculor.grammar.compile import Constraint
from speculor.grammar.tools import Tool
from speculor.runtime import openmp
from speculor.runtime.backend import Pair
from speculor.serving import llama_api
from speculor.serving.errors import APIError, bad_request, install_error_handlers
from speculor.serving.formats import EventStream, Format, collect, sse_stream, watch_disconnect
from speculor.serving.llama_api import DetokenizeRequest, LlamaCompletion, TokenizeRequest
from speculor.serving.metrics import Metrics, MetricsMiddleware
from speculor.serving.scheduler import MAX_BATCH, Job, Scheduler
from speculor.serving.schemas import (
    UNSUPPORTED,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
)
from speculor.serving.security import Guard, GuardMiddleware, warn_if_exposed

logger = logging.getLogger("speculor.serving.app")


@dataclass
class Stream:
    """A streamed answer: its jobs and the server-sent-events body; closing the body or `cancel` stops the jobs."""

    jobs: list[Job]
    body: AsyncIterator[str]

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel.set()  # a no-op once the job has ended


Answer = dict[str, Any] | Stream  # a whole response body, or a stream


class Service(Protocol):
    """What the routes need: this process's `_Server`, or Ray Serve's ingress (serving/ray_serve.py)."""

    model: str

    async def respond(self, req: GenerationRequest, chat: bool, request: Request) -> Response: ...

    async def respond_llama(self, req: LlamaCompletion, request: Request) -> Response: ...

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]: ...

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]: ...

    async def props(self) -> dict[str, Any]: ...

    async def health(self) -> dict[str, Any]: ...

    def render_metrics(self) -> Response: ...


@dataclass
class _Server:
    """What the endpoints share: the engine, its scheduler, metrics, the served model's name and the default number of
    new tokens of a request that gives none (None: the endpoint's own default)."""

    sp: Speculor
    scheduler: Scheduler
    metrics: Metrics
    model: str
    n_predict: int | None = None

    def context_length(self) -> int:
        return self.sp.pair.target.context_length

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        vocab = self.sp.pair.target.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"{param} token ids must be in [0, {vocab})", param=param)

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

    def encode_messages(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            ids = self.sp.encode_chat([m.flat() for m in messages], tools)
        except SpeculorError as exc:  # a tool message answering no call, arguments that are not JSON
            raise bad_request(exc, "messages") from exc
        except (ValueError, jinja2.TemplateError) as exc:  # no chat template, or the template refused them
            raise APIError(400, f"cannot apply the chat template to these messages: {exc}",
                           param="messages") from exc
        if not ids:
            raise APIError(400, "the chat template produced an empty prompt", param="messages")
        return ids

    def make_jobs(self, req: GenerationRequest, ids: list[int], max_tokens: int | None, param: str) -> list[Job]:
        """Validate the request's fields, sampling and context; one Job per choice (`n`, choice i seeded with
        seed + i), with the request's strategy as it names it (checked by `check_strategy`). Raises APIError 400."""
        for name in UNSUPPORTED:
            if getattr(req, name, None) is not None:
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_field")
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
            bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError as exc:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from exc
        try:
            cfg = SamplingConfig(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                 max_new_tokens=max_tokens or room, stop=stop, min_p=req.min_p,
                                 presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                 repetition_penalty=req.repetition_penalty, logit_bias=bias,
                                 logprobs=logprobs_of(req))
            engine.check_prompt(ids, cfg, self.sp.pair.target)
        except SpeculorError as exc:
            raise bad_request(exc) from exc
        spec = req.speculative
        strategy, options = (None, {}) if spec is None else (spec.strategy, dict(spec.model_extra or {}))
        constraint, tools = self.constraint_of(req)
        loop = asyncio.get_running_loop()
        seeds = [None if cfg.seed is None else (cfg.seed + i) % 2**64 for i in range(req.n)]
        return [Job(ids, replace(cfg, seed=seed), strategy, options, loop, constraint=constraint, tools=tools)
                for seed in seeds]

    def constraint_of(self, req: GenerationRequest) -> tuple[Constraint | None, list[Tool]]:
        """The request's constraint (compiled now, once per constraint: a 400 names what does not compile) and its
        tools: `tools` with `tool_choice` (chat), `response_format`, or llama-server's `json_schema` or `grammar`
        (GBNF), at most one of them."""
        tools_ = getattr(req, "tools", None)
        given = {name: getattr(req, name) for name in ("tools", "response_format", "json_schema", "grammar")
                 if getattr(req, name, None) is not None}
        if isinstance(req.response_format, dict) and req.response_format.get("type") == "text":
            given.pop("response_format")
        if len(given) > 1:
            raise APIError(400, f"{' and '.join(given)} cannot be combined: give one constraint", param=list(given)[1])
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name, None) is not None and tools_ is None:
                raise APIError(400, f"{name} needs tools", param=name)
        try:
            read = tool_calls.read_tools(tools_) if tools_ is not None else []
        except SpeculorError as exc:
            raise bad_request(exc, "tools") from exc
        try:  # where there are tools, only tool_choice can be wrong here
            constraint = (self.sp.tool_constraint(read, req.tool_choice, req.parallel_tool_calls is not False) if read
                          else tool_calls.response_constraint(req.response_format) if req.response_format else
                          Constraint.json_schema(req.json_schema) if req.json_schema is not None else
                          Constraint("gbnf", req.grammar) if req.grammar is not None else None)
        except SpeculorError as exc:
            raise bad_request(exc, "tool_choice" if read else next(iter(given), None)) from exc
        try:
            if constraint is not None:
                self.sp.grammars.matcher(constraint)  # compiled and kept; a 400 if it does not compile
        except SpeculorError as exc:
            raise bad_request(exc, next(iter(given), None)) from exc
        return constraint, read if constraint is not None or not read else []  # "none": no call is read back

    async def check_strategy(self, job: Job) -> None:
        """A request's strategy checked by building its shared part (once per strategy and options), in the
        scheduler's turn with the models, off the event loop. Raises APIError 400."""
        if job.strategy is None and not job.options:
            return
        try:
            await self.scheduler.build(*self.sp.options_for(job.strategy, job.options))
        except SpeculorError as exc:
            raise bad_request(exc, "speculative") from exc

    def max_tokens(self, req: GenerationRequest, chat: bool) -> int | None:
        """The new tokens a request asks for at most: its own, else the server's `n_predict`, else the endpoint's
        default (16 for completions, as in OpenAI; None, the rest of the context, for chat)."""
        if chat:
            return req.max_completion_tokens or req.max_tokens or self.n_predict
        return req.max_tokens if "max_tokens" in req.model_fields_set else self.n_predict or req.max_tokens

    async def submit(self, req: GenerationRequest, chat: bool) -> list[Job]:
        """Validate a request and queue its jobs (429 if full): the one path of every generation. Raises APIError."""
        if chat:
            ids, param = self.encode_messages(req.messages, req.tools), "messages"
        else:
            ids, param = self.encode_prompt(req.prompt), "prompt"
        jobs = self.make_jobs(req, ids, self.max_tokens(req, chat), param)
        await self.check_strategy(jobs[0])
        for i, job in enumerate(jobs):
            try:
                self.scheduler.submit(job)
            except APIError:
                for queued in jobs[:i]:
                    queued.cancel.set()
                raise
        return jobs

    async def answer(self, req: GenerationRequest, chat: bool, request: Request | None = None) -> Answer:
        """Validate a request and queue its jobs (429 if full); the whole response body once done, or its `Stream`.
        `request`, where there is one, is watched for the client hanging up. Raises APIError."""
        jobs = await self.submit(req, chat)
        fmt = Format(chat, self.model, jobs[0].id, self.piece, jobs[0].cfg.logprobs, tools=jobs[0].tools)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Stream(jobs, sse_stream(jobs, fmt, include_usage))
        answers, usage = await collect(jobs, request)
        return fmt.full(answers, usage)

    async def respond(self, req: GenerationRequest, chat: bool, request: Request) -> Response:
        """The HTTP response of a request: a JSON body, or a stream of server-sent events."""
        out = await self.answer(req, chat, request)
        return EventStream(out.body, out.cancel) if isinstance(out, Stream) else JSONResponse(out)

    async def respond_llama(self, req: LlamaCompletion, request: Request) -> Response:
        """llama-server's /completion (serving/llama_api.py) on the same job path."""
        oa = llama_api.as_completion(req, self.n_predict)
        job = (await self.submit(oa, False))[0]
        tok = self.sp.pair.tokenizer
        out = llama_api.Answer(self.model, tok.decode(job.prompt, skip_special_tokens=False), len(job.prompt),
                               llama_api.settings(oa, self.context_length()), req.return_tokens)
        if req.stream:
            return EventStream(out.events(job), job.cancel.set)
        watcher = asyncio.create_task(watch_disconnect(request, [job]))
        try:
            return JSONResponse(await out.whole(job))
        finally:
            job.cancel.set()  # a no-op once it has ended
            watcher.cancel()

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        tok = self.sp.pair.tokenizer
        ids = tok(req.content, add_special_tokens=req.add_special, split_special_tokens=not req.parse_special
                  )["input_ids"]
        return {"tokens": [{"id": i, "piece": llama_api.piece(tok, i)} for i in ids] if req.with_pieces else ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_ids(req.tokens, "tokens")
        return {"content": self.sp.pair.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def props(self) -> dict[str, Any]:
        """llama-server's GET /props: the defaults of /completion, the slots (requests decoded together), the model."""
        tok, n_ctx = self.sp.pair.tokenizer, self.context_length()
        template = tok.chat_template if isinstance(tok.chat_template, str) else (tok.chat_template or {}).get(
            "default", "")
        params = llama_api.settings(llama_api.as_completion(LlamaCompletion(prompt=""), self.n_predict), n_ctx)
        return {"default_generation_settings": {"n_ctx": n_ctx, "params": params},
                "total_slots": self.scheduler.max_batch, "model_path": self.sp.pair.target_name or self.model,
                "model_alias": self.model, "chat_template": (template or "").removesuffix("\n"),  # as Jinja reads it
                "bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "",
                "modalities": {"vision": False, "audio": False}, "build_info": "speculor"}

    async def health(self) -> dict[str, Any]:
        s = self.scheduler
        return {"status": "ok", "model": self.model, "queue_depth": s.depth(), "queue_size": s.queue_size,
                "running": s.size(), "max_batch": s.max_batch,
                "peak_memory_gib": _finite(self.metrics.peak_memory_gib())}

    def render_metrics(self) -> Response:
        return self.metrics.render()

    def piece(self, token: int) -> str:
        """A token's own text (log-probability entries)."""
        return self.sp.pair.tokenizer.decode([token])


def logprobs_of(req: GenerationRequest) -> int | None:
    """The number of alternatives a request wants beside each token's log-probability, or None for none: chat
    asks with `logprobs: true` (+ `top_logprobs`), completions with `logprobs: k`."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await service.respond(req, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        return await service.respond(req, True, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": 0,
                                            "owned_by": "speculor"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return await service.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return service.render_metrics()

    _llama_routes(app, service)


def _llama_routes(app: FastAPI, service: Service) -> None:
    """llama-server's own routes (serving/llama_api.py)."""

    @app.post("/completion")
    @app.post("/completions")
    async def completion(req: LlamaCompletion, request: Request) -> Response:
        return await service.respond_llama(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await service.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await service.detokenize(req)

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return await service.props()


def _finite(x: float) -> float | None:
    """x, or None (JSON null) for NaN: JSON has no NaN."""
    return None if math.isnan(x) else x


def make_server(pair: Pair, strategy: str | None = None, queue_size: int = 64, max_batch: int = MAX_BATCH,
                metrics: Metrics | None = None, *, n_predict: int | None = None, model: str | None = None,
                **options: Any) -> _Server:
    """The engine side of a server: `pair` with a default `strategy` and its `options` (e.g. k=4), its scheduler
    and metrics; no strategy: the default one (drafters/registry.py `_default`). `n_predict`: the new tokens of a
    request that asks for no number (None: each endpoint's default); `model`: the name it serves (default: the
    target's). Raises SpeculorError for a bad strategy, queue size, batch size or n_predict."""
    if n_predict is not None and (not isinstance(n_predict, int) or n_predict < 1):
        raise SpeculorError(f"n_predict (-n) must be a positive number of tokens, got {n_predict!r}")
    sp = Speculor(pair, strategy=strategy or "default", **options)
    metrics = metrics or Metrics(pair.target.device)
    return _Server(sp, Scheduler(sp, queue_size, metrics, max_batch), metrics,
                   model or pair.target_name or "speculor", n_predict)


def build_app(service: Service, metrics: Metrics, on_shutdown: Callable[[], None] | None = None,
              guard: Guard | None = None) -> FastAPI:
    """The FastAPI app of a service (this process's `_Server`, or Ray Serve's ingress, serving/ray_serve.py): the
    routes, the OpenAI-style error handlers, the network safety of `guard` (serving/security.py; default: no key, the
    default limits) and the request metrics (of refused requests too); `on_shutdown` runs (in a thread) at the app's
    shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="speculor", version="0.1.0", lifespan=lifespan)
    app.state.server = service
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, guard=guard or Guard())
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # the outer one: it counts what the guard refuses
    _routes(app, service)
    return app


def create_app(pair: Pair, strategy: str | None = None, queue_size: int = 64, max_batch: int = MAX_BATCH, *,
               guard: Guard | None = None, n_predict: int | None = None, model: str | None = None,
               **options: Any) -> FastAPI:
    """A FastAPI app serving `pair` in this process (see `make_server` for the strategy, `n_predict` and `model`;
    `guard`: API keys and limits, serving/security.py).

    Up to `max_batch` generations run together (continuous batching, serving/scheduler.py); `queue_size` (>= 1)
    requests may wait for a place, more get 429. The worker thread starts with the first request and stops
    at the app's shutdown. Raises SpeculorError for a bad strategy, queue size or batch size.
    """
    srv = make_server(pair, strategy, queue_size, max_batch, n_predict=n_predict, model=model, **options)
    return build_app(srv, srv.metrics, on_shutdown=srv.scheduler.stop, guard=guard)


def warm_up(pair: Pair) -> None:
    """Two greedy tokens after a 40-token prompt (a prompt's own calls: TILED rows or more) on the target and on a draft
    model, before the first request, as
    llama-server warms its model at start: the first request then does not pay the first calls' costs (weights
    paged in from the mapped file, llama.cpp's prompt context made, kernels set up). Nothing a request reads is
    left: the caches are released, and the prompt memory keeps only the prompts the server fills in chunks. The
    calling thread (it loaded and warmed the pair) then ends its OpenMP team: from here the scheduler's worker
    decodes, at full speed only where no other thread's team waits beside its own (runtime/openmp.py)."""
    for model in (pair.target, pair.draft):
        if model is not None:
            for _ in engine.stream(model, None, list(range(40)), SamplingConfig(max_new_tokens=2)):
                pass
    openmp.release()


def serve(pair: Pair, host: str = "127.0.0.1", port: int = 8000, strategy: str | None = None, queue_size: int = 64,
          max_batch: int = MAX_BATCH, *, guard: Guard | None = None, ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None, timeout_keep_alive: float = 5.0, n_predict: int | None = None,
          model: str | None = None, **options: Any) -> None:
    """Serve `pair` over HTTP (HTTPS with `ssl_keyfile` and `ssl_certfile`, PEM files) until interrupted (see
    `create_app`); an idle kept-alive connection is closed after `timeout_keep_alive` seconds (uvicorn's)."""
    import uvicorn

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise SpeculorError("TLS needs both --ssl-key-file and --ssl-cert-file")
    guard = guard or Guard()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(pair, strategy=strategy, queue_size=queue_size, max_batch=max_batch, guard=guard,
                     n_predict=n_predict, model=model, **options)
    warm_up(pair)
    warn_if_exposed(host, guard)
    logger.info("serving %s with strategy %r (batches of up to %d) on %s://%s:%d/v1%s", model or pair.target_name or
                "speculor", strategy or "default", max_batch, "https" if ssl_certfile else "http", host, port,
                f" ({len(guard.api_keys)} API key(s))" if guard.api_keys else "")
    uvicorn.run(app, host=host, port=port, log_level="info", ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                timeout_keep_alive=timeout_keep_alive)
