"""What a service answers: :class:`GradResult` (one call), :class:`CompareResult` (one comparison) and
:class:`ExplainResult` (one explanation)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from moegrad.http._accuracy import ComparisonReport, Explanation

__all__ = ["CompareResult", "ExplainResult", "GradResult"]


@dataclasses.dataclass(frozen=True, eq=False)
class GradResult:
    """One call's answer from the service.

    Attributes:
        grad_x: [N, H], the dtype of grad_expanded_x (float16, ``ml_dtypes.bfloat16`` or float32),
            C-contiguous, writable, owned by the caller.
        backend: the backend that ran the call (``"reference"``, ``"ascend"``).
        order: the device profile whose bits these are, always a canonical name of
            :data:`moegrad.PROFILES` (``"ascend910b@9.1"``, ``"ascend950@9.0"``, ``"sequential"``...;
            a call naming an alias such as ``"ascend950"`` gets the profile it means), or
            ``"unknown"`` from a device whose profile (chip and CANN release) moegrad does not know.
        device: the device that ran it (e.g. ``"Ascend910B3:0"``), or None for the CPU emulation.
        timings_ms: ``{"queue": ..., "compute": ..., "total": ...}`` as the server measured them,
            in milliseconds (a batch's result: ``queue`` and ``compute`` only; the batch's own
            ``total`` covers all of its calls).
        request_id: the ``X-Request-Id`` the server echoed (the client sends one per call).
        server_url: the root URL of the replica that answered (``client.stats`` lists them).
    """

    grad_x: np.ndarray
    backend: str
    order: str
    device: str | None
    timings_ms: Mapping[str, float]
    request_id: str | None
    server_url: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class CompareResult:
    """One accuracy comparison's answer from the service (docs/accuracy.md, "Reading a report").

    Attributes:
        report: the :class:`~moegrad.ComparisonReport`, rebuilt with ``ComparisonReport.from_dict``
            from the reply: the three comparisons, the zero rows and every standard's verdict.
        grad_x: the device's (or the emulation's) grad_x, [N, H] in the call's dtype, C-contiguous,
            writable, owned by the caller, when the call asked for it (``return_grad_x=True``);
            else None.
        backend: the backend that ran the call (``"reference"``, ``"ascend"``).
        order: the device profile of the device result, as for :attr:`GradResult.order`.
        device: the device that ran it, or None for the CPU emulation.
        timings_ms: ``{"queue", "compute", "golden", "compare", "total"}`` as the server measured
            them, in milliseconds.
        request_id: the ``X-Request-Id`` the server echoed.
        server_url: the root URL of the replica that answered.
    """

    report: ComparisonReport
    grad_x: np.ndarray | None
    backend: str
    order: str
    device: str | None
    timings_ms: Mapping[str, float]
    request_id: str | None
    server_url: str | None = None

    @property
    def passed(self) -> bool:
        """True unless the overall verdict is ``"fail"`` (a warning passes): ``report.passed``."""
        return self.report.passed


@dataclasses.dataclass(frozen=True, eq=False)
class ExplainResult:
    """One explanation's answer from the service (docs/accuracy.md, "Explaining a mismatch").

    Attributes:
        explanation: the :class:`~moegrad.Explanation`, rebuilt with ``Explanation.from_dict`` from
            the reply: each row of the candidate that differs from the device's result, explained.
        backend: the backend that ran the call (``"reference"``, ``"ascend"``).
        order: the device profile of the device result, as for :attr:`GradResult.order`.
        device: the device that ran it, or None for the CPU emulation.
        timings_ms: ``{"queue", "compute", "explain", "total"}`` as the server measured them, in
            milliseconds.
        request_id: the ``X-Request-Id`` the server echoed.
        server_url: the root URL of the replica that answered.
    """

    explanation: Explanation
    backend: str
    order: str
    device: str | None
    timings_ms: Mapping[str, float]
    request_id: str | None
    server_url: str | None = None
