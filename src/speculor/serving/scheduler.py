"""The generation queue: requests become `Job`s in a bounded FIFO run one at a time by one worker thread.

Contract: `Scheduler.submit` queues a job or raises APIError 429 when `queue_size` jobs already wait; the
worker (started by the first submit, ended by `stop`) runs each job on the shared `Speculor` and hands its
events (`Delta` text, then exactly one `Done` or `Failed`) to the job's event loop; it never raises. A
job's `cancel` flag is checked before it starts and after every token. The event loop never runs the model.
Outcomes, tokens and tau go to `Metrics`; each generation is logged on the "speculor.serving.app" logger.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from speculor import engine
from speculor.api import Detokenizer, Speculor
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.serving.errors import APIError, bad_request
from speculor.serving.metrics import Metrics

logger = logging.getLogger("speculor.serving.app")  # the server's one log channel


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
