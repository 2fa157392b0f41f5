"""speculor on Ray Serve: an ingress deployment with `speculor serve`'s FastAPI app (serving/app.py's `build_app`, the
same routes, error bodies and request metrics) and a replica deployment whose every replica holds a model pair and
the continuous-batching scheduler (`make_server`). Ray Serve routes the requests between replicas, scales them
(`replicas`, or autoscaling between `min_replicas` and `max_replicas` on ongoing requests) and restarts a dead one.

Contract:

* The ingress passes a validated request (its JSON) to a replica and relays the answer; the replica answers with a
  `Head` (an error body, a whole response, or "a stream follows") and then the stream's server-sent events, joined
  where several are ready at once. Every response names the replica in the `x-speculor-replica` header.
* A replica's `max_ongoing_requests` is `max_batch + queue_size`; requests beyond that wait in Ray Serve's queue at
  the ingress (`max_queued_requests` of them, default unbounded as in Ray Serve; more get 429 as from `speculor
  serve`).
* A replica that dies: a request that has not started its response yet is sent to another replica (RETRIES times at
  most, then 503); a stream that had started and whose replica's events end without `[DONE]` (however they end:
  the actor died, a Ray error, a lost connection, or they just stop) ends with an OpenAI-style error event (`code:
  replica_died`) and `[DONE]`, never as a short answer that looks whole. Ray Serve restarts the replica;
  `check_health` fails a replica whose engine thread died. A replica that is stopped (scale-down, shutdown) first
  drains: Ray waits up to `drain_s` for its requests to finish.
* The ingress's app applies the same network safety as `speculor serve`'s (serving/security.py: API keys, body
  limits, slow clients; `RaySettings.guard`); TLS and the keep-alive timeout are Ray Serve's HTTP proxy's
  (`http_options`). llama-server's own routes (/completion, /tokenize, /detokenize, /props) are `speculor serve`'s
  in one process: here they answer 404 saying so.
* Metrics go through Ray's metrics (serving/ray_metrics.py): each replica's batch size, tau, accepted lengths,
  queue, generations; the ingress's request counts and latencies; GET /metrics says where they are.
* `build(args)` makes the application from a `serve run` / `serve deploy` config's args (`RaySettings`);
  `run(settings, ...)` is `speculor serve --ray` (commands/serve.py makes the settings from its arguments).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from speculor.errors import SpeculorError
from speculor.serving.app import Stream, build_app, make_server, warm_up
from speculor.serving.errors import APIError, bad_request
from speculor.serving.formats import EventStream
from speculor.serving.metrics import Metrics
from speculor.serving.ray_config import RaySettings, check_fits, check_strategy, port_free
from speculor.serving.ray_metrics import Ray
from speculor.serving.schemas import MAX_N, ChatRequest, CompletionRequest, GenerationRequest
from speculor.serving.security import Guard, warn_if_exposed

logger = logging.getLogger("speculor.serving.app")

APP = "speculor"  # the Ray Serve application's default name
REPLICA_HEADER = "x-speculor-replica"
RETRIES = 2  # other replicas tried for a request whose replica died before its response began
GONE = (RayActorError, DeploymentUnavailableError)  # the replica died, or none is there


@dataclass(frozen=True)
class Head:
    """The start of a replica's answer: `body` is an error or a whole response (the end), None when SSE follow."""

    status: int
    body: dict[str, Any] | None
    replica: str


