"""Prometheus text exposition (format 0.0.4), written here: counters, a histogram, gauges.

Thread-safe (sync endpoints update counters from worker threads). Gauges are read at scrape time.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

Labels = tuple[tuple[str, str], ...]


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels, extra: Labels = ()) -> str:
    items = (*labels, *extra)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


class Metrics:
    """The server's metrics. ``render()`` returns the exposition text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._help: dict[str, tuple[str, str]] = {}
        self._hist: dict[Labels, list[float]] = {}  # per label set: bucket counts + [sum, count]
        self._gauges: list[tuple[str, str, Callable[[], Iterable[tuple[Labels, float]]]]] = []
        self._counter_sources: dict[str, Callable[[], float]] = {}
        self._declare("quantd_http_requests_total", "counter", "HTTP requests by method, route and status")
        self._declare("quantd_http_request_duration_seconds", "histogram", "HTTP request latency")
        self._declare("quantd_http_request_bytes_total", "counter", "request body bytes received")
        self._declare("quantd_http_response_bytes_total", "counter", "response body bytes sent")
        self._declare("quantd_quantized_bytes_total", "counter",
                      "input bytes quantized: sync /v1/quantize calls of this API process plus every job that "
                      "succeeded (on any worker; the job part is the shared store's total, the same in every "
                      "replica: do not sum it across replicas)")
        self._declare("quantd_uploads_total", "counter", "uploads stored, by endpoint")

    def _declare(self, name: str, kind: str, help_: str) -> None:
        self._help[name] = (kind, help_)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._counters[name][key] += value

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.inc("quantd_http_requests_total", method=method, route=route, status=str(status))
        key: Labels = (("method", method), ("route", route))
        with self._lock:
            h = self._hist.get(key)
            if h is None:
                h = self._hist[key] = [0.0] * (len(LATENCY_BUCKETS) + 2)
            for i, b in enumerate(LATENCY_BUCKETS):
                if seconds <= b:
                    h[i] += 1
            h[-2] += seconds
            h[-1] += 1

    def counter_source(self, name: str, read: Callable[[], float]) -> None:
        """Add ``read()`` (a count that only grows, read at scrape time: e.g. from the job store, which
        every process writes) to the unlabelled sample of counter ``name``."""
        self._counter_sources[name] = read

    def gauge(self, name: str, help_: str, read: Callable[[], Iterable[tuple[Labels, float]]]) -> None:
        """Register a gauge whose samples are read at scrape time (errors in ``read`` skip it)."""
        self._gauges.append((name, help_, read))

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            counters = {n: dict(v) for n, v in self._counters.items()}
            hist = {k: list(v) for k, v in self._hist.items()}
        for name, (kind, help_) in self._help.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                for key, h in sorted(hist.items()):
                    for i, b in enumerate(LATENCY_BUCKETS):
                        lines.append(f"{name}_bucket{_fmt_labels(key, (('le', _fmt_value(b)),))} {_fmt_value(h[i])}")
                    lines.append(f"{name}_bucket{_fmt_labels(key, (('le', '+Inf'),))} {_fmt_value(h[-1])}")
                    lines.append(f"{name}_sum{_fmt_labels(key)} {_fmt_value(h[-2])}")
                    lines.append(f"{name}_count{_fmt_labels(key)} {_fmt_value(h[-1])}")
            else:
                samples = counters.get(name, {})
                source = self._counter_sources.get(name)
                if source is not None:
                    with contextlib.suppress(Exception):  # a broken source leaves this process's own count
                        samples[()] = samples.get((), 0.0) + source()
                for key, v in sorted(samples.items()):
                    lines.append(f"{name}{_fmt_labels(key)} {_fmt_value(v)}")
        for name, help_, read in self._gauges:
            try:
                samples = list(read())
            except Exception:  # a broken source must not take /metrics down with it
                continue
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
            lines += [f"{name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in samples]
        return "\n".join(lines) + "\n"
