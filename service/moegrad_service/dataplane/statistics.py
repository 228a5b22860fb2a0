"""The model's inference statistics in Triton's schema, kept by the dataplane for every protocol."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moegrad_service.engine import Timings

__all__ = ["Duration", "InferenceStatistics"]


@dataclass
class Duration:
    """A count of events and their total duration in nanoseconds (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` events that took ``seconds`` each."""
        self.count += count
        self.ns += count * max(0, round(seconds * 1e9))


@dataclass
class InferenceStatistics:
    """The model's inference statistics in Triton's schema (``InferStatistics`` of its service
    definition), over every protocol since the process started.

    Attributes:
        success: calls answered with a result; ns from the request's arrival (when the endpoint says
            when, else from the dataplane's start) to the result.
        fail: calls that reached the dataplane validated and then failed (queue full, not ready,
            deadline, the device's rejection or fault, the caller gone); ns as for success. A request
            refused while being decoded never reaches the dataplane and is not counted here, nor is
            a call refused for naming an order its device does not compute.
        queue: time the successful calls waited for a worker.
        compute_input: time from the request's arrival to the dataplane: reading, decoding and
            validating the inputs (0 ns for an endpoint that does not say when its request arrived).
        compute_infer: time a worker spent computing (the backend's run, copies included).
        compute_output: time from the worker's result to the dataplane's answer; encoding the reply
            is the protocol's and is not included.
        inference_count: inferences performed (one per successful call: no batching).
        execution_count: executions (equal to inference_count).
        last_inference_ms: when the last successful call finished, in milliseconds since the epoch (0: none yet).
    """

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0

    def count_success(self, received: float, entered: float, computed: float, timings: Timings, count: int = 1) -> None:
        """Count ``count`` successful calls that each took these times (``time.perf_counter()``
        readings: the request's arrival, its entry into the dataplane, the worker's result; a batch
        chunk's calls share them), done now."""
        done = time.perf_counter()
        self.success.add(done - received, count)
        self.queue.add(timings.queue_s, count)
        self.compute_input.add(entered - received, count)
        self.compute_infer.add(timings.compute_s, count)
        self.compute_output.add(done - computed, count)
        self.inference_count += count
        self.execution_count += count
        self.last_inference_ms = time.time_ns() // 1_000_000
