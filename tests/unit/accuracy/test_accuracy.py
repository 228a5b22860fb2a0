"""moegrad accuracy: metric values by hand, each standard's boundary, and operator-level cases.

Oracles: expected numbers come from hand arithmetic on tiny arrays (exact in binary), from the
dtype's own bit patterns (ULPs), from the float64 computation of tests/support/oracle.py, or from the
thresholds docs/accuracy.md gives; never from the module under test. The operator-level cases
that use the emulation as the candidate (``test_the_emulation_*``) check that the thresholds leave
room for the device's own rounding; they are not oracles for the bitwise standard.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import (
    DTYPE_LIMITS,
    STANDARDS,
    THRESHOLDS,
    ComparisonReport,
    InvalidArgument,
    Metrics,
    MoeInitRoutingV2GradCall,
    accuracy,
    compare,
    compare_arrays,
    metrics,
    moe_init_routing_v2_grad,
    skipped_rows,
)
from support.oracle import (
    ALL_STANDARDS,
    ORACLE_CASES,
    device_k2,
    figures,
    float32_statuses,
    golden_and_scale,
    oracle_call,
    oracle_candidate,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
DTYPES = {"float16": F16, "bfloat16": BF16, "float32": F32}
UINT = {2: np.uint16, 4: np.uint32}
TOLERANCE_STANDARDS = ("dual_thousandth", "threshold", "benchmark", "accumulative")


def row(values, dtype) -> np.ndarray:
    """A [1, n] array (the metrics take [N, H])."""
    return np.asarray([values], dtype=np.float64).astype(dtype)


def step(values: np.ndarray, ulps: int) -> np.ndarray:
    """Move each element by ``ulps`` representable values (on the bit pattern, away from +0 for ulps > 0)."""
    unsigned = UINT[values.dtype.itemsize]
    return (values.view(unsigned).astype(np.int64) + ulps).astype(unsigned).view(values.dtype)


# --------------------------------------------------------------------------------------------------
# Metrics, by hand


def test_basic_errors_float32():
    actual = row([1, 2, 3, 4], F32)
    golden = row([1, 2.5, 2, 4], np.float64)  # errors 0, -0.5, +1, 0
    m = metrics(actual, golden)
    assert (m.dtype, m.actual_dtype, m.relative_to) == ("float32", "float32", "golden")
    assert (m.count, m.finite_count, m.normal_count, m.small_count) == (4, 4, 4, 0)
    assert m.max_abs_error == 1.0
    assert m.mean_abs_error == 0.375
    assert m.rmse == pytest.approx(math.sqrt(1.25 / 4), rel=1e-15)
    assert m.max_relative_error == 0.5  # 1 / 2
    assert m.mean_relative_error == pytest.approx((0.5 / 2.5 + 1 / 2) / 4, rel=1e-15)
    assert m.max_accumulative_error == 0.5  # |err| / max(|golden|, 1)
    assert m.cosine_similarity == pytest.approx(28 / math.sqrt(30 * 27.25), rel=1e-15)
    assert (m.bitwise_equal_count, m.bitwise_equal_share) == (2, 0.5)
    # float32 ULP of 2 and of 2.5 is 2^-22: errors of 0.5 and 1 are 2^21 and 2^22 ULPs.
    assert m.max_ulp_error == 2.0**22
    assert m.mean_ulp_error == (2.0**21 + 2.0**22) / 4
    assert m.ulp_error_above_1_share == 0.5
    # scaled errors 0, 0.2, 0.5, 0: two of four within any of 1e-2, 1e-3, 1e-4
    assert (m.hundredth_share, m.thousandth_share, m.ten_thousandth_share) == (0.5, 0.5, 0.5)
    assert (m.nan_mismatch_count, m.inf_mismatch_count) == (0, 0)
    assert (m.positive_error_share, m.negative_error_share) == (0.25, 0.25)
    assert (m.toward_zero_share, m.away_from_zero_share) == (0.25, 0.25)
    assert (m.nonzero_error_count, m.error_imbalance) == (2, 0.0)
    assert (m.worst.row, m.worst.column) == (0, 2)
    assert (m.worst.actual, m.worst.expected, m.worst.golden, m.worst.abs_error) == (3.0, 2.0, 2.0, 1.0)


def test_zeros_and_subnormals_float16():
    golden = row([0.0, 3 * 2.0**-25, 1.0, -0.0], np.float64)
    actual = row([2.0**-24, 2.0**-24, 1.0, 0.0], F16)  # 2^-24 is float16's smallest subnormal
    m = metrics(actual, golden)
    # ULP at 0 and at the subnormal 1.5 * 2^-24 is 2^-24: errors of 2^-24 and 2^-25 are 1 and 0.5 ULP.
    assert m.max_ulp_error == 1.0
    assert m.mean_ulp_error == 1.5 / 4
    assert m.ulp_error_above_1_share == 0.0
    # +0.0 against -0.0 is not bitwise equal, though the error is 0.
    assert (m.bitwise_equal_count, m.bitwise_equal_share) == (1, 0.25)
    assert m.max_abs_error == 2.0**-24
    # |golden| < 2^-10: three small values, measured absolutely
    assert (m.normal_count, m.small_count) == (1, 3)
    assert m.max_small_value_abs_error == 2.0**-24
    assert (m.small_value_error_count, m.small_value_error_rate) == (0, 0.0)
    assert (m.max_relative_error, m.mean_relative_error) == (0.0, 0.0)
    assert (m.positive_error_share, m.negative_error_share) == (0.25, 0.25)
    assert (m.toward_zero_share, m.away_from_zero_share) == (0.25, 0.25)
    assert m.nonzero_error_count == 2
    assert (m.worst.row, m.worst.column, m.worst.actual, m.worst.golden) == (0, 0, 2.0**-24, 0.0)
    # 2^-24 / 2^-10 = 2^-14 < 1e-4: every element within every share
    assert (m.hundredth_share, m.thousandth_share, m.ten_thousandth_share) == (1.0, 1.0, 1.0)


def test_small_values_use_the_absolute_error():
    golden = row([2.0**-12, 2.0**-12, 0.5], np.float64)
    actual = row([2.0**-12 + 2.0**-15, 2.0**-12 + 2.0**-16, 0.5 + 2.0**-11], F16)
    m = metrics(actual, golden)
    assert (m.small_count, m.normal_count) == (2, 1)
    # float16's small-value atol is 2^-16: an error of 2^-15 counts, one of 2^-16 does not
    assert (m.small_value_error_count, m.small_value_error_rate) == (1, 0.5)
    assert m.max_small_value_abs_error == 2.0**-15
    assert m.max_relative_error == 2.0**-10  # 2^-11 / 0.5; the small values stay out of it


def test_magnitude_replaces_golden_as_the_scale():
    golden = row([0.5, 4.0], np.float64)
    actual = row([0.5 + 2.0**-10, 4.0], F32)
    magnitude = row([8.0, 4.0], np.float64)  # e.g. 4.25 + (-3.75): summands of magnitude 8
    m = metrics(actual, golden, magnitude=magnitude)
    assert m.relative_to == "magnitude"
    assert m.max_relative_error == 2.0**-13  # 2^-10 / 8, not 2^-10 / 0.5
    assert m.max_accumulative_error == 2.0**-13
    assert m.max_ulp_error == 2.0**-10 / 2.0**-24  # ULPs stay ULPs of golden (0.5 -> 2^-24)


def test_error_balance():
    golden = row([1, -1, 2, -2], np.float64)
    actual = row([0.5, -0.5, 2, -3], F32)  # errors -0.5 (toward 0), +0.5 (toward 0), 0, -1 (away)
    m = metrics(actual, golden)
    assert (m.positive_error_share, m.negative_error_share) == (0.25, 0.5)
    assert (m.toward_zero_share, m.away_from_zero_share) == (0.5, 0.25)
    assert m.nonzero_error_count == 3
    assert m.error_imbalance == pytest.approx(1 / 3, rel=1e-15)


def test_nan_and_inf_mismatches_float16():
    golden = row([1.0, np.nan, np.inf, 2.0, 70000.0, -np.inf], np.float64)
    actual = row([np.nan, np.nan, np.inf, np.inf, np.inf, np.inf], F16)
    m = metrics(actual, golden)
    # 70000 rounds to float16 +inf, so inf there is right; +inf against -inf is a mismatch.
    assert (m.nan_mismatch_count, m.inf_mismatch_count) == (1, 2)
    assert m.finite_count == 0
    assert math.isnan(m.max_abs_error) and math.isnan(m.rmse) and math.isnan(m.cosine_similarity)
    assert m.bitwise_equal_count == 2  # NaN/NaN and inf/inf
    assert m.hundredth_share == 0.5  # the three matching special values of six
    assert (m.worst.row, m.worst.column, m.worst.expected) == (0, 0, 1.0)
    assert math.isnan(m.worst.actual)


def test_cosine_of_zero_vectors():
    zeros = row([0.0, 0.0], F32)
    assert metrics(zeros, row([0.0, -0.0], np.float64)).cosine_similarity == 1.0
    assert metrics(zeros, row([1.0, 0.0], np.float64)).cosine_similarity == 0.0


def test_identical_arrays_have_no_worst_element():
    values = row([1.0, -0.0, np.nan], F32)
    m = metrics(values, values.astype(np.float64))
    assert m.worst is None
    assert (m.bitwise_equal_share, m.max_abs_error, m.rmse) == (1.0, 0.0, 0.0)
    assert math.isnan(m.error_imbalance)  # no nonzero error: balance undefined


def _ulp_cases():
    cases = {
        "float16": [0.0, 2.0**-20, 2.0**-14, 1.0, -1.0, 1000.0, 65504.0],
        "bfloat16": [0.0, 2.0**-130, 2.0**-126, 1.0, -1.0, 3.0, float(ml_dtypes.finfo(BF16).max)],
        "float32": [0.0, 2.0**-140, 2.0**-126, 1.0, -1.0, float(np.float32(1e30)), float(np.finfo(np.float32).max)],
    }
    return [(name, value) for name, values in cases.items() for value in values]


@pytest.mark.parametrize(("name", "value"), _ulp_cases())
@pytest.mark.parametrize("ulps", [1, 2])
def test_ulp_error_counts_representable_values(name, value, ulps):
    dtype = DTYPES[name]
    golden = row([value], dtype)
    is_max = value == float(ml_dtypes.finfo(dtype).max)
    actual = step(golden, -ulps if is_max else ulps)  # the neighbours ulps values away, by bit pattern
    m = metrics(actual, golden.astype(np.float64))
    assert m.max_ulp_error == ulps
    assert m.ulp_error_above_1_share == (1.0 if ulps > 1 else 0.0)


def test_ulps_are_the_candidates_dtype():
    golden = row([1.0], np.float64)
    actual = row([1 + 2.0**-23], F32)
    m = metrics(actual, golden, dtype="float16")  # float16 tolerances, a float32 candidate
    assert m.max_ulp_error == 1.0
    assert (m.dtype, m.actual_dtype) == ("float16", "float32")


def test_metrics_rejects_misuse():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics(row([1, 2], F32), row([1], np.float64))
    with pytest.raises(ValueError, match="2-D"):
        metrics(np.ones(3, F32), np.ones(3))
    with pytest.raises(TypeError, match="actual.dtype"):
        metrics(np.ones((1, 2), np.int32), np.ones((1, 2)))
    with pytest.raises(TypeError, match="dtype="):
        metrics(row([1], F32), row([1], np.float64), dtype="float64")


# --------------------------------------------------------------------------------------------------
# Standards: the table, and each boundary


def _limit(standard: str, dtype: str, measure: str) -> tuple[str, float, str]:
    (criterion,) = [c for c in THRESHOLDS[(standard, dtype)] if c.measure == measure]
    return criterion.op, criterion.limit, criterion.on_miss


def test_the_table_holds_the_issues_numbers():
    assert set(THRESHOLDS) == {(s, d) for s in STANDARDS for d in DTYPES}
    for dtype, t in (("float16", 2.0**-10), ("bfloat16", 2.0**-7), ("float32", 2.0**-13)):
        assert _limit("threshold", dtype, "mean_relative_error") == ("<", t, "fail")
        assert _limit("threshold", dtype, "max_relative_error") == ("<", 10 * t, "fail")
    for dtype, bound in (("float16", 2.0**-8), ("bfloat16", 2.0**-7), ("float32", 2.0**-11)):
        assert _limit("accumulative", dtype, "max_accumulative_error") == ("<=", bound, "fail")
        assert _limit("accumulative", dtype, "special_value_mismatches") == ("<=", 0, "fail")
    for dtype in ("float16", "bfloat16"):
        assert _limit("dual_thousandth", dtype, "hundredth_share") == (">", 0.99, "fail")
        assert _limit("dual_thousandth", dtype, "thousandth_share") == (">", 0.999, "warning")
    assert _limit("dual_thousandth", "float32", "thousandth_share") == (">", 0.999, "fail")
    assert _limit("dual_thousandth", "float32", "ten_thousandth_share") == (">", 0.9999, "warning")
    for dtype in DTYPES:
        assert _limit("benchmark", dtype, "rmse_ratio")[:2] == ("<=", 2)
        assert _limit("benchmark", dtype, "mean_relative_error_ratio")[:2] == ("<=", 2)
        assert _limit("benchmark", dtype, "max_relative_error_ratio")[:2] == ("<=", 10)
        assert _limit("benchmark", dtype, "small_value_error_ratio")[:2] == ("<=", 2)
        for standard in STANDARDS:  # zero rows are checked whatever the standard
            assert _limit(standard, dtype, "zero_row_mismatches") == ("<=", 0, "fail")
    assert set(DTYPE_LIMITS) == set(DTYPES)


def judge(candidate, device, golden=None, standard="bitwise", **kwargs):
    golden = device.astype(np.float64) if golden is None else golden
    return compare_arrays(candidate, device, golden, standards=[standard], **kwargs).verdict_of(standard)


def criterion(verdict, measure):
    (found,) = [c for c in verdict.criteria if c.measure == measure]
    return found


def test_bitwise_boundary():
    device = row([1.0, 2.0, 0.0, 3.0], F32)
    assert judge(device.copy(), device).status == "pass"
    off_by_one = device.copy()
    off_by_one[0, 3] = step(device[:, 3:], 1)[0, 0]
    verdict = judge(off_by_one, device)
    assert verdict.status == "fail"
    assert criterion(verdict, "bitwise_mismatches").value == 1
    negative_zero = device.copy()
    negative_zero[0, 2] = -0.0
    assert judge(negative_zero, device).status == "fail"


def test_bitwise_ignores_nan_payloads():
    device = row([1.0, np.nan], F32)
    candidate = device.copy()
    candidate.view(np.uint32)[0, 1] = 0x7FC00001  # another quiet NaN
    assert np.isnan(candidate[0, 1])
    assert judge(candidate, device, golden=row([1.0, np.nan], np.float64)).status == "pass"


def _ones_with(n: int, dtype, changes: dict[float, int]) -> np.ndarray:
    values = np.ones((1, n), dtype=np.float64)
    start = 0
    for value, count in changes.items():
        values[0, start:start + count] = value
        start += count
    return values.astype(dtype)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize(("n", "outside_1e2", "outside_1e3", "status"), [
    (1000, 10, 0, "fail"),      # 99.0% within 1e-2: not more than 99%
    (1000, 9, 0, "warning"),    # 99.1% within 1e-2 is required; within 1e-3 it is not 99.9%
    (1000, 0, 1, "warning"),    # 99.9% within 1e-3: not more than 99.9%
    (1001, 0, 1, "pass"),       # 1000/1001 within 1e-3
])
def test_dual_thousandth_boundary_half(name, n, outside_1e2, outside_1e3, status):
    dtype = DTYPES[name]
    # 1 + 2^-6 is off by 1.6e-2; 1 + 2^-7 by 7.8e-3 (inside 1e-2, outside 1e-3); both exact in either dtype
    candidate = _ones_with(n, dtype, {1 + 2.0**-6: outside_1e2, 1 + 2.0**-7: outside_1e3})
    device = np.ones((1, n), dtype=dtype)
    assert judge(candidate, device, standard="dual_thousandth").status == status


@pytest.mark.parametrize(("n", "outside_1e3", "outside_1e4", "status"), [
    (1000, 1, 0, "fail"),       # 99.9% within 1e-3: not more than 99.9%
    (1001, 1, 0, "warning"),    # required share met; within 1e-4 it is not 99.99%
    (10000, 0, 1, "warning"),   # 99.99% within 1e-4: not more than 99.99%
    (10001, 0, 1, "pass"),
])
def test_dual_thousandth_boundary_float32(n, outside_1e3, outside_1e4, status):
    # 1 + 2^-9 is off by 2.0e-3; 1 + 2^-12 by 2.4e-4 (inside 1e-3, outside 1e-4)
    candidate = _ones_with(n, F32, {1 + 2.0**-9: outside_1e3, 1 + 2.0**-12: outside_1e4})
    assert judge(candidate, np.ones((1, n), F32), standard="dual_thousandth").status == status


@pytest.mark.parametrize(("name", "t", "ulp_at_1"), [
    ("float16", 2.0**-10, 2.0**-10), ("bfloat16", 2.0**-7, 2.0**-7), ("float32", 2.0**-13, 2.0**-23)])
def test_threshold_boundary(name, t, ulp_at_1):
    dtype = DTYPES[name]
    device = np.ones((1, 64), dtype=dtype)
    # mean relative error exactly T fails (it must be below T); one element a ULP lower passes
    at_t = _ones_with(64, dtype, {1 + t: 64})
    below_t = _ones_with(64, dtype, {1 + t - ulp_at_1: 1, 1 + t: 63})
    assert criterion(judge(at_t, device, standard="threshold"), "mean_relative_error").value == t
    assert judge(at_t, device, standard="threshold").status == "fail"
    assert judge(below_t, device, standard="threshold").status == "pass"
    # max relative error exactly 10 T fails; a ULP less passes
    at_10t = _ones_with(64, dtype, {1 + 10 * t: 1})
    below_10t = _ones_with(64, dtype, {1 + 10 * t - ulp_at_1: 1})
    verdict = judge(at_10t, device, standard="threshold")
    assert (verdict.status, [c.measure for c in verdict.failures]) == ("fail", ["max_relative_error"])
    assert judge(below_10t, device, standard="threshold").status == "pass"


def test_benchmark_rmse_and_mean_ratio_boundary():
    golden = np.ones((1, 64))
    device = _ones_with(64, F32, {1 + 2.0**-10: 64})
    twice = _ones_with(64, F32, {1 + 2.0**-9: 64})  # every error exactly twice the device's
    verdict = judge(twice, device, golden, "benchmark")
    assert verdict.status == "pass"
    assert criterion(verdict, "rmse_ratio").value == 2.0
    assert criterion(verdict, "mean_relative_error_ratio").value == 2.0
    more = _ones_with(64, F32, {1 + 2.0**-9 + 2.0**-23: 64})
    verdict = judge(more, device, golden, "benchmark")
    assert verdict.status == "fail"
    assert {c.measure for c in verdict.failures} == {"rmse_ratio", "mean_relative_error_ratio"}


def test_benchmark_max_ratio_boundary():
    golden = np.ones((1, 64))
    device = _ones_with(64, F32, {1 + 2.0**-10: 64})
    ten = _ones_with(64, F32, {1 + 10 * 2.0**-10: 1, 1 + 2.0**-10: 63})
    verdict = judge(ten, device, golden, "benchmark")
    assert (verdict.status, criterion(verdict, "max_relative_error_ratio").value) == ("pass", 10.0)
    over = _ones_with(64, F32, {1 + 10 * 2.0**-10 + 2.0**-23: 1, 1 + 2.0**-10: 63})
    verdict = judge(over, device, golden, "benchmark")
    assert [c.measure for c in verdict.failures] == ["max_relative_error_ratio"]


@pytest.mark.parametrize(("candidate_errors", "status"), [(8, "pass"), (9, "fail")])
def test_benchmark_small_value_ratio_boundary(candidate_errors, status):
    golden = np.zeros((1, 64))  # all small values
    device = np.zeros((1, 64), F32)
    device[0, :4] = 2.0**-20  # over float32's small-value atol of 2^-30
    candidate = np.zeros((1, 64), F32)
    candidate[0, :candidate_errors] = 2.0**-20
    verdict = judge(candidate, device, golden, "benchmark")
    assert criterion(verdict, "small_value_error_ratio").value == candidate_errors / 4
    assert verdict.status == status


@pytest.mark.parametrize(("up", "status"), [(48, "pass"), (49, "fail")])
def test_benchmark_error_balance_boundary(up, status):
    golden = np.ones((1, 64))
    device = _ones_with(64, F32, {1 + 2.0**-10: 32, 1 - 2.0**-10: 32})  # balanced
    candidate = _ones_with(64, F32, {1 + 2.0**-10: up, 1 - 2.0**-10: 64 - up})
    verdict = judge(candidate, device, golden, "benchmark")
    assert criterion(verdict, "error_imbalance_excess").value == (up - (64 - up)) / 64
    assert verdict.status == status


def test_benchmark_error_balance_needs_64_errors():
    golden = np.ones((1, 63))
    device = _ones_with(63, F32, {1 + 2.0**-10: 32, 1 - 2.0**-10: 31})
    candidate = _ones_with(63, F32, {1 - 2.0**-10: 63})  # all on one side, but only 63 of them
    found = criterion(judge(candidate, device, golden, "benchmark"), "error_imbalance_excess")
    assert (found.assessed, found.status) == (False, "pass")


def test_benchmark_special_values():
    golden = np.ones((1, 4))
    device = np.ones((1, 4), F32)
    candidate = row([1, 1, np.nan, 1], F32)
    verdict = judge(candidate, device, golden, "benchmark")
    assert [c.measure for c in verdict.failures] == ["special_value_mismatch_excess"]


@pytest.mark.parametrize(("name", "bound", "ulp_at_2", "ulp_at_half"), [
    ("float16", 2.0**-8, 2.0**-9, 2.0**-11),
    ("bfloat16", 2.0**-7, 2.0**-6, 2.0**-8),
    ("float32", 2.0**-11, 2.0**-22, 2.0**-24),
])
def test_accumulative_boundary(name, bound, ulp_at_2, ulp_at_half):
    dtype = DTYPES[name]
    golden = row([2.0, 0.5], np.float64)  # relative error at |golden| >= 1, absolute below
    device = golden.astype(dtype)
    at_bound = row([2 + 2 * bound, 0.5 + bound], dtype)
    assert judge(at_bound, device, golden, "accumulative").status == "pass"
    over_relative = row([2 + 2 * bound + ulp_at_2, 0.5], dtype)
    over_absolute = row([2.0, 0.5 + bound + ulp_at_half], dtype)
    for candidate in (over_relative, over_absolute):
        verdict = judge(candidate, device, golden, "accumulative")
        assert [c.measure for c in verdict.failures] == ["max_accumulative_error"]
    with_nan = row([np.nan, 0.5], dtype)
    verdict = judge(with_nan, device, golden, "accumulative")
    assert [c.measure for c in verdict.failures] == ["special_value_mismatches"]


@pytest.mark.parametrize("standard", STANDARDS)
def test_zero_rows_are_bitwise_under_every_standard(standard):
    device = np.array([[1.0, 2.0], [0.0, 0.0]], F32)
    rows = np.array([False, True])
    assert judge(device.copy(), device, standard=standard, zero_rows=rows).status == "pass"
    candidate = device.copy()
    candidate[1, 1] = -0.0
    verdict = judge(candidate, device, standard=standard, zero_rows=rows)
    assert verdict.status == "fail"
    assert criterion(verdict, "zero_row_mismatches").value == 1


# --------------------------------------------------------------------------------------------------
# The operator: device, Huawei's golden, a corrupted row, truncated bfloat16


def make_call(mode: str, name: str, *, tokens=32, top_k=4, hidden=48, seed=0, positive=False) -> MoeInitRoutingV2GradCall:
    """A valid call; in active and drop/pad mode token 0 has every slot skipped."""
    rng = np.random.default_rng(seed)
    slots = tokens * top_k

    def values(rows: int) -> np.ndarray:
        data = rng.uniform(0.25, 1.0, (rows, hidden)) if positive else rng.standard_normal((rows, hidden))
        return data.astype(DTYPES[name])

    if mode == "dropless":
        return MoeInitRoutingV2GradCall(grad_expanded_x=values(slots),
                                        expanded_row_idx=rng.permutation(slots).astype(np.int32), top_k=top_k)
    if mode == "active":
        active = slots - top_k - 5
        index = np.concatenate([np.arange(slots - top_k, slots), rng.permutation(slots - top_k)]).astype(np.int32)
        return MoeInitRoutingV2GradCall(grad_expanded_x=values(active), expanded_row_idx=index, top_k=top_k,
                                        active_num=active)
    experts, capacity = 4, (slots * 3 // 4) // 4
    index = np.full(slots, -1, dtype=np.int32)
    kept = rng.choice(np.arange(top_k, slots), size=experts * capacity - 2, replace=False)
    index[kept] = rng.permutation(experts * capacity)[:kept.size]
    return MoeInitRoutingV2GradCall(grad_expanded_x=values(experts * capacity).reshape(experts, capacity, hidden),
                                    expanded_row_idx=index, top_k=top_k, drop_pad_mode=1)


MODES = ("dropless", "active", "drop_pad")


def statuses(report: ComparisonReport) -> dict[str, str]:
    return {v.standard: v.status for v in report.verdicts}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["float16", "float32"])
def test_the_device_result_passes_every_standard(mode, name):
    # K=2: the device's result is one float32 add from +0.0, rounded once (docs/semantics.md),
    # computed here without moegrad; bitwise passing proves the default device result is that.
    call = make_call(mode, name, top_k=2)
    candidate = device_k2(call)
    report = compare(call, candidate, standards=STANDARDS)
    assert statuses(report) == dict.fromkeys(STANDARDS, "pass")
    assert report.candidate_vs_device.bitwise_equal_count == candidate.size
    assert report.verdict == "pass" and report.passed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["float16", "float32"])
def test_the_emulation_at_k4_passes_its_own_tolerances(mode, name):
    call = make_call(mode, name)
    report = compare(call, moe_init_routing_v2_grad(call), standards=STANDARDS)
    assert statuses(report) == dict.fromkeys(STANDARDS, "pass")


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_compare_matches_an_independent_float64_computation(case):
    call = oracle_call(seed=2)
    device = device_k2(call)
    candidate = oracle_candidate(case, device)
    golden, scale = golden_and_scale(call)
    report = compare(call, candidate, standards=ALL_STANDARDS)
    assert statuses(report) == float32_statuses(candidate, device, golden, scale)
    for comparison, actual in ((report.candidate_vs_golden, candidate), (report.device_vs_golden, device)):
        for name, value in figures(actual, golden, scale).items():
            assert getattr(comparison, name) == pytest.approx(value, rel=1e-9, nan_ok=True), name


def test_skipped_rows_at_the_active_num_boundary():
    # active_num=2, expanded_row_idx=[2, 3, 0, 1], K=2: token 0's slots are 2 and 3, both >= active_num,
    # so it is skipped (docs/semantics.md: a slot is skipped when its index >= active_num);
    # token 1 sums rows 0 and 1.
    grad = np.array([[1.0, 2.0], [4.0, 8.0]], F32)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([2, 3, 0, 1], np.int32), top_k=2,
                                    active_num=2)
    assert skipped_rows(call).tolist() == [True, False]
    candidate = np.array([[0.0, -0.0], [5.0, 10.0]], F32)
    report = compare(call, candidate)
    z = report.zero_rows
    assert (z.rows, z.mismatched_rows, z.mismatched_elements, z.first_mismatched_row) == (1, 1, 1, 0)
    assert report.verdict == "fail"


def test_the_default_standards_are_the_tolerance_standards():
    # docs/accuracy.md, "Verdict policy": bitwise decides only when named or when exactness is required.
    assert moegrad.DEFAULT_STANDARDS == TOLERANCE_STANDARDS
    call = oracle_call()
    report = compare(call, device_k2(call))
    assert [v.standard for v in report.verdicts] == list(TOLERANCE_STANDARDS)


def test_every_criterion_shows_the_devices_own_figure():
    call = oracle_call(seed=5)
    device = device_k2(call)
    candidate = oracle_candidate("scaled_up", device)
    golden, scale = golden_and_scale(call)
    report = compare(call, candidate)
    device_figures = figures(device, golden, scale)
    threshold = report.verdict_of("threshold")
    for c in threshold.criteria:
        if c.measure in device_figures:
            assert c.device_value == pytest.approx(device_figures[c.measure], rel=1e-9), c.measure
    assert threshold.status == "fail" and threshold.device_status == "pass"
    rmse = criterion(report.verdict_of("benchmark"), "rmse_ratio")
    assert rmse.device_value == 1.0  # the device against itself
    assert "device" in rmse.describe()


@pytest.mark.parametrize("mode", MODES)
def test_the_device_result_in_bfloat16_warns_only_on_dual_thousandth(mode):
    # bfloat16 keeps 8 significant bits: rounding alone is off by up to 2^-8 = 3.9e-3 of the value,
    # so at K=4 far fewer than 99.9% of elements are within 1e-3 (docs/accuracy.md).
    call = make_call(mode, "bfloat16")
    report = compare(call, moe_init_routing_v2_grad(call))
    assert statuses(report) == {**dict.fromkeys(TOLERANCE_STANDARDS, "pass"), "dual_thousandth": "warning"}
    assert report.exact.bit_exact
    (warned,) = report.verdict_of("dual_thousandth").failures
    assert warned.measure == "thousandth_share"
    assert (report.verdict, report.passed) == ("warning", True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("top_k", [3, 4, 8, 16])
def test_the_sequential_golden_passes_tolerances_but_not_bitwise_in_float32(mode, top_k):
    call = make_call(mode, "float32", top_k=top_k, seed=top_k)
    sequential = moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    differing = int(np.count_nonzero(sequential.view(np.uint32) != moe_init_routing_v2_grad(call).view(np.uint32)))
    report = compare(call, sequential)
    # The verdict policy: a correct port passes by default; exactness is stated apart ...
    assert statuses(report) == dict.fromkeys(TOLERANCE_STANDARDS, "pass") and report.verdict == "pass"
    assert not report.exact.bit_exact and report.exact.mismatched == differing > 0
    assert report.exact.share == differing / sequential.size
    # ... and decides only when required.
    required = compare(call, sequential, require_exact=True)
    assert (required.verdict, required.exact.required) == ("fail", True)
    assert statuses(required) == statuses(report)
    assert criterion(compare(call, sequential, standards=STANDARDS).verdict_of("bitwise"), "bitwise_mismatches").value == differing


def test_the_sequential_golden_is_measurably_worse_at_large_k():
    # Adding 128 same-sign values one by one loses about sqrt(K / log2 K) times more than the
    # device's 64 bins and tree (docs/accuracy.md): the benchmark says so.
    call = make_call("dropless", "float32", tokens=16, top_k=128, hidden=64, positive=True)
    sequential = moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    verdict = compare(call, sequential, standards="benchmark").verdict_of("benchmark")
    assert criterion(verdict, "rmse_ratio").value > 2
    assert verdict.status == "fail"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_a_corrupted_row_fails_and_is_the_worst(mode, name):
    call = make_call(mode, name)
    device = moe_init_routing_v2_grad(call)
    candidate = device.copy()
    candidate[7] = (candidate[7].astype(np.float32) + 1.0).astype(candidate.dtype)
    report = compare(call, candidate)
    assert report.verdict == "fail" and not report.exact.bit_exact
    for standard in ("threshold", "benchmark", "accumulative"):
        assert report.verdict_of(standard).status == "fail", standard
    assert report.candidate_vs_golden.worst.row == 7
    assert report.candidate_vs_device.worst.row == 7
    assert report.candidate_vs_device.worst.abs_error == pytest.approx(1.0, rel=2.0**-6)


def truncated_bfloat16(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The float32 sum in the device's order, rounded to bfloat16 by dropping the low 16 bits."""
    wide = call.model_copy(update={"grad_expanded_x": call.grad_expanded_x.astype(np.float32)})
    total = moe_init_routing_v2_grad(wide)
    return (total.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(BF16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("top_k", [2, 4, 8])
@pytest.mark.parametrize("positive", [False, True])
def test_truncated_bfloat16_is_caught_by_the_error_balance(mode, top_k, positive):
    call = make_call(mode, "bfloat16", top_k=top_k, positive=positive)
    report = compare(call, truncated_bfloat16(call))
    balance = criterion(report.verdict_of("benchmark"), "error_imbalance_excess")
    assert balance.assessed and balance.status == "fail"
    assert report.verdict_of("benchmark").status == "fail"
    cg = report.candidate_vs_golden
    assert cg.toward_zero_share > 0.9 * (cg.nonzero_error_count / cg.finite_count)  # nearly every error shrinks |x|
    # What does not catch it, as docs/accuracy.md explains: truncation stays within 1 ULP and
    # inside the accumulative bound.
    assert cg.ulp_error_above_1_share == 0.0
    assert report.verdict_of("accumulative").status == "pass"


@pytest.mark.parametrize("mode", ["active", "drop_pad"])
def test_skipped_rows_follow_the_mode(mode):
    call = make_call(mode, "float32")
    index = call.expanded_row_idx.reshape(-1, call.top_k)
    if mode == "drop_pad":
        expected = [all(v == -1 for v in token) for token in index.tolist()]
    else:
        expected = [all(v >= call.active_num for v in token) for token in index.tolist()]
    assert skipped_rows(call).tolist() == expected
    assert expected[0]
    candidate = moe_init_routing_v2_grad(call)
    candidate[0, 5] = -0.0
    report = compare(call, candidate)
    assert (report.zero_rows.mismatched_rows, report.zero_rows.first_mismatched_row) == (1, 0)
    assert statuses(compare(call, candidate, standards=STANDARDS)) == dict.fromkeys(STANDARDS, "fail")


def test_dropless_has_no_zero_rows():
    assert not skipped_rows(make_call("dropless", "float16")).any()


def test_an_empty_call_passes():
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.zeros((0, 8), F16),
                                    expanded_row_idx=np.zeros(0, np.int32), top_k=2)
    report = compare(call, np.zeros((0, 8), F16))
    assert report.verdict == "pass"
    assert report.candidate_vs_golden.worst is None and report.candidate_vs_golden.count == 0


def test_a_float32_candidate_for_a_bfloat16_call():
    call = make_call("dropless", "bfloat16")
    wide = call.model_copy(update={"grad_expanded_x": call.grad_expanded_x.astype(np.float32)})
    report = compare(call, moe_init_routing_v2_grad(wide))
    assert (report.dtype, report.candidate_dtype) == ("bfloat16", "float32")
    assert not report.exact.bit_exact  # unrounded float32 is not the device's bfloat16
    assert report.verdict_of("threshold").status == "pass"


# --------------------------------------------------------------------------------------------------
# Validation


def test_candidate_and_standards_are_validated():
    call = make_call("dropless", "float16")
    good = moe_init_routing_v2_grad(call)
    for bad in (good.astype(np.float64), good.astype(BF16), good[:-1], good.tolist()):
        with pytest.raises(InvalidArgument) as caught:
            compare(call, bad)
        assert (caught.value.field, caught.value.aclnn_status) == ("candidate", 161002)
    with pytest.raises(InvalidArgument) as caught:
        compare(call, good, standards=["bitwise", "exact"])
    assert caught.value.field == "standards" and "exact" in caught.value.message
    with pytest.raises(InvalidArgument):
        compare(call, good, standards=[])
    report = compare(call, good, standards=["threshold", "bitwise", "threshold"])
    assert [v.standard for v in report.verdicts] == ["bitwise", "threshold"]
    with pytest.raises(KeyError):
        report.verdict_of("benchmark")
    assert [v.standard for v in compare(call, good, standards="benchmark").verdicts] == ["benchmark"]
    with pytest.raises(ValueError, match="device_result"):
        compare(call, good, device_result=good[:-1])
    with pytest.raises(TypeError):
        compare("not a call", good)


# --------------------------------------------------------------------------------------------------
# The dict form


def test_report_round_trips_through_json_and_msgpack():
    call = make_call("drop_pad", "bfloat16")
    candidate = truncated_bfloat16(call)
    candidate[3, 3] = np.nan
    report = compare(call, candidate)
    document = report.to_dict()
    text = json.dumps(document, allow_nan=False)  # no bare NaN/inf anywhere
    assert json.loads(text) == document
    assert msgpack.unpackb(msgpack.packb(document, use_bin_type=True), raw=False) == document
    assert document["candidate_vs_golden"]["worst"]["actual"] == "nan"
    again = ComparisonReport.from_dict(json.loads(text))
    assert again.to_dict() == document
    assert isinstance(again.verdicts, tuple) and again.shape == (32, 48)
    assert math.isnan(again.candidate_vs_golden.worst.actual)


def test_non_finite_values_are_strings():
    golden = np.ones((1, 64))
    device = np.ones((1, 64), F32)  # exact: any candidate error is infinitely worse
    candidate = _ones_with(64, F32, {1 + 2.0**-20: 1})
    document = compare_arrays(candidate, device, golden).to_dict()
    (benchmark,) = [v for v in document["verdicts"] if v["standard"] == "benchmark"]
    rmse = [c for c in benchmark["criteria"] if c["measure"] == "rmse_ratio"][0]
    assert (rmse["value"], rmse["status"]) == ("inf", "fail")
    small = [c for c in benchmark["criteria"] if c["measure"] == "small_value_error_ratio"][0]
    assert (small["value"], small["assessed"]) == ("nan", False)


def test_from_dict_rejects_missing_and_mistyped_fields_and_ignores_new_ones():
    document = metrics(row([1, 2], F32), row([1, 2.5], np.float64)).to_dict()
    assert Metrics.from_dict({**document, "added_later": 1}).to_dict() == document
    with pytest.raises(ValueError, match="rmse"):
        Metrics.from_dict({k: v for k, v in document.items() if k != "rmse"})
    with pytest.raises(ValueError, match="count"):
        Metrics.from_dict({**document, "count": "four"})
    with pytest.raises(ValueError, match="relative_to"):
        Metrics.from_dict({**document, "relative_to": "elsewhere"})


def test_public_names_are_exported():
    assert accuracy.__all__ == sorted(accuracy.__all__, key=lambda name: (not name.isupper(), not name[0].isupper(), name))
    for name in set(accuracy.__all__) & set(moegrad.__all__):  # the top level re-exports the same objects
        assert getattr(moegrad, name) is getattr(accuracy, name), name
    assert {"compare", "ComparisonReport", "STANDARDS"} <= set(moegrad.__all__)


# --------------------------------------------------------------------------------------------------
# The compiled comparison agrees with the NumPy path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("special", [False, True])
def test_the_compiled_comparison_is_the_numpy_one(mode, name, special, monkeypatch):
    from moegrad.accuracy import _compare, _fused

    if not _fused.available():
        pytest.skip("numba is not installed: compare() runs the NumPy path only")
    call = make_call(mode, name, top_k=5, seed=21)
    if special:
        call.grad_expanded_x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    device = moe_init_routing_v2_grad(call)
    candidate = device.copy()
    candidate[3] = (candidate[3].astype(np.float32) * 1.01).astype(candidate.dtype)
    compiled = compare(call, candidate, standards=STANDARDS)
    monkeypatch.setattr(_compare, "_FUSED", "numpy")
    reference = compare(call, candidate, standards=STANDARDS)
    assert statuses(compiled) == statuses(reference)
    for field in ("candidate_vs_golden", "device_vs_golden", "candidate_vs_device"):
        got, want = getattr(compiled, field).to_dict(), getattr(reference, field).to_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12, abs=0.0), (field, key)
            else:
                assert got[key] == value, (field, key)


