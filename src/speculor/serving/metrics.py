"""Prometheus metrics of the server, served by GET /metrics.

Contract: `Metrics` holds one app's metrics, made by a `family`: by default prometheus_client's, in a registry of
its own (several apps may live in one process; `render` is the text format), or Ray's (serving/ray_metrics.py:
exported through Ray's metrics agent, tagged with the Ray Serve deployment and replica). `MetricsMiddleware` counts
every HTTP request by endpoint (one of ENDPOINTS, else "other") and status and times it to the end of its body,
streams included. The generation metrics are filled by the scheduler.
"""

from __future__ import annotations

import time
from typing import Any

import prometheus_client as prom
import torch
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speculor.runtime.memory import peak_memory_gib

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/completion",
             "/completions", "/tokenize", "/detokenize", "/props")
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)


class Prometheus:
    """prometheus_client's metrics in a registry of their own: what `Metrics` makes its metrics with by default."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return prom.Counter(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Any:
        return prom.Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

    def gauge(self, name: str, doc: str) -> Any:
        return prom.Gauge(name, doc, registry=self.registry)


class Metrics:
    """The metrics of one app (or Ray Serve replica), made by `family` (Prometheus() or ray_metrics.Ray())."""

    def __init__(self, device: torch.device | None = None, family: Any = None) -> None:
        self.family = family or Prometheus()
        self.device = device or torch.device("cpu")
        f = self.family
        self.requests = f.counter("speculor_requests", "HTTP requests by endpoint and status", ("endpoint", "status"))
        self.latency = f.histogram("speculor_request_latency_seconds",
                                   "HTTP request latency, to the end of the response body",
                                   (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), ("endpoint",))
        self.generations = f.counter("speculor_generations", "generations by outcome (completed, cancelled, failed)",
                                     ("outcome",))
        self.tokens = f.counter("speculor_generated_tokens", "tokens generated (cancelled generations included)")
        self.accepted = f.counter("speculor_accepted_draft_tokens", "generated tokens that were accepted draft "
                                  "tokens")
        self.tau = f.histogram("speculor_tau", "tokens per target forward of each completed generation", TAU_BUCKETS)
        self.queue_depth = f.gauge("speculor_queue_depth", "requests waiting for the engine")
        self.running = f.gauge("speculor_running_generations", "generations in the running batch")
        self.batch_size = f.histogram("speculor_batch_size", "requests in each batched step",
                                      (1, 2, 4, 8, 16, 32, 64, 128))
        self.rows = f.histogram("speculor_rows_per_step", "target rows (roots + draft tokens) of each batched step",
                                (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.accept_length = f.histogram("speculor_accepted_length", "draft tokens accepted per request and step",
                                         (0, 1, 2, 3, 4, 5, 6, 8, 12, 16))
        self.peak_memory = f.gauge("speculor_peak_memory_gib", "peak memory of the server process since it started, "
                                   "in GiB: resident set on a CPU, torch's allocator peak on a GPU (NaN where the OS "
                                   "does not say)")
        self.peak_memory.set_function(self.peak_memory_gib)

    def peak_memory_gib(self) -> float:
        """The peak memory since the process started (runtime/memory.py), read at each scrape; NaN if unknown."""
        peak = peak_memory_gib(self.device)
        return float("nan") if peak is None else peak

    def observe_step(self, batch: int, rows: int, accepted: list[int]) -> None:
        """One batched step: its number of requests and target rows, and each request's accepted length."""
        self.batch_size.observe(batch)
        self.rows.observe(rows)
        for a in accepted:
            self.accept_length.observe(a)

    def render(self) -> Response:
        """The Prometheus text format (prometheus_client's family only)."""
        return Response(prom.generate_latest(self.family.registry), media_type=prom.CONTENT_TYPE_LATEST)


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
