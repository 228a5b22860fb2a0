"""The compiled comparison (moegrad.accuracy._fused_jit) against the NumPy path, row by row.

The kernel takes one of two compiled loops per row: the classified one (NaN, Inf and values over
the format's overflow) and the one for rows whose every value is finite. Oracle: the NumPy path of
:func:`moegrad.compare` (element-wise float64 arrays, no compiled code), whose metrics docs/accuracy.md
defines; counts, maxima and the worst element must be equal, sums equal to 1e-12.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import MoeInitRoutingV2GradCall
from moegrad.accuracy import _compare, _fused

pytestmark = pytest.mark.skipif(not _fused.available(), reason="numba is not installed")

FIELDS = ("candidate_vs_golden", "device_vs_golden", "candidate_vs_device")


def _both(call, candidate, monkeypatch):
    compiled = moegrad.compare(call, candidate, standards=moegrad.STANDARDS)
    with monkeypatch.context() as patch:
        patch.setattr(_compare, "_FUSED", "numpy")
        reference = moegrad.compare(call, candidate, standards=moegrad.STANDARDS)
    return compiled, reference


def _assert_same(compiled, reference):
    for field in FIELDS:
        got, want = getattr(compiled, field).to_dict(), getattr(reference, field).to_dict()
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12, abs=0.0), (field, key)
            else:
                assert got[key] == value, (field, key)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_finite_rows_beside_exceptional_rows(dtype, monkeypatch):
    rng = np.random.default_rng(5)
    tokens, top_k, hidden = 12, 3, 40
    grad = rng.standard_normal((tokens * top_k, hidden)).astype(dtype)
    index = rng.permutation(tokens * top_k).astype(np.int32)
    big = float(ml_dtypes.finfo(dtype).max)
    rows = index.reshape(tokens, top_k)
    grad[rows[2, 0], 5] = np.nan  # row 2: a NaN summand
    grad[rows[5, 0], 7] = np.inf  # row 5: an infinite summand
    grad[rows[8, 0], 9], grad[rows[8, 1], 9] = big, big  # row 8: a golden over the format's overflow
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=top_k)
    device = moegrad.moe_init_routing_v2_grad(call)
    candidate = device.copy()
    candidate[1] = (candidate[1].astype(np.float32) * 1.001).astype(dtype)
    candidate[8, 3] = np.inf  # an Inf where the device is finite, in a row that needs classifying
    _assert_same(*_both(call, candidate, monkeypatch))


def test_the_worst_element_is_the_first_of_equal_errors(monkeypatch):
    hidden = 64
    grad = np.zeros((2, hidden), dtype=np.float32)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(2, dtype=np.int32), top_k=2)
    candidate = np.zeros((1, hidden), dtype=np.float32)
    candidate[0, [17, 3, 40]] = 0.5  # three equal errors: np.argmax's order picks column 3
    compiled, reference = _both(call, candidate, monkeypatch)
    _assert_same(compiled, reference)
    assert compiled.candidate_vs_golden.worst.column == 3
    assert compiled.candidate_vs_golden.worst.abs_error == 0.5


def test_the_golden_is_correctly_rounded_where_the_compensation_rounds(monkeypatch):
    # Summands spread over more binades than float64 holds: Neumaier's compensation term itself
    # rounds (2**-62 is lost beside 2**73), and total + comp is one float64 ULP below the exact sum
    # that math.fsum, and the NumPy path's golden, round.
    values = [2.0**-62, 1.5 * 2.0**125, 1.5 * 2.0**125, 2.0**73]
    grad = np.array(values, dtype=np.float32).reshape(4, 1)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(4, dtype=np.int32), top_k=4)
    candidate = np.zeros((1, 1), dtype=np.float32)
    compiled, reference = _both(call, candidate, monkeypatch)
    _assert_same(compiled, reference)
    assert compiled.candidate_vs_golden.worst.golden == math.fsum(values)


def _frozen(array):
    array = array.copy()
    array.flags.writeable = False
    return array


def test_read_only_inputs_use_the_signatures_warm_up_compiled():
    """A request's tensors arrive read-only (viewed in its receive buffer) and numba types a
    read-only array apart from a writeable one: after warm_up_compare, judging read-only and
    writeable inputs of every kind compiles nothing more."""
    from moegrad.accuracy import _fused_jit

    assert moegrad.accuracy.warm_up_compare()
    compiled = len(_fused_jit.compare_rows.signatures)

    rng = np.random.default_rng(5)
    grad = rng.standard_normal((12, 4)).astype(np.float32)
    idx = rng.permutation(12).astype(np.int32)
    for wrap in (np.copy, _frozen):
        call = MoeInitRoutingV2GradCall(grad_expanded_x=wrap(grad), expanded_row_idx=wrap(idx), top_k=3)
        candidate = wrap(moegrad.moe_init_routing_v2_grad(grad, idx, 3))
        for device_result in (None, candidate):
            moegrad.compare(call, candidate, device_result=device_result)
    assert len(_fused_jit.compare_rows.signatures) == compiled


def test_row_errors_use_the_signatures_warm_up_compiled():
    """A report's row errors (its golden rows and its per-row figures), over read-only, writeable and
    Fortran-ordered inputs of every dtype, a candidate that has the device's bits and one that does
    not: nothing compiled after warm_up_compare."""
    from moegrad.accuracy import _fused_jit

    assert moegrad.accuracy.warm_up_compare()
    kernels = (_fused_jit._golden_rows, _fused_jit.row_figures)
    compiled = [len(kernel.signatures) for kernel in kernels]
    rng = np.random.default_rng(6)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        grad = rng.standard_normal((12, 4)).astype(dtype)
        idx = rng.permutation(12).astype(np.int32)
        for wrap in (np.copy, _frozen, np.asfortranarray):
            call = MoeInitRoutingV2GradCall(grad_expanded_x=wrap(grad), expanded_row_idx=wrap(idx), top_k=3)
            device = moegrad.moe_init_routing_v2_grad(call)
            for candidate in (device, device.astype(np.float32) * 2):
                moegrad.accuracy.row_errors(call, wrap(candidate), device_result=wrap(device))
    assert [len(kernel.signatures) for kernel in kernels] == compiled