def test_warm_up_compiles_the_comparison_when_numba_is_there():
    from moegrad.accuracy import _fused

    assert accuracy.warm_up_compare() is _fused.available()


def test_the_zero_row_check_over_many_blocks_counts_every_wrong_element():
    # 3 x 65536 dropped tokens with H = 2: the check runs in blocks of 65536 elements (32768 rows).
    # Planted by hand: -0.0 in dropped row 40000 (block 2) and 1.0 in dropped rows 70000 and 131071.
    tokens, hidden = 3 * 65536, 2
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((1, 1, hidden), F32),
                                    expanded_row_idx=np.full(tokens, -1, np.int32), top_k=1, drop_pad_mode=1)
    candidate = np.zeros((tokens, hidden), F32)
    candidate[40000, 1] = -0.0
    candidate[70000, :] = 1.0
    candidate[131071, 0] = 1.0
    z = compare(call, candidate).zero_rows
    assert (z.rows, z.mismatched_rows, z.mismatched_elements, z.first_mismatched_row) == (tokens, 3, 4, 40000)


def test_a_set_stop_event_stops_the_comparison():
    import threading

    call = make_call("drop_pad", "float32")
    stop = threading.Event()
    stop.set()
    with pytest.raises(moegrad.DeadlineExceeded, match="stopped"):
        compare(call, moe_init_routing_v2_grad(call), stop=stop)
    assert compare(call, moe_init_routing_v2_grad(call), stop=threading.Event()).verdict == "pass"


@pytest.mark.parametrize("mode", ["dropless", "drop_pad"])
def test_a_comparison_on_the_calling_thread_alone_gives_the_same_report(mode):
    call = make_call(mode, "bfloat16", tokens=6000, top_k=2)  # 5 blocks of at most 1365 rows of 48
    device = moe_init_routing_v2_grad(call)
    candidate = device.copy()
    candidate.reshape(-1)[::97] = 1.0
    together = compare(call, candidate, device_result=device)
    alone = compare(call, candidate, device_result=device, parallel=False)
    assert json.dumps(alone.to_dict(), sort_keys=True) == json.dumps(together.to_dict(), sort_keys=True)
