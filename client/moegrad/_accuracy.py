"""Accuracy of a candidate gradX, judged against the device's result and a float64 golden.

An accuracy team sends the inputs of one call and its own gradX (the *candidate*, from a GPU or CPU
port); :func:`compare` measures three pairs and judges the candidate by named standards
(docs/accuracy.md has the definitions, the thresholds and their sources)::

    candidate_vs_golden   candidate  against the float64 golden   (single-golden standards)
    device_vs_golden      the device against the float64 golden   (the benchmark's yardstick)
    candidate_vs_device   candidate  against the device           (bitwise)

Standards (each a :class:`StandardVerdict`: pass / warning / fail, with the numbers that decided it):

- ``bitwise``          the candidate equals the device result bit for bit;
- ``dual_thousandth``  Ascend's 双千 indicator: shares of elements within 1e-2 / 1e-3 / 1e-4;
- ``threshold``        single golden: mean and max relative error under 2^-n and 10 * 2^-n;
- ``benchmark``        dual golden: the candidate's errors over the device's (RMSE, relative errors,
                       small-value errors, error balance);
- ``accumulative``     a per-element bound for accumulating operators (relative for a scale >= 1,
                       absolute below), no NaN/Inf mismatch.

Relative errors are taken against a *scale*: ``|golden|`` for bare arrays (:func:`metrics`), and in
:func:`compare` the magnitude of each output's summands (:func:`summand_magnitude`), which is the
scale a summation's rounding error is proportional to. The two agree wherever a row's summands
share a sign; where they cancel, ``|golden|`` would blame the candidate for the cancellation.

Rows whose every slot is skipped (dropped tokens in drop/pad mode, indices >= active_num in active
mode) must be exactly +0.0 on the device (DESIGN.md section 3); every standard checks them bit for bit.

All thresholds live in :data:`THRESHOLDS` (standard, dtype) and :data:`DTYPE_LIMITS` (dtype); nothing
else in this module holds a tolerance. NumPy only; no device, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad._reference import moe_init_routing_v2_grad, moe_init_routing_v2_grad_golden
from moegrad._spec import GRAD_DTYPES, MoeInitRoutingV2GradCall
from moegrad._wire import dtype_name

__all__ = [
    "DTYPE_LIMITS",
    "STANDARDS",
    "THRESHOLDS",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DtypeLimits",
    "Metrics",
    "StandardVerdict",
    "WorstElement",
    "ZeroRowCheck",
    "check_compare_arguments",
    "compare",
    "compare_arrays",
    "metrics",
    "skipped_rows",
    "summand_magnitude",
]

Status = Literal["pass", "warning", "fail"]
Op = Literal["<", "<=", ">", ">="]

#: The standards by name, in the order reports list them.
STANDARDS: tuple[str, ...] = ("bitwise", "dual_thousandth", "threshold", "benchmark", "accumulative")
_SEVERITY: Mapping[str, int] = {"pass": 0, "warning": 1, "fail": 2}
_INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
_NULLPTR = AclnnStatus.ACLNN_ERR_PARAM_NULLPTR


# --------------------------------------------------------------------------------------------------
# The two tables


@dataclass(frozen=True)
class DtypeLimits:
    """Per-dtype constants of the metrics (docs/accuracy.md, "Small values" and "ULP").

    Attributes:
        mantissa_bits: stored fraction bits p (float16 10, bfloat16 7, float32 23); one ULP of a
            normal value in [2^e, 2^(e+1)) is 2^(e-p).
        min_exponent: the exponent of the smallest normal value (float16 -14, bfloat16 and float32
            -126); below it, and at zero, one ULP is the smallest subnormal 2^(min_exponent-p).
        small_value: an element whose scale (|golden|, or the summands' magnitude) is below this is
            a *small value*: its error is measured absolutely, never relatively (msprobe's
            small-value threshold).
        small_value_atol: a small value whose absolute error exceeds this counts as a small-value
            error (the benchmark standard compares the candidate's and the device's rates).
        accumulative_small_value: the accumulative standard's split: relative error where the scale
            is at or above it, absolute error below it (msprobe's accumulative-error comparison uses 1).
    """

    mantissa_bits: int
    min_exponent: int
    small_value: float
    small_value_atol: float
    accumulative_small_value: float


#: Metric constants per dtype name (sources in docs/accuracy.md).
DTYPE_LIMITS: Mapping[str, DtypeLimits] = types.MappingProxyType({
    "float16": DtypeLimits(mantissa_bits=10, min_exponent=-14, small_value=2.0**-10, small_value_atol=2.0**-16,
                           accumulative_small_value=1.0),
    "bfloat16": DtypeLimits(mantissa_bits=7, min_exponent=-126, small_value=2.0**-10, small_value_atol=2.0**-16,
                            accumulative_small_value=1.0),
    "float32": DtypeLimits(mantissa_bits=23, min_exponent=-126, small_value=2.0**-20, small_value_atol=2.0**-30,
                           accumulative_small_value=1.0),
})


@dataclass(frozen=True)
class Criterion:
    """One requirement of a standard: ``measure op limit``, else the criterion is ``on_miss``.

    Attributes:
        measure: the name of a number computed from the three comparisons (docs/accuracy.md,
            "Measures"), e.g. ``"rmse_ratio"`` or ``"thousandth_share"``.
        op: how the measure must compare with ``limit`` to pass.
        limit: the threshold (a share in [0, 1], a ratio, a relative or absolute error, a count).
        on_miss: the status when the requirement is not met: ``"fail"`` or ``"warning"``.
        min_samples: the fewest elements the measure must rest on to be judged; with fewer (or when
            the measure is undefined, NaN) the criterion is *not assessed* and passes.
    """

    measure: str
    op: Op
    limit: float
    on_miss: Status = "fail"
    min_samples: int = 0


_SPECIAL = Criterion("special_value_mismatches", "<=", 0)
_ZERO_ROWS = Criterion("zero_row_mismatches", "<=", 0)


def _dual_thousandth(required: tuple[str, float], passing: tuple[str, float]) -> tuple[Criterion, ...]:
    return (Criterion(required[0], ">", required[1]), Criterion(passing[0], ">", passing[1], on_miss="warning"),
            _SPECIAL, _ZERO_ROWS)


def _threshold(t: float) -> tuple[Criterion, ...]:
    return (Criterion("mean_relative_error", "<", t), Criterion("max_relative_error", "<", 10 * t), _SPECIAL, _ZERO_ROWS)


_BENCHMARK = (
    Criterion("rmse_ratio", "<=", 2.0),
    Criterion("mean_relative_error_ratio", "<=", 2.0),
    Criterion("max_relative_error_ratio", "<=", 10.0),
    Criterion("small_value_error_ratio", "<=", 2.0, min_samples=64),
    Criterion("error_imbalance_excess", "<=", 0.5, min_samples=64),
    Criterion("special_value_mismatch_excess", "<=", 0),
    _ZERO_ROWS,
)


def _accumulative(bound: float) -> tuple[Criterion, ...]:
    return (Criterion("max_accumulative_error", "<=", bound), _SPECIAL, _ZERO_ROWS)


_BITWISE = (Criterion("bitwise_mismatches", "<=", 0), _ZERO_ROWS)

#: Every standard's criteria per (standard, dtype name): the one table of thresholds.
THRESHOLDS: Mapping[tuple[str, str], tuple[Criterion, ...]] = types.MappingProxyType({
    ("bitwise", "float16"): _BITWISE,
    ("bitwise", "bfloat16"): _BITWISE,
    ("bitwise", "float32"): _BITWISE,
    ("dual_thousandth", "float16"): _dual_thousandth(("hundredth_share", 0.99), ("thousandth_share", 0.999)),
    ("dual_thousandth", "bfloat16"): _dual_thousandth(("hundredth_share", 0.99), ("thousandth_share", 0.999)),
    ("dual_thousandth", "float32"): _dual_thousandth(("thousandth_share", 0.999), ("ten_thousandth_share", 0.9999)),
    ("threshold", "float16"): _threshold(2.0**-10),
    ("threshold", "bfloat16"): _threshold(2.0**-7),
    ("threshold", "float32"): _threshold(2.0**-13),
    ("benchmark", "float16"): _BENCHMARK,
    ("benchmark", "bfloat16"): _BENCHMARK,
    ("benchmark", "float32"): _BENCHMARK,
    ("accumulative", "float16"): _accumulative(2.0**-8),
    ("accumulative", "bfloat16"): _accumulative(2.0**-7),
    ("accumulative", "float32"): _accumulative(2.0**-11),
})


# --------------------------------------------------------------------------------------------------
# Result objects and their dict form

_T = TypeVar("_T")


class _Serializable:
    """``to_dict`` / ``from_dict`` for the frozen result dataclasses below.

    The dict holds only str keys, str, int, float, bool, None and lists: JSON and msgpack carry it
    as is. A float that is not finite is written as a string: ``"nan"``, ``"inf"`` or ``"-inf"``
    (NaN means *undefined*, e.g. a mean over no elements). ``from_dict`` reverses this, ignores keys
    it does not know (a newer server may add some) and raises ``ValueError`` for a missing or
    mistyped one.
    """

    def to_dict(self) -> dict[str, Any]:
        """This object as a JSON- and msgpack-safe dict (non-finite floats as strings)."""
        return _encode(self)

    @classmethod
    def from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
        """Rebuild the object from :meth:`to_dict`'s output (for example a server's reply).

        Raises:
            ValueError: a field is missing or has the wrong type.
        """
        return _decode_dataclass(cls, data, cls.__name__)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    return value


_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _decode(tp: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is float:
        if isinstance(raw, str) and raw in _FLOAT_WORDS:
            return _FLOAT_WORDS[raw]
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif tp is bool or tp is str:
        if isinstance(raw, tp):
            return raw
    elif origin is Literal:
        if raw in typing.get_args(tp):
            return raw
    elif origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if raw is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return _decode(inner, raw, where)
    elif origin is tuple:
        args = typing.get_args(tp)
        if isinstance(raw, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(raw))
            if len(raw) == len(args):
                return tuple(_decode(arg, item, f"{where}[{i}]") for i, (arg, item) in enumerate(zip(args, raw)))
    elif dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, raw, where)
    raise ValueError(f"{where}: {raw!r} is not a valid {getattr(tp, '__name__', tp)}")


def _decode_dataclass(cls: type[_T], data: Any, where: str) -> _T:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a map, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            values[field.name] = _decode(hints[field.name], data[field.name], f"{where}.{field.name}")
        elif field.default is dataclasses.MISSING:
            raise ValueError(f"{where}: missing field {field.name!r}")
    return cls(**values)


@dataclass(frozen=True)
class WorstElement(_Serializable):
    """The element with the largest error of one comparison (a NaN/Inf mismatch ranks above any).

    Attributes:
        row: the token index i in [0, N).
        column: the hidden index in [0, H).
        actual, expected, golden: the three values at (row, column), as float64 (may be non-finite).
        abs_error: ``|actual - expected|`` (inf or NaN for a NaN/Inf mismatch).
    """

    row: int
    column: int
    actual: float
    expected: float
    golden: float
    abs_error: float


@dataclass(frozen=True)
class Metrics(_Serializable):
    """Error statistics of ``actual`` against ``expected`` (see :func:`metrics`; docs/accuracy.md).

    Counts are element counts; shares are fractions in [0, 1]; errors are in the values' own units
    unless the name says relative or ULP. A statistic over an empty set is NaN. *Scale* below is
    ``|golden|``, or the summands' magnitude when :func:`compare` computed the metrics
    (``relative_to`` says which).

    Attributes:
        dtype: the tolerance dtype (the operator's dtype): picks :data:`DTYPE_LIMITS`.
        actual_dtype: the dtype of ``actual``; ULPs are ULPs of this dtype.
        relative_to: ``"golden"`` (scale = |golden|) or ``"magnitude"`` (scale = sum of |summands|).
        count: elements compared (N*H).
        finite_count: elements where actual, expected, golden and the scale are all finite: the
            error statistics below cover these.
        normal_count: finite elements with scale >= ``small_value``.
        small_count: finite elements with scale < ``small_value``.
        max_abs_error, mean_abs_error: of ``|actual - expected|``.
        rmse: ``sqrt(mean((actual - expected)^2))``.
        max_relative_error, mean_relative_error: of ``|actual - expected| / scale`` over the normal
            elements only.
        small_value_error_count: small elements with ``|actual - expected| > small_value_atol``.
        small_value_error_rate: ``small_value_error_count / small_count``.
        max_small_value_abs_error: the largest absolute error among the small elements.
        max_accumulative_error: the largest ``|actual - expected| / max(scale, accumulative_small_value)``.
        cosine_similarity: of the finite elements as vectors (1.0 when both are all zeros, 0.0 when
            only one is).
        bitwise_equal_count, bitwise_equal_share: elements whose values are identical, the sign of
            zero included (any NaN equals any NaN); the share is over ``count``.
        max_ulp_error, mean_ulp_error: ``|actual - expected|`` in ULPs of golden in ``actual_dtype``.
        ulp_error_above_1_share: finite elements more than 1 ULP off, over ``finite_count``.
        hundredth_share, thousandth_share, ten_thousandth_share: elements (over ``count``) whose error
            is within 1e-2 / 1e-3 / 1e-4 of ``max(scale, small_value)``; an element whose NaN/Inf
            class matches counts as within, a mismatch does not.
        nan_mismatch_count: elements where exactly one of actual and expected is NaN.
        inf_mismatch_count: other elements whose classes (finite, +inf, -inf) differ; expected is
            first rounded to ``actual_dtype``, so an overflow that rounds to inf matches inf.
        positive_error_share, negative_error_share: finite elements with actual > / < expected.
        toward_zero_share, away_from_zero_share: finite elements with |actual| < / > |expected|.
        nonzero_error_count: finite elements with actual != expected.
        error_imbalance: ``max(|positive - negative|, |away - toward|) / nonzero_error_count`` in
            [0, 1]: 0 for errors that fall on both sides equally, 1 for errors all on one side.
        worst: the worst element, or None when nothing differs.
    """

    dtype: str
    actual_dtype: str
    relative_to: Literal["golden", "magnitude"]
    count: int
    finite_count: int
    normal_count: int
    small_count: int
    max_abs_error: float
    mean_abs_error: float
    rmse: float
    max_relative_error: float
    mean_relative_error: float
    small_value_error_count: int
    small_value_error_rate: float
    max_small_value_abs_error: float
    max_accumulative_error: float
    cosine_similarity: float
    bitwise_equal_count: int
    bitwise_equal_share: float
    max_ulp_error: float
    mean_ulp_error: float
    ulp_error_above_1_share: float
    hundredth_share: float
    thousandth_share: float
    ten_thousandth_share: float
    nan_mismatch_count: int
    inf_mismatch_count: int
    positive_error_share: float
    negative_error_share: float
    toward_zero_share: float
    away_from_zero_share: float
    nonzero_error_count: int
    error_imbalance: float
    worst: WorstElement | None


@dataclass(frozen=True)
class ZeroRowCheck(_Serializable):
    """The rows that must be exactly +0.0 (every slot skipped), checked bit for bit in the candidate.

    Attributes:
        rows: how many rows must be +0.0.
        mismatched_rows: how many of them hold any element that is not +0.0 (-0.0 and NaN included).
        mismatched_elements: how many elements of those rows are not +0.0.
        first_mismatched_row: the lowest such row index, or None.
    """

    rows: int
    mismatched_rows: int
    mismatched_elements: int
    first_mismatched_row: int | None


@dataclass(frozen=True)
class CriterionResult(_Serializable):
    """One criterion of a standard as judged: the number, the threshold, the outcome.

    Attributes:
        measure: the measure's name (:attr:`Criterion.measure`).
        status: ``"pass"``, ``"warning"`` or ``"fail"``.
        value: the measured number (NaN when the measure is undefined).
        op, limit: the requirement, ``value op limit``.
        assessed: False when the measure was undefined or rested on fewer than ``samples_needed``
            elements; such a criterion passes.
        samples: the elements the measure rests on.
        samples_needed: :attr:`Criterion.min_samples`.
    """

    measure: str
    status: Status
    value: float
    op: Op
    limit: float
    assessed: bool
    samples: int
    samples_needed: int = 0

    def describe(self) -> str:
        """One line for people, e.g. ``"rmse_ratio = 2.31 (needs <= 2): fail"``."""
        if not self.assessed:
            why = "undefined" if math.isnan(self.value) else f"{self.samples} < {self.samples_needed} samples"
            return f"{self.measure}: not assessed ({why})"
        return f"{self.measure} = {self.value:.6g} (needs {self.op} {self.limit:.6g}): {self.status}"


@dataclass(frozen=True)
class StandardVerdict(_Serializable):
    """One standard's verdict: the worst of its criteria.

    Attributes:
        standard: one of :data:`STANDARDS`.
        status: ``"pass"``, ``"warning"`` or ``"fail"``.
        criteria: every criterion as judged, in table order.
    """

    standard: str
    status: Status
    criteria: tuple[CriterionResult, ...]

    @property
    def failures(self) -> tuple[CriterionResult, ...]:
        """The criteria that did not pass (warnings and failures)."""
        return tuple(c for c in self.criteria if c.status != "pass")


@dataclass(frozen=True)
class ComparisonReport(_Serializable):
    """Everything :func:`compare` found: three comparisons, the zero rows, the verdicts.

    Attributes:
        dtype: the operator's dtype (the thresholds' key).
        candidate_dtype: the candidate's dtype (the operator's, or float32).
        shape: [N, H] of grad_x.
        verdict: the overall status, the worst of ``verdicts``.
        verdicts: one :class:`StandardVerdict` per requested standard, in :data:`STANDARDS` order.
        candidate_vs_golden, device_vs_golden, candidate_vs_device: :class:`Metrics`.
        zero_rows: :class:`ZeroRowCheck` of the candidate.
    """

    dtype: str
    candidate_dtype: str
    shape: tuple[int, int]
    verdict: Status
    verdicts: tuple[StandardVerdict, ...]
    candidate_vs_golden: Metrics
    device_vs_golden: Metrics
    candidate_vs_device: Metrics
    zero_rows: ZeroRowCheck

    @property
    def passed(self) -> bool:
        """True unless the overall verdict is ``"fail"`` (a warning passes)."""
        return self.verdict != "fail"

    def verdict_of(self, standard: str) -> StandardVerdict:
        """The verdict of ``standard``.

        Raises:
            KeyError: the standard was not requested.
        """
        for verdict in self.verdicts:
            if verdict.standard == standard:
                return verdict
        raise KeyError(f"standard {standard!r} is not in this report ({', '.join(v.standard for v in self.verdicts)})")


# --------------------------------------------------------------------------------------------------
# Metrics

_FLOAT_INPUTS = (*GRAD_DTYPES, "float64")


def _float_array(value: Any, what: str, allowed: tuple[str, ...]) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, got {type(value).__name__}")
    name = "float64" if value.dtype.kind == "f" and value.dtype.itemsize == 8 else dtype_name(value.dtype)
    if name not in allowed:
        raise TypeError(f"{what}.dtype={value.dtype} is not one of {', '.join(allowed)}")
    if value.ndim != 2:
        raise ValueError(f"{what} has shape {list(value.shape)}; it must be 2-D [N, H]")
    return value


def _share(part: int, whole: int) -> float:
    return part / whole if whole else math.nan


def _classes(values: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    out = np.zeros(values.shape, dtype=np.int8)
    out[np.isnan(values)] = 1
    out[np.isposinf(values)] = 2
    out[np.isneginf(values)] = 3
    return out


def _ulp(golden: np.ndarray, limits: DtypeLimits) -> np.ndarray:
    """One ULP at each (finite, float64) golden value in a dtype with ``limits``.

    A value in [2^e, 2^(e+1)) has ULP 2^(e-p); zero and subnormals have the smallest subnormal.
    """
    _, exponent = np.frexp(golden)  # golden = m * 2^exponent with 0.5 <= |m| < 1, so e = exponent - 1
    e = np.where(golden == 0, limits.min_exponent, np.maximum(exponent - 1, limits.min_exponent))
    return np.ldexp(1.0, (e - limits.mantissa_bits).astype(np.int32))


def metrics(actual: np.ndarray, expected: np.ndarray, golden: np.ndarray | None = None, *,
            dtype: str | None = None, magnitude: np.ndarray | None = None) -> Metrics:
    """Error statistics of ``actual`` against ``expected``, with relative errors and ULPs taken at ``golden``.

    Args:
        actual: [N, H] float16, bfloat16 or float32: the values judged (a candidate, or the device).
        expected: [N, H] float16, bfloat16, float32 or float64: the reference (the golden, or the device).
        golden: [N, H] float64 (or any of the above): the exact values; their ULPs in ``actual``'s
            dtype are the ULP unit, and by default their magnitudes scale the relative errors.
            Defaults to ``expected``.
        dtype: the tolerance dtype name (``"float16"``, ``"bfloat16"``, ``"float32"``): whose
            :data:`DTYPE_LIMITS` apply; defaults to ``actual``'s dtype.
        magnitude: [N, H] float64 >= 0, the scale relative errors are taken against and small values
            are picked by; default ``|golden|``. :func:`compare` passes the magnitude of the summands,
            ``sum over t of |grad_expanded_x[expanded_row_idx[i*K + t]]|`` (docs/accuracy.md,
            "Relative to what").

    Returns:
        A :class:`Metrics` (every field documented there; definitions in docs/accuracy.md).

    Raises:
        TypeError: an argument is not an ndarray of an allowed dtype, or ``dtype`` is unknown.
        ValueError: the arrays are not 2-D or their shapes differ.
    """
    actual = _float_array(actual, "actual", GRAD_DTYPES)
    expected = _float_array(expected, "expected", _FLOAT_INPUTS)
    golden = expected if golden is None else _float_array(golden, "golden", _FLOAT_INPUTS)
    if magnitude is not None:
        magnitude = _float_array(magnitude, "magnitude", ("float64",))
    if not actual.shape == expected.shape == golden.shape == (actual.shape if magnitude is None else magnitude.shape):
        raise ValueError(f"shapes differ: actual {list(actual.shape)}, expected {list(expected.shape)}, "
                         f"golden {list(golden.shape)}" + ("" if magnitude is None else f", magnitude {list(magnitude.shape)}"))
    actual_dtype = dtype_name(actual.dtype)
    dtype = actual_dtype if dtype is None else dtype
    if dtype not in DTYPE_LIMITS:
        raise TypeError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_LIMITS)}")
    with np.errstate(all="ignore"):
        return _metrics(actual, expected, golden, magnitude, dtype, actual_dtype)


def _metrics(actual: np.ndarray, expected: np.ndarray, golden: np.ndarray, magnitude: np.ndarray | None, dtype: str,
             actual_dtype: str) -> Metrics:
    limits, ulp_limits = DTYPE_LIMITS[dtype], DTYPE_LIMITS[actual_dtype]
    count, width = actual.size, actual.shape[1]
    a = actual.astype(np.float64).ravel()
    e = expected.astype(np.float64).ravel()
    g = golden.astype(np.float64).ravel()
    m = np.abs(g) if magnitude is None else magnitude.astype(np.float64).ravel()

    # NaN/Inf classes, expected rounded to actual's dtype first (an overflow to inf is the right answer).
    class_a = _classes(a)
    class_e = _classes(expected.astype(actual.dtype.newbyteorder("=")).astype(np.float64).ravel())
    mismatch = class_a != class_e
    nan_mismatch = mismatch & ((class_a == 1) | (class_e == 1))
    inf_mismatch = mismatch & ~nan_mismatch
    finite = (class_a == 0) & (class_e == 0) & np.isfinite(g) & np.isfinite(m)
    matched_other = ~mismatch & ~finite

    af, ef, gf, mf = a[finite], e[finite], g[finite], m[finite]
    n = af.size
    err = af - ef
    abs_err = np.abs(err)
    normal = mf >= limits.small_value
    rel = abs_err[normal] / mf[normal]
    small_abs = abs_err[~normal]
    ulp_err = abs_err / _ulp(gf, ulp_limits)
    scaled = abs_err / np.maximum(mf, limits.small_value)

    def stat(values: np.ndarray, reduce: Callable[[np.ndarray], Any]) -> float:
        return float(reduce(values)) if values.size else math.nan

    if n == 0:
        cosine = math.nan
    else:
        norm_a, norm_e = float(np.sqrt(np.dot(af, af))), float(np.sqrt(np.dot(ef, ef)))
        if norm_a == 0 and norm_e == 0:
            cosine = 1.0
        elif norm_a == 0 or norm_e == 0:
            cosine = 0.0
        else:
            cosine = float(np.dot(af, ef)) / norm_a / norm_e

    equal = ((a == e) & (np.signbit(a) == np.signbit(e))) | (np.isnan(a) & np.isnan(e))
    bitwise_equal = int(np.count_nonzero(equal))
    matched = int(np.count_nonzero(matched_other))
    positive, negative = int(np.count_nonzero(err > 0)), int(np.count_nonzero(err < 0))
    toward = int(np.count_nonzero(np.abs(af) < np.abs(ef)))
    away = int(np.count_nonzero(np.abs(af) > np.abs(ef)))
    nonzero = positive + negative
    imbalance = max(abs(positive - negative), abs(away - toward)) / nonzero if nonzero else math.nan

    badness = np.full(count, -1.0)
    badness[finite] = abs_err
    badness[mismatch] = math.inf
    worst = None
    if count and badness.max() > 0:
        index = int(np.argmax(badness))
        worst = WorstElement(row=index // width, column=index % width, actual=float(a[index]),
                             expected=float(e[index]), golden=float(g[index]), abs_error=float(abs(a[index] - e[index])))

    small_errors = int(np.count_nonzero(small_abs > limits.small_value_atol))
    return Metrics(
        dtype=dtype,
        actual_dtype=actual_dtype,
        relative_to="golden" if magnitude is None else "magnitude",
        count=count,
        finite_count=n,
        normal_count=int(np.count_nonzero(normal)),
        small_count=int(small_abs.size),
        max_abs_error=stat(abs_err, np.max),
        mean_abs_error=stat(abs_err, np.mean),
        rmse=stat(err, lambda x: np.sqrt(np.mean(x * x))),
        max_relative_error=stat(rel, np.max),
        mean_relative_error=stat(rel, np.mean),
        small_value_error_count=small_errors,
        small_value_error_rate=_share(small_errors, small_abs.size),
        max_small_value_abs_error=stat(small_abs, np.max),
        max_accumulative_error=stat(abs_err / np.maximum(mf, limits.accumulative_small_value), np.max),
        cosine_similarity=cosine,
        bitwise_equal_count=bitwise_equal,
        bitwise_equal_share=_share(bitwise_equal, count),
        max_ulp_error=stat(ulp_err, np.max),
        mean_ulp_error=stat(ulp_err, np.mean),
        ulp_error_above_1_share=_share(int(np.count_nonzero(ulp_err > 1)), n),
        hundredth_share=_share(int(np.count_nonzero(scaled <= 1e-2)) + matched, count),
        thousandth_share=_share(int(np.count_nonzero(scaled <= 1e-3)) + matched, count),
        ten_thousandth_share=_share(int(np.count_nonzero(scaled <= 1e-4)) + matched, count),
        nan_mismatch_count=int(np.count_nonzero(nan_mismatch)),
        inf_mismatch_count=int(np.count_nonzero(inf_mismatch)),
        positive_error_share=_share(positive, n),
        negative_error_share=_share(negative, n),
        toward_zero_share=_share(toward, n),
        away_from_zero_share=_share(away, n),
        nonzero_error_count=nonzero,
        error_imbalance=imbalance,
        worst=worst,
    )


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
        _ratio(cg.mean_relative_error, dg.mean_relative_error), cg.normal_count),
    "max_relative_error_ratio": lambda cg, dg, cd, zr: (
        _ratio(cg.max_relative_error, dg.max_relative_error), cg.normal_count),
    "small_value_error_ratio": lambda cg, dg, cd, zr: (
        _ratio(cg.small_value_error_rate, dg.small_value_error_rate), cg.small_count),
    "error_imbalance_excess": lambda cg, dg, cd, zr: (_imbalance_excess(cg, dg), cg.nonzero_error_count),
    "max_accumulative_error": lambda cg, dg, cd, zr: (cg.max_accumulative_error, cg.finite_count),
    "special_value_mismatches": lambda cg, dg, cd, zr: (_specials(cg), cg.count),
    "special_value_mismatch_excess": lambda cg, dg, cd, zr: (_specials(cg) - _specials(dg), cg.count),
    "zero_row_mismatches": lambda cg, dg, cd, zr: (zr.mismatched_elements, zr.rows),
}
_OPS: Mapping[str, Callable[[float, float], bool]] = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def _judge(standard: str, dtype: str, cg: Metrics, dg: Metrics, cd: Metrics, zr: ZeroRowCheck) -> StandardVerdict:
    results = []
    for criterion in THRESHOLDS[(standard, dtype)]:
        value, samples = _MEASURES[criterion.measure](cg, dg, cd, zr)
        value = float(value)
        assessed = not math.isnan(value) and samples >= criterion.min_samples
        if not assessed or _OPS[criterion.op](value, criterion.limit):
            status: Status = "pass"
        else:
            status = criterion.on_miss
        results.append(CriterionResult(measure=criterion.measure, status=status, value=value, op=criterion.op,
                                       limit=float(criterion.limit), assessed=assessed, samples=int(samples),
                                       samples_needed=criterion.min_samples))
    return StandardVerdict(standard=standard, status=_worst(r.status for r in results), criteria=tuple(results))


def _worst(statuses: Iterable[str]) -> Status:
    return max(statuses, key=_SEVERITY.__getitem__, default="pass")  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Entry points


def skipped_rows(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The rows of grad_x whose every slot is skipped, which the device writes as +0.0.

    A slot is skipped when its index is -1 in drop/pad mode, or >= active_num in active mode
    (DESIGN.md section 3); dropless mode skips nothing.

    Returns:
        [N] bool, True for a row that must be exactly +0.0.
    """
    index = call.expanded_row_idx.reshape(-1, call.top_k)
    if call.drop_pad_mode == 1:
        skipped = index < 0
    elif call.active_num > 0:
        skipped = index >= call.active_num
    else:
        return np.zeros(index.shape[0], dtype=np.bool_)
    return skipped.all(axis=1)


