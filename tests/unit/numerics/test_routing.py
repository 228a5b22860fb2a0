"""moegrad.moe_init_routing_v2 (the forward routing) against an independent reading of its documentation.

The oracle below is written from aclnnMoeInitRoutingV2's documentation ("Function": a key-value
sort of the flat expert ids, ``expandedRowIdxOut[sortedRowIdx[i]] = i``, ``expandedXOut[i] =
x[sortedRowIdx[i] // k]``, histograms; drop/pad: each expert keeps expertCapacity rows, the rest
dropped, short experts padded with zeros; active: the first activeNum rows) as plain loops: an
expert-by-expert scan instead of a sort, counters instead of bincount.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moegrad import (
    AclnnStatus,
    InvalidArgument,
    expanded_row_idx_layout,
    invert_expanded_row_idx,
    moe_init_routing_v2,
    moe_init_routing_v2_grad,
)

INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
TILING = AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR
NULLPTR = AclnnStatus.ACLNN_ERR_PARAM_NULLPTR


def oracle(x, expert_idx, active_num=0, expert_capacity=0, expert_num=0, drop_pad_mode=0, count_flag=0,
           before_flag=False):
    """The four outputs, by loops over the documentation's steps."""
    n, h = x.shape
    k = expert_idx.shape[1]
    flat = [int(v) for v in expert_idx.reshape(-1)]
    # Key-value sort: experts in increasing id, each expert's slots in increasing slot number.
    sorted_row_idx = []
    for expert in sorted(set(flat)):
        sorted_row_idx += [s for s in range(len(flat)) if flat[s] == expert]
    histogram = [0] * expert_num
    for expert in flat:
        if expert < expert_num:
            histogram[expert] += 1
    if drop_pad_mode == 0:
        expanded_row_idx = [0] * len(flat)
        for position, slot in enumerate(sorted_row_idx):
            expanded_row_idx[slot] = position
        rows = len(flat) if active_num == 0 else min(active_num, len(flat))
        expanded_x = np.zeros((rows, h), dtype=x.dtype)
        for position in range(rows):
            expanded_x[position] = x[sorted_row_idx[position] // k]
        counts = None
        if count_flag == 2:
            counts = histogram
        elif count_flag == 1:
            counts, total = [], 0
            for value in histogram:
                total += value
                counts.append(total)
        return expanded_x, expanded_row_idx, counts, None
    expanded_row_idx = [-1] * len(flat)
    expanded_x = np.zeros((expert_num, expert_capacity, h), dtype=x.dtype)
    taken = [0] * expert_num
    for slot in sorted_row_idx:
        expert = flat[slot]
        if taken[expert] < expert_capacity:
            expanded_row_idx[slot] = expert * expert_capacity + taken[expert]
            expanded_x[expert, taken[expert]] = x[slot // k]
            taken[expert] += 1
    return expanded_x, expanded_row_idx, None, histogram if before_flag else None


def check(x, expert_idx, **kwargs):
    names = {"expert_tokens_count_or_cumsum_flag": "count_flag", "expert_tokens_before_capacity_flag": "before_flag"}
    want = oracle(x, expert_idx, **{names.get(key, key): value for key, value in kwargs.items()})
    got = moe_init_routing_v2(x, expert_idx, **kwargs)
    assert got.expanded_x.dtype == x.dtype and got.expanded_x.shape == want[0].shape
    assert got.expanded_x.tobytes() == want[0].tobytes()
    assert got.expanded_row_idx.dtype == np.int32
    assert got.expanded_row_idx.tolist() == want[1]
    for output, expected in zip(got[2:], want[2:]):
        if expected is None:
            assert output is None
        else:
            assert output.dtype == np.int32 and output.tolist() == expected
    return got


def features(rng, n, h, dtype=np.float32):
    return rng.standard_normal((n, h)).astype(dtype)


def test_the_documentation_example():
    # aclnnMoeInitRoutingV2's example: x rows 0.1, 0.2, 0.3; experts [[1, 2], [0, 1], [0, 2]]; C = 2, E = 3.
    x = np.repeat(np.array([[0.1], [0.2], [0.3]], np.float32), 4, axis=1)
    expert_idx = np.array([[1, 2], [0, 1], [0, 2]], np.int32)
    got = check(x, expert_idx, expert_capacity=2, expert_num=3, drop_pad_mode=1,
                expert_tokens_before_capacity_flag=True)
    # By hand: expert 0 gets slots 2, 4 (tokens 1, 2), expert 1 slots 0, 3, expert 2 slots 1, 5.
    assert got.expanded_row_idx.tolist() == [2, 4, 0, 3, 1, 5]
    assert got.expanded_x[:, :, 0].tolist() == np.array([[0.2, 0.3], [0.1, 0.2], [0.1, 0.3]], np.float32).tolist()
    assert got.expert_tokens_before_capacity.tolist() == [2, 2, 2]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("count_flag", [0, 1, 2])
def test_dropless(dtype, count_flag):
    rng = np.random.default_rng(1)
    check(features(rng, 13, 5, dtype), rng.integers(0, 6, (13, 3)).astype(np.int32), expert_num=6,
          expert_tokens_count_or_cumsum_flag=count_flag)


@pytest.mark.parametrize("active_num", [1, 7, 38, 39, 40, 1000])
def test_active_truncates_expanded_x_but_numbers_every_slot(active_num):
    rng = np.random.default_rng(2)
    got = check(features(rng, 13, 4), rng.integers(0, 5, (13, 3)).astype(np.int32), active_num=active_num)
    assert got.expanded_x.shape[0] == min(active_num, 39)
    assert sorted(got.expanded_row_idx.tolist()) == list(range(39))


@pytest.mark.parametrize("capacity", [1, 2, 5, 13])
@pytest.mark.parametrize("before_flag", [False, True])
def test_drop_pad_overflow_and_padding(capacity, before_flag):
    rng = np.random.default_rng(3)
    expert_idx = rng.integers(0, 4, (13, 2)).astype(np.int32)
    got = check(features(rng, 13, 3), expert_idx, expert_capacity=capacity, expert_num=4, drop_pad_mode=1,
                expert_tokens_before_capacity_flag=before_flag)
    kept = np.minimum(np.bincount(expert_idx.reshape(-1), minlength=4), capacity)
    assert int((got.expanded_row_idx >= 0).sum()) == int(kept.sum())


def test_ties_keep_slot_order():
    # Every token picks expert 3 twice over (K = 2, ids [3, 3]): the sort must keep slot order 0, 1, 2, ...
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    expert_idx = np.full((6, 2), 3, np.int32)
    got = check(x, expert_idx, expert_num=4, expert_tokens_count_or_cumsum_flag=2)
    assert got.expanded_row_idx.tolist() == list(range(12))
    assert got.expert_tokens_count_or_cumsum.tolist() == [0, 0, 0, 12]
    dropped = check(x, expert_idx, expert_capacity=5, expert_num=4, drop_pad_mode=1)
    assert dropped.expanded_row_idx.tolist() == [15, 16, 17, 18, 19] + [-1] * 7


def test_int64_ids_and_empty_tokens():
    rng = np.random.default_rng(4)
    check(features(rng, 9, 4), rng.integers(0, 3, (9, 2)), expert_num=3, expert_tokens_count_or_cumsum_flag=1)
    check(np.zeros((0, 4), np.float32), np.zeros((0, 2), np.int32), expert_num=3, expert_tokens_count_or_cumsum_flag=1)


def test_its_index_feeds_the_backward():
    # grad_x[i] = sum over t of grad_expanded_x[expanded_row_idx[i*K + t]]: with grad_expanded_x = expanded_x
    # and K = 1 (one summand), the backward gives back x exactly (dropless), or x / 0 rows (drop/pad).
    rng = np.random.default_rng(5)
    x = features(rng, 10, 4)
    expert_idx = rng.integers(0, 3, (10, 1)).astype(np.int32)
    routed = moe_init_routing_v2(x, expert_idx)
    assert moe_init_routing_v2_grad(routed.expanded_x, routed.expanded_row_idx, 1).tobytes() == x.tobytes()
    routed = moe_init_routing_v2(x, expert_idx, expert_capacity=2, expert_num=3, drop_pad_mode=1)
    grad_x = moe_init_routing_v2_grad(routed.expanded_x, routed.expanded_row_idx, 1, drop_pad_mode=1)
    kept = routed.expanded_row_idx >= 0
    assert grad_x[kept].tobytes() == x[kept].tobytes() and not grad_x[~kept].any()


def test_layouts_convert_and_are_told_apart():
    # 3 tokens, K = 2, experts [[2, 0], [1, 0], [2, 1]]: sorted slots 1, 3, 2, 5, 0, 4 (row -> slot).
    expert_idx = np.array([[2, 0], [1, 0], [2, 1]], np.int32)
    routed = moe_init_routing_v2(np.zeros((3, 1), np.float32), expert_idx)
    slot_to_row = routed.expanded_row_idx
    assert slot_to_row.tolist() == [4, 0, 2, 1, 5, 3]
    row_to_slot = invert_expanded_row_idx(slot_to_row)
    assert row_to_slot.tolist() == [1, 3, 2, 5, 0, 4]
    assert invert_expanded_row_idx(row_to_slot).tolist() == slot_to_row.tolist()
    assert expanded_row_idx_layout(slot_to_row, expert_idx) == "slot_to_row"
    assert expanded_row_idx_layout(row_to_slot, expert_idx) == "row_to_slot"
    assert expanded_row_idx_layout(np.arange(6, dtype=np.int32), np.array([[0, 0], [1, 1], [2, 2]])) == "both"
    with pytest.raises(ValueError, match="neither layout"):
        expanded_row_idx_layout(np.array([0, 1, 2, 3, 4, 5], np.int32), expert_idx)
    with pytest.raises(ValueError, match="not a permutation"):
        invert_expanded_row_idx(np.array([0, -1, 2], np.int32))


def test_the_worked_example_in_drop_pad_mode():
    # docs/semantics.md: E = 3, C = 1: each expert keeps its first slot (1, 2, 0 by expert), the rest drop.
    expert_idx = np.array([[2, 0], [1, 0], [2, 1]], np.int32)
    routed = moe_init_routing_v2(np.zeros((3, 1), np.float32), expert_idx, expert_capacity=1, expert_num=3,
                                 drop_pad_mode=1)
    assert routed.expanded_row_idx.tolist() == [2, 0, 1, -1, -1, -1]


def test_the_other_layout_gives_another_gradient():
    # Passing row -> slot where slot -> row is expected is accepted (both are permutations) but wrong.
    expert_idx = np.array([[2, 0], [1, 0], [2, 1]], np.int32)
    routed = moe_init_routing_v2(np.zeros((3, 1), np.float32), expert_idx)
    grad = np.arange(6, dtype=np.float32).reshape(6, 1)  # row r of grad_expanded_x holds r
    right = moe_init_routing_v2_grad(grad, routed.expanded_row_idx, 2)
    wrong = moe_init_routing_v2_grad(grad, invert_expanded_row_idx(routed.expanded_row_idx), 2)
    assert right[:, 0].tolist() == [4 + 0, 2 + 1, 5 + 3]  # each token's rows, by hand from [4, 0, 2, 1, 5, 3]
    assert wrong[:, 0].tolist() != right[:, 0].tolist()


@pytest.mark.parametrize(("kwargs", "status", "field", "text"), [
    ({"x": None}, NULLPTR, "x", "missing"),
    ({"x": np.zeros((4, 2))}, INVALID, "x", "astype(numpy.float32)"),
    ({"expert_idx": np.zeros((4, 2), np.float32)}, INVALID, "expert_idx", "astype(numpy.int32)"),
    ({"expert_idx": np.array([[0, -1]] * 4, np.int32)}, INVALID, "expert_idx", "outside"),
    ({"expert_idx": np.array([[0, 3]] * 4, np.int32), "expert_num": 3, "expert_tokens_count_or_cumsum_flag": 1},
     INVALID, "expert_idx", "[0, 3)"),
    ({"expert_idx": np.array([[0, 2**24]] * 4, np.int32)}, INVALID, "expert_idx", "float32"),
    ({"active_num": -1}, TILING, "active_num", ">= 0"),
    ({"drop_pad_mode": 2}, TILING, "drop_pad_mode", "0 (dropless"),
    ({"expert_tokens_count_or_cumsum_flag": 3}, TILING, "expert_tokens_count_or_cumsum_flag", "2 (count)"),
    ({"expert_tokens_count_or_cumsum_flag": 1}, TILING, "expert_num", "expert_num > 0"),
    ({"drop_pad_mode": 1, "expert_num": 3}, TILING, "expert_capacity", "expert_capacity > 0"),
    ({"drop_pad_mode": 1, "expert_num": 3, "expert_capacity": 5}, TILING, "expert_capacity", "(0, 4]"),
    ({"x": np.zeros((4, 2, 1), np.float32)}, TILING, "x", "2-D"),
    ({"expert_idx": np.zeros((3, 2), np.int32)}, TILING, "expert_idx", "x.shape[0]=4"),
    ({"expert_tokens_before_capacity_flag": 1}, TILING, "expert_tokens_before_capacity_flag", "bool"),
])
def test_bad_input_names_the_field_and_code(kwargs, status, field, text):
    arguments = {"x": np.zeros((4, 2), np.float32), "expert_idx": np.zeros((4, 2), np.int32), **kwargs}
    with pytest.raises(InvalidArgument) as caught:
        moe_init_routing_v2(**arguments)
    assert caught.value.aclnn_status == status and caught.value.field == field
    assert text in caught.value.message


# --------------------------------------------------------------------------------------------------
# active_expert_range: aclnnMoeInitRoutingV3/V4's attribute (recursion-ascend/ops-transformer
# moe/moe_init_routing_v4/docs/aclnnMoeInitRoutingV4.md @ a093e954: only experts in [start, end) are
# routed, availableIdxNum of them; rowIdxType 0 fills the other slots' expandedRowIdxOut with -1).
# --------------------------------------------------------------------------------------------------


def range_oracle(x, expert_idx, start, end, active_num=0, count_flag=0):
    """expanded_x, expanded_row_idx and the range's counts, by loops over the V4 documentation's steps."""
    k = expert_idx.shape[1]
    flat = [int(v) for v in expert_idx.reshape(-1)]
    routed = []  # the key-value sort, restricted to the range: experts in increasing id, slots in order
    for expert in range(start, end):
        routed += [s for s in range(len(flat)) if flat[s] == expert]
    expanded_row_idx = [-1] * len(flat)
    for row, slot in enumerate(routed):
        expanded_row_idx[slot] = row
    rows = len(flat) if active_num == 0 else min(active_num, len(flat))
    expanded_x = np.zeros((rows, x.shape[1]), dtype=x.dtype)  # rows past the routed ones: zeros (moegrad's choice)
    for row in range(min(rows, len(routed))):
        expanded_x[row] = x[routed[row] // k]
    counts = [sum(1 for e in flat if e == expert) for expert in range(start, end)]
    if count_flag == 1:
        counts = [sum(counts[: i + 1]) for i in range(len(counts))]
    return expanded_x, expanded_row_idx, counts if count_flag else None


@pytest.mark.parametrize(("start", "end"), [(0, 6), (0, 1), (2, 5), (5, 6), (3, 4)])
@pytest.mark.parametrize("active_num", [0, 7, 39, 100])
@pytest.mark.parametrize("count_flag", [0, 1, 2])
def test_active_expert_range_routes_the_range_and_marks_the_rest_minus_one(start, end, active_num, count_flag):
    rng = np.random.default_rng(6)
    x = features(rng, 13, 4)
    expert_idx = rng.integers(0, 6, (13, 3)).astype(np.int32)
    want = range_oracle(x, expert_idx, start, end, active_num, count_flag)
    got = moe_init_routing_v2(x, expert_idx, active_num=active_num, expert_num=6,
                              expert_tokens_count_or_cumsum_flag=count_flag, active_expert_range=(start, end))
    assert got.expanded_x.shape == want[0].shape and got.expanded_x.tobytes() == want[0].tobytes()
    assert got.expanded_row_idx.dtype == np.int32 and got.expanded_row_idx.tolist() == want[1]
    if count_flag:
        assert got.expert_tokens_count_or_cumsum.tolist() == want[2]
    else:
        assert got.expert_tokens_count_or_cumsum is None


def test_the_whole_range_is_no_range():
    rng = np.random.default_rng(7)
    x, expert_idx = features(rng, 9, 3), rng.integers(0, 4, (9, 2)).astype(np.int32)
    plain = moe_init_routing_v2(x, expert_idx, expert_num=4)
    ranged = moe_init_routing_v2(x, expert_idx, expert_num=4, active_expert_range=[0, 4])
    assert plain.expanded_row_idx.tolist() == ranged.expanded_row_idx.tolist()
    assert plain.expanded_x.tobytes() == ranged.expanded_x.tobytes()
    # drop/pad mode takes only the whole range (V4's DropPad constraint) and is then unchanged
    dropped = moe_init_routing_v2(x, expert_idx, expert_capacity=2, expert_num=4, drop_pad_mode=1,
                                  active_expert_range=(0, 4))
    assert dropped.expanded_row_idx.tolist() == check(x, expert_idx, expert_capacity=2, expert_num=4,
                                                      drop_pad_mode=1).expanded_row_idx.tolist()


@pytest.mark.parametrize(("active_expert_range", "kwargs", "text"), [
    ((2, 2), {}, "0 <= start < end"),
    ((-1, 2), {}, "0 <= start < end"),
    ((0, 5), {"expert_num": 4}, "expert_num=4"),
    ((0,), {}, "two values"),
    ("ab", {}, "two integers"),
    ((0, 1.5), {}, "must be an integer"),
    ((1, 4), {"expert_num": 4, "expert_capacity": 2, "drop_pad_mode": 1}, "drop/pad"),
])
def test_a_bad_active_expert_range_is_561002(active_expert_range, kwargs, text):
    arguments = {"x": np.zeros((4, 2), np.float32), "expert_idx": np.zeros((4, 2), np.int32), **kwargs}
    with pytest.raises(InvalidArgument) as caught:
        moe_init_routing_v2(**arguments, active_expert_range=active_expert_range)
    assert caught.value.aclnn_status == TILING and caught.value.field == "active_expert_range"
    assert text in caught.value.message
