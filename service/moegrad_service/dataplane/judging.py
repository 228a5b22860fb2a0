"""The host work a request does after its call: judging a comparison, explaining a candidate.

Each function here runs on a judging thread of the :class:`~moegrad_service.engine.JudgePool`, in
its tenant's turn, as ``work(stop)``: it stops with DeadlineExceeded at its next block of rows
once ``stop`` is set (the client has gone, or the request's deadline passed), so what it held is
freed and its thread takes the next tenant's work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moegrad import ComparisonReport, Explanation, MoegradError, compare, explain
from moegrad_service.dataplane.records import CompareOutcome, Comparison, ExplainRequest, GradOutcome

__all__ = ["explain_candidate", "judge", "judge_each"]


def judge(
    comparison: Comparison,
    device_result: np.ndarray,
    stop: threading.Event,
    *,
    alone: Callable[[], bool] = lambda: True,
) -> tuple[ComparisonReport, float, float]:
    """The report, and the seconds it took: the golden is computed within the comparison (one
    compiled pass with the metrics), so its own share is 0. Its rows are spread over the reference
    kernels' shared pool only when ``alone()`` says no other judging waits or runs.

    Raises:
        DeadlineExceeded: ``stop`` was set (looked at before each block of rows).
    """
    started = time.perf_counter()
    report = compare(
        comparison.call,
        comparison.candidate,
        device_result=device_result,
        standards=comparison.standards,
        stop=stop,
        parallel=alone(),
    )
    return report, 0.0, time.perf_counter() - started


def judge_each(
    judged: list[tuple[int, Comparison, GradOutcome]],
    done: dict[int, Any],
    stop: threading.Event,
    *,
    alone: Callable[[], bool] = lambda: True,
) -> None:
    """Each comparison whose call succeeded, against its device result, its answer put in ``done``
    under its place as soon as it has one; none after ``stop`` is set (:func:`judge`)."""
    for index, comparison, grad in judged:
        if stop.is_set():
            return
        try:
            report, golden_s, compare_s = judge(comparison, grad.grad_x, stop, alone=alone)
        except MoegradError as exc:
            done[index] = exc.with_traceback(None)
        else:
            done[index] = CompareOutcome(grad, report, golden_s, compare_s)


def explain_candidate(
    request: ExplainRequest, device_result: np.ndarray, profile: str | None, stop: threading.Event
) -> tuple[Explanation, float]:
    """The explanation of the candidate's rows that differ from ``device_result`` against
    ``profile`` (None: the call's order), and the seconds it took.

    Raises:
        DeadlineExceeded: ``stop`` was set (looked at before each block of rows, and within the
            search of other rows for a wrong summand, a few rows at a time).
    """
    started = time.perf_counter()
    explanation = explain(request.call, request.candidate, profile=profile, device_result=device_result, stop=stop)
    return explanation, time.perf_counter() - started
