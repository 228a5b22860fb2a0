"""The any-order error bound of ``moegrad.explain`` (``moegrad.accuracy._bound.sum_bound``, per element).

Oracles: gamma and the ULPs by hand from their definitions (docs/accuracy.md, "The any-order
bound"); the exact sum from ``math.fsum``; the orders of adds from the slow loops of
``support.slow_loops`` (every device profile, every add tree for small K) and ``support.planted``
(sequential, reversed, pairwise, Kahan, float64, float16/bfloat16 accumulation), none of which
import moegrad. The property tested: every schedule's result lies within the bound of the exact
sum, on random inputs, inputs that cancel, and inputs spread over many binades.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from moegrad.accuracy._bound import UNIT_ROUNDOFF, gamma, ordinal, sum_bound, ulp
from support import planted
from support.inputs import BF16, F16, F32
from support.slow_loops import SLOW_PROFILES, every_add_tree, expected_chunk, slow_profile

NAMES = {F16: "float16", BF16: "bfloat16", F32: "float32"}


def test_gamma_from_its_definition():
    u = 2.0**-24
    assert UNIT_ROUNDOFF == u
    assert gamma(0) == 0.0
    assert gamma(1) == u / (1 - u)
    assert gamma(7) == 7 * u / (1 - 7 * u)
    assert gamma(-3) == 0.0  # no summand, no rounding
    assert math.isinf(float(gamma(2**24)))  # n*u >= 1: no bound


def test_ulp_by_hand():
    assert ulp(np.array([1.0]), "float32")[0] == 2.0**-23
    assert ulp(np.array([1.5]), "float16")[0] == 2.0**-10
    assert ulp(np.array([-3.0]), "bfloat16")[0] == 2.0**-6  # 3 is in [2, 4): 2^(1-7)
    assert ulp(np.array([0.0]), "float16")[0] == 2.0**-24  # zero: the smallest subnormal
    assert ulp(np.array([2.0**-20]), "float16")[0] == 2.0**-24  # subnormal range
    assert np.isnan(ulp(np.array([np.inf]), "float32")[0])


def test_ordinal_counts_representable_values_between():
    values = np.array([-1.0, -0.0, 0.0, 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))], dtype=np.float32)
    steps = ordinal(values)
    assert steps[1] == steps[2] == 0  # +0.0 and -0.0 are the same point
    assert steps[4] - steps[3] == 1
    assert steps[3] - steps[0] == 2 * 0x3F800000


def test_the_bound_of_a_hand_example_is_reached():
    # K = 3 in float32, the chain: (1 + 2^-24) rounds to 1 (a tie, to even), + 2^-24 again: 1.
    # The exact sum is 1 + 2^-23, so the error is 2^-23; gamma_2 * (1 + 2^-23) is just above it.
    error = 2.0**-23
    bound = sum_bound(np.array([1.0 + 2.0**-23]), np.array([3]), np.array([1.0]), "float32")[0]
    assert error <= bound < error * (1 + 2.0**-20)


def test_the_final_cast_adds_half_an_ulp_of_the_output():
    # one summand: no add, no rounding in float32; the cast to float16 rounds by at most half an ULP
    bound = sum_bound(np.array([1.0]), np.array([1]), np.array([1.0]), "float16")[0]
    assert bound == pytest.approx(2.0**-11, rel=1e-12)
    assert sum_bound(np.array([1.0]), np.array([1]), np.array([1.0]), "float32")[0] < 2.0**-48


def _inputs(rng: np.random.Generator, kind: str, top_k: int, hidden: int, dtype: np.dtype) -> np.ndarray:
    """[K, H] summands of ``dtype``: normal, spread over many binades, or cancelling pairs."""
    if kind == "normal":
        raw = rng.standard_normal((top_k, hidden))
    elif kind == "wide":  # over 24 binades for float16 (its whole normal range), 40 for the others
        low, high = (-12, 8) if dtype == F16 else (-20, 20)
        raw = rng.standard_normal((top_k, hidden)) * np.exp2(rng.integers(low, high, (top_k, hidden)))
    else:  # pairs x, -x * (1 + tiny), so the partial sums are large and the sum small
        half = rng.standard_normal(((top_k + 1) // 2, hidden)) * np.exp2(rng.integers(-4, 12, ((top_k + 1) // 2, hidden)))
        raw = np.concatenate([half, -half * (1 + rng.random(half.shape) * 2.0**-12)])[:top_k]
        raw = raw[rng.permutation(top_k)]
    return planted.round_to(raw, dtype)  # exactly the dtype's values, kept as float64


def _check(values: np.ndarray, result: np.ndarray, dtype: np.dtype, count: int | None = None) -> None:
    """result [H] lies within the bound of the exact sum of values [K, H] (each column)."""
    exact = np.array([math.fsum(values[:, h]) for h in range(values.shape[1])])
    magnitude = np.array([math.fsum(np.abs(values[:, h])) for h in range(values.shape[1])])
    n = values.shape[0] if count is None else count
    bound = sum_bound(magnitude, np.array(n), result, NAMES[dtype])
    finite = np.isfinite(result)
    assert (np.abs(result - exact)[finite] <= bound[finite]).all(), (np.abs(result - exact) / bound).max()


@pytest.mark.parametrize("kind", ["normal", "wide", "cancelling"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: NAMES[d])
@pytest.mark.parametrize("top_k", [2, 3, 5, 8, 16, 130])
def test_every_schedule_lies_within_the_bound(kind, dtype, top_k):
    rng = np.random.default_rng(top_k * 7 + len(kind))
    hidden = 24
    values = _inputs(rng, kind, top_k, hidden, dtype)
    rows = [values[t] for t in range(top_k)]
    grad = values.astype(dtype)
    index = np.arange(top_k, dtype=np.int32)
    with np.errstate(all="ignore"):
        for profile in SLOW_PROFILES:  # every device profile's documented order
            chunk = expected_chunk(dtype, top_k, hidden, 253952)
            result = slow_profile(grad, index, top_k, profile=profile, chunk=chunk)[0].astype(np.float64)
            _check(values, result, dtype)
        for order in (
            planted.chain_row(rows, planted.add32, hidden),
            planted.chain_row(rows[::-1], planted.add32, hidden),
            planted.pairwise_row(rows, planted.add32, hidden),
            planted.kahan_row(rows, hidden),
            planted.float64_row(rows, hidden),
        ):
            _check(values, planted.round_to(order, dtype), dtype)


@pytest.mark.parametrize("top_k", [3, 4, 5, 6])
def test_every_tree_of_adds_lies_within_the_bound(top_k):
    rng = np.random.default_rng(top_k)
    values = _inputs(rng, "cancelling" if top_k % 2 else "wide", top_k, 6, F32)
    trees = every_add_tree(values.astype(np.float32)).astype(np.float64)
    for result in trees:
        _check(values, result, F32)


def test_skipped_slots_do_not_count_as_summands():
    values = np.array([[1.0], [2.0**-24], [2.0**-24]])
    result = np.array([1.0])  # (1 + 2^-24) + 2^-24 in the chain
    _check(values, result, F32)
    # had the skipped slots been counted, the bound would be looser, never tighter
    assert sum_bound(np.array([1.0]), np.array(5), result, "float32")[0] > sum_bound(
        np.array([1.0]), np.array(3), result, "float32"
    )[0]


def test_a_narrower_accumulator_leaves_the_bound():
    """The bound is tight enough to tell precision apart: float16 accumulation of K = 16 summands
    of normal values leaves it in most columns of a float32 call."""
    rng = np.random.default_rng(5)
    values = _inputs(rng, "normal", 16, 64, F32)
    rows = [planted.round_to(values[t], F16) for t in range(16)]
    narrow = planted.chain_row(rows, planted.narrow_add(F16), 64)
    exact = np.array([math.fsum(values[:, h]) for h in range(64)])
    magnitude = np.array([math.fsum(np.abs(values[:, h])) for h in range(64)])
    outside = np.abs(narrow - exact) > sum_bound(magnitude, np.array(16), narrow, "float32")
    assert outside.mean() > 0.5
