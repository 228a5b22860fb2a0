"""Judging a candidate gradX: the standards' verdicts and the entry points (:func:`compare`).

An accuracy team sends the inputs of one call and its own gradX (the *candidate*, from a GPU or CPU
port); :func:`compare` measures three pairs and judges the candidate by named standards
(docs/accuracy.md has the definitions, the thresholds and their sources)::

    candidate_vs_golden   candidate  against the float64 golden   (single-golden standards)
    device_vs_golden      the device against the float64 golden   (the benchmark's yardstick)
    candidate_vs_device   candidate  against the device           (bitwise)

Rows whose every slot is skipped (dropped tokens in drop/pad mode, indices >= active_num in active
mode) must be exactly +0.0 on the device (docs/semantics.md); every standard checks them bit for bit.
NumPy only; no device, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from moegrad._dtypes import dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad.accuracy._fused import fused_metrics
from moegrad.accuracy._metrics import FLOAT_INPUTS, float_array, metrics
from moegrad.accuracy._results import (
    ComparisonReport,
    CriterionResult,
    ExactMatch,
    Metrics,
    ReportContext,
    StandardVerdict,
    ZeroRowCheck,
)
from moegrad.accuracy._standards import DEFAULT_STANDARDS, SEVERITY, STANDARDS, THRESHOLDS, Criterion, Status
from moegrad.accuracy._stop import check_stop
from moegrad.numerics._reference import moe_init_routing_v2_grad, moe_init_routing_v2_grad_golden
from moegrad.operator._call import GRAD_DTYPES, MoeInitRoutingV2GradCall

__all__ = [
    "check_compare_arguments",
    "compare",
    "compare_arrays",
    "rejudge",
    "skipped_rows",
    "summand_magnitude",
]

_ZERO_ROW_BLOCK = 1 << 16  # elements of a block of the zero-row check
_FUSED = "auto"  # compare()'s path: "auto" (the compiled pass when numba imports) or "numpy"
_INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
_NULLPTR = AclnnStatus.ACLNN_ERR_PARAM_NULLPTR


# --------------------------------------------------------------------------------------------------
# Standards


def _ratio(candidate: float, device: float) -> float:
    """candidate / device, with 0 when the candidate is exact and inf when only the device is."""
    if math.isnan(candidate) or math.isnan(device):
        return math.nan
    if candidate == 0:
        return 0.0
    if device == 0:
        return math.inf
    return candidate / device


def _specials(m: Metrics) -> int:
    return m.nan_mismatch_count + m.inf_mismatch_count


def _imbalance_excess(cg: Metrics, dg: Metrics) -> float:
    device = 0.0 if math.isnan(dg.error_imbalance) else dg.error_imbalance
    return cg.error_imbalance - device


# measure -> (candidate_vs_golden, device_vs_golden, candidate_vs_device, zero rows) -> (value, samples)
_Measure = Callable[[Metrics, Metrics, Metrics, ZeroRowCheck], tuple[float, int]]
_MEASURES: Mapping[str, _Measure] = {
    "bitwise_mismatches": lambda cg, dg, cd, zr: (cd.count - cd.bitwise_equal_count, cd.count),
    "hundredth_share": lambda cg, dg, cd, zr: (cg.hundredth_share, cg.count),
    "thousandth_share": lambda cg, dg, cd, zr: (cg.thousandth_share, cg.count),
    "ten_thousandth_share": lambda cg, dg, cd, zr: (cg.ten_thousandth_share, cg.count),
    "mean_relative_error": lambda cg, dg, cd, zr: (cg.mean_relative_error, cg.normal_count),
    "max_relative_error": lambda cg, dg, cd, zr: (cg.max_relative_error, cg.normal_count),
    "rmse_ratio": lambda cg, dg, cd, zr: (_ratio(cg.rmse, dg.rmse), cg.finite_count),
    "mean_relative_error_ratio": lambda cg, dg, cd, zr: (
        _ratio(cg.mean_relative_error, dg.mean_relative_error),
        cg.normal_count,
    ),
    "max_relative_error_ratio": lambda cg, dg, cd, zr: (
        _ratio(cg.max_relative_error, dg.max_relative_error),
        cg.normal_count,
    ),
    "small_value_error_ratio": lambda cg, dg, cd, zr: (
        _ratio(cg.small_value_error_rate, dg.small_value_error_rate),
        cg.small_count,
    ),
    "error_imbalance_excess": lambda cg, dg, cd, zr: (_imbalance_excess(cg, dg), cg.nonzero_error_count),
    "max_accumulative_error": lambda cg, dg, cd, zr: (cg.max_accumulative_error, cg.finite_count),
    "special_value_mismatches": lambda cg, dg, cd, zr: (_specials(cg), cg.count),
    "special_value_mismatch_excess": lambda cg, dg, cd, zr: (_specials(cg) - _specials(dg), cg.count),
    "zero_row_mismatches": lambda cg, dg, cd, zr: (zr.mismatched_elements, zr.rows),
}
_OPS: Mapping[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _status(criterion: Criterion, value: float, samples: int) -> tuple[Status, bool]:
    assessed = not math.isnan(value) and samples >= criterion.min_samples
    if not assessed or _OPS[criterion.op](value, criterion.limit):
        return "pass", assessed
    return criterion.on_miss, assessed


def _judge(
    standard: str, dtype: str, cg: Metrics, dg: Metrics, cd: Metrics, zr: ZeroRowCheck, dd: Metrics, dzr: ZeroRowCheck
) -> StandardVerdict:
    """One standard's verdict of the candidate; each criterion also judged with the device in its place
    (``dd``: the device against itself, ``dzr``: the device's zero rows)."""
    results: list[CriterionResult] = []
    device_statuses: list[Status] = []
    for criterion in THRESHOLDS[(standard, dtype)]:
        value, samples = _MEASURES[criterion.measure](cg, dg, cd, zr)
        device_value, device_samples = _MEASURES[criterion.measure](dg, dg, dd, dzr)
        value, device_value = float(value), float(device_value)
        status, assessed = _status(criterion, value, samples)
        device_statuses.append(_status(criterion, device_value, device_samples)[0])
        results.append(
            CriterionResult(
                measure=criterion.measure,
                status=status,
                value=value,
                op=criterion.op,
                limit=float(criterion.limit),
                assessed=assessed,
                samples=int(samples),
                samples_needed=criterion.min_samples,
                device_value=device_value,
            )
        )
    return StandardVerdict(
        standard=standard,
        status=_worst(r.status for r in results),
        criteria=tuple(results),
        device_status=_worst(device_statuses),
    )


def _worst(statuses: Iterable[Status]) -> Status:
    return max(statuses, key=SEVERITY.__getitem__, default="pass")


# --------------------------------------------------------------------------------------------------
# Entry points


def skipped_rows(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The rows of grad_x whose every slot is skipped, which the device writes as +0.0.

    A slot is skipped when its index names no row of grad_expanded_x (docs/semantics.md section 2):
    -1 in drop/pad mode, >= active_num in active mode, and on ``ascend950@9.1`` any negative index
    and a dropless index >= N*K; validation leaves no other such index.

    Returns:
        [N] bool, True for a row that must be exactly +0.0.
    """
    index = call.expanded_row_idx.reshape(-1, call.top_k)
    lenient = call.profile.skips_any_negative or call.profile.skips_dropless_overflow
    if (call.drop_pad_mode, call.active_num) == (0, 0) and not lenient:
        return np.zeros(index.shape[0], dtype=np.bool_)  # dropless: every index names a row
    rows = math.prod(call.grad_expanded_x.shape[:-1])  # N*K dropless, A active, E*C drop/pad
    return ((index < 0) | (index >= rows)).all(axis=1)


def _zero_rows(candidate: np.ndarray, rows: np.ndarray, stop: threading.Event | None = None) -> ZeroRowCheck:
    """The rows that must be +0.0, checked a block of about _ZERO_ROW_BLOCK elements at a time (so
    that the check's float64 copy stays small whatever the call), ``stop`` looked at before each."""
    where = np.flatnonzero(rows)
    step = max(1, _ZERO_ROW_BLOCK // max(candidate.shape[1], 1))
    mismatched_rows = mismatched = 0
    first = None
    for start in range(0, where.size, step):
        _check_stop(stop)
        block = candidate[where[start : start + step]].astype(np.float64)
        bad = ~((block == 0) & ~np.signbit(block))
        bad_rows = np.flatnonzero(bad.any(axis=1))
        if bad_rows.size and first is None:
            first = int(where[start + bad_rows[0]])
        mismatched_rows += int(bad_rows.size)
        mismatched += int(np.count_nonzero(bad))
    return ZeroRowCheck(
        rows=int(where.size),
        mismatched_rows=mismatched_rows,
        mismatched_elements=mismatched,
        first_mismatched_row=first,
    )


def _check_stop(stop: threading.Event | None) -> None:
    check_stop(stop, "the comparison")


def _candidate_dtype(candidate: np.ndarray) -> str:
    name = dtype_name(candidate.dtype)
    assert name is not None, "_check_candidate took the candidate, so its dtype is a wire dtype"
    return name


def _check_candidate(candidate: Any, shape: tuple[int, int], dtype: str) -> np.ndarray:
    if not isinstance(candidate, np.ndarray):
        raise InvalidArgument(
            f"candidate must be a numpy.ndarray, got {type(candidate).__name__}",
            aclnn_status=_INVALID,
            field="candidate",
        )
    name = dtype_name(candidate.dtype)
    allowed = (dtype,) if dtype == "float32" else (dtype, "float32")
    if name not in allowed:
        raise InvalidArgument(
            f"candidate.dtype={candidate.dtype} must be {' or '.join(allowed)} "
            f"(grad_expanded_x's dtype{'' if dtype == 'float32' else ', or float32'})",
            aclnn_status=_INVALID,
            field="candidate",
        )
    if candidate.shape != shape:
        raise InvalidArgument(
            f"candidate has shape {list(candidate.shape)}; grad_x of this call is {list(shape)} [N, H]",
            aclnn_status=_INVALID,
            field="candidate",
        )
    return candidate


def _check_standards(standards: Iterable[str] | str | None) -> tuple[str, ...]:
    if standards is None:
        return DEFAULT_STANDARDS
    names = (standards,) if isinstance(standards, str) else tuple(standards)
    unknown = [name for name in names if name not in STANDARDS]
    if unknown:
        raise InvalidArgument(
            f"unknown standard {unknown[0]!r}; the standards are {', '.join(STANDARDS)}",
            aclnn_status=_INVALID,
            field="standards",
        )
    if not names:
        raise InvalidArgument(
            f"no standard requested; choose from {', '.join(STANDARDS)}", aclnn_status=_INVALID, field="standards"
        )
    return tuple(name for name in STANDARDS if name in names)


def check_compare_arguments(
    call: MoeInitRoutingV2GradCall, candidate: Any, standards: Iterable[str] | str | None = None
) -> tuple[str, ...]:
    """Check a comparison's arguments without computing anything (a service runs this before its device).

    Args:
        call: the validated call (:class:`moegrad.MoeInitRoutingV2GradCall`).
        candidate: the implementation's grad_x: a numpy.ndarray of shape [N, H] of the call, in the
            call's dtype or float32 (docs/accuracy.md, "Three comparisons").
        standards: names from :data:`STANDARDS` (a single name is accepted); None: :data:`DEFAULT_STANDARDS`.

    Returns:
        The requested standards, each once, in :data:`STANDARDS` order (the order of a report).

    Raises:
        InvalidArgument: the candidate is missing (None; aclnn 161001, as the operator answers a null
            tensor), or not an ndarray, or of another dtype or shape (aclnn 161002), field
            ``"candidate"``; a standard is unknown or none is given (aclnn 161002, field ``"standards"``);
            an empty call whose grad_expanded_x is not floating (from CANN 9.1 phase one skips the
            dtype check of an empty tensor, so the call is valid, but a comparison judges floating
            values only: aclnn 161002, field ``"grad_expanded_x"``).
        TypeError: ``call`` is not a :class:`~moegrad.MoeInitRoutingV2GradCall`.
    """
    if not isinstance(call, MoeInitRoutingV2GradCall):
        raise TypeError(f"call must be a MoeInitRoutingV2GradCall, got {type(call).__name__}")
    if call.dtype_name not in GRAD_DTYPES:
        raise InvalidArgument(
            f"grad_expanded_x.dtype={call.dtype_name}: this empty call is valid on profile {call.order} (an "
            f"empty tensor's dtype is not checked), but a comparison judges {', '.join(GRAD_DTYPES)} results only; "
            "send the call in one of those dtypes",
            aclnn_status=_INVALID,
            field="grad_expanded_x",
        )
    if candidate is None:
        raise InvalidArgument(
            "candidate is missing: send the implementation's grad_x [N, H]", aclnn_status=_NULLPTR, field="candidate"
        )
    _check_candidate(candidate, (call.num_tokens, call.hidden_size), call.dtype_name)
    return _check_standards(standards)


def compare_arrays(
    candidate: np.ndarray,
    device_result: np.ndarray,
    golden: np.ndarray,
    *,
    dtype: str | None = None,
    magnitude: np.ndarray | None = None,
    zero_rows: np.ndarray | None = None,
    standards: Iterable[str] | str | None = None,
    require_exact: bool = False,
) -> ComparisonReport:
    """Judge a candidate gradX given the device's result and the golden (no operator call needed).

    Args:
        candidate: [N, H], the operator's dtype or float32.
        device_result: [N, H], the operator's dtype: the device's (or the emulation's) grad_x.
        golden: [N, H] float64 (:func:`moegrad.moe_init_routing_v2_grad_golden`).
        dtype: the operator's dtype name; defaults to ``device_result``'s.
        magnitude: [N, H] float64, the scale of relative errors (see :func:`metrics`); default |golden|.
        zero_rows: [N] bool, rows that must be exactly +0.0 (:func:`skipped_rows`); default none.
        standards: names from :data:`STANDARDS` (a single name is accepted); default
            :data:`DEFAULT_STANDARDS` (every tolerance standard; bitwise only when named).
        require_exact: the verdict fails unless the candidate is bit-exact to ``device_result``.

    Returns:
        A :class:`ComparisonReport`.

    Raises:
        InvalidArgument: the candidate has the wrong type, dtype or shape (field ``"candidate"``), or
            a standard is unknown or none is given (field ``"standards"``); aclnn 161002.
        TypeError, ValueError: ``device_result``, ``golden``, ``magnitude`` or ``zero_rows`` do not fit.
    """
    device_result = float_array(device_result, "device_result", GRAD_DTYPES)
    dtype = dtype_name(device_result.dtype) if dtype is None else dtype
    if dtype not in GRAD_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not one of {', '.join(GRAD_DTYPES)}")
    if dtype_name(device_result.dtype) != dtype:
        raise TypeError(f"device_result.dtype={device_result.dtype} is not the operator's dtype {dtype}")
    shape = (int(device_result.shape[0]), int(device_result.shape[1]))
    candidate = _check_candidate(candidate, shape, dtype)
    names = _check_standards(standards)
    golden = float_array(golden, "golden", FLOAT_INPUTS)
    if golden.shape != shape:
        raise ValueError(f"golden has shape {list(golden.shape)}, not {list(shape)}")
    rows = np.zeros(shape[0], dtype=np.bool_) if zero_rows is None else np.asarray(zero_rows)
    if rows.dtype != np.bool_ or rows.shape != (shape[0],):
        raise ValueError(f"zero_rows must be a bool array of shape [{shape[0]}], got {rows.dtype} {list(rows.shape)}")

    if not isinstance(require_exact, bool):
        raise InvalidArgument(
            f"require_exact must be a bool, got {type(require_exact).__name__}",
            aclnn_status=_INVALID,
            field="require_exact",
        )
    cg = metrics(candidate, golden, dtype=dtype, magnitude=magnitude)
    dg = metrics(device_result, golden, dtype=dtype, magnitude=magnitude)
    cd = metrics(candidate, device_result, golden, dtype=dtype, magnitude=magnitude)
    return _report(
        dtype,
        _candidate_dtype(candidate),
        shape,
        names,
        require_exact,
        cg,
        dg,
        cd,
        _zero_rows(candidate, rows),
        _zero_rows(device_result, rows),
    )


def _self_metrics(dg: Metrics) -> Metrics:
    """The device compared with itself: what the bitwise measure sees when the device is the candidate."""
    return dataclasses.replace(dg, bitwise_equal_count=dg.count, bitwise_equal_share=1.0 if dg.count else math.nan)


def _report(
    dtype: str,
    candidate_dtype: str,
    shape: tuple[int, int],
    names: tuple[str, ...],
    require_exact: bool,
    cg: Metrics,
    dg: Metrics,
    cd: Metrics,
    zr: ZeroRowCheck,
    dzr: ZeroRowCheck,
    context: ReportContext | None = None,
    profiles_matching: tuple[str, ...] | None = None,
) -> ComparisonReport:
    dd = _self_metrics(dg)
    verdicts = tuple(_judge(name, dtype, cg, dg, cd, zr, dd, dzr) for name in names)
    mismatched = cd.count - cd.bitwise_equal_count
    exact = ExactMatch(
        bit_exact=mismatched == 0,
        mismatched=mismatched,
        count=cd.count,
        share=mismatched / cd.count if cd.count else 0.0,
        required=require_exact,
    )
    verdict = _worst(v.status for v in verdicts)
    if require_exact and not exact.bit_exact:
        verdict = "fail"
    return ComparisonReport(
        dtype=dtype,
        candidate_dtype=candidate_dtype,
        shape=shape,
        verdict=verdict,
        verdicts=verdicts,
        candidate_vs_golden=cg,
        device_vs_golden=dg,
        candidate_vs_device=cd,
        zero_rows=zr,
        exact=exact,
        device_zero_rows=dzr,
        context=context,
        profiles_matching=profiles_matching,
    )


def rejudge(
    report: ComparisonReport, *, standards: Iterable[str] | str | None = None, require_exact: bool | None = None
) -> ComparisonReport:
    """Judge a report's stored metrics again (a report read back from JSON, or with other standards).

    The verdicts are a pure function of the three comparisons and the zero rows, so a saved report
    reproduces its verdict without the tensors (its context, profiles_matching, explained and row_errors
    are kept).

    Args:
        report: a :class:`ComparisonReport` (for example :func:`read_json_report`'s).
        standards: names from :data:`STANDARDS`; default: the standards the report judged.
        require_exact: default: as the report was judged.

    Returns:
        A new :class:`ComparisonReport` with the same metrics and context.

    Raises:
        InvalidArgument: an unknown standard (field ``"standards"``, aclnn 161002).
    """
    names = tuple(v.standard for v in report.verdicts) if standards is None else _check_standards(standards)
    if require_exact is None:
        required = report.exact.required if report.exact is not None else False
    else:
        required = require_exact
    device_rows = report.zero_rows if report.device_zero_rows is None else report.device_zero_rows
    judged = _report(
        report.dtype,
        report.candidate_dtype,
        report.shape,
        names,
        required,
        report.candidate_vs_golden,
        report.device_vs_golden,
        report.candidate_vs_device,
        report.zero_rows,
        device_rows,
        report.context,
        report.profiles_matching,
    )
    return dataclasses.replace(judged, explained=report.explained, row_errors=report.row_errors)


def summand_magnitude(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The magnitude of each output's summands, ``sum over t of |grad_expanded_x[expanded_row_idx[i*K + t]]|``.

    The scale a summation's rounding error is proportional to (docs/accuracy.md, "Relative to
    what"); equal to ``|grad_x|`` when a row's summands share one sign. Skipped slots add nothing.

    Returns:
        [N, H] float64, >= 0 (NaN where a summand is NaN).
    """
    absolute = call.model_copy(update={"grad_expanded_x": np.abs(call.grad_expanded_x)})  # same indices: still valid
    return moe_init_routing_v2_grad_golden(absolute)


def _check_shapes(call: MoeInitRoutingV2GradCall, device_result: Any, golden: Any) -> tuple[int, int]:
    """grad_x's shape, [N, H]; a given ``device_result`` or ``golden`` of another shape is a ValueError."""
    shape = (call.num_tokens, call.hidden_size)
    for name, given in (("device_result", device_result), ("golden", golden)):
        if given is not None and getattr(given, "shape", None) != shape:
            raise ValueError(
                f"{name} has shape {list(getattr(given, 'shape', ()))}; grad_x of this call is {list(shape)}"
            )
    return shape


def compare(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    device_result: np.ndarray | None = None,
    golden: np.ndarray | None = None,
    standards: Iterable[str] | str | None = None,
    require_exact: bool = False,
    stop: threading.Event | None = None,
    parallel: bool = True,
) -> ComparisonReport:
    """Judge a candidate implementation's gradX for one validated operator call.

    Relative errors are taken against the magnitude of each output's summands
    (:func:`summand_magnitude`), the scale a correctly rounded summation is accurate to; rows of
    ``call`` whose every slot is skipped (:func:`skipped_rows`) must be +0.0 under every standard.

    Args:
        call: the validated call (:class:`moegrad.MoeInitRoutingV2GradCall`).
        candidate: [N, H] grad_x from the implementation under test; the call's dtype or float32.
        device_result: [N, H] in the call's dtype: the device's grad_x; default
            :func:`moegrad.moe_init_routing_v2_grad` of ``call`` (the bit-exact emulation, in
            ``call.order``).
        golden: [N, H] float64; default :func:`moegrad.moe_init_routing_v2_grad_golden` of ``call``.
        standards: names from :data:`STANDARDS`; default :data:`DEFAULT_STANDARDS`.
        require_exact: the verdict fails unless the candidate is bit-exact to the device's result
            (:attr:`ComparisonReport.exact` states exactness either way).
        stop: set it (from another thread) to stop the comparison at its next block of rows (a
            service whose caller has gone); None: it runs to the end.
        parallel: spread the rows over the shared thread pool of the reference kernels (the
            default); False: compute them on the calling thread alone (a service judging many
            comparisons at once on threads of its own, which should not queue behind each other
            there, nor hold up the calls it runs on that pool).

    Returns:
        A :class:`ComparisonReport`.

    Raises:
        InvalidArgument: as :func:`check_compare_arguments` (a missing candidate 161001, a bad
            candidate or an unknown standard 161002); checked before anything is computed.
        DeadlineExceeded: ``stop`` was set before the comparison ended.
        TypeError: ``call`` is not a :class:`~moegrad.MoeInitRoutingV2GradCall`.
        ValueError: ``device_result`` or ``golden`` has the wrong shape or dtype.
    """
    check_compare_arguments(call, candidate, standards)
    shape = _check_shapes(call, device_result, golden)
    if device_result is None:
        device_result = moe_init_routing_v2_grad(call)
    if _FUSED != "numpy" and isinstance(require_exact, bool):
        device_result = float_array(device_result, "device_result", GRAD_DTYPES)
        if dtype_name(device_result.dtype) != call.dtype_name:
            raise TypeError(f"device_result.dtype={device_result.dtype} is not the operator's dtype {call.dtype_name}")
        fused = fused_metrics(call, candidate, device_result, golden, stop, parallel)
        if fused is not None:
            rows = skipped_rows(call)
            return _report(
                call.dtype_name,
                _candidate_dtype(candidate),
                shape,
                _check_standards(standards),
                require_exact,
                *fused,
                _zero_rows(candidate, rows, stop),
                _zero_rows(device_result, rows, stop),
            )
    _check_stop(stop)
    if golden is None:
        golden = moe_init_routing_v2_grad_golden(call)
    _check_stop(stop)
    return compare_arrays(
        candidate,
        device_result,
        golden,
        dtype=call.dtype_name,
        magnitude=summand_magnitude(call),
        zero_rows=skipped_rows(call),
        standards=standards,
        require_exact=require_exact,
    )