@serve.deployment
class Replica:
    """A model pair and its continuous-batching scheduler; metrics through Ray."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from speculor.runtime.loading import load_pair

        s = RaySettings.of(settings)
        pair = load_pair(s.pair_spec())
        # Ray Serve bounds the requests a replica holds (max_ongoing_requests): its own queue takes all their jobs
        jobs, self.queue_size = (s.max_batch + s.queue_size) * MAX_N, s.queue_size
        self.srv = make_server(pair, s.strategy, jobs, s.max_batch, Metrics(pair.target.device, Ray()),
                               n_predict=s.n_predict, model=s.alias, **s.options)
        warm_up(pair)
        self.id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s (pid %d) serves %s", self.id, os.getpid(), self.srv.model)

    async def generate(self, body: str, chat: bool) -> AsyncIterator[Head | str]:
        """A request's answer: its Head, then (a stream) its server-sent events."""
        try:
            req: GenerationRequest = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
            out = await self.srv.answer(req, chat)
        except APIError as exc:
            yield Head(exc.status, exc.body(), self.id)
            return
        except SpeculorError as exc:
            yield Head(400, bad_request(exc).body(), self.id)
            return
        except Exception:  # noqa: BLE001 - a bug: the client gets a 500, the replica keeps serving
            logger.exception("replica %s failed a request", self.id)
            yield Head(500, APIError(500, "internal server error", type="server_error").body(), self.id)
            return
        if not isinstance(out, Stream):
            yield Head(200, out, self.id)
            return
        yield Head(200, None, self.id)
        try:
            async for text in coalesced(out.body):
                yield text
        finally:
            out.cancel()  # the ingress (its client) left, or the stream ended: a no-op then

    async def health(self) -> dict[str, Any]:
        return {**await self.srv.health(), "queue_size": self.queue_size, "replica": self.id, "pid": os.getpid()}

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine thread died is restarted."""
        if not self.srv.scheduler.alive():
            raise RuntimeError("the engine thread of this replica died")

    def __del__(self) -> None:
        self.srv.scheduler.stop()


async def coalesced(parts: AsyncIterator[str]) -> AsyncIterator[str]:
    """`parts`, those ready at once joined into one (a step's tokens: one message through Ray, not one each)."""
    ready: asyncio.Queue[str | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for part in parts:
                ready.put_nowait(part)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            ready.put_nowait(exc)
        ready.put_nowait(None)

    task = asyncio.create_task(pump())
    try:
        done = False
        while not done:
            batch = [await ready.get()]
            while not ready.empty():
                batch.append(ready.get_nowait())
            if texts := [p for p in batch if isinstance(p, str)]:
                yield "".join(texts)
            for p in batch:
                if isinstance(p, BaseException):
                    raise p
            done = None in batch
    finally:
        task.cancel()


class RayService:
    """The ingress's side of the app's routes (app.Service): each request goes to a replica."""

    def __init__(self, replica: DeploymentHandle, model: str, queued: int) -> None:
        self.replica, self.model, self.queued = replica, model, queued
        self.metrics = Metrics(family=Ray())

    async def respond(self, req: GenerationRequest, chat: bool, request: Request) -> Response:
        body = req.model_dump_json(exclude_unset=True)
        for attempt in range(1 + RETRIES):
            answer = self.replica.options(stream=True).generate.remote(body, chat)
            try:
                head: Head = await answer.__anext__()
                break
            except GONE as exc:
                answer.cancel()
                logger.warning("a replica failed before answering (%s: %s); try %d of %d", type(exc).__name__,
                               exc, attempt + 1, 1 + RETRIES)
            except BackPressureError:
                raise APIError(429, f"the server is busy: {self.queued} requests are already waiting; retry "
                               "later", type="rate_limit_error", code="queue_full") from None
            except BaseException:  # the client left (cancelled), or a bug
                answer.cancel()
                raise
        else:
            raise APIError(503, "no replica could serve the request (they died or none is running); retry later",
                           type="server_error", code="replica_unavailable")
        headers = {REPLICA_HEADER: head.replica}
        if head.body is not None:
            if head.status == 429:
                headers["Retry-After"] = "1"
            return JSONResponse(head.body, status_code=head.status, headers=headers)
        return EventStream(relay(answer), answer.cancel, headers)  # the client left: the replica stops

    async def health(self) -> dict[str, Any]:
        """Ready when a replica runs: the replicas by state (Ray Serve's), and one replica's own health."""
        states = await asyncio.to_thread(replica_states, serve.get_replica_context().app_name)
        if not states.get("RUNNING"):
            raise APIError(503, f"no replica is running yet ({states or 'none'})", type="server_error",
                           code="no_replica")
        one = await self.replica.health.remote()
        return {"status": "ok", "model": self.model, "replicas": states, "replica": one}

    async def respond_llama(self, req: Any, request: Request) -> Response:
        raise _llama_route()

    async def tokenize(self, req: Any) -> dict[str, Any]:
        raise _llama_route()

    async def detokenize(self, req: Any) -> dict[str, Any]:
        raise _llama_route()

    async def props(self) -> dict[str, Any]:
        raise _llama_route()

    def render_metrics(self) -> Response:
        raise APIError(404, "on Ray Serve the metrics go through Ray's metrics: scrape each node's metrics export "
                       "port (names ray_speculor_*, tagged by deployment and replica)", code="not_found")


def _llama_route() -> APIError:
    return APIError(404, "llama-server's routes (/completion, /tokenize, /detokenize, /props) are served by `speculor "
                    "serve` without --ray; on Ray Serve use /v1/completions and /v1/chat/completions", code="not_found")


def replica_states(name: str = APP) -> dict[str, int]:
    """Application `name`'s replicas of the model pair by state (RUNNING, STARTING, ...), from Ray Serve's
    controller."""
    app = serve.status().applications.get(name)
    deployment = app.deployments.get("Replica") if app else None
    return {str(k): v for k, v in (deployment.replica_states if deployment else {}).items()}


DONE = "data: [DONE]\n\n"  # the last event of every stream a replica answers (formats.sse_stream)


async def relay(answer: AsyncIterator[str]) -> AsyncIterator[str]:
    """A replica's server-sent events, relayed. A replica's stream that ends without its `data: [DONE]` is a dead
    replica however it ends (normally, or by an exception: the actor died, a Ray or Serve error, a lost
    connection): the client gets an OpenAI-style error event (`code: replica_died`) and `[DONE]`, never a short
    answer that looks whole. Only the relay's own closing (the client left) or cancellation ends it without one."""
    ended = False  # [DONE] relayed
    try:
        async for text in answer:
            yield text
            ended = text.endswith(DONE)  # events ready at once come joined (`coalesced`): [DONE] comes last
        if ended:
            return
        why = "its stream ended without [DONE]"
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # this request was cancelled (the client left, the ingress stops): nobody reads on
        why = "its stream was cancelled"  # Ray's TaskCancelledError as the handle raises it: not our cancellation
    except Exception as exc:  # noqa: BLE001 - a dead replica however it shows; the client gets an error event
        if ended:
            return  # the answer was whole: what broke after it changes nothing for the client
        why = f"{type(exc).__name__}: {exc}"
    logger.warning("a replica's stream ended mid-answer (%s)", why)
    error = APIError(503, "the replica serving this request stopped mid-stream; ask again", type="server_error",
                     code="replica_died")
    yield f"data: {json.dumps(error.body())}\n\n"
    yield DONE


@serve.deployment
@serve.ingress()
class Ingress:
    """`speculor serve`'s FastAPI app in front of the replicas."""

    def __init__(self, replica: DeploymentHandle, model: str, queued: int, guard: Guard | None = None) -> None:
        self.service, self.guard = RayService(replica, model, queued), guard

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.service, self.service.metrics, guard=self.guard)


def application(s: RaySettings) -> Any:
    """The Ray Serve application: the ingress bound to the replica deployment."""
    from speculor.runtime import embedded

    replica = Replica.options(ray_actor_options=s.actor_options(), max_ongoing_requests=s.max_batch + s.queue_size,
                              max_queued_requests=s.max_queued_requests, graceful_shutdown_timeout_s=s.drain_s,
                              **s.scaling()).bind(s.replica_args())
    model = s.alias or embedded.named(s.target, None)[0]
    return Ingress.options(num_replicas=s.ingress_replicas, ray_actor_options={"num_cpus": 0},
                           max_ongoing_requests=10_000, graceful_shutdown_timeout_s=s.drain_s
                           ).bind(replica, model, s.max_queued_requests, s.guard())


def build(args: dict[str, Any]) -> Any:
    """The application of a `serve run` / `serve deploy` config (its `args`: RaySettings' fields), its strategy and
    options checked before anything is deployed."""
    s = RaySettings.of(args)
    check_strategy(s)
    return application(s)


def run(s: RaySettings, *, host: str, port: int, address: str | None, metrics_port: int, name: str = APP,
        ssl_keyfile: str | None = None, ssl_certfile: str | None = None, timeout_keep_alive: float | None = None
        ) -> None:
    """`speculor serve --ray`: start Ray here (or join `address`), deploy, serve until interrupted, then drain. TLS
    (`ssl_keyfile`, `ssl_certfile`) and `timeout_keep_alive` are the HTTP proxy's."""
    check_strategy(s)  # before anything is started
    http = {"host": host, "port": port, "ssl_keyfile": ssl_keyfile, "ssl_certfile": ssl_certfile,
            "keep_alive_timeout_s": timeout_keep_alive}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not address:
        port_free(metrics_port, "--metrics-port")
    try:
        if address:
            ray.init(address=address)
        else:
            ray.init(include_dashboard=False, _metrics_export_port=metrics_port)
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exceptions for a node that does not start
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        raise SpeculorError(f"could not start or reach {where}: {exc}") from None
    for sig in (signal.SIGINT, signal.SIGTERM):  # both drain; set after ray.init, whose own handler aborts
        signal.signal(sig, signal.default_int_handler)
    try:
        check_fits(s)
        serve.start(http_options={k: v for k, v in http.items() if v is not None})
        warn_if_exposed(host, s.guard())
        t0 = time.perf_counter()
        serve.run(application(s), name=name, route_prefix="/")
        logger.info("serving %s on %d replica(s) (%s) at http://%s:%d/v1 after %.0f s; metrics through Ray%s",
                    s.target, s.replicas if s.max_replicas is None else s.max_replicas, s.actor_options(), host, port,
                    time.perf_counter() - t0, "" if address else f" on http://127.0.0.1:{metrics_port}/metrics")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("draining (up to %.0f s) ...", s.drain_s)
    finally:
        try:
            serve.delete(name)  # graceful: each replica finishes its requests first (drain_s)
        finally:
            if not address:
                serve.shutdown()
                ray.shutdown()
