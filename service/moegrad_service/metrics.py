"""Prometheus metrics, named after Triton's (``nv_inference_*`` -> ``moegrad_inference_*``).

One registry per app, so several apps (tests) never collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The service's counters, histograms and gauges (durations in seconds, sizes in bytes)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.success = Counter(
            "moegrad_inference_request_success", "Calls answered with a result.", ["endpoint"], registry=r
        )
        self.failure = Counter(
            "moegrad_inference_request_failure",
            "Calls answered with an error, by reason.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.request_duration = Histogram(
            "moegrad_inference_request_duration_seconds",
            "Whole request: arrival to reply built.",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "moegrad_inference_queue_duration_seconds",
            "Time admitted calls waited for a worker.",
            buckets=_SECONDS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "moegrad_inference_compute_duration_seconds",
            "Time a worker spent computing a call.",
            buckets=_SECONDS,
            registry=r,
        )
        self.bytes_in = Counter("moegrad_inference_request_bytes", "Request body bytes read.", registry=r)
        self.bytes_out = Counter("moegrad_inference_response_bytes", "Response body bytes sent.", registry=r)
        self.pending = Gauge(
            "moegrad_inference_pending_request_count",
            "Work admitted and waiting: calls queued for a worker, comparisons and explanations queued for a judge.",
            registry=r,
        )
        self.in_flight = Gauge(
            "moegrad_inference_exec_count",
            "Work running now: calls on a worker, comparisons being judged, explanations being worked out.",
            registry=r,
        )
        self.held_bytes = Gauge(
            "moegrad_inflight_bytes",
            "Bytes of the in-flight budget (max_inflight_bytes) held now: admitted requests and kept receive buffers.",
            registry=r,
        )
        self.kept_bytes = Gauge(
            "moegrad_receive_buffer_kept_bytes",
            "Bytes of receive buffers kept for the next body of their size (receive_keep_s).",
            registry=r,
        )

    def succeeded(self, endpoint: str, started: float, calls: int = 1) -> None:
        """Count ``calls`` calls answered with a result on ``endpoint`` (a route's path; a batch's
        good calls) and observe the request's whole duration: ``started`` is the
        ``time.perf_counter()`` reading when it arrived."""
        if calls:
            self.success.labels(endpoint=endpoint).inc(calls)
        self.request_duration.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    def bind(self, queue_depth: Callable[[], float], in_flight: Callable[[], float]) -> None:
        """Read the two queue gauges from the live dataplane (its pool and its judges) at scrape time."""
        self.pending.set_function(queue_depth)
        self.in_flight.set_function(in_flight)

    def bind_memory(self, held_bytes: Callable[[], float], kept_bytes: Callable[[], float]) -> None:
        """Read the in-flight budget's two gauges from the live dataplane at scrape time."""
        self.held_bytes.set_function(held_bytes)
        self.kept_bytes.set_function(kept_bytes)
