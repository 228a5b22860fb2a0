"""Many small calls computed as one (``moe_init_routing_v2_grad_many``), bit for bit each call's own.

Expected values come from the independent slow loops (docs/semantics.md sections 2 and 7.2:
tests/support/slow_loops.py) and from the documentation's example,
never from the function under test; both kernel paths (compiled and NumPy) run every case.
"""

from __future__ import annotations

import numpy as np
import pytest

from moegrad import InvalidArgument, MoeInitRoutingV2GradCall
from moegrad.numerics import _reference, _reference_many
from moegrad.numerics._reference_many import moe_init_routing_v2_grad_group, moe_init_routing_v2_grad_many
from moegrad.operator._call import CallGroup
from support.bits import assert_bitwise_equal
from support.docexample import DOC_GRAD, DOC_IDX
from support.inputs import GRAD_DTYPES, MODES, random_call
from support.slow_loops import SLOW_ALIASES, SLOW_PROFILES, expected_chunk, slow_profile

UB_BYTES = 253952  # Ascend 950PR/950DT's UB size, docs/semantics.md 7.4
ALL_ORDERS = [*SLOW_PROFILES, *SLOW_ALIASES]  # every device profile, and every alias


@pytest.fixture(params=["numba", "numpy"])
def path(request, monkeypatch):
    if request.param == "numba":
        pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")
    monkeypatch.setattr(_reference, "_KERNEL", request.param)
    return request.param


def slow(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """The call's grad_x from the slow loop of its order (the 950's K chunk by docs/semantics.md 7.1,
    written out independently in tests/support, on the default UB size)."""
    grad, idx = call.grad_expanded_x, call.expanded_row_idx
    chunk = None
    if call.order.startswith("ascend950"):
        chunk = expected_chunk(np.dtype(grad.dtype), call.top_k, call.hidden_size, UB_BYTES)
    return slow_profile(grad, idx, call.top_k, call.drop_pad_mode, call.active_num, profile=call.order, chunk=chunk)


def mixed_calls(seed: int, count: int) -> list[MoeInitRoutingV2GradCall]:
    """Calls of every mode, dtype and order, K and N varied (so also the 950's k_chunk), some sharing
    a stack and some not; a few strided or byte-swapped."""
    rng = np.random.default_rng(seed)
    calls = []
    for number in range(count):
        mode = MODES[number % 3]
        dtype = GRAD_DTYPES[int(rng.integers(3))]
        top_k = int(rng.choice([1, 2, 3, 5, 8, 130]))
        tokens = int(rng.integers(2, 6)) if top_k < 100 else 2
        grad, idx, drop_pad_mode, active_num = random_call(
            rng, mode, top_k, dtype, tokens, hidden=int(rng.choice([1, 3, 67]))
        )
        if number % 7 == 3:
            grad = np.asfortranarray(grad)
        elif number % 7 == 5 and dtype != GRAD_DTYPES[1]:  # bfloat16 has no byte-swapped NumPy form
            grad = grad.astype(grad.dtype.newbyteorder(">"))
        calls.append(
            MoeInitRoutingV2GradCall(
                grad_expanded_x=grad,
                expanded_row_idx=idx,
                top_k=top_k,
                drop_pad_mode=drop_pad_mode,
                active_num=active_num,
                order=ALL_ORDERS[int(rng.integers(len(ALL_ORDERS)))],
            )
        )
    return calls


def test_each_result_is_the_slow_loops_bits(path):
    calls = mixed_calls(1, 60) + mixed_calls(1, 60)  # the same shapes twice: stacks of several members
    results = moe_init_routing_v2_grad_many(calls)
    assert len(results) == len(calls)
    for call, grad_x in zip(calls, results, strict=True):
        assert grad_x.flags.c_contiguous
        assert_bitwise_equal(grad_x, slow(call))


def test_the_documented_example_in_a_stack():
    """docs/operator.md's example, three times over with a different call between: [[0.3, 0.3],
    [0.70000005, 0.70000005]] float32 each time."""
    example = MoeInitRoutingV2GradCall(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=2)
    other = MoeInitRoutingV2GradCall(
        grad_expanded_x=np.ones((2, 2), np.float32), expanded_row_idx=np.array([1, 0], np.int32), top_k=2
    )
    want = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32).view(np.uint32)
    results = moe_init_routing_v2_grad_many([example, other, example, example])
    for grad_x in (results[0], results[2], results[3]):
        assert (grad_x.view(np.uint32) == want).all()
    assert (results[1] == np.float32(2.0)).all()


def test_empty_large_and_split_stacks_keep_the_bits(monkeypatch, path):
    monkeypatch.setattr(_reference_many, "_STACK_CALL_BYTES", 600)  # some calls now run alone
    monkeypatch.setattr(_reference_many, "_STACK_BYTES", 1000)  # and the rest in several stacks
    calls = mixed_calls(2, 40)
    empty = [
        MoeInitRoutingV2GradCall(
            grad_expanded_x=np.zeros((0, 3), np.float32), expanded_row_idx=np.zeros(0, np.int32), top_k=2
        ),
        MoeInitRoutingV2GradCall(
            grad_expanded_x=np.zeros((4, 0), np.float16), expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2
        ),
    ]
    calls[5:5] = empty
    results = moe_init_routing_v2_grad_many(calls)
    assert results[5].shape == (0, 3) and results[6].shape == (2, 0) and results[6].dtype == np.float16
    for call, grad_x in zip(calls, results, strict=True):
        if call.num_tokens and call.hidden_size:
            assert_bitwise_equal(grad_x, slow(call))