def _zero_rows(candidate: np.ndarray, rows: np.ndarray) -> ZeroRowCheck:
    block = candidate[rows].astype(np.float64)
    bad = ~((block == 0) & ~np.signbit(block))
    bad_rows = np.flatnonzero(bad.any(axis=1))
    first = int(np.flatnonzero(rows)[bad_rows[0]]) if bad_rows.size else None
    return ZeroRowCheck(rows=int(np.count_nonzero(rows)), mismatched_rows=int(bad_rows.size),
                        mismatched_elements=int(np.count_nonzero(bad)), first_mismatched_row=first)


def _check_candidate(candidate: Any, shape: tuple[int, int], dtype: str) -> np.ndarray:
    if not isinstance(candidate, np.ndarray):
        raise InvalidArgument(f"candidate must be a numpy.ndarray, got {type(candidate).__name__}",
                              aclnn_status=_INVALID, field="candidate")
    name = dtype_name(candidate.dtype)
    allowed = (dtype,) if dtype == "float32" else (dtype, "float32")
    if name not in allowed:
        raise InvalidArgument(f"candidate.dtype={candidate.dtype} must be {' or '.join(allowed)} "
                              f"(grad_expanded_x's dtype{'' if dtype == 'float32' else ', or float32'})",
                              aclnn_status=_INVALID, field="candidate")
    if candidate.shape != shape:
        raise InvalidArgument(f"candidate has shape {list(candidate.shape)}; grad_x of this call is {list(shape)} [N, H]",
                              aclnn_status=_INVALID, field="candidate")
    return candidate


