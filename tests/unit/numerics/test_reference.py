"""moegrad's reference numerics against independent computations (docs/semantics.md sections 2-5).

The expected values here never come from moegrad: a slow per-row loop written from docs/semantics.md
section 3 (bins, S1-S4, skip rules), a float32 -> float16/bfloat16 rounding written from the
IEEE 754 definition, math.fsum, an exhaustive enumeration of add-trees, and the numbers of the
operator documentation's example.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import moegrad.numerics._reference
from moegrad import InvalidArgument, moe_init_routing_v2_grad, moe_init_routing_v2_grad_golden
from support import routing
from support.bits import assert_bitwise_equal, bits
from support.docexample import DOC_GRAD, DOC_IDX
from support.inputs import BF16, F16, F32, GRAD_DTYPES, KS, MODES, ORDERS, random_call, wide_values
from support.slow_loops import (
    device_order_row,
    double_factorial,
    every_add_tree,
    round_from_float32,
    sequential_row,
    slow_grad_x,
)

# --------------------------------------------------------------------------------------------------
# The slow loop, checked on a few cases by hand, before it is trusted.
# --------------------------------------------------------------------------------------------------

def test_rounding_helper_ties_to_even():
    # float16: ulp(1) = 2**-10, so 1 + 2**-11 is a tie (-> 1.0) and 1 + 3*2**-11 a tie (-> 1 + 2**-9).
    assert round_from_float32(np.float32(1 + 2**-11), F16) == 1.0
    assert round_from_float32(np.float32(1 + 3 * 2**-11), F16) == 1 + 2**-9
    assert round_from_float32(np.float32(65519.0), F16) == 65504.0
    assert math.isinf(float(round_from_float32(np.float32(65520.0), F16)))
    assert round_from_float32(np.float32(2**-25), F16) == 0.0  # a tie with 0 -> +0
    assert round_from_float32(np.float32(3 * 2**-26), F16) == 2**-24  # above the tie -> smallest subnormal
    # bfloat16: ulp(1) = 2**-7.
    assert round_from_float32(np.float32(1 + 2**-8), BF16) == 1.0
    assert round_from_float32(np.float32(1 + 3 * 2**-8), BF16) == 1 + 2**-6
    assert np.signbit(round_from_float32(np.float32(-(2**-140)), BF16))


def test_slow_loop_orders_by_hand():
    v = [np.array([x], dtype=np.float32) for x in (1.0, 2.0**-24, 3 * 2.0**-24, 2.0**-23, 5.0, 7.0)]
    assert device_order_row(v[:3], 1)[0] == (v[0] + v[2]) + v[1]
    k6 = device_order_row(v, 1)[0]
    assert k6 == ((((v[0] + v[4]) + v[1]) + v[5]) + (v[2] + v[3]))[0]
    assert sequential_row([None, v[1]], 1)[0] == v[1][0]
    assert not np.signbit(device_order_row([None, None], 1)[0])


# --------------------------------------------------------------------------------------------------
# The documentation's example.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
def test_documentation_example(order):
    out = moe_init_routing_v2_grad(DOC_GRAD, DOC_IDX, 2, 0, 0, order=order)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    expected = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32)
    np.testing.assert_array_equal(bits(out), bits(expected))
    assert bits(out)[0, 0] == np.float32(0.3).view(np.uint32)
    assert bits(out)[1, 0] == np.float32(0.70000005).view(np.uint32)


# --------------------------------------------------------------------------------------------------
# The vectorised reference against the slow loop: modes x dtypes x K x orders.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("top_k", KS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_reference_matches_slow_loop(mode, dtype, top_k, order):
    rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), top_k, ORDERS.index(order)])
    tokens = 3 if top_k >= 127 else 5
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden=6)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, order))
    assert out.flags.c_contiguous


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_many_rows_over_several_chunks(dtype):
    # 4096 tokens x 96 hidden x 4 bins of float32 is more than one chunk: the chunked/threaded path.
    rng = np.random.default_rng(7)
    top_k, tokens, hidden = 8, 4096, 96
    grad = wide_values(rng, (tokens * top_k, hidden), dtype, top_k)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    assert_bitwise_equal(moe_init_routing_v2_grad(grad, idx, top_k), slow_grad_x(grad, idx, top_k))


def test_byte_order_and_strides_do_not_change_the_result():
    rng = np.random.default_rng(11)
    top_k, tokens, hidden = 6, 5, 7
    grad = wide_values(rng, (tokens * top_k, 2 * hidden), F32, top_k)[:, ::2]  # non-contiguous
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    expected = slow_grad_x(grad, idx, top_k)
    assert_bitwise_equal(moe_init_routing_v2_grad(grad, idx, top_k), expected)
    out = moe_init_routing_v2_grad(grad.astype(">f4"), idx.astype(">i4"), top_k)
    assert out.dtype.isnative
    assert_bitwise_equal(out, expected)


# --------------------------------------------------------------------------------------------------
# Hand-derived orders: K=3, 6, 8, proved unique among every order of adds.
# --------------------------------------------------------------------------------------------------

HAND_ORDERS = {
    3: lambda v: (v[0] + v[2]) + v[1],
    6: lambda v: (((v[0] + v[4]) + v[1]) + v[5]) + (v[2] + v[3]),
    8: lambda v: ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])),
}


@pytest.mark.parametrize("top_k", sorted(HAND_ORDERS))
def test_hand_derived_order_is_the_only_order_that_fits(top_k):
    # 32 columns of values over 26 binades: chosen (seeded) so that every add rounds; the test then
    # shows that no other tree of adds reproduces the documented order's 32 results.
    rng = np.random.default_rng(2024)
    exponent = rng.integers(-26, 1, (top_k, 32))
    values = (rng.choice([-1.0, 1.0], (top_k, 32)) * (1 + rng.random((top_k, 32))) * np.exp2(exponent)).astype(np.float32)
    out = moe_init_routing_v2_grad(values, np.arange(top_k, dtype=np.int32), top_k)
    expected = HAND_ORDERS[top_k](values)
    np.testing.assert_array_equal(bits(out[0]), bits(expected))

    every = every_add_tree(values)
    assert every.shape[0] == double_factorial(2 * top_k - 3)  # 3, 945, 135135: the enumeration is complete
    matches = np.all(bits(every) == bits(expected)[None, :], axis=1)
    assert int(matches.sum()) == 1, "another order of adds gives the same float32 results"

    sequential = np.zeros(32, dtype=np.float32)
    for t in range(top_k):
        sequential = sequential + values[t]
    assert (bits(sequential) != bits(out[0])).any()
    np.testing.assert_array_equal(bits(moe_init_routing_v2_grad(values, np.arange(top_k, dtype=np.int32), top_k,
                                                                order="sequential")[0]), bits(sequential))


def test_k3_order_on_small_numbers():
    # ulp(1) = 2**-23. v0 = 1, v1 = -2**-24, v2 = 3*2**-24:
    # (v0+v2)+v1: 1 + 3*2**-24 is a tie -> 1 + 2**-22 (even); + v1 = 1 + 3*2**-24 again -> 1 + 2**-22.
    # (v0+v1)+v2: 1 - 2**-24 is exact (ulp below 1 is 2**-24); + v2 = 1 + 2**-23 exactly.
    # (v1+v2)+v0: 2**-23 exactly; + 1 = 1 + 2**-23 exactly.
    v = np.array([[1.0], [-(2.0**-24)], [3 * 2.0**-24]], dtype=np.float32)
    out = moe_init_routing_v2_grad(v, np.arange(3, dtype=np.int32), 3)
    assert out[0, 0] == np.float32(1 + 2**-22)
    seq = moe_init_routing_v2_grad(v, np.arange(3, dtype=np.int32), 3, order="sequential")
    assert seq[0, 0] == np.float32(1 + 2**-23)


# --------------------------------------------------------------------------------------------------
# sequential vs ascend910b.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [3, 4, 5, 8, 16, 17, 128, 256])
def test_sequential_differs_from_device_order_for_float32(top_k):
    rng = np.random.default_rng(top_k)
    tokens, hidden = 128, 16
    grad = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    device = moe_init_routing_v2_grad(grad, idx, top_k)
    sequential = moe_init_routing_v2_grad(grad, idx, top_k, order="sequential")
    differ = float(np.mean(bits(device) != bits(sequential)))
    assert differ > 0.15, f"only {differ:.0%} of elements differ at K={top_k}"
    assert_bitwise_equal(sequential, slow_grad_x(grad, idx, top_k, order="sequential"))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("top_k", [1, 2])
def test_sequential_equals_device_order_for_k_up_to_2(top_k, dtype):
    # Without -0.0 (0.0 + -0.0 = +0.0 is the one difference: see test_negative_zero_row).
    rng = np.random.default_rng(top_k)
    tokens, hidden = 256, 16
    grad = wide_values(rng, (tokens * top_k, hidden), dtype, top_k)
    grad[np.signbit(grad.astype(np.float32)) & (grad.astype(np.float32) == 0)] = 0.0
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    assert_bitwise_equal(moe_init_routing_v2_grad(grad, idx, top_k, order="sequential"),
                         moe_init_routing_v2_grad(grad, idx, top_k))


# --------------------------------------------------------------------------------------------------
# Zero signs, skip rules, empty tensors.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("top_k", [1, 2, 3, 8, 128, 130])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_all_skipped_row_is_positive_zero(dtype, top_k, order):
    # drop/pad: token 0 dropped everywhere; active: token 0's rows were never materialised.
    grad = np.full((2, top_k, 3), -0.0, dtype=dtype)
    idx = np.concatenate([np.full(top_k, -1), np.arange(top_k)]).astype(np.int32)
    out = moe_init_routing_v2_grad(grad, idx, top_k, 1, order=order)
    np.testing.assert_array_equal(bits(out[0]), np.zeros(3, dtype=bits(out).dtype))

    active = np.full((top_k, 3), -0.0, dtype=dtype)
    idx = np.concatenate([np.arange(top_k, 2 * top_k), np.arange(top_k)]).astype(np.int32)
    out = moe_init_routing_v2_grad(active, idx, top_k, 0, top_k, order=order)
    np.testing.assert_array_equal(bits(out[0]), np.zeros(3, dtype=bits(out).dtype))


@pytest.mark.parametrize("top_k", [1, 2, 3, 6, 8, 127, 128, 130, 256])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_negative_zero_row(dtype, top_k):
    grad = np.full((top_k, 4), -0.0, dtype=dtype)
    idx = np.arange(top_k, dtype=np.int32)
    device = moe_init_routing_v2_grad(grad, idx, top_k)
    assert np.all(np.signbit(device.astype(np.float32))) and np.all(device.astype(np.float32) == 0)
    sequential = moe_init_routing_v2_grad(grad, idx, top_k, order="sequential")
    assert not np.any(np.signbit(sequential.astype(np.float32)))  # +0.0 + -0.0 = +0.0


def test_skipped_first_slot_contributes_positive_zero():
    # K=2, B=1: S1 sets bin 0 to +0.0 for the dropped slot 0, then adds -0.0: +0.0.
    grad = np.full((1, 2, 1), -0.0, dtype=np.float32)
    out = moe_init_routing_v2_grad(grad, np.array([-1, 1, 0, -1], dtype=np.int32), 2, 1)
    assert not np.signbit(out[0, 0]) and np.signbit(out[1, 0])


def test_active_mode_skips_rows_at_or_past_active_num():
    # A = 3 materialised rows; N*K = 6 so indices 3, 4, 5 are valid but skipped.
    grad = np.array([[1.0], [2.0], [4.0]], dtype=np.float32)
    idx = np.array([0, 5, 2, 1, 3, 4], dtype=np.int32)
    out = moe_init_routing_v2_grad(grad, idx, 2, 0, 3)
    np.testing.assert_array_equal(out, np.array([[1.0], [6.0], [0.0]], dtype=np.float32))


def test_drop_pad_mode_skips_minus_one_and_reads_e_c_flat():
    # [E=2, C=2, H=1]: rows e*C + c are 1, 2, 4, 8; active_num is ignored in this mode.
    grad = np.array([[[1.0], [2.0]], [[4.0], [8.0]]], dtype=np.float32)
    idx = np.array([-1, 3, 0, 2, -1, -1], dtype=np.int32)
    out = moe_init_routing_v2_grad(grad, idx, 2, 1, 0)
    np.testing.assert_array_equal(out, np.array([[8.0], [5.0], [0.0]], dtype=np.float32))
    np.testing.assert_array_equal(moe_init_routing_v2_grad(grad, idx, 2, 1, 1), out)


EMPTY_CASES = {
    # name: (grad shape, expanded_row_idx, top_k, drop_pad_mode, active_num, expected [N, H])
    "dropless N=0": ((0, 4), [], 2, 0, 0, (0, 4)),
    "dropless H=0": ((6, 0), [5, 0, 1, 2, 3, 4], 2, 0, 0, (3, 0)),
    "active N=0": ((3, 4), [], 2, 0, 3, (0, 4)),
    "active H=0": ((3, 0), [5, 0, 1, 2, 3, 4], 2, 0, 3, (3, 0)),
    "drop/pad N=0": ((2, 3, 4), [], 2, 1, 0, (0, 4)),
    "drop/pad H=0": ((2, 3, 0), [-1, 0, 5, -1, 2, 1], 2, 1, 0, (3, 0)),
    "drop/pad E*C=0, all dropped": ((0, 3, 4), [-1] * 6, 2, 1, 0, (3, 4)),
    "drop/pad E=2, C=0, all dropped": ((2, 0, 4), [-1] * 6, 2, 1, 0, (3, 4)),
    "drop/pad huge E*C, H=0": ((10**6, 10**6, 0), [-1, 0, 2_147_483_647, -1, 2, 1], 2, 1, 0, (3, 0)),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_empty_inputs(case, dtype, order):
    grad_shape, index, top_k, mode, active, expected_shape = EMPTY_CASES[case]
    grad = np.zeros(grad_shape, dtype=dtype)
    idx = np.array(index, dtype=np.int32)
    out = moe_init_routing_v2_grad(grad, idx, top_k, mode, active, order=order)
    assert out.shape == expected_shape and out.dtype == dtype
    np.testing.assert_array_equal(bits(out), np.zeros(expected_shape, dtype=bits(out).dtype))  # +0.0
    golden = moe_init_routing_v2_grad_golden(grad, idx, top_k, mode, active)
    assert golden.shape == expected_shape and golden.dtype == np.float64


def test_reference_validates_its_input():
    with pytest.raises(InvalidArgument) as info:
        moe_init_routing_v2_grad(np.zeros((4, 2), np.float32), np.array([0, 1, 2, 4], np.int32), 2)
    assert info.value.aclnn_status == 161002 and info.value.field == "expanded_row_idx"
    with pytest.raises(InvalidArgument):
        moe_init_routing_v2_grad(np.zeros((4, 2), np.float32), np.arange(4, dtype=np.int32), 2, order="pairwise")


def test_duplicates_allowed_when_asked_sum_each_use():
    grad = np.array([[1.0], [2.0], [4.0], [8.0]], dtype=np.float32)
    idx = np.array([3, 3, 0, 3], dtype=np.int32)
    out = moe_init_routing_v2_grad(grad, idx, 2, allow_duplicate_indices=True)
    np.testing.assert_array_equal(out, np.array([[16.0], [9.0]], dtype=np.float32))


@pytest.mark.parametrize("path", ["numpy", "auto", "golden"])
def test_no_n_k_h_intermediate(path, monkeypatch):
    # [N, K, H] float32 would be 32 MiB; the call's traced NumPy allocations must stay far below it.
    # tracemalloc sees NumPy's allocations only, so the NumPy path (and the float64 golden, always
    # NumPy) is run explicitly: the compiled path's buffers are invisible to it.
    if path == "numpy":
        monkeypatch.setattr(moegrad.numerics._reference, "_KERNEL", "numpy")
    function = moe_init_routing_v2_grad_golden if path == "golden" else moe_init_routing_v2_grad
    rng = np.random.default_rng(3)
    tokens, top_k, hidden = 2048, 64, 64
    grad = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    function(grad[:top_k], np.arange(top_k, dtype=np.int32), top_k)  # compile (or load) the kernel before tracing
    tracemalloc.start()
    try:
        out = function(grad, idx, top_k)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < tokens * top_k * hidden * 4 // 2 + out.nbytes


# --------------------------------------------------------------------------------------------------
# Inputs from a forward routing.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 2, 3, 6, 8, 17, 128, 130])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_forward_routing_inputs_match_slow_loop(mode, dtype, top_k):
    rng = np.random.default_rng([MODES.index(mode), top_k, GRAD_DTYPES.index(dtype), 99])
    experts = max(8, top_k + 3)
    r = routing.route(rng, tokens=4, top_k=top_k, experts=experts, mode=mode)
    grad = wide_values(rng, r.grad_shape(hidden=5), dtype, top_k)
    out = moe_init_routing_v2_grad(grad, **r.kwargs())
    assert_bitwise_equal(out, slow_grad_x(grad, r.expanded_row_idx, top_k, r.drop_pad_mode, r.active_num))


def test_routing_generator_follows_a_stable_expert_sort():
    expert_ids = np.array([[2, 0], [0, 1], [2, 1]], dtype=np.int32)
    # Slots by expert, token order kept: expert 0: slots 1, 2; expert 1: 3, 5; expert 2: 0, 4.
    np.testing.assert_array_equal(routing.dropless_index(expert_ids), [4, 0, 1, 2, 5, 3])
    # Capacity 1: each expert keeps its first slot at row e*1 + 0; the rest are dropped.
    np.testing.assert_array_equal(routing.drop_pad_index(expert_ids, 3, 1), [2, 0, -1, 1, -1, -1])
    rng = np.random.default_rng(0)
    r = routing.route(rng, tokens=50, top_k=4, experts=16, mode="drop_pad", capacity=5)
    kept = r.expanded_row_idx[r.expanded_row_idx >= 0]
    assert np.unique(kept).size == kept.size
    np.testing.assert_array_equal(kept // 5, r.expert_ids.reshape(-1)[r.expanded_row_idx >= 0])


# --------------------------------------------------------------------------------------------------
# The float64 golden.
# --------------------------------------------------------------------------------------------------

def fsum_grad_x(grad, idx, top_k, drop_pad_mode=0, active_num=0) -> np.ndarray:
    hidden = grad.shape[-1]
    flat = grad.reshape(-1, hidden).astype(np.float64)
    tokens = idx.shape[0] // top_k
    out = np.zeros((tokens, hidden))
    for i in range(tokens):
        used = [int(j) for j in idx[i * top_k:(i + 1) * top_k]
                if not (j == -1 if drop_pad_mode == 1 else (active_num > 0 and j >= active_num))]
        for h in range(hidden):
            out[i, h] = math.fsum(flat[j, h] for j in used)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("top_k", [1, 3, 8, 17, 130])
def test_golden_is_the_exact_sum(mode, dtype, top_k):
    # Over 16 binades (24-bit mantissas, K <= 130) every float64 partial sum is exact: golden == fsum.
    rng = np.random.default_rng([top_k, GRAD_DTYPES.index(dtype), MODES.index(mode), 5])
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, F32, 4, 5)
    grad = (rng.choice([-1.0, 1.0], grad.shape) * (1 + rng.random(grad.shape))
            * np.exp2(rng.integers(-8, 8, grad.shape).astype(np.float64))).astype(dtype)
    golden = moe_init_routing_v2_grad_golden(grad, idx, top_k, drop_pad_mode, active_num)
    assert golden.dtype == np.float64
    np.testing.assert_array_equal(golden, fsum_grad_x(grad, idx, top_k, drop_pad_mode, active_num))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("top_k", [2, 3, 8, 64, 256])
def test_golden_is_correctly_rounded_over_the_whole_range(top_k, dtype, mode):
    # Values from 2**-149 to 2**127 in near-cancelling pairs: float64 partial sums are not exact here,
    # yet the golden must still be the correctly rounded exact sum, which math.fsum computes.
    rng = np.random.default_rng([top_k, GRAD_DTYPES.index(dtype), MODES.index(mode), 6])
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, F32, 6, 8)
    exponent = rng.integers(-149, 127, grad.shape).astype(np.float64)
    values = (rng.choice([-1.0, 1.0], grad.shape) * (1 + rng.random(grad.shape)) * np.exp2(exponent)).astype(dtype)
    flat = values.reshape(-1, 8)
    flat[1::2] = -(flat[0::2][: flat[1::2].shape[0]].astype(np.float32) * np.float32(1 + 2**-6)).astype(dtype)
    golden = moe_init_routing_v2_grad_golden(values, idx, top_k, drop_pad_mode, active_num)
    np.testing.assert_array_equal(golden, fsum_grad_x(values, idx, top_k, drop_pad_mode, active_num))


def test_golden_when_the_compensation_term_itself_rounds():
    # float64 cannot hold 2**100 + 2**40 + 2**-60 at once; the exact sum of the five is 2**-60.
    values = np.array([[2.0**100], [2.0**40], [2.0**-60], [-(2.0**100)], [-(2.0**40)]], dtype=np.float32)
    golden = moe_init_routing_v2_grad_golden(values, np.arange(5, dtype=np.int32), 5)
    assert golden[0, 0] == 2.0**-60


def test_golden_special_values():
    inf, nan = np.inf, np.nan
    grad = np.array([[inf], [1.0], [inf], [-inf], [nan], [2.0], [-0.0], [-0.0]], dtype=np.float32)
    golden = moe_init_routing_v2_grad_golden(grad, np.arange(8, dtype=np.int32), 2)
    np.testing.assert_array_equal(golden[:3, 0], [inf, nan, nan])
    assert golden[3, 0] == 0.0
