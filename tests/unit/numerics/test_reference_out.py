"""The reference's ``out=`` buffer and its strided inputs, against independent computations.

Expected values come from the slow per-row loops of tests/support/slow_loops.py
(written from docs/semantics.md sections 3 and 7), never from moegrad.
Memory is measured with tracemalloc (NumPy reports its allocations to it).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from moegrad import InvalidArgument, moe_init_routing_v2_grad
from moegrad.numerics import _fast, _reference
from support.bits import assert_bitwise_equal, bits
from support.inputs import F16, F32, GRAD_DTYPES, MODES, random_call
from support.slow_loops import expected_chunk, slow950, slow_grad_x

UB_BYTES = 253952  # Ascend 950PR/950DT's UB size, docs/semantics.md 7.4
ALL_ORDERS = ["ascend910b", "sequential", "ascend950", "ascend950@2025-12"]
PATHS = ["numba", "numpy"] if _fast.available() else ["numpy"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Runs a test once per path, through the module switch the public function reads."""
    monkeypatch.setattr(_reference, "_KERNEL", request.param)
    return request.param


def expected(grad, idx, top_k, drop_pad_mode, active_num, order):
    """gradX from the slow loop of the order (the 950's K chunk by docs/semantics.md 7.1, written out
    independently in tests/support, on the default UB size)."""
    if order.startswith("ascend950"):
        chunk = expected_chunk(np.dtype(grad.dtype), top_k, grad.shape[-1], UB_BYTES)
        return slow950(grad, idx, top_k, drop_pad_mode, active_num, chunk=chunk, grouped=order == "ascend950")
    return slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, order)


# --------------------------------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("top_k", [3, 8, 130])
def test_out_gives_the_same_bits_as_a_new_result(path, mode, dtype, order, top_k):
    rng = np.random.default_rng(top_k * 7 + len(mode))
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens=3, hidden=9)
    want = expected(grad, idx, top_k, drop_pad_mode, active_num, order)
    buffer = np.full(want.shape, np.nan, dtype=dtype)  # every element must be written over
    got = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order, out=buffer)
    assert got is buffer
    assert_bitwise_equal(got, want)
    fresh = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order)
    np.testing.assert_array_equal(bits(got), bits(fresh))


def test_out_is_reused_across_calls(path):
    buffer = np.empty((4, 6), dtype=F32)
    for seed in range(3):
        grad, idx, mode, active = random_call(np.random.default_rng(seed), "dropless", 8, F32, tokens=4, hidden=6)
        got = moe_init_routing_v2_grad(grad, idx, 8, mode, active, out=buffer)
        assert got is buffer
        assert_bitwise_equal(buffer, slow_grad_x(grad, idx, 8))


def test_out_for_an_empty_result():
    grad = np.zeros((0, 4), dtype=F16)
    buffer = np.empty((0, 4), dtype=F16)
    assert moe_init_routing_v2_grad(grad, np.zeros(0, dtype=np.int32), 2, out=buffer) is buffer


def _call_args():
    rng = np.random.default_rng(1)
    grad, idx, mode, active = random_call(rng, "dropless", 2, F32, tokens=3, hidden=4)
    return grad, idx, 2, mode, active


@pytest.mark.parametrize("buffer, status", [
    (np.empty((3, 4), dtype=F16), 161002),  # another dtype
    (np.empty((3, 4), dtype=">f4"), 161002),  # not native byte order
    (np.empty((4, 3), dtype=F32), 561103),  # another shape: the default profile's (CANN 9.1) shape code
    (np.empty((12,), dtype=F32), 561103),
], ids=["dtype", "byte-order", "shape", "rank"])
def test_out_with_another_dtype_or_shape_is_invalid_argument(buffer, status):
    with pytest.raises(InvalidArgument) as caught:
        moe_init_routing_v2_grad(*_call_args(), out=buffer)
    assert caught.value.aclnn_status == status
    assert caught.value.field == "grad_x"
    assert "out." in caught.value.message


