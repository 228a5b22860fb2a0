"""The record that makes a saved comparison report reproducible (docs/accuracy.md, "Reports that reproduce"):
the call, the SHA-256 of its inputs as the wire sends them, its profile and product line, who
answered and when; and, when asked, the device profiles whose bits the candidate has."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib

import numpy as np

from moegrad._dtypes import dtype_name
from moegrad._version import __version__
from moegrad.accuracy._results import ComparisonReport, ReportContext
from moegrad.accuracy._traits import call_traits
from moegrad.numerics._identify import profiles_matching
from moegrad.operator._call import ORDERS, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import resolve_profile

__all__ = ["report_context", "with_context", "with_profiles"]


def _product_line(order: str) -> str:
    """``"Atlas A2, CANN 9.1"``..., or ``order`` itself (``"unknown"``: a device of no known profile)."""
    return resolve_profile(order).product_line if order in ORDERS else order


def _sha256(array: np.ndarray) -> str:
    data = np.ascontiguousarray(array)
    if data.dtype.itemsize > 1:  # the bytes as the wire sends them: little-endian
        data = data.view(f"u{data.dtype.itemsize}").astype(f"<u{data.dtype.itemsize}", copy=False)
    if data.size == 0:  # memoryview.cast refuses a shape with a zero in it: the digest of no bytes
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(data.data.cast("B")).hexdigest()


def report_context(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    backend: str = "in-process",
    device: str | None = None,
    server_url: str | None = None,
    order: str | None = None,
    case: str | None = None,
    created: str | None = None,
) -> ReportContext:
    """The record that makes a saved report reproducible: the call, SHA-256 of its inputs, who answered, when.

    Args:
        call: the validated call the report judged.
        candidate: [N, H], the candidate it judged.
        backend: who computed the device result (a service's backend name, or ``"in-process"``).
        device: the device that ran it, or None for an emulation.
        server_url: the service's URL, or None in-process.
        order: the device result's profile (a name of :data:`moegrad.PROFILES`, or ``"unknown"``);
            default ``call.order``.
        case: the case's name in a bulk run.
        created: ISO 8601 time; default now, in UTC.

    Returns:
        A :class:`ReportContext` (attach it with :func:`with_context`), with the call's
        :class:`~moegrad.accuracy.CallTraits` (a sweep's factor analysis reads them).
    """
    tensors = {
        "grad_expanded_x": call.grad_expanded_x,
        "expanded_row_idx": call.expanded_row_idx,
        "candidate": np.asarray(candidate),
    }
    used = call.order if order is None else order
    return ReportContext(
        operator="aclnnMoeInitRoutingV2Grad",
        shapes={name: tuple(int(n) for n in t.shape) for name, t in tensors.items()},
        dtypes={name: dtype_name(t.dtype) or str(t.dtype) for name, t in tensors.items()},
        sha256={name: _sha256(t) for name, t in tensors.items()},
        top_k=call.top_k,
        drop_pad_mode=call.drop_pad_mode,
        active_num=call.active_num,
        order=used,
        product_line=_product_line(used),
        moegrad_version=__version__,
        backend=backend,
        device=device,
        server_url=server_url,
        case=case,
        created=created or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        traits=call_traits(call),
    )


def with_context(report: ComparisonReport, context: ReportContext | None) -> ComparisonReport:
    """``report`` with its :attr:`~ComparisonReport.context` set (the metrics and verdicts unchanged)."""
    return dataclasses.replace(report, context=context)


def with_profiles(report: ComparisonReport, call: MoeInitRoutingV2GradCall, candidate: np.ndarray) -> ComparisonReport:
    """``report`` with :attr:`~moegrad.ComparisonReport.profiles_matching` set: the profiles whose
    emulation of ``call`` is bit-identical to ``candidate`` (:func:`~moegrad.identify`; up to four
    emulations, so it is asked for, not done by every comparison). Same errors as that function."""
    return dataclasses.replace(report, profiles_matching=profiles_matching(call, candidate))
