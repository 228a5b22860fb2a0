"""MoeInitRoutingV2GradCall: the documented constraints, their aclnn codes, fields and order.

Codes and names are the operator documentation's (docs/operator.md) in docs/semantics.md section 8's order:
1 missing tensor -> 161001; 2 dtypes -> 161002; 3 attributes, 4 ranks, 5 dim 0, 6 divisibility
-> 561103 ACLNN_ERR_INNER_NULLPTR on the default profile (ascend910b@9.1: the CANN 9.1 documentation's
code, zh docs at commit 192ebbfa), 561002 ACLNN_ERR_INNER_TILING_ERROR on every profile before 9.1
(the earlier documentation's); 7 index values and uniqueness -> 161002. The profile rules of 9.1
(invalid slots, empty grad_x) are in tests/unit/operator/test_profiles_spec.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pydantic
import pytest

from moegrad import (
    InvalidArgument,
    MalformedRequest,
    MoeInitRoutingV2GradCall,
    PayloadTooLarge,
    decode_body,
    encode_body,
    encode_tensor,
    resolve_profile,
)
from moegrad.operator import names_profile

NULLPTR, INVALID, TILING, SHAPE = 161001, 161002, 561002, 561103
NAMES = {NULLPTR: "ACLNN_ERR_PARAM_NULLPTR", INVALID: "ACLNN_ERR_PARAM_INVALID", TILING: "ACLNN_ERR_INNER_TILING_ERROR",
         SHAPE: "ACLNN_ERR_INNER_NULLPTR"}
BEFORE_9_1 = "ascend910b@9.0"  # the attribute/shape code is 561002 there (TILING), 561103 from 9.1 (SHAPE)


def dropless(hidden: int = 4, **overrides):
    """Keyword arguments of a valid dropless call (N=3, K=2, H=hidden), with overrides."""
    kwargs = {
        "grad_expanded_x": np.zeros((6, hidden), dtype=np.float32),
        "expanded_row_idx": np.arange(6, dtype=np.int32)[::-1].copy(),
        "top_k": 2,
        "drop_pad_mode": 0,
        "active_num": 0,
    }
    kwargs.update(overrides)
    return kwargs


def drop_pad(experts: int = 2, capacity: int = 3, hidden: int = 4, index=(0, -1, 5, 2, -1, -1), top_k: int = 2, **overrides):
    kwargs = {
        "grad_expanded_x": np.zeros((experts, capacity, hidden), dtype=np.float16),
        "expanded_row_idx": np.array(index, dtype=np.int32),
        "top_k": top_k,
        "drop_pad_mode": 1,
        "active_num": 0,
    }
    kwargs.update(overrides)
    return kwargs


def rejected(kwargs, status: int, field: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        MoeInitRoutingV2GradCall(**kwargs)
    error = info.value
    assert (error.aclnn_status, error.aclnn_name, error.field) == (status, NAMES[status], field), str(error)
    assert type(error.aclnn_status) is int
    assert str(status) in str(error) and field in str(error)
    return error


# --------------------------------------------------------------------------------------------------
# Valid calls.
# --------------------------------------------------------------------------------------------------

def test_valid_calls_keep_their_arrays_and_normalise_attributes():
    kwargs = dropless(top_k=np.int64(2), drop_pad_mode=np.int32(0), active_num=np.uint8(0))
    call = MoeInitRoutingV2GradCall(**kwargs)
    assert call.grad_expanded_x is kwargs["grad_expanded_x"]
    assert call.expanded_row_idx is kwargs["expanded_row_idx"]
    assert (call.top_k, call.drop_pad_mode, call.active_num) == (2, 0, 0)
    assert all(type(v) is int for v in (call.top_k, call.drop_pad_mode, call.active_num))
    assert (call.order, call.allow_duplicate_indices) == ("ascend910b@9.1", False)  # the default profile
    assert (call.num_tokens, call.hidden_size, call.dtype_name) == (3, 4, "float32")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, ">f2", ">f4"])
def test_every_grad_dtype_is_accepted(dtype):
    call = MoeInitRoutingV2GradCall(**dropless(grad_expanded_x=np.zeros((6, 4), dtype=dtype),
                                               expanded_row_idx=np.arange(6, dtype=">i4")))
    assert call.num_tokens == 3


def test_non_contiguous_arrays_are_accepted():
    grad = np.zeros((6, 8), dtype=np.float32)[:, ::2]
    idx = np.arange(12, dtype=np.int32)[::2] // 2
    MoeInitRoutingV2GradCall(**dropless(grad_expanded_x=grad, expanded_row_idx=idx))


def test_active_and_drop_pad_calls_are_accepted():
    # Active: A = 2 rows; indices cover [0, N*K) = [0, 6), those >= 2 are skipped later.
    MoeInitRoutingV2GradCall(**dropless(grad_expanded_x=np.zeros((2, 4), np.float32), active_num=2))
    # Drop/pad: -1 may repeat; active_num is ignored (any value >= 0).
    MoeInitRoutingV2GradCall(**drop_pad(active_num=7))


def test_the_model_is_frozen():
    call = MoeInitRoutingV2GradCall(**dropless())
    with pytest.raises(pydantic.ValidationError):
        call.top_k = 3


# --------------------------------------------------------------------------------------------------
# Rule 1: a missing tensor -> 161001.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["grad_expanded_x", "expanded_row_idx"])
def test_rule1_missing_tensor(field):
    kwargs = dropless()
    kwargs[field] = None
    rejected(kwargs, NULLPTR, field)
    del kwargs[field]
    rejected(kwargs, NULLPTR, field)


# --------------------------------------------------------------------------------------------------
# Rule 2: dtypes -> 161002.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8, np.bool_, np.complex64, object])
def test_rule2_grad_dtype(dtype):
    error = rejected(dropless(grad_expanded_x=np.zeros((6, 4), dtype=dtype)), INVALID, "grad_expanded_x")
    assert str(np.dtype(dtype)) in error.message


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.int16, np.float32])
def test_rule2_index_dtype(dtype):
    error = rejected(dropless(expanded_row_idx=np.arange(6, dtype=dtype)), INVALID, "expanded_row_idx")
    assert "int32" in error.message


@pytest.mark.parametrize("field", ["grad_expanded_x", "expanded_row_idx"])
def test_rule2_not_an_array(field):
    kwargs = dropless()
    kwargs[field] = kwargs[field].tolist()
    error = rejected(kwargs, INVALID, field)
    assert "list" in error.message


# --------------------------------------------------------------------------------------------------
# Rule 3: attributes -> 561002.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("field", "value"),
    [("drop_pad_mode", 2), ("drop_pad_mode", -1), ("top_k", 0), ("top_k", -2), ("active_num", -1)],
)
def test_rule3_attribute_values(field, value):
    error = rejected(dropless(**{field: value}), SHAPE, field)
    assert f"{field}={value}" in error.message


@pytest.mark.parametrize("field", ["top_k", "drop_pad_mode", "active_num"])
@pytest.mark.parametrize("value", [2.0, "2", True, False, np.bool_(True), None, [2], np.float32(2)])
def test_rule3_attributes_must_be_integers(field, value):
    error = rejected(dropless(**{field: value}), SHAPE, field)
    assert "integer" in error.message


@pytest.mark.parametrize("field", ["top_k", "drop_pad_mode", "active_num"])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_rule3_attributes_must_fit_int64(field, value):
    error = rejected(dropless(**{field: value}), SHAPE, field)
    assert "int64" in error.message


def test_rule3_int64_bounds_themselves_are_integers():
    # 2**63 - 1 fits int64_t: it passes rule 3 and fails later (dim 0 against active_num, rule 5).
    rejected(dropless(active_num=2**63 - 1), SHAPE, "grad_expanded_x")
    rejected(dropless(top_k=-(2**63)), SHAPE, "top_k")  # fits, but <= 0


# --------------------------------------------------------------------------------------------------
# Rule 4: ranks -> 561002.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6,), (6, 4, 1), (1, 6, 4), ()])
def test_rule4_grad_rank_dropless(shape):
    error = rejected(dropless(grad_expanded_x=np.zeros(shape, np.float32)), SHAPE, "grad_expanded_x")
    assert f"rank {len(shape)}" in error.message


@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4, 1), (24,)])
def test_rule4_grad_rank_drop_pad(shape):
    error = rejected(drop_pad(grad_expanded_x=np.zeros(shape, np.float32)), SHAPE, "grad_expanded_x")
    assert "[E, C, H]" in error.message


@pytest.mark.parametrize("shape", [(6, 1), (1, 6), (2, 3), ()])
def test_rule4_index_rank(shape):
    idx = np.arange(6, dtype=np.int32).reshape(shape) if shape else np.array(0, np.int32)
    rejected(dropless(expanded_row_idx=idx), SHAPE, "expanded_row_idx")


# --------------------------------------------------------------------------------------------------
# Rule 5: dim 0 -> 561002.
# --------------------------------------------------------------------------------------------------

def test_rule5_dropless_rows_must_equal_index_length():
    error = rejected(dropless(grad_expanded_x=np.zeros((5, 4), np.float32)), SHAPE, "grad_expanded_x")
    assert "grad_expanded_x.shape[0]=5" in error.message and "6" in error.message


def test_rule5_active_rows_must_equal_active_num():
    error = rejected(dropless(active_num=3, grad_expanded_x=np.zeros((6, 4), np.float32)), SHAPE, "grad_expanded_x")
    assert "active_num=3" in error.message
    # In drop/pad mode active_num is ignored: no dim-0 rule.
    MoeInitRoutingV2GradCall(**drop_pad(active_num=3))


# --------------------------------------------------------------------------------------------------
# Rule 6: divisibility -> 561002.
# --------------------------------------------------------------------------------------------------

def test_rule6_index_length_divisible_by_top_k():
    kwargs = dropless(grad_expanded_x=np.zeros((7, 4), np.float32), expanded_row_idx=np.arange(7, dtype=np.int32))
    error = rejected(kwargs, SHAPE, "expanded_row_idx")
    assert "expanded_row_idx.shape[0]=7 is not divisible by top_k=2" in error.message
    rejected(drop_pad(index=[0, 1, 2], top_k=2), SHAPE, "expanded_row_idx")


# --------------------------------------------------------------------------------------------------
# Rule 7: index values and uniqueness -> 161002.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, -7, 6, 2**31 - 1, -(2**31)])
def test_rule7_dropless_range(bad):
    idx = np.arange(6, dtype=np.int32)
    idx[4] = bad
    error = rejected(dropless(expanded_row_idx=idx), INVALID, "expanded_row_idx")
    assert f"expanded_row_idx[4]={bad}" in error.message and "[0, 6)" in error.message


@pytest.mark.parametrize("bad", [-1, 6])
def test_rule7_active_range_is_n_times_k(bad):
    # A = 2, N*K = 6: 2..5 are valid (skipped) values, -1 and 6 are not.
    idx = np.arange(6, dtype=np.int32)
    MoeInitRoutingV2GradCall(**dropless(grad_expanded_x=np.zeros((2, 4), np.float32), active_num=2, expanded_row_idx=idx))
    idx[0] = bad
    rejected(dropless(grad_expanded_x=np.zeros((2, 4), np.float32), active_num=2, expanded_row_idx=idx),
             INVALID, "expanded_row_idx")


@pytest.mark.parametrize("bad", [-2, 6, 100])
def test_rule7_drop_pad_range_is_minus_one_to_e_c(bad):
    # E*C = 6: -1..5 are valid.
    MoeInitRoutingV2GradCall(**drop_pad(index=[5, -1, 0, -1, -1, 4]))
    error = rejected(drop_pad(index=[5, -1, 0, bad, -1, 4]), INVALID, "expanded_row_idx")
    assert f"expanded_row_idx[3]={bad}" in error.message and "[-1, 6)" in error.message


def test_rule7_duplicates():
    idx = np.array([0, 1, 5, 3, 2, 5], dtype=np.int32)
    error = rejected(dropless(expanded_row_idx=idx), INVALID, "expanded_row_idx")
    assert "expanded_row_idx[5]=5 repeats expanded_row_idx[2]" in error.message
    assert "allow_duplicate_indices" in error.message
    call = MoeInitRoutingV2GradCall(**dropless(expanded_row_idx=idx), allow_duplicate_indices=True)
    assert call.allow_duplicate_indices is True


def test_rule7_duplicates_in_drop_pad_ignore_minus_one():
    MoeInitRoutingV2GradCall(**drop_pad(index=[-1, -1, -1, -1, 3, -1]))
    error = rejected(drop_pad(index=[-1, 4, -1, 2, 4, -1]), INVALID, "expanded_row_idx")
    assert "expanded_row_idx[4]=4 repeats expanded_row_idx[1]" in error.message
    MoeInitRoutingV2GradCall(**drop_pad(index=[-1, 4, -1, 2, 4, -1]), allow_duplicate_indices=True)


def test_rule7_duplicates_when_e_c_dwarfs_the_index():
    # E*C = 10**12 with H = 0 costs no memory; the check must not build a table of E*C entries.
    # (H = 0 is an empty grad_x, which CANN 9.1 does not check at all: a profile before 9.1 here.)
    grad = np.zeros((10**6, 10**6, 0), dtype=np.float32)
    MoeInitRoutingV2GradCall(**drop_pad(grad_expanded_x=grad, index=[2**31 - 1, -1, 7, -1, -1, 0], order=BEFORE_9_1))
    error = rejected(drop_pad(grad_expanded_x=grad, index=[9, -1, 7, 9, -1, 7], order=BEFORE_9_1), INVALID,
                     "expanded_row_idx")
    assert "expanded_row_idx[3]=9 repeats expanded_row_idx[0]" in error.message


def test_rule7_duplicates_across_chunks_of_a_long_index():
    rng = np.random.default_rng(0)
    n = 1_500_000  # two chunks of the uniqueness scatter (2**20 each)
    idx = rng.permutation(n).astype(np.int32)
    grad = np.zeros((n, 0), dtype=np.float32)  # H = 0: unchecked from 9.1, so a profile before 9.1
    MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=4, order=BEFORE_9_1)
    first = int(idx[10])
    idx[n - 1] = first  # the same value 10 and n-1 positions apart, in different chunks
    error = rejected({"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": 4, "order": BEFORE_9_1}, INVALID,
                     "expanded_row_idx")
    assert f"expanded_row_idx[{n - 1}]={first} repeats expanded_row_idx[10]" in error.message


# --------------------------------------------------------------------------------------------------
# The other fields: order, allow_duplicate_indices, unknown keywords.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["pairwise", "", "ASCEND910B", 3])
def test_unknown_order(order):
    rejected(dropless(order=order), INVALID, "order")


def test_no_order_is_the_default_profile():
    # None names no profile, as an absent or nil order on the wire: the documented default, ascend910b@9.1.
    assert MoeInitRoutingV2GradCall(**dropless(order=None)).order == "ascend910b@9.1"


@pytest.mark.parametrize(("order", "profile"), [("ascend910b", "ascend910b@9.1"), ("sequential", "sequential"),
                                               ("ascend950@9.0", "ascend950@9.0"), ("ascend950@2025-12", "ascend950@8.5")])
def test_known_orders_are_kept_as_their_profile(order, profile):
    assert MoeInitRoutingV2GradCall(**dropless(order=order)).order == profile


@pytest.mark.parametrize("value", [1, "true", None])
def test_allow_duplicate_indices_must_be_a_bool(value):
    rejected(dropless(allow_duplicate_indices=value), INVALID, "allow_duplicate_indices")


def test_unknown_keyword():
    rejected(dropless(topk=2), INVALID, "topk")


# --------------------------------------------------------------------------------------------------
# Rule order: the first broken rule is the one reported.
# --------------------------------------------------------------------------------------------------

RULE_ORDER_CASES = {
    # name: (overrides of the valid dropless call, reported status, reported field)
    "1 before 2": ({"expanded_row_idx": None, "grad_expanded_x": np.zeros((6, 4), np.float64)}, NULLPTR, "expanded_row_idx"),
    "1 before 3": ({"grad_expanded_x": None, "top_k": 0}, NULLPTR, "grad_expanded_x"),
    "2 before 3": ({"expanded_row_idx": np.arange(6, dtype=np.int64), "top_k": 0}, INVALID, "expanded_row_idx"),
    "2 before 5": ({"grad_expanded_x": np.zeros((5, 4), np.float64)}, INVALID, "grad_expanded_x"),
    "3 before 4": ({"drop_pad_mode": 3, "grad_expanded_x": np.zeros((6,), np.float32)}, SHAPE, "drop_pad_mode"),
    "3: mode before top_k": ({"drop_pad_mode": 3, "top_k": 0}, SHAPE, "drop_pad_mode"),
    "3: top_k before active_num": ({"top_k": -1, "active_num": -1}, SHAPE, "top_k"),
    "4 before 5": ({"grad_expanded_x": np.zeros((5, 4, 1), np.float32)}, SHAPE, "grad_expanded_x"),
    "4: grad rank before index rank": ({"grad_expanded_x": np.zeros((6,), np.float32),
                                        "expanded_row_idx": np.zeros((2, 3), np.int32)}, SHAPE, "grad_expanded_x"),
    "5 before 6": ({"grad_expanded_x": np.zeros((5, 4), np.float32), "expanded_row_idx": np.arange(7, dtype=np.int32)},
                   SHAPE, "grad_expanded_x"),
    "6 before 7": ({"grad_expanded_x": np.zeros((7, 4), np.float32), "expanded_row_idx": np.full(7, 99, np.int32)}, SHAPE, "expanded_row_idx"),
    "5 before 7": ({"grad_expanded_x": np.zeros((5, 4), np.float32), "expanded_row_idx": np.full(6, -3, np.int32)}, SHAPE, "grad_expanded_x"),
    "7: range before duplicates": ({"expanded_row_idx": np.array([1, 1, 2, 3, 4, 6], np.int32)}, INVALID, "expanded_row_idx"),
}


@pytest.mark.parametrize("case", list(RULE_ORDER_CASES))
def test_rule_order(case):
    overrides, status, field = RULE_ORDER_CASES[case]
    error = rejected(dropless(**overrides), status, field)
    if case == "7: range before duplicates":
        assert "outside" in error.message


# A profile before CANN 9.1 -> the same chip at 9.1 (sequential, Huawei's golden of no release, keeps
# the earlier code).
AT_9_1 = {"ascend910b@8.5": "ascend910b@9.1", "ascend910b@9.0": "ascend910b@9.1", "ascend910_93@9.0": "ascend910_93@9.1",
          "ascend950@8.5": "ascend950@9.1", "ascend950@9.0": "ascend950@9.1", "ascend950@2025-12": "ascend950@9.1",
          "sequential": None}


@pytest.mark.parametrize("order", sorted(AT_9_1))
@pytest.mark.parametrize("case", [case for case, (_, status, _) in RULE_ORDER_CASES.items() if status == SHAPE])
def test_rules_3_to_6_are_561002_before_cann_9_1(case, order):
    # the earlier documentation's code for the same rules and the same field; 561103 from 9.1
    overrides, _, field = RULE_ORDER_CASES[case]
    rejected(dropless(**overrides, order=order), TILING, field)
    if AT_9_1[order] is not None:
        rejected(dropless(**overrides, order=AT_9_1[order]), SHAPE, field)


# --------------------------------------------------------------------------------------------------
# from_wire / to_wire.
# --------------------------------------------------------------------------------------------------

def wire_document(**overrides):
    call = MoeInitRoutingV2GradCall(**dropless())
    document = decode_body(encode_body(call.to_wire()))
    document.update(overrides)
    return document


def test_wire_round_trip():
    kwargs = dropless(hidden=5)
    kwargs["grad_expanded_x"] = np.random.default_rng(0).standard_normal((6, 5)).astype(ml_dtypes.bfloat16)
    call = MoeInitRoutingV2GradCall(**kwargs, order="sequential", allow_duplicate_indices=True)
    back = MoeInitRoutingV2GradCall.from_wire(decode_body(encode_body(call.to_wire())))
    assert back.grad_expanded_x.dtype == call.grad_expanded_x.dtype
    np.testing.assert_array_equal(back.grad_expanded_x.view(np.uint16), call.grad_expanded_x.view(np.uint16))
    np.testing.assert_array_equal(back.expanded_row_idx, call.expanded_row_idx)
    assert (back.top_k, back.drop_pad_mode, back.active_num, back.order, back.allow_duplicate_indices) == (
        2, 0, 0, "sequential", True)


def test_from_wire_unknown_field_is_malformed():
    with pytest.raises(MalformedRequest) as info:
        MoeInitRoutingV2GradCall.from_wire(wire_document(topk=2))
    assert not isinstance(info.value, InvalidArgument)
    assert info.value.field == "topk" and "'topk'" in info.value.message
    MoeInitRoutingV2GradCall.from_wire(wire_document(topk=2), extra_fields=frozenset({"topk"}))


@pytest.mark.parametrize("field", ["grad_expanded_x", "expanded_row_idx"])
def test_from_wire_missing_tensor_is_nullptr(field):
    document = wire_document()
    del document[field]
    with pytest.raises(InvalidArgument) as info:
        MoeInitRoutingV2GradCall.from_wire(document)
    assert (info.value.aclnn_status, info.value.aclnn_name, info.value.field) == (NULLPTR, NAMES[NULLPTR], field)
    document[field] = None  # msgpack nil: also a null tensor
    with pytest.raises(InvalidArgument) as info:
        MoeInitRoutingV2GradCall.from_wire(document)
    assert info.value.aclnn_status == NULLPTR


def test_from_wire_broken_tensor_is_malformed():
    document = wire_document(grad_expanded_x={"dtype": "float99", "shape": [6, 4], "data": b"\0" * 192})
    with pytest.raises(MalformedRequest) as info:
        MoeInitRoutingV2GradCall.from_wire(document)
    assert info.value.field == "grad_expanded_x"


def test_from_wire_element_cap():
    with pytest.raises(PayloadTooLarge) as info:
        MoeInitRoutingV2GradCall.from_wire(wire_document(), max_elements=23)
    assert info.value.field == "grad_expanded_x"
    MoeInitRoutingV2GradCall.from_wire(wire_document(), max_elements=24)


def test_from_wire_default_order_and_attribute_rules():
    document = wire_document()
    del document["order"]
    assert MoeInitRoutingV2GradCall.from_wire(document, default_order="sequential").order == "sequential"
    del document["top_k"]
    with pytest.raises(InvalidArgument) as info:
        MoeInitRoutingV2GradCall.from_wire(document)
    assert (info.value.aclnn_status, info.value.field) == (SHAPE, "top_k")
    with pytest.raises(InvalidArgument) as info:
        MoeInitRoutingV2GradCall.from_wire(wire_document(top_k=2.0))
    assert (info.value.aclnn_status, info.value.field) == (SHAPE, "top_k")
    for order in ("fastest", "", False, 0):
        with pytest.raises(InvalidArgument) as info:
            MoeInitRoutingV2GradCall.from_wire(wire_document(order=order))
        assert (info.value.aclnn_status, info.value.field) == (INVALID, "order")
    assert MoeInitRoutingV2GradCall.from_wire(wire_document(order=None), default_order="sequential").order == "sequential"


@pytest.mark.parametrize("default", ["ascend910b@9.1", "ascend950", BEFORE_9_1, "ascend910b@8.5"])
def test_a_call_names_its_profile_only_when_it_was_given_one(default):
    """names_profile is the one test of it (docs/protocol.md: a call that names no profile runs on
    its server's): a call built naming none, by with_default_order or from_wire (an order absent or
    nil), is checked on the default's rules and carries that profile, yet names none."""
    canonical = resolve_profile(default).name
    document = wire_document()
    del document["order"]
    for unnamed in (
        MoeInitRoutingV2GradCall.from_wire(document, default_order=default),
        MoeInitRoutingV2GradCall.from_wire({**document, "order": None}, default_order=default),
        MoeInitRoutingV2GradCall.with_default_order(default, **dropless()),
        MoeInitRoutingV2GradCall.with_default_order(default, **dropless(order=None)),
    ):
        assert not names_profile(unnamed) and unnamed.order == canonical
    for named in (
        MoeInitRoutingV2GradCall.from_wire({**document, "order": default}, default_order="sequential"),
        MoeInitRoutingV2GradCall.with_default_order("sequential", **dropless(order=default)),
    ):
        assert names_profile(named) and named.order == canonical
    with pytest.raises(InvalidArgument) as info:  # the default's rules: 561002 before CANN 9.1, 561103 from it
        MoeInitRoutingV2GradCall.with_default_order(default, **dropless(top_k=0))
    assert info.value.aclnn_status == (TILING if canonical.endswith(("@9.0", "@8.5")) else SHAPE)


def test_to_wire_encodes_big_endian_and_strided_arrays():
    grad = np.arange(48, dtype=">f4").reshape(6, 8)[:, ::2]
    call = MoeInitRoutingV2GradCall(**dropless(grad_expanded_x=grad))
    document = call.to_wire()
    assert document["grad_expanded_x"]["shape"] == [6, 4]
    assert bytes(document["grad_expanded_x"]["data"]) == encode_tensor(np.ascontiguousarray(grad, "<f4"))["data"].tobytes()
    assert bytes(document["grad_expanded_x"]["data"]) == np.arange(48, dtype="<f4").reshape(6, 8)[:, ::2].tobytes()