def test_out_layout_rules_are_value_errors():
    grad, idx, top_k, _, _ = _call_args()
    with pytest.raises(ValueError, match="C-contiguous"):
        moe_init_routing_v2_grad(grad, idx, top_k, out=np.empty((4, 3), dtype=F32).T)
    read_only = np.empty((3, 4), dtype=F32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        moe_init_routing_v2_grad(grad, idx, top_k, out=read_only)
    with pytest.raises(ValueError, match="share memory"):
        moe_init_routing_v2_grad(grad, idx, top_k, out=grad[:3])
    with pytest.raises(TypeError, match="numpy.ndarray"):
        moe_init_routing_v2_grad(grad, idx, top_k, out=[[0.0] * 4] * 3)


# --------------------------------------------------------------------------------------------------
# Strided inputs: only the referenced rows are gathered.
# --------------------------------------------------------------------------------------------------

def strided_views(grad: np.ndarray) -> list[np.ndarray]:
    """Non-contiguous views with grad's values: every other element of a wider array, a transposed
    copy viewed back, rows of a bigger array taken every third one."""
    wide = np.empty((*grad.shape[:-1], 2 * grad.shape[-1]), dtype=grad.dtype)
    wide[..., ::2] = grad
    transposed = np.ascontiguousarray(np.moveaxis(grad, -1, 0))
    spaced = np.empty((3 * grad.shape[0], *grad.shape[1:]), dtype=grad.dtype)
    spaced[::3] = grad
    views = [wide[..., ::2], np.moveaxis(transposed, 0, -1), spaced[::3]]
    assert not any(view.flags.c_contiguous for view in views)
    return views


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs_give_the_bits_of_their_contiguous_copy(path, mode, dtype, order):
    rng = np.random.default_rng(len(mode) + 3 * len(order))
    top_k = 6
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens=4, hidden=5)
    want = expected(grad, idx, top_k, drop_pad_mode, active_num, order)
    for view in strided_views(grad):
        got = moe_init_routing_v2_grad(view, idx, top_k, drop_pad_mode, active_num, order=order)
        assert_bitwise_equal(got, want)
        contiguous = moe_init_routing_v2_grad(np.ascontiguousarray(view), idx, top_k, drop_pad_mode, active_num,
                                              order=order)
        np.testing.assert_array_equal(bits(got), bits(contiguous))


def test_strided_input_whose_slots_are_all_skipped(path):
    grad = np.ones((2, 3, 8), dtype=F32)[:, :, ::2]
    idx = np.full(4, -1, dtype=np.int32)
    got = moe_init_routing_v2_grad(grad, idx, 2, 1)
    np.testing.assert_array_equal(bits(got), np.zeros((2, 4), dtype=np.uint32))


@pytest.mark.parametrize("order", ["ascend910b", "ascend950"])
def test_a_small_overlapping_view_of_a_big_grad_costs_about_its_referenced_rows(path, order):
    experts, capacity, hidden = 64, 1024, 256  # a 64 MiB [E, C, H] float32 view of a 1 MiB array
    base = np.random.default_rng(3).standard_normal((capacity, hidden)).astype(F32)
    view = as_strided(base, shape=(experts, capacity, hidden), strides=(0, *base.strides), writeable=False)
    rng = np.random.default_rng(4)
    tokens, top_k = 16, 4
    idx = rng.choice(experts * capacity, size=tokens * top_k, replace=False).astype(np.int32)
    idx[rng.random(idx.size) < 0.25] = -1
    referenced_bytes = int(np.count_nonzero(idx >= 0)) * hidden * F32.itemsize  # 48 rows: about 48 KiB
    out = np.empty((tokens, hidden), dtype=F32)
    moe_init_routing_v2_grad(view, idx, top_k, 1, order=order, out=out)  # compile, pool threads
    tracemalloc.start()
    try:
        moe_init_routing_v2_grad(view, idx, top_k, 1, order=order, out=out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * referenced_bytes + (256 << 10), f"peak {peak} bytes for {referenced_bytes} referenced bytes"
    flat = base[np.where(idx >= 0, idx % capacity, 0)]  # the rows the slots read (row e*C + c is base[c])
    compact = np.where((idx >= 0)[:, None], flat, 0).astype(F32)
    # the same sums on an equivalent contiguous [rows, H] input: each slot its own row, -1 kept
    dense_idx = np.where(idx >= 0, np.arange(idx.size), -1).astype(np.int32)
    want = expected(compact.reshape(idx.size, 1, hidden), dense_idx, top_k, 1, 0, order)
    assert_bitwise_equal(out, want)
