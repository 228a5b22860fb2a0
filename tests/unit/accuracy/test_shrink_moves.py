"""The shrinker's moves (moegrad.accuracy._reduce): every smaller call is valid in its mode and keeps
what the kept tokens read.

Oracles: routings from tests/support/routing.py (the forward's stable sort, docs/operator.md); the
operator's rules as MoeInitRoutingV2GradCall checks them (a move that broke one would raise); the
sums of tests/support/triggers.py's correct candidate (the A2/A3 bins' order, written from
docs/semantics.md section 3.1): a kept token keeps its summands in their slot order, so its row of
grad_x keeps its bits; and the rows' relative order, read from the index itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad.accuracy._reduce import (
    ReductionRefused,
    keep_capacity,
    keep_columns,
    keep_experts,
    keep_slots,
    keep_tokens,
)
from support import routing, triggers
from support.bits import same_bits

MODES = {"dropless": {}, "active": {"active_num": 40}, "drop_pad": {"capacity": 3}}


def routed_call(mode, tokens=12, top_k=4, hidden=5, seed=0, order="ascend910b@9.1"):
    rng = np.random.default_rng(seed)
    routed = routing.route(rng, tokens, top_k, 8, mode, **MODES[mode])
    grad = rng.standard_normal(routed.grad_shape(hidden)).astype(np.float32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, order=order, **routed.kwargs())


def sums(call):
    return triggers.correct(call.grad_expanded_x, call.expanded_row_idx, call.top_k,
                            drop_pad_mode=call.drop_pad_mode, active_num=call.active_num)


@pytest.mark.parametrize("mode", list(MODES))
def test_kept_tokens_keep_their_rows_bits_and_the_rows_order(mode):
    call = routed_call(mode)
    kept = [1, 4, 5, 11]
    smaller = keep_tokens(call, kept)
    assert (smaller.num_tokens, smaller.top_k, smaller.hidden_size) == (4, 4, 5)
    assert (smaller.drop_pad_mode, smaller.order) == (call.drop_pad_mode, call.order)
    assert same_bits(sums(smaller), sums(call)[kept])
    before = call.expanded_row_idx.reshape(-1, 4)[kept].reshape(-1)
    after = smaller.expanded_row_idx
    read = after >= 0
    if mode == "active":
        read = after < smaller.active_num
        assert smaller.grad_expanded_x.shape[0] == smaller.active_num == int((before < call.active_num).sum())
    # the rows read keep their relative order (a scatter over rows adds in the same order)
    assert np.array_equal(np.argsort(after[read], kind="stable"), np.argsort(before[read], kind="stable"))
    if mode == "dropless":
        assert sorted(after.tolist()) == list(range(16))  # a permutation of [0, N'*K')
    if mode == "drop_pad":
        assert same_bits(smaller.grad_expanded_x, call.grad_expanded_x)  # experts and capacity stay


@pytest.mark.parametrize("mode", list(MODES))
def test_kept_slots_and_columns_are_what_is_left(mode):
    call = routed_call(mode)
    fewer = keep_slots(call, [0, 2])
    assert (fewer.num_tokens, fewer.top_k) == (12, 2)
    values = call.grad_expanded_x.reshape(-1, 5)
    limit = call.active_num or values.shape[0]
    index = call.expanded_row_idx.reshape(-1, 4)[:, [0, 2]]
    want = np.zeros((12, 5), np.float32)  # two slots: one add, any order
    for t in range(2):
        read = (index[:, t] >= 0) & (index[:, t] < limit)
        want[read] += values[index[read, t]]
    assert same_bits(sums(fewer), want)
    narrow = keep_columns(call, [1, 3])
    assert same_bits(sums(narrow), sums(call)[:, [1, 3]])


def test_an_active_call_left_with_no_row_read_is_refused():
    call = routed_call("active")
    token, slot = np.argwhere(call.expanded_row_idx.reshape(-1, 4) >= call.active_num)[0]
    with pytest.raises(ReductionRefused, match="active"):
        keep_slots(keep_tokens(call, [int(token)]), [int(slot)])


def test_experts_and_capacity_removed_drop_the_slots_that_read_them():
    call = routed_call("drop_pad")
    experts, capacity, _ = call.grad_expanded_x.shape
    flat = call.expanded_row_idx.astype(np.int64)
    fewer = keep_experts(call, [0, 3, 5])
    assert fewer.grad_expanded_x.shape == (3, capacity, 5)
    expert = np.where(flat >= 0, flat // capacity, -1)
    kept = np.isin(expert, [0, 3, 5])
    assert (fewer.expanded_row_idx[~kept] == -1).all()
    new_expert = {0: 0, 3: 1, 5: 2}
    assert fewer.expanded_row_idx[kept].tolist() == [new_expert[e] * capacity + v % capacity
                                                     for e, v in zip(expert[kept], flat[kept], strict=True)]
    narrow = keep_capacity(call, [0, 2])
    assert narrow.grad_expanded_x.shape == (experts, 2, 5)
    position = np.where(flat >= 0, flat % capacity, -1)
    kept = np.isin(position, [0, 2])
    assert (narrow.expanded_row_idx[~kept] == -1).all()
    assert narrow.expanded_row_idx[kept].tolist() == [v // capacity * 2 + (v % capacity) // 2 for v in flat[kept]]
    # a token none of whose slots is still read sums nothing
    assert not sums(narrow)[~kept.reshape(-1, 4).any(axis=1)].any()


def test_the_950_at_9_1s_zero_rows_stay_outside_the_rows():
    # ascend950@9.1 takes any negative value, and any value past N*K in dropless mode, as a +0.0 row
    call = routed_call("dropless", order="ascend950@9.1")
    index = call.expanded_row_idx.copy()
    index[[0, 5, 9]] = [-7, 48 + 3, 48 + 100]
    lenient = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=call.grad_expanded_x, expanded_row_idx=index,
                                               top_k=4, order="ascend950@9.1")
    smaller = keep_tokens(lenient, [0, 1, 2])
    got = smaller.expanded_row_idx
    assert got[0] == -7 and got[5] == 12 + 3 and got[9] == 12 + 100
    assert smaller.grad_expanded_x.shape[0] == 12
    read = (got >= 0) & (got < 12)
    assert len(set(got[read].tolist())) == read.sum()
