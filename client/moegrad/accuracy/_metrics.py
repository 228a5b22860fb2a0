"""Error statistics of one pair of arrays (:func:`metrics`); docs/accuracy.md defines every number."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from moegrad._dtypes import dtype_name
from moegrad.accuracy._results import Metrics, WorstElement
from moegrad.accuracy._standards import DTYPE_LIMITS, DtypeLimits
from moegrad.operator._call import GRAD_DTYPES

__all__ = ["FLOAT_INPUTS", "float_array", "metrics"]


# --------------------------------------------------------------------------------------------------
# Metrics

FLOAT_INPUTS = (*GRAD_DTYPES, "float64")


def float_array(value: Any, what: str, allowed: tuple[str, ...]) -> np.ndarray:
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


def metrics(
    actual: np.ndarray,
    expected: np.ndarray,
    golden: np.ndarray | None = None,
    *,
    dtype: str | None = None,
    magnitude: np.ndarray | None = None,
) -> Metrics:
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
    actual = float_array(actual, "actual", GRAD_DTYPES)
    expected = float_array(expected, "expected", FLOAT_INPUTS)
    golden = expected if golden is None else float_array(golden, "golden", FLOAT_INPUTS)
    if magnitude is not None:
        magnitude = float_array(magnitude, "magnitude", ("float64",))
    if not actual.shape == expected.shape == golden.shape == (actual.shape if magnitude is None else magnitude.shape):
        raise ValueError(
            f"shapes differ: actual {list(actual.shape)}, expected {list(expected.shape)}, "
            f"golden {list(golden.shape)}" + ("" if magnitude is None else f", magnitude {list(magnitude.shape)}")
        )
    actual_dtype = dtype_name(actual.dtype)
    assert actual_dtype is not None, "float_array checked that actual's dtype is one of GRAD_DTYPES"
    dtype = actual_dtype if dtype is None else dtype
    if dtype not in DTYPE_LIMITS:
        raise TypeError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_LIMITS)}")
    with np.errstate(all="ignore"):
        return _pair_metrics(actual, expected, golden, magnitude, dtype, actual_dtype)


def _pair_metrics(
    actual: np.ndarray,
    expected: np.ndarray,
    golden: np.ndarray,
    magnitude: np.ndarray | None,
    dtype: str,
    actual_dtype: str,
) -> Metrics:
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

    equal = ((a == e) & (np.signbit(a) == np.signbit(e))) | (np.isnan(a) & np.isnan(e))
    bitwise_equal = int(np.count_nonzero(equal))
    matched = int(np.count_nonzero(matched_other))
    positive, negative, toward, away = _directions(err, af, ef)
    nonzero = positive + negative

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
        cosine_similarity=_cosine(af, ef),
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
        error_imbalance=max(abs(positive - negative), abs(away - toward)) / nonzero if nonzero else math.nan,
        worst=_worst(a, e, g, np.where(finite, np.abs(a - e), np.where(mismatch, math.inf, -1.0)), width),
    )


def _cosine(actual: np.ndarray, expected: np.ndarray) -> float:
    """The cosine similarity of two float64 vectors: 1.0 when both are zero, 0.0 when one is, NaN when empty."""
    if actual.size == 0:
        return math.nan
    norm_a, norm_e = float(np.sqrt(np.dot(actual, actual))), float(np.sqrt(np.dot(expected, expected)))
    if norm_a == 0 and norm_e == 0:
        return 1.0
    if norm_a == 0 or norm_e == 0:
        return 0.0
    return float(np.dot(actual, expected)) / norm_a / norm_e


def _worst(a: np.ndarray, e: np.ndarray, g: np.ndarray, badness: np.ndarray, width: int) -> WorstElement | None:
    """The element of largest ``badness`` (a finite pair's absolute error, inf for a NaN/Inf class
    mismatch, -1 otherwise), or None when no element is off."""
    if not badness.size or badness.max() <= 0:
        return None
    index = int(np.argmax(badness))
    return WorstElement(
        row=index // width,
        column=index % width,
        actual=float(a[index]),
        expected=float(e[index]),
        golden=float(g[index]),
        abs_error=float(abs(a[index] - e[index])),
    )


def _directions(err: np.ndarray, actual: np.ndarray, expected: np.ndarray) -> tuple[int, int, int, int]:
    """How many finite errors are positive, negative, toward zero and away from zero."""
    positive, negative = int(np.count_nonzero(err > 0)), int(np.count_nonzero(err < 0))
    toward = int(np.count_nonzero(np.abs(actual) < np.abs(expected)))
    away = int(np.count_nonzero(np.abs(actual) > np.abs(expected)))
    return positive, negative, toward, away
