"""Test helpers: :func:`assert_close`, a pytest-friendly accuracy check of a port of aclnnMoeInitRoutingV2Grad.

In the spirit of ``torch.testing.assert_close``, but the tolerances are not two numbers: they are
the accuracy standards of :mod:`moegrad.accuracy` (docs/accuracy.md), whose thresholds depend on
the call's dtype, judged against the device's result (the bit-exact emulation in-process, or a
moegrad service's device) and a float64 golden.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from moegrad.accuracy import DTYPE_LIMITS, ComparisonReport, compare, exactness_line, summand_magnitude
from moegrad.numerics._reference import moe_init_routing_v2_grad_golden
from moegrad.operator._call import MoeInitRoutingV2GradCall

if TYPE_CHECKING:
    from moegrad.http._client import Client

__all__ = ["assert_close"]

_WORST_ROWS = 5


def assert_close(
    candidate: Any,
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: int,
    *,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    order: str | None = None,
    allow_duplicate_indices: bool = False,
    standards: Iterable[str] | str | None = None,
    require_exact: bool = False,
    client: Client | None = None,
    device_result: np.ndarray | None = None,
    msg: str | None = None,
) -> ComparisonReport:
    """Assert that ``candidate`` is an accurate grad_x of the call, by the accuracy standards of its dtype.

    Args:
        candidate: [N, H] grad_x of the implementation under test: a numpy array (or anything
            ``numpy.asarray`` takes) in the dtype of grad_expanded_x or float32.
        grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order,
            allow_duplicate_indices: the operator call, as :func:`moegrad.moe_init_routing_v2_grad`
            takes it (shapes [N*K, H] / [A, H] / [E, C, H] and [N*K] int32).
        standards: names from :data:`moegrad.accuracy.STANDARDS`; default
            :data:`moegrad.accuracy.DEFAULT_STANDARDS` (the tolerance standards, whose thresholds
            per dtype are :data:`moegrad.accuracy.THRESHOLDS`).
        require_exact: fail unless the candidate is bit-exact to the device's result.
        client: a :class:`moegrad.Client`: judge against its service's device; default in-process,
            against the bit-exact emulation.
        device_result: [N, H], the device's grad_x when you have it (in-process only).
        msg: a line put first in the failure message.

    Returns:
        The :class:`~moegrad.accuracy.ComparisonReport` (a warning passes).

    Raises:
        AssertionError: the verdict is ``"fail"``; the message names the standards and criteria
            that failed, the device's own figures, bit-exactness, and the worst rows (largest
            error against the golden relative to the summands' magnitude).
        InvalidArgument: the call or the candidate breaks a documented constraint (aclnn 161001 /
            161002 / 561002, naming the field), as :class:`moegrad.MoeInitRoutingV2GradCall` and
            :func:`moegrad.compare` raise it.
    """
    call = MoeInitRoutingV2GradCall(
        grad_expanded_x=np.asarray(grad_expanded_x),
        expanded_row_idx=np.asarray(expanded_row_idx),
        top_k=top_k,
        drop_pad_mode=drop_pad_mode,
        active_num=active_num,
        allow_duplicate_indices=allow_duplicate_indices,
        **({} if order is None else {"order": order}),
    )
    values = np.asarray(candidate)
    if client is None:
        report = compare(call, values, device_result=device_result, standards=standards, require_exact=require_exact)
    else:
        report = client.compare(
            call.grad_expanded_x,
            call.expanded_row_idx,
            call.top_k,
            call.drop_pad_mode,
            call.active_num,
            candidate=values,
            standards=standards,
            order=order,
            allow_duplicate_indices=allow_duplicate_indices,
            require_exact=require_exact,
        ).report
    if report.passed:
        return report
    raise AssertionError(_message(report, call, values, msg))


def _message(report: ComparisonReport, call: MoeInitRoutingV2GradCall, candidate: np.ndarray, msg: str | None) -> str:
    n, h = report.shape
    lines = [msg] if msg else []
    lines.append(
        f"grad_x is not accurate enough: verdict FAIL for aclnnMoeInitRoutingV2Grad grad_x [{n}, {h}] "
        f"{report.dtype} (candidate {report.candidate_dtype}; docs/accuracy.md)"
    )
    for verdict in report.verdicts:
        if verdict.status != "pass":
            lines.append(f"  {verdict.standard}: {verdict.status} (the device: {verdict.device_status})")
            lines += [f"    {c.describe()}" for c in verdict.failures]
    lines.append(f"  {exactness_line(report)}")
    if report.zero_rows.mismatched_rows:
        z = report.zero_rows
        lines.append(
            f"  rows that must be +0.0 (every slot skipped): {z.mismatched_rows} hold other values, "
            f"first row {z.first_mismatched_row}"
        )
    lines.append("  worst rows (|candidate - golden| / max(sum |summands|, small value)):")
    lines += [f"    {line}" for line in _worst_rows(call, candidate)]
    return "\n".join(lines)


def _worst_rows(call: MoeInitRoutingV2GradCall, candidate: np.ndarray) -> list[str]:
    if candidate.size == 0:
        return ["none (grad_x is empty)"]
    golden = moe_init_routing_v2_grad_golden(call)
    scale = np.maximum(summand_magnitude(call), DTYPE_LIMITS[call.dtype_name].small_value)
    values = candidate.astype(np.float64)
    with np.errstate(all="ignore"):
        error = np.abs(values - golden) / scale
    error = np.where(np.isnan(values) != np.isnan(golden), np.inf, np.nan_to_num(error, nan=0.0))
    column = np.argmax(error, axis=1)
    row_error = error[np.arange(error.shape[0]), column]
    rows = [int(r) for r in np.argsort(-row_error, kind="stable")[:_WORST_ROWS] if row_error[r] > 0]
    if not rows:
        return ["none: every element equals the golden"]
    return [
        f"row {r}: {row_error[r]:.3g} at column {int(column[r])} (candidate {float(values[r, column[r]])!r}, "
        f"golden {float(golden[r, column[r]])!r})"
        for r in rows
    ]