def test_duplicate_indices_allowed_by_a_call_stay_its_own():
    grad = np.array([[1.0], [2.0], [4.0]], dtype=np.float32)
    duplicated = MoeInitRoutingV2GradCall(
        grad_expanded_x=grad,
        expanded_row_idx=np.array([2, 2, 0], np.int32),
        top_k=3,
        drop_pad_mode=0,
        active_num=3,
        allow_duplicate_indices=True,
    )
    plain = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([2, 1, 0], np.int32), top_k=3)
    results = moe_init_routing_v2_grad_many([duplicated, plain])
    assert results[0].tolist() == [[9.0]] and results[1].tolist() == [[7.0]]


# --------------------------------------------------------------------------------------------------
# A CallGroup (many calls of one shape, their tensors stacked): the batch endpoint's unit of work.
# --------------------------------------------------------------------------------------------------


def group_of(rng: np.random.Generator, mode: str, top_k: int, dtype, tokens: int, hidden: int, order: str, size: int):
    """A CallGroup of ``size`` random members of one shape, and each member as its own validated call."""
    first = random_call(rng, mode, top_k, dtype, tokens, hidden)
    grads, indices = [first[0]], [first[1]]
    while len(grads) < size:
        grad, idx, _, _ = random_call(rng, mode, top_k, dtype, tokens, hidden)
        if grad.shape == first[0].shape:  # drop/pad picks its capacity at random, active mode its A
            grads.append(grad)
            indices.append(idx)
    calls = [
        MoeInitRoutingV2GradCall(
            grad_expanded_x=grad,
            expanded_row_idx=idx,
            top_k=top_k,
            drop_pad_mode=first[2],
            active_num=first[3],
            order=order,
        )
        for grad, idx in zip(grads, indices, strict=True)
    ]
    return CallGroup(calls[0], np.stack(grads), np.stack(indices)), calls


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_a_group_gives_each_member_the_slow_loops_bits(path, order, mode):
    rng = np.random.default_rng(7)
    for dtype in GRAD_DTYPES:
        for top_k, tokens, hidden in ((1, 3, 5), (2, 4, 3), (8, 3, 67), (130, 2, 2)):
            group, calls = group_of(rng, mode, top_k, dtype, tokens, hidden, order, 5)
            results = moe_init_routing_v2_grad_group(group)
            assert results.shape == (5, tokens, hidden) and results.flags.c_contiguous
            for member, call in enumerate(calls):
                assert_bitwise_equal(results[member], slow(call))
                assert_bitwise_equal(group.call(member).expanded_row_idx, call.expanded_row_idx)


def test_the_documented_example_as_a_group():
    """docs/operator.md's example as three members, the middle one with its rows swapped: the
    example's [[0.3, 0.3], [0.70000005, 0.70000005]] float32, and for the swapped rows
    [[0.2 + 0.4, ...], [0.1 + 0.3, ...]]."""
    grad, idx = DOC_GRAD, DOC_IDX
    example = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=2)
    swapped = np.array([0, 2, 3, 1], np.int32)
    group = CallGroup(example, np.stack([grad, grad, grad]), np.stack([idx, swapped, idx]))
    results = moe_init_routing_v2_grad_group(group)
    want = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32).view(np.uint32)
    assert (results[0].view(np.uint32) == want).all() and (results[2].view(np.uint32) == want).all()
    swapped_want = np.array([[np.float32(0.1) + np.float32(0.2)] * 2, [np.float32(0.4) + np.float32(0.3)] * 2])
    assert (results[1].view(np.uint32) == swapped_want.astype(np.float32).view(np.uint32)).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("allow_duplicates", [False, True])
def test_breaking_rule_7_agrees_with_the_calls_own_check(mode, allow_duplicates):
    """Over random indices (in range, out of range by one, repeated, -1), a member breaks rule 7
    exactly when building it as a call raises the rule-7 error."""
    rng = np.random.default_rng(11)
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, 3, GRAD_DTYPES[2], 4, 2)
    fields = {
        "grad_expanded_x": grad,
        "top_k": 3,
        "drop_pad_mode": drop_pad_mode,
        "active_num": active_num,
        "allow_duplicate_indices": allow_duplicates,
    }
    like = MoeInitRoutingV2GradCall(expanded_row_idx=idx, **fields)
    high = grad.shape[0] * grad.shape[1] if drop_pad_mode == 1 else idx.shape[0]
    rows = rng.integers(-2, high + 2, size=(400, idx.shape[0])).astype(np.int32)
    rows[:100] = [rng.permutation(high)[: idx.shape[0]] for _ in range(100)]  # valid unless a value repeats
    broken = CallGroup.breaking_rule_7(like, rows)
    for row, says in zip(rows, broken.tolist(), strict=True):
        try:
            MoeInitRoutingV2GradCall(expanded_row_idx=row, **fields)
        except InvalidArgument as exc:
            assert says, exc
            assert exc.field == "expanded_row_idx" and exc.aclnn_status == 161002
        else:
            assert not says, row
    assert 0 < broken.sum() < len(rows)


def test_a_group_of_drop_pad_calls_with_no_expert_rows_is_all_zeros():
    """E*C = 0 (no expert holds a row): every slot is -1, so every grad_x row is +0.0 (docs/semantics.md:
    a row whose slots are all skipped)."""
    for shape in ((0, 4, 2), (3, 0, 2)):
        like = MoeInitRoutingV2GradCall(
            grad_expanded_x=np.zeros(shape, np.float32),
            expanded_row_idx=np.full(4, -1, np.int32),
            top_k=2,
            drop_pad_mode=1,
        )
        group = CallGroup(like, np.zeros((3, *shape), np.float32), np.full((3, 4), -1, np.int32))
        results = moe_init_routing_v2_grad_group(group)
        assert results.shape == (3, 2, 2) and (results.view(np.uint32) == 0).all()