def _check_standards(standards: Iterable[str] | str | None) -> tuple[str, ...]:
    if standards is None:
        return STANDARDS
    names = (standards,) if isinstance(standards, str) else tuple(standards)
    unknown = [name for name in names if name not in STANDARDS]
    if unknown:
        raise InvalidArgument(f"unknown standard {unknown[0]!r}; the standards are {', '.join(STANDARDS)}",
                              aclnn_status=_INVALID, field="standards")
    if not names:
        raise InvalidArgument(f"no standard requested; choose from {', '.join(STANDARDS)}",
                              aclnn_status=_INVALID, field="standards")
    return tuple(name for name in STANDARDS if name in names)


def check_compare_arguments(call: MoeInitRoutingV2GradCall, candidate: Any,
                            standards: Iterable[str] | str | None = None) -> tuple[str, ...]:
    """Check a comparison's arguments without computing anything (a service runs this before its device).

    Args:
        call: the validated call (:class:`moegrad.MoeInitRoutingV2GradCall`).
        candidate: the implementation's grad_x: a numpy.ndarray of shape [N, H] of the call, in the
            call's dtype or float32 (docs/accuracy.md, "Three comparisons").
        standards: names from :data:`STANDARDS` (a single name is accepted); None: all of them.

    Returns:
        The requested standards, each once, in :data:`STANDARDS` order (the order of a report).

    Raises:
        InvalidArgument: the candidate is missing (None; aclnn 161001, as the operator answers a null
            tensor), or not an ndarray, or of another dtype or shape (aclnn 161002), field
            ``"candidate"``; a standard is unknown or none is given (aclnn 161002, field ``"standards"``).
        TypeError: ``call`` is not a :class:`~moegrad.MoeInitRoutingV2GradCall`.
    """
    if not isinstance(call, MoeInitRoutingV2GradCall):
        raise TypeError(f"call must be a MoeInitRoutingV2GradCall, got {type(call).__name__}")
    if candidate is None:
        raise InvalidArgument("candidate is missing: send the implementation's grad_x [N, H]",
                              aclnn_status=_NULLPTR, field="candidate")
    _check_candidate(candidate, (call.num_tokens, call.hidden_size), call.dtype_name)
    return _check_standards(standards)


