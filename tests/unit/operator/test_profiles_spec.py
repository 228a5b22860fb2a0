"""Validation per device profile: the invalid-slot rules at their boundaries, the attribute code, the
CANN 9.1 empty-tensor rules, and the profile names (docs/semantics.md sections 2, 5 and 8).

Oracle: the kernels' public sources, written out in tests/support/profile_cases.py (never read from
moegrad's table): which slot values each profile accepts, and which of them are rows of +0.0. The
accepted calls' bits come from the slow loop (tests/support/slow_loops.py), the float64 golden's
from math.fsum over the rows each slot reads.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import moegrad
from moegrad import CallGroup, InvalidArgument, MoeInitRoutingV2GradCall, moe_init_routing_v2_grad
from moegrad.accuracy import skipped_rows
from support.bits import assert_bitwise_equal
from support.profile_cases import BASE, BOUNDARIES, HIDDEN, LENIENT, TOKENS, TOP_K, boundary_call
from support.slow_loops import SLOW_ALIASES, SLOW_PROFILES, slot_skipped, slow_profile

INVALID, TILING, SHAPE = 161002, 561002, 561103
PROFILE_NAMES = [*SLOW_PROFILES, *SLOW_ALIASES]
call_with = boundary_call


def lenient(profile: str) -> bool:
    return SLOW_PROFILES[SLOW_ALIASES.get(profile, profile)][1]


def golden(kwargs: dict, is_lenient: bool) -> np.ndarray:
    """Each token's exact sum of the rows its slots read, rounded once to float64 (math.fsum)."""
    grad, idx = kwargs["grad_expanded_x"], kwargs["expanded_row_idx"]
    flat = grad.reshape(-1, HIDDEN).astype(np.float64)
    out = np.zeros((TOKENS, HIDDEN))
    for i in range(TOKENS):
        read = [int(j) for j in idx[i * TOP_K:(i + 1) * TOP_K]
                if not slot_skipped(int(j), kwargs["drop_pad_mode"], kwargs["active_num"], idx.size, is_lenient)]
        for h in range(HIDDEN):
            out[i, h] = math.fsum(flat[j, h] for j in read)
    return out


@pytest.mark.parametrize("profile", PROFILE_NAMES)
@pytest.mark.parametrize(("mode", "label", "value", "before", "at_9_1"), BOUNDARIES,
                         ids=[f"{b[0]}-{b[1]}" for b in BOUNDARIES])
def test_each_boundary_is_accepted_or_refused_as_the_kernel_source_says(profile, mode, label, value, before, at_9_1):
    kwargs = call_with(mode, value)
    accepted = at_9_1 if lenient(profile) else before
    if not accepted:
        with pytest.raises(InvalidArgument) as refused:
            MoeInitRoutingV2GradCall(**kwargs, order=profile)
        error = refused.value
        assert (error.aclnn_status, error.field) == (INVALID, "expanded_row_idx")
        assert f"expanded_row_idx[2]={value}" in error.message
        # the refusal names the profile that would accept the call, or says none does
        assert (f"{LENIENT} accepts it" in error.message) == at_9_1
        assert ("no profile defines it" in error.message) == (not at_9_1)
        return
    call = MoeInitRoutingV2GradCall(**kwargs, order=profile)
    grad_x = moe_init_routing_v2_grad(call)
    assert_bitwise_equal(grad_x, slow_profile(**kwargs, profile=profile))
    np.testing.assert_array_equal(moegrad.moe_init_routing_v2_grad_golden(call), golden(kwargs, lenient(profile)))


