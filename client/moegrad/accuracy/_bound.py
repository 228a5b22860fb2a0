"""The any-order error bound of a float32 sum, and the ULP figures of :func:`moegrad.explain`.

A row of grad_x is H independent sums of the same n summands (the slots the device adds). Whatever
tree of float32 adds computes one of them, round to nearest, the result ``s`` satisfies

    |s - S| <= gamma_(n-1) * sum_t |x_t|,        gamma_m = m*u / (1 - m*u),  u = 2^-24,

with ``S`` the exact sum: each summand passes through at most n - 1 roundings, each a factor
(1 + d) with |d| <= u (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4
and Lemma 3.1; an add whose exact result is subnormal is exact, so underflow adds nothing). The
final cast to float16 or bfloat16 adds at most half an ULP of the result in that dtype (it rounds
to nearest, and the result's binade is at least the float32 sum's). docs/accuracy.md derives it.

:func:`sum_bound` computes it per element; it adds a slack of 2^-50 * (sum |x_t| + |result|) for
the float64 arithmetic that evaluates both sides (the golden is the exact sum rounded once to
float64; the magnitude a float64 sum of at most K terms), far below any float32 rounding.
:func:`any_order_bound` is the same bound for a whole call, as the candidate harness uses it. Every
part of the accuracy toolkit that needs the bound takes it from here.
"""

from __future__ import annotations

import numpy as np

from moegrad.accuracy._compare import summand_magnitude
from moegrad.accuracy._standards import DTYPE_LIMITS
from moegrad.numerics._reference import moe_init_routing_v2_grad_golden
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["UNIT_ROUNDOFF", "any_order_bound", "cast_term", "gamma", "ordinal", "sum_bound", "ulp"]

#: u, the unit roundoff of float32 (round to nearest): half an ULP of 1.0.
UNIT_ROUNDOFF = 2.0**-24
_EVALUATION_SLACK = 2.0**-50
_ORDINAL_VIEWS = {2: (np.int16, 0x7FFF), 4: (np.int32, 0x7FFFFFFF)}


def gamma(steps: np.ndarray | int) -> np.ndarray:
    """``gamma_m = m*u / (1 - m*u)`` for m >= 0 float32 roundings (u = 2^-24); inf once m*u >= 1.

    Args:
        steps: m, an integer or an integer array (a negative m counts as 0).

    Returns:
        float64, the shape of ``steps``.
    """
    m = np.maximum(np.asarray(steps, dtype=np.float64), 0.0)
    mu = m * UNIT_ROUNDOFF
    with np.errstate(divide="ignore"):
        return np.where(mu < 1.0, mu / np.maximum(1.0 - mu, 0.0), np.inf)


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """One ULP of ``dtype`` at each of ``values`` (float64): 2^(e - p) for |v| in [2^e, 2^(e+1)),
    the smallest subnormal 2^(emin - p) at zero and below the normal range (docs/accuracy.md,
    "Metrics": the same definition as the metrics' ULP).

    Args:
        values: float64 array; an infinite or NaN value gives NaN.
        dtype: "float16", "bfloat16" or "float32".
    """
    limits = DTYPE_LIMITS[dtype]
    values = np.asarray(values, dtype=np.float64)
    _, exponent = np.frexp(values)  # |v| = m * 2^exponent with 0.5 <= m < 1: e = exponent - 1
    e = np.maximum(exponent.astype(np.int64) - 1, limits.min_exponent)
    e = np.where(values == 0, limits.min_exponent, e)
    result = np.ldexp(1.0, (e - limits.mantissa_bits).astype(np.int32))
    return np.where(np.isfinite(values), result, np.nan)


def sum_bound(
    magnitude: np.ndarray, summands: np.ndarray, result: np.ndarray, dtype: str, cast: np.ndarray | None = None
) -> np.ndarray:
    """The largest ``|result - exact sum|`` any float32 schedule of adds can give, then the final cast.

    ``gamma_(n-1) * magnitude + (half an ULP of dtype at result, unless dtype is float32)``, plus
    the evaluation slack of the module docstring.

    Args:
        magnitude: float64 ``sum_t |x_t|`` over the summands actually added, [..., H].
        summands: n, the number of summands added (skipped slots excluded), broadcastable to
            ``magnitude`` (e.g. [rows, 1]).
        result: the result in question as float64 (the candidate's or the device's value), the
            shape of ``magnitude``; the half ULP is taken at ``|result|``.
        dtype: the output dtype ("float16", "bfloat16" or "float32").
        cast: :func:`cast_term` of ``result`` when the caller has it already (it depends on
            ``result`` alone), broadcastable to ``magnitude``.

    Returns:
        float64, the shape of ``magnitude``; inf where n is so large that gamma is (never for K
        below 2^23), NaN where ``result`` is not finite.
    """
    bound = gamma(np.asarray(summands) - 1) * magnitude
    bound += _EVALUATION_SLACK * (magnitude + np.abs(result))
    bound += cast_term(result, dtype) if cast is None else cast
    return bound


def any_order_bound(call: MoeInitRoutingV2GradCall, golden: np.ndarray | None = None) -> np.ndarray:
    """How far from the exact sum some schedule of float32 adds can land, per element of grad_x.

    :func:`sum_bound` with n the slots each row adds (a skipped slot adds nothing) and the final
    cast's half ULP taken at ``|golden| + gamma_(n-1) * sum_t |x_t|``, the farthest the float32 sum
    can reach (so that it covers a sum rounded into the next binade).

    Args:
        call: the call.
        golden: ``moe_init_routing_v2_grad_golden(call)`` when already computed.

    Returns:
        [N, H] float64; NaN where the golden is not finite (there the bound does not apply: the
        classes NaN, +inf and -inf are compared instead).
    """
    golden = moe_init_routing_v2_grad_golden(call) if golden is None else golden
    magnitude = summand_magnitude(call)
    rows = int(np.prod(call.grad_expanded_x.shape[:-1]))
    index = call.expanded_row_idx.reshape(-1, max(call.top_k, 1))
    added = ((index >= 0) & (index < rows)).sum(axis=1)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        reach = np.abs(golden) + gamma(added - 1) * magnitude
        return sum_bound(magnitude, added, reach, call.dtype_name)


def cast_term(result: np.ndarray, dtype: str) -> np.ndarray | float:
    """The final cast's part of the bound: half an ULP of ``dtype`` at ``result`` (0 for float32)."""
    return 0.0 if dtype == "float32" else 0.5 * ulp(result, dtype)


def ordinal(values: np.ndarray) -> np.ndarray:
    """Each float16 / bfloat16 / float32 value's position on the number line, as an int64 whose
    differences count the representable values between two of them (+0.0 and -0.0 are both 0).

    Args:
        values: an array of a 2- or 4-byte float dtype (bfloat16 as ``ml_dtypes.bfloat16``).
    """
    view, magnitude_mask = _ORDINAL_VIEWS[values.dtype.itemsize]
    bits = np.ascontiguousarray(values).view(view).astype(np.int64)
    magnitude = bits & magnitude_mask
    return np.where(bits < 0, -magnitude, magnitude)
