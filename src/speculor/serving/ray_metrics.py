"""`Ray()`: a metrics family for `serving.metrics.Metrics` that records through Ray's metrics (ray.serve.metrics).

Contract: the same metric names and labels as the Prometheus family; Ray's agent exports them on each node's metrics
export port with a `ray_` prefix (counters also with `_total`), tagged with the Ray Serve application, deployment and
replica. A gauge read from a function (`set_function`) is set from it every REFRESH_S seconds by one daemon thread,
since Ray's gauges are pushed, not read at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ray.serve import metrics as serve_metrics

REFRESH_S = 1.0


class _Metric:
    """A Ray metric with prometheus_client's call shape: `labels(*values)` binds label values; inc/observe/set."""

    def __init__(self, metric: Any, keys: tuple[str, ...], values: tuple[str, ...] = ()) -> None:
        self.metric, self.keys, self.values = metric, keys, values

    def labels(self, *values: str) -> _Metric:
        return _Metric(self.metric, self.keys, tuple(str(v) for v in values))

    def _tags(self) -> dict[str, str] | None:
        return dict(zip(self.keys, self.values, strict=True)) if self.keys else None

    def inc(self, amount: float = 1.0) -> None:
        if amount > 0:  # Ray's counters refuse 0
            self.metric.inc(amount, tags=self._tags())

    def observe(self, value: float) -> None:
        self.metric.observe(value, tags=self._tags())

    def set(self, value: float) -> None:
        self.metric.set(value, tags=self._tags())


class _Gauge(_Metric):
    def __init__(self, metric: Any, keys: tuple[str, ...], *, family: Ray) -> None:
        super().__init__(metric, keys)
        self.family = family

    def set_function(self, fn: Callable[[], float]) -> None:
        """Set from `fn()` every REFRESH_S seconds."""
        self.family._read(self, fn)


class Ray:
    """Makes `Metrics`' counters, histograms and gauges as Ray Serve metrics."""

    def __init__(self) -> None:
        self._functions: list[tuple[_Metric, Callable[[], float]]] = []
        self._thread: threading.Thread | None = None

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> _Metric:
        return _Metric(serve_metrics.Counter(name, doc, tag_keys=labels or None), labels)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> _Metric:
        bounds = [b for b in buckets if b > 0]  # Ray's boundaries must be positive (0 falls in the first bucket)
        return _Metric(serve_metrics.Histogram(name, doc, boundaries=bounds, tag_keys=labels or None), labels)

    def gauge(self, name: str, doc: str) -> _Gauge:
        return _Gauge(serve_metrics.Gauge(name, doc), (), family=self)

    def _read(self, gauge: _Metric, fn: Callable[[], float]) -> None:
        self._functions.append((gauge, fn))
        if self._thread is None:
            self._thread = threading.Thread(target=self._refresh, name="speculor-metrics", daemon=True)
            self._thread.start()

    def _refresh(self) -> None:
        while True:
            for gauge, fn in list(self._functions):
                try:
                    gauge.set(fn())
                except Exception:  # noqa: BLE001 - a gauge that cannot be read now is read next time
                    pass
            time.sleep(REFRESH_S)