def compare_arrays(candidate: np.ndarray, device_result: np.ndarray, golden: np.ndarray, *, dtype: str | None = None,
                   magnitude: np.ndarray | None = None, zero_rows: np.ndarray | None = None,
                   standards: Iterable[str] | str | None = None) -> ComparisonReport:
    """Judge a candidate gradX given the device's result and the golden (no operator call needed).

    Args:
        candidate: [N, H], the operator's dtype or float32.
        device_result: [N, H], the operator's dtype: the device's (or the emulation's) grad_x.
        golden: [N, H] float64 (:func:`moegrad.moe_init_routing_v2_grad_golden`).
        dtype: the operator's dtype name; defaults to ``device_result``'s.
        magnitude: [N, H] float64, the scale of relative errors (see :func:`metrics`); default |golden|.
        zero_rows: [N] bool, rows that must be exactly +0.0 (:func:`skipped_rows`); default none.
        standards: names from :data:`STANDARDS` (a single name is accepted); default all.

    Returns:
        A :class:`ComparisonReport`.

    Raises:
        InvalidArgument: the candidate has the wrong type, dtype or shape (field ``"candidate"``), or
            a standard is unknown or none is given (field ``"standards"``); aclnn 161002.
        TypeError, ValueError: ``device_result``, ``golden``, ``magnitude`` or ``zero_rows`` do not fit.
    """
    device_result = _float_array(device_result, "device_result", GRAD_DTYPES)
    dtype = dtype_name(device_result.dtype) if dtype is None else dtype
    if dtype not in GRAD_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not one of {', '.join(GRAD_DTYPES)}")
    if dtype_name(device_result.dtype) != dtype:
        raise TypeError(f"device_result.dtype={device_result.dtype} is not the operator's dtype {dtype}")
    shape = (int(device_result.shape[0]), int(device_result.shape[1]))
    candidate = _check_candidate(candidate, shape, dtype)
    names = _check_standards(standards)
    golden = _float_array(golden, "golden", _FLOAT_INPUTS)
    if golden.shape != shape:
        raise ValueError(f"golden has shape {list(golden.shape)}, not {list(shape)}")
    rows = np.zeros(shape[0], dtype=np.bool_) if zero_rows is None else np.asarray(zero_rows)
    if rows.dtype != np.bool_ or rows.shape != (shape[0],):
        raise ValueError(f"zero_rows must be a bool array of shape [{shape[0]}], got {rows.dtype} {list(rows.shape)}")

    cg = metrics(candidate, golden, dtype=dtype, magnitude=magnitude)
    dg = metrics(device_result, golden, dtype=dtype, magnitude=magnitude)
    cd = metrics(candidate, device_result, golden, dtype=dtype, magnitude=magnitude)
    zr = _zero_rows(candidate, rows)
    verdicts = tuple(_judge(name, dtype, cg, dg, cd, zr) for name in names)
    return ComparisonReport(dtype=dtype, candidate_dtype=dtype_name(candidate.dtype), shape=shape,
                            verdict=_worst(v.status for v in verdicts), verdicts=verdicts, candidate_vs_golden=cg,
                            device_vs_golden=dg, candidate_vs_device=cd, zero_rows=zr)


