"""The two tables of the accuracy standards: per-dtype metric constants and every standard's criteria.

Nothing else in :mod:`moegrad.accuracy` holds a tolerance; docs/accuracy.md gives each number's
source.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_STANDARDS", "DTYPE_LIMITS", "STANDARDS", "THRESHOLDS", "Criterion", "DtypeLimits", "Op", "Status"]

Status = Literal["pass", "warning", "fail"]
Op = Literal["<", "<=", ">", ">="]

#: The standards by name, in the order reports list them.
STANDARDS: tuple[str, ...] = ("bitwise", "dual_thousandth", "threshold", "benchmark", "accumulative")
#: The standards that decide the verdict unless the caller names others: the tolerance standards
#: that fit a port of this operator (docs/accuracy.md, "Verdict policy"). Bit-exactness is always
#: reported apart (:class:`ExactMatch`) and decides the verdict only when required.
DEFAULT_STANDARDS: tuple[str, ...] = ("dual_thousandth", "threshold", "benchmark", "accumulative")
SEVERITY: Mapping[str, int] = types.MappingProxyType({"pass": 0, "warning": 1, "fail": 2})


@dataclass(frozen=True)
class DtypeLimits:
    """Per-dtype constants of the metrics (docs/accuracy.md, "Small values" and "Metrics").

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
DTYPE_LIMITS: Mapping[str, DtypeLimits] = types.MappingProxyType(
    {
        "float16": DtypeLimits(
            mantissa_bits=10,
            min_exponent=-14,
            small_value=2.0**-10,
            small_value_atol=2.0**-16,
            accumulative_small_value=1.0,
        ),
        "bfloat16": DtypeLimits(
            mantissa_bits=7,
            min_exponent=-126,
            small_value=2.0**-10,
            small_value_atol=2.0**-16,
            accumulative_small_value=1.0,
        ),
        "float32": DtypeLimits(
            mantissa_bits=23,
            min_exponent=-126,
            small_value=2.0**-20,
            small_value_atol=2.0**-30,
            accumulative_small_value=1.0,
        ),
    }
)


@dataclass(frozen=True)
class Criterion:
    """One requirement of a standard: ``measure op limit``, else the criterion is ``on_miss``.

    Attributes:
        measure: the name of a number computed from the three comparisons (docs/accuracy.md,
            "Metrics" and "Standards"), e.g. ``"rmse_ratio"`` or ``"thousandth_share"``.
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
    return (
        Criterion(required[0], ">", required[1]),
        Criterion(passing[0], ">", passing[1], on_miss="warning"),
        _SPECIAL,
        _ZERO_ROWS,
    )


def _threshold(t: float) -> tuple[Criterion, ...]:
    return (
        Criterion("mean_relative_error", "<", t),
        Criterion("max_relative_error", "<", 10 * t),
        _SPECIAL,
        _ZERO_ROWS,
    )


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
THRESHOLDS: Mapping[tuple[str, str], tuple[Criterion, ...]] = types.MappingProxyType(
    {
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
    }
)