@pytest.mark.parametrize("path", ["numba", "numpy"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
def test_the_950_at_9_1_adds_a_zero_row_for_every_invalid_slot_on_every_path(monkeypatch, path, layout, mode):
    if path == "numba":
        pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")
    monkeypatch.setattr(moegrad.numerics._reference, "_KERNEL", path)
    rng = np.random.default_rng([len(mode), len(layout), len(path)])
    slots = 40 * 9
    rows = {"dropless": slots, "active": 200, "drop_pad": 400}[mode]
    idx = rng.permutation(rows)[:slots] if rows >= slots else rng.permutation(slots)
    idx = idx.astype(np.int64)
    invalid = rng.random(slots) < 0.3
    idx[invalid] = rng.choice([-1, -5, -(2**31), rows, 2**31 - 1] if mode != "drop_pad" else [-1, -5, -(2**31)],
                              invalid.sum())
    idx[:9] = -3  # token 0: every slot a +0.0 row
    shape = (rows, 67) if mode != "drop_pad" else (20, 20, 67)
    grad = rng.standard_normal(shape).astype(np.float32)
    grad[grad > 1.5] = -0.0
    if layout == "strided":
        grad = np.repeat(grad, 2, axis=-1)[..., ::2]
    kwargs = {"grad_expanded_x": grad, "expanded_row_idx": idx.astype(np.int32), "top_k": 9,
              "drop_pad_mode": int(mode == "drop_pad"), "active_num": 200 if mode == "active" else 0}
    call = MoeInitRoutingV2GradCall(**kwargs, order=LENIENT)
    grad_x = moe_init_routing_v2_grad(call)
    assert_bitwise_equal(grad_x, slow_profile(**kwargs, profile=LENIENT))
    assert skipped_rows(call)[0] and (grad_x[0] == 0).all() and not np.signbit(grad_x[0]).any()
    many = moegrad.moe_init_routing_v2_grad_many([call, call])
    assert_bitwise_equal(many[1], grad_x)


@pytest.mark.parametrize(("mode", "label", "value", "before", "at_9_1"), BOUNDARIES,
                         ids=[f"{b[0]}-{b[1]}" for b in BOUNDARIES])
@pytest.mark.parametrize("profile", ["ascend910b@9.1", "ascend950@9.0", LENIENT])
def test_a_call_group_breaks_rule_7_exactly_where_the_single_call_does(profile, mode, label, value, before, at_9_1):
    good, bad = call_with(mode, BASE[mode][2]), call_with(mode, value)
    like = MoeInitRoutingV2GradCall(**good, order=profile)
    stacked = np.stack([good["expanded_row_idx"], bad["expanded_row_idx"]])
    broken = CallGroup.breaking_rule_7(like, stacked)
    assert broken.tolist() == [False, not (at_9_1 if lenient(profile) else before)]


def test_repeats_of_the_zero_rows_are_accepted_and_of_rows_read_refused_on_the_950_at_9_1():
    repeated = call_with("dropless", -1)
    repeated["expanded_row_idx"] = np.array([-1, 0, -1, 9, 9, 1], np.int32)  # -1 twice, N*K + 3 twice
    MoeInitRoutingV2GradCall(**repeated, order=LENIENT)
    with pytest.raises(InvalidArgument) as refused:
        MoeInitRoutingV2GradCall(**repeated, order="ascend950@9.0")
    assert "ascend950@9.1 accepts it" in refused.value.message
    active = call_with("active", 4)
    active["expanded_row_idx"] = np.array([4, 0, 5, 5, 1, 2], np.int32)  # 5 >= A twice: zero rows on 9.1
    MoeInitRoutingV2GradCall(**active, order=LENIENT)
    with pytest.raises(InvalidArgument) as refused:  # before 9.1 the documented uniqueness holds over [0, N*K)
        MoeInitRoutingV2GradCall(**active, order="ascend910b@9.1")
    assert "repeats expanded_row_idx[2]" in refused.value.message
    read_twice = call_with("dropless", -1)
    read_twice["expanded_row_idx"] = np.array([-1, 0, -1, 3, 3, 1], np.int32)
    with pytest.raises(InvalidArgument) as refused:
        MoeInitRoutingV2GradCall(**read_twice, order=LENIENT)
    assert "expanded_row_idx[4]=3 repeats expanded_row_idx[3]" in refused.value.message
    assert MoeInitRoutingV2GradCall(**read_twice, order=LENIENT, allow_duplicate_indices=True)


def test_huaweis_binding_backward_is_accepted_on_the_950_at_9_1_only():
    # cann_ops_transformer's moe_init_routing (active_expert_range) fills the index with -1 and its
    # autograd calls this operator in dropless mode (recursion-ascend @ a093e954)
    kwargs = call_with("dropless", -1)
    kwargs["expanded_row_idx"] = np.array([0, -1, -1, -1, 1, 2], np.int32)
    grad_x = moe_init_routing_v2_grad(**kwargs, order="ascend950")  # the bare chip: 9.1
    grad = kwargs["grad_expanded_x"]
    want = [grad[0], np.zeros(HIDDEN, np.float32), grad[1] + grad[2]]
    assert_bitwise_equal(grad_x, np.stack([np.float32(0) + w for w in want]))
    for older in ("ascend950@9.0", "ascend950@8.5", "ascend910b", "ascend910_93@9.1"):
        with pytest.raises(InvalidArgument, match="ascend950@9.1 accepts it"):
            moe_init_routing_v2_grad(**kwargs, order=older)


# --------------------------------------------------------------------------------------------------
# Rules 3-6's code, and the CANN 9.1 empty-tensor rules.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILE_NAMES)
def test_the_attribute_code_is_561002_before_cann_9_1_and_561103_from_it(profile):
    release = SLOW_ALIASES.get(profile, profile).partition("@")[2]
    want = SHAPE if release == "9.1" else TILING  # sequential (no release) keeps the earlier code
    for overrides, field in (({"top_k": 0}, "top_k"), ({"drop_pad_mode": 2}, "drop_pad_mode"),
                             ({"active_num": 5}, "grad_expanded_x"), ({"top_k": 4}, "expanded_row_idx")):
        with pytest.raises(InvalidArgument) as refused:
            MoeInitRoutingV2GradCall(**{**call_with("dropless", 5), **overrides}, order=profile)
        assert (refused.value.aclnn_status, refused.value.field) == (want, field)
    out = np.empty((4, 4), np.float32)  # another shape than [N, H]: the same code, field grad_x
    with pytest.raises(InvalidArgument) as refused:
        moe_init_routing_v2_grad(**call_with("dropless", 5), order=profile, out=out)
    assert (refused.value.aclnn_status, refused.value.field) == (want, "grad_x")


EMPTY_OUT = {  # (kwargs, grad_x's shape): grad_x is empty, and the call breaks rules 2-7 otherwise
    "N = 0, mode 7, int32 grad": (dict(grad_expanded_x=np.zeros((0, 4), np.int32), expanded_row_idx=np.zeros(0, np.int32),
                                       top_k=2, drop_pad_mode=7), (0, 4)),
    "N = 0, float16 index": (dict(grad_expanded_x=np.zeros((3, 4), np.float32),
                                  expanded_row_idx=np.zeros(0, np.float16), top_k=3, active_num=-2), (0, 4)),
    "H = 0, index outside": (dict(grad_expanded_x=np.zeros((2, 0), np.float16),
                                  expanded_row_idx=np.array([9, 9, -4, 70], np.int32), top_k=2), (2, 0)),
    "H = 0, drop/pad rank": (dict(grad_expanded_x=np.zeros((6, 0), np.float32),
                                  expanded_row_idx=np.arange(6, dtype=np.int32), top_k=3, drop_pad_mode=1), (2, 0)),
}


@pytest.mark.parametrize("case", list(EMPTY_OUT))
def test_an_empty_grad_x_skips_every_attribute_check_from_cann_9_1(case):
    kwargs, shape = EMPTY_OUT[case]
    for profile in ("ascend910b@9.1", "ascend910_93@9.1", LENIENT):
        grad_x = moe_init_routing_v2_grad(**kwargs, order=profile)  # no launch: phase one succeeds
        assert grad_x.shape == shape and grad_x.dtype == kwargs["grad_expanded_x"].dtype
    for profile in ("ascend910b@9.0", "ascend950@8.5", "sequential"):
        with pytest.raises(InvalidArgument) as refused:
            MoeInitRoutingV2GradCall(**kwargs, order=profile)
        assert refused.value.aclnn_status in (INVALID, TILING)


@pytest.mark.parametrize(("kwargs", "status", "field"), [
    # what sizes grad_x ([len(idx) / top_k, H]) is still checked: top_k, the index's rank and length
    (dict(grad_expanded_x=np.zeros((2, 0), np.float32), expanded_row_idx=np.arange(4, dtype=np.int32), top_k=0),
     SHAPE, "top_k"),
    (dict(grad_expanded_x=np.zeros((2, 0), np.float32), expanded_row_idx=np.arange(5, dtype=np.int32), top_k=2),
     SHAPE, "expanded_row_idx"),
    (dict(grad_expanded_x=np.zeros((2, 0), np.float32), expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2.5),
     SHAPE, "top_k"),
    # an empty tensor's dtype must still be one moegrad carries
    (dict(grad_expanded_x=np.zeros((0, 4), np.float64), expanded_row_idx=np.zeros(0, np.int32), top_k=2),
     INVALID, "grad_expanded_x"),
    # grad_x not empty (drop/pad with E*C = 0): the kernel runs, so the dtypes are checked
    (dict(grad_expanded_x=np.zeros((0, 3, 4), np.int32), expanded_row_idx=np.full(4, -1, np.int32), top_k=2,
          drop_pad_mode=1), INVALID, "grad_expanded_x"),
    # a non-empty tensor's dtype is checked beside an empty grad_x
    (dict(grad_expanded_x=np.zeros((2, 0), np.float32), expanded_row_idx=np.arange(4, dtype=np.int64), top_k=2),
     INVALID, "expanded_row_idx"),
], ids=["top_k 0", "length not divisible", "top_k not an integer", "empty float64", "E*C = 0 int32",
        "non-empty int64 index"])
def test_what_an_empty_grad_x_still_needs_from_cann_9_1(kwargs, status, field):
    with pytest.raises(InvalidArgument) as refused:
        MoeInitRoutingV2GradCall(**kwargs, order="ascend910b@9.1")
    assert (refused.value.aclnn_status, refused.value.field) == (status, field)


# --------------------------------------------------------------------------------------------------
# Names: every profile, every alias, kept as the canonical name.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_every_name_is_kept_as_its_profile_on_every_way_in(name):
    profile = SLOW_ALIASES.get(name, name)
    call = MoeInitRoutingV2GradCall(**call_with("dropless", 5), order=name)
    assert call.order == profile and call.profile.name == profile
    assert call.to_wire()["order"] == profile
    document = moegrad.decode_body(moegrad.encode_body({**call.to_wire(), "order": name}))
    assert MoeInitRoutingV2GradCall.from_wire(document).order == profile
    del document["order"]
    assert MoeInitRoutingV2GradCall.from_wire(document, default_order=name).order == profile
    assert moegrad.resolve_profile(name) is moegrad.PROFILES[profile]


def test_the_profile_names_and_the_default():
    assert set(moegrad.PROFILES) == set(SLOW_PROFILES)
    assert MoeInitRoutingV2GradCall(**call_with("dropless", 5)).order == "ascend910b@9.1"
    for bad in ("ascend910b@9.2", "ascend950@2026-02", "Ascend950", "ascend910b@", "@9.1", ""):
        with pytest.raises(InvalidArgument) as refused:
            MoeInitRoutingV2GradCall(**call_with("dropless", 5), order=bad)
        assert (refused.value.aclnn_status, refused.value.field) == (INVALID, "order")
        assert "ascend950@9.1" in refused.value.message or "release one of 8.5, 9.0, 9.1" in refused.value.message


def test_the_settings_and_the_torch_switch_take_profile_names():
    from moegrad_service.settings import Settings

    assert Settings(order="ascend950").order == "ascend950@9.1"
    assert Settings().order == "ascend910b@9.1"
    with pytest.raises(ValueError, match="not a device profile"):
        Settings(order="ascend910")
    mt = pytest.importorskip("moegrad.torch", reason="the torch extra")
    with mt.using_order("ascend950@2025-12"):
        assert mt.set_order("ascend910_93") == "ascend950@8.5"
        assert mt.set_order("ascend950@8.5") == "ascend910_93@9.1"
    with pytest.raises(InvalidArgument) as refused:
        mt.set_order("ascend920")
    assert (refused.value.aclnn_status, refused.value.field) == (INVALID, "order")


@pytest.mark.parametrize("path", ["numba", "numpy"])
def test_the_comparison_leaves_the_zero_rows_of_the_950_at_9_1_out_of_its_golden(monkeypatch, path):
    # the accuracy comparison (compiled and NumPy) sums the rows read, as the golden above does
    if path == "numba":
        pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")
    else:
        monkeypatch.setattr("moegrad.accuracy._compare.fused_metrics", lambda *args, **kwargs: None)
    kwargs = boundary_call("dropless", -1)
    kwargs["expanded_row_idx"] = np.array([-1, 2**31 - 1, 0, -7, 4, 6], np.int32)  # token 0: no row read
    call = MoeInitRoutingV2GradCall(**kwargs, order=LENIENT)
    device = slow_profile(**kwargs, profile=LENIENT)
    report = moegrad.compare(call, device, require_exact=True)
    assert report.passed and report.zero_rows.rows == 1
    assert report.device_vs_golden.max_abs_error <= np.abs(golden(kwargs, True)).max() * 2.0**-23
    wrong = device.copy()
    wrong[0, 0] = 1.0  # a row every slot of which is a +0.0 row must be +0.0
    assert moegrad.compare(call, wrong).zero_rows.mismatched_rows == 1


def test_the_profiles_are_the_device_profiles_and_the_old_names_their_aliases(monkeypatch):
    pytest.importorskip("torch", reason="the msprobe extra")
    import moegrad.msprobe as bench

    # A2/A3 run MoeTokenPermuteGrad for the permute backward (a chain: the sequential golden's bits);
    # the 950 runs this operator for both; the names are moegrad's device profiles
    assert set(bench.PROFILES) == set(moegrad.PROFILES)
    assert bench.PROFILES["ascend910_93@9.0"] == bench.Profile("ascend910_93@9.0", "sequential", "ascend910_93@9.0")
    assert bench.PROFILES["ascend950@8.5"] == bench.Profile("ascend950@8.5", "ascend950@8.5", "ascend950@8.5")
    for name, profile in (("ascend910b", "ascend910b@9.1"), ("ascend950", "ascend950@9.1"),
                          ("ascend950@2025-12", "ascend950@8.5"), ("sequential", "sequential")):
        monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", name)
        assert bench.current_profile().name == profile
    monkeypatch.delenv("MOEGRAD_MSPROBE_ORDER")
    assert bench.current_profile().name == "ascend910b@9.1"


def test_a_profile_names_its_kernels_schedule_and_keeps_the_former_name():
    """``Profile.schedule`` is the kernel's schedule of adds (docs/semantics.md, the profile table:
    bins on A2/A3, a chain on the 950 at 8.5 and for the golden, groups of four on the 950 from
    9.0); ``Profile.order`` is the same value under its former name."""
    expected = {"ascend910b": "bins", "ascend910_93": "bins"}
    for name, profile in moegrad.PROFILES.items():
        if profile.chip == "ascend950":
            want = "chain" if profile.release == "8.5" else "groups_of_four"
        else:
            want = expected.get(profile.chip, "chain")
        assert profile.schedule == want == profile.order, name
