"""Continuous batching: requests become `Job`s in a bounded FIFO; one worker thread runs the running batch step by
step (engine/batch.py) and lets jobs join and leave it between steps (iteration-level scheduling).

Contract: `Scheduler.submit` queues a job or raises APIError 429 when `queue_size` jobs already wait. The worker
(started by the first submit, ended by `stop`) loops: admit the waiting jobs, oldest first, while fewer than
`max_batch` run and, on a backend whose requests share one memory (llama.cpp's), the next one's prompt and longest
answer fit there beside the running jobs' (their prompts are then prefilled inside the batched steps, a chunk of
engine/request.py's PREFILL_CHUNK tokens a step each, so joining requests slow the running ones by their chunks' rows
instead of stopping them),
run one batched step over the running jobs, hand each job its new text (`Delta`), and end the jobs that are done
(EOS, length, a stop string: `Done`) or whose client left (`cancel`, checked before admission and after every
step: `Done("cancelled")`). Each job keeps its own strategy, options, sampling settings and seed; its output is
what it would be alone (docs/algorithms.md §11). The worker never raises; the event loop never runs the model.
One lock guards the pair's models: the worker holds it for an admission or a step, and `build` (a request's strategy,
whose shared part may run forwards: an auto budget timing a head) holds it in a thread of its own, between steps.
Outcomes, tokens, tau, batch sizes, rows per step and accepted lengths go to `Metrics`; each generation is
logged on the "speculor.serving.app" logger when it is admitted and when it ends.
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
from speculor.config import SamplingConfig, check_int
from speculor.engine.batch import Active
from speculor.engine.batch import step as batch_step
from speculor.errors import SpeculorError
from speculor.grammar.compile import Constraint
from speculor.grammar.tools import Tool
from speculor.runtime import openmp
from speculor.serving.errors import APIError, bad_request
from speculor.serving.metrics import Metrics

logger = logging.getLogger("speculor.serving.app")  # the server's one log channel
MAX_BATCH = 16  # requests decoded together by default (llama-server's users start 16 slots: `-np 16`)


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: tuple[engine.Token, ...] = ()  # the tokens whose text this is (their logprobs, when asked for)


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop", "length" or "cancelled"
    usage: dict[str, Any]
    stop_word: str | None = None  # the stop string that ended it ("stop" by an end-of-sequence token: None)


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
    constraint: Constraint | None = None  # its structured output's (grammar/compile.py), compiled already
    tools: list[Tool] = field(default_factory=list)  # its tools, whose calls are read back from its text
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


@dataclass
class _Running:
    """A job in the running batch: its request state, detokenizer and counts."""

    job: Job
    active: Active
    detok: Detokenizer
    progress: _Progress
    t0: float


class Scheduler:
    """A bounded FIFO of jobs and the one worker thread that runs up to `max_batch` of them together on `sp`."""

    def __init__(self, sp: Speculor, queue_size: int, metrics: Metrics, max_batch: int = MAX_BATCH) -> None:
        if not isinstance(queue_size, int) or queue_size < 1:
            raise SpeculorError(f"queue_size must be a positive integer, got {queue_size!r}")
        check_int("max_batch", max_batch, 1, 256)
        self.sp, self.metrics, self.queue_size, self.max_batch = sp, metrics, queue_size, max_batch
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._start_guard = threading.Lock()
        self._stopping = False
        self.running: list[_Running] = []
        self.starting: Job | None = None  # the job whose prefill runs now
        self._held: Job | None = None  # the oldest waiting job, taken from the queue, waiting for memory
        self._models = threading.Lock()  # the pair's models: one admission, step or strategy build at a time
        metrics.queue_depth.set_function(self.depth)
        metrics.running.set_function(self.size)

    def size(self) -> int:
        """Jobs in the batch, the one being admitted included."""
        return len(self.running) + (self.starting is not None)

    def depth(self) -> int:
        """Jobs waiting (the running ones not counted)."""
        return self._queue.qsize() + (self._held is not None)

    def alive(self) -> bool:
        """False only when the worker thread ended without being stopped (a bug: nothing would serve the queue)."""
        thread = self._thread
        return thread is None or thread.is_alive() or self._stopping

    def submit(self, job: Job) -> None:
        """Queue a job behind the others; APIError 429 when `queue_size` jobs already wait."""
        self._ensure_started()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy: {self.queue_size} requests are already waiting; retry "
                           "later", type="rate_limit_error", code="queue_full") from None

    async def build(self, name: str, options: dict[str, Any]) -> None:
        """Build strategy `name`'s shared part with `options` (cached by `sp`; SpeculorError if invalid) off the
        event loop, between the worker's steps: never beside a forward on the same models. One built already
        returns at once; a new one waits for the admission or step in progress."""
        if self.sp.built(name, **options):
            return

        def locked() -> None:
            with self._models:
                try:
                    self.sp.strategy_for(name, **options)
                finally:  # a pool's thread that timed forwards keeps no OpenMP team beside the worker's
                    openmp.release()

        await asyncio.to_thread(locked)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running jobs, fail the waiting ones (503) and end the worker thread."""
        for job in [r.job for r in list(self.running)] + ([self.starting] if self.starting else []):
            job.cancel.set()
        if self._held is not None:
            self._held.emit(Failed(APIError(503, "the server is shutting down", type="server_error")))
            self._held = None
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(Failed(APIError(503, "the server is shutting down", type="server_error")))
        if self._thread is not None:
            self._stopping = True
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _ensure_started(self) -> None:
        with self._start_guard:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._work, name="speculor-engine", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while not (self._stopping and not self.running):
            job = self._next_job()
            while job is not None:  # every waiting job that has room, before the next step
                with self._models:
                    self._admit(job)
                job = self._next_job() if self.running else None
            if self.running:
                with self._models:
                    self._step()

    def _next_job(self) -> Job | None:
        """The oldest waiting job if the batch has room (waits for one when nothing runs); None otherwise."""
        if len(self.running) >= self.max_batch or self._stopping:
            return None
        job, self._held = self._held, None
        if job is None:
            try:
                job = self._queue.get() if not self.running else self._queue.get_nowait()
            except queue.Empty:
                return None
        if job is None:
            self._stopping = True
        elif not self._fits(job):
            self._held = job  # first in line until the running jobs leave it room
            return None
        return job

    def _fits(self, job: Job) -> bool:
        """Whether the job's prompt and longest answer fit beside the running jobs' in a target whose requests share
        one memory of `cells` (llama.cpp's); a job that runs alone always does (its length was checked)."""
        cells = self.sp.pair.target.traits.cells
        size = lambda j: len(j.prompt) + j.cfg.max_new_tokens  # noqa: E731
        return cells is None or not self.running or sum(size(r.job) for r in self.running) + size(job) <= cells

    def _admit(self, job: Job) -> None:
        """Start a job (its prefill runs now) and add it to the batch; a job whose client left is ended at once."""
        t0, progress, stats = time.perf_counter(), _Progress(), engine.Stats()
        if job.cancel.is_set():  # the client left while the job waited
            job.emit(Done("cancelled", progress.usage(job, stats)))
            self._account(job, "cancelled", stats, progress, 0.0)
            return
        self.starting = job
        try:
            name, options = self.sp.options_for(job.strategy, job.options)
            shared = self.sp.strategy_for(name, **options)
            req = engine.start(self.sp.pair.target, shared.drafter() if shared is not None else None, job.prompt,
                               job.cfg, stats, prefill=False, grammar=self.sp.grammar(job.constraint))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the job's answer; the server keeps serving
            self._fail(job, exc, stats, progress, t0)
            return
        finally:
            self.starting = None
        logger.info("generation %s admitted (%s, batch of %d)", job.id, name, len(self.running) + 1)
        self.running.append(_Running(job, Active(req, self.sp.eos_ids),
                                     Detokenizer(self.sp.pair.tokenizer, job.cfg.stop), progress, t0))

    def _step(self) -> None:
        """One batched step; every job's new text; the jobs that ended leave the batch."""
        decoding = [r for r in self.running if not r.active.req.unfilled]  # the others fill their prompts
        try:
            emitted = batch_step(self.sp.pair.target, [r.active for r in self.running])
        except Exception as exc:  # noqa: BLE001 - a failed step fails the jobs in it, not the server
            for r in self.running:
                self._fail(r.job, exc, r.active.req.stats, r.progress, r.t0)
            self.running = []
            return
        steps = [r.active.req.stats.steps[-1] for r in decoding]
        if steps:
            self.metrics.observe_step(len(steps), sum(1 + s.drafted for s in steps), [s.accepted for s in steps])
        still = []
        for r, toks in zip(self.running, emitted, strict=True):
            if self._deliver(r, toks):
                still.append(r)
        self.running = still

    def _deliver(self, r: _Running, toks: list[engine.Token]) -> bool:
        """Hand a job its new tokens as text; True while it goes on, else it has been ended (Done)."""
        job, stats = r.job, r.active.req.stats
        for tok in toks:
            r.progress.add(tok)
            if delta := r.detok.add(tok):
                job.emit(Delta(delta, tuple(r.detok.pop_tokens())))
            if r.detok.stopped:
                break
        if r.detok.stopped or r.active.done:
            if not r.detok.stopped and (delta := r.detok.flush()):
                job.emit(Delta(delta, tuple(r.detok.pop_tokens())))
            stopped = r.detok.stopped or (r.progress.last in self.sp.eos_ids)
            job.emit(Done("stop" if stopped else "length", r.progress.usage(job, stats), _stop_word(r.detok)))
            self._account(job, "completed", stats, r.progress, time.perf_counter() - r.t0)
            return False
        if job.cancel.is_set():
            job.emit(Done("cancelled", r.progress.usage(job, stats)))
            self._account(job, "cancelled", stats, r.progress, time.perf_counter() - r.t0)
            return False
        return True

    def _fail(self, job: Job, exc: Exception, stats: engine.Stats, progress: _Progress, t0: float) -> None:
        if isinstance(exc, SpeculorError):
            job.emit(Failed(bad_request(exc)))
        else:  # a bug: keep serving, tell the client nothing more than that
            logger.error("generation %s failed", job.id, exc_info=exc)
            job.emit(Failed(APIError(500, "internal server error during generation", type="server_error")))
        self._account(job, "failed", stats, progress, time.perf_counter() - t0)

    def _account(self, job: Job, outcome: str, stats: engine.Stats, progress: _Progress, seconds: float) -> None:
        m = self.metrics
        m.generations.labels(outcome).inc()
        m.tokens.inc(progress.tokens)
        m.accepted.inc(progress.accepted)
        if outcome == "completed" and stats.steps:
            m.tau.observe(stats.tau)
        logger.info("generation %s %s: %d of max %d tokens, tau %.2f, %.3f s", job.id, outcome, progress.tokens,
                    job.cfg.max_new_tokens, stats.tau, seconds)


def _stop_word(detok: Detokenizer) -> str | None:
    """The stop string that stopped a detokenizer (the text it released ends where the string begins), if one did."""
    if not detok.stopped:
        return None
    text = detok.tokenizer.decode(detok.ids, skip_special_tokens=True)
    return next((s for s in detok.stop if text.startswith(s, detok.sent)), None)


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
        steps = len(stats.steps)
        return {"prompt_tokens": len(job.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(job.prompt) + self.tokens, "tau": round(stats.tau, 4),
                "accepted_tokens": self.accepted, "steps": steps,
                "drafted_tokens": sum(s.drafted for s in stats.steps), "forced_tokens": stats.forced,
                "tokens_per_step": round(self.tokens / steps, 4) if steps else 0.0}