def summand_magnitude(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The magnitude of each output's summands, ``sum over t of |grad_expanded_x[expanded_row_idx[i*K + t]]|``.

    The scale a summation's rounding error is proportional to (docs/accuracy.md, "Relative to
    what"); equal to ``|grad_x|`` when a row's summands share one sign. Skipped slots add nothing.

    Returns:
        [N, H] float64, >= 0 (NaN where a summand is NaN).
    """
    absolute = call.model_copy(update={"grad_expanded_x": np.abs(call.grad_expanded_x)})  # same indices: still valid
    return moe_init_routing_v2_grad_golden(absolute)


def compare(call: MoeInitRoutingV2GradCall, candidate: np.ndarray, *, device_result: np.ndarray | None = None,
            golden: np.ndarray | None = None, standards: Iterable[str] | str | None = None) -> ComparisonReport:
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
        standards: names from :data:`STANDARDS`; default all.

    Returns:
        A :class:`ComparisonReport`.

    Raises:
        InvalidArgument: as :func:`check_compare_arguments` (a missing candidate 161001, a bad
            candidate or an unknown standard 161002); checked before anything is computed.
        TypeError: ``call`` is not a :class:`~moegrad.MoeInitRoutingV2GradCall`.
        ValueError: ``device_result`` or ``golden`` has the wrong shape or dtype.
    """
    check_compare_arguments(call, candidate, standards)
    shape = (call.num_tokens, call.hidden_size)
    for name, given in (("device_result", device_result), ("golden", golden)):
        if given is not None and getattr(given, "shape", None) != shape:
            raise ValueError(f"{name} has shape {list(getattr(given, 'shape', ()))}; grad_x of this call is {list(shape)}")
    if device_result is None:
        device_result = moe_init_routing_v2_grad(call)
    if golden is None:
        golden = moe_init_routing_v2_grad_golden(call)
    return compare_arrays(candidate, device_result, golden, dtype=call.dtype_name, magnitude=summand_magnitude(call),
                          zero_rows=skipped_rows(call), standards=standards)
