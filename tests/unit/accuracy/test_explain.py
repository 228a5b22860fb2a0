"""moegrad.explain: one label per differing row, with its slot, row, schedule and evidence.

Oracles: the worked examples of docs/accuracy.md ("Explaining a mismatch"), each label's arrays
small enough to add by hand (their sums are written out below); the planted-fault matrix of
``support.planted``, whose candidates and device results come from slow per-row loops that share
no code with explain (a deterministic sample here, the whole matrix in ``python -m
bench.explain_matrix``); ``math.fsum`` and hand ULPs for the element figures.
"""

from __future__ import annotations

import json
import math
import threading
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import AclnnStatus, InvalidArgument, MoeInitRoutingV2GradCall, accuracy, explain
from moegrad.accuracy import _fused
from support import planted
from support.inputs import BF16, F16, F32

F = np.float32
U = 2.0**-24
SUMMAND_FAULTS = {"missing", "duplicated", "replaced", "extra"}


def call_of(rows, index, top_k, **attributes):
    return MoeInitRoutingV2GradCall(grad_expanded_x=np.asarray(rows), expanded_row_idx=np.array(index, dtype=np.int32),
                                    top_k=top_k, **attributes)


INTEGERS = np.array([[1, 2, 3, 4], [10, 20, 30, 40], [100, 200, 300, 400], [1000, 2000, 3000, 4000],
                     [5, 6, 7, 8], [50, 60, 70, 80]], dtype=F)  # fmt: skip


def integer_call():
    """Two tokens, K = 3: token 0 reads rows 0, 1, 2 (sum [111, 222, 333, 444]), token 1 rows 3, 4, 5."""
    return call_of(INTEGERS, [0, 1, 2, 3, 4, 5], 3)


def only(explanation, row=0):
    assert [r.row for r in explanation.rows] == [row]
    return explanation.rows[0]


# --------------------------------------------------------------------------------------------------
# The worked examples, one per label (docs/accuracy.md)
# --------------------------------------------------------------------------------------------------

# One token, K = 3, H = 2; the slots' rows v0 = [1, 2^-24], v1 = [2^-24, 2^-24], v2 = [-1, 1].
ORDER_ROWS = np.array([[1.0, U], [U, U], [-1.0, 1.0]], dtype=F)


def test_order_a_known_schedule_reproduces_the_row():
    call = call_of(ORDER_ROWS, [0, 1, 2], 3)
    # A2/A3 (K = 3): (v0 + v2) + v1: col 0 = (1 - 1) + 2^-24 = 2^-24; col 1 = (2^-24 + 1) + 2^-24 = 1
    # (each add a tie, to even); the exact sums are [2^-24, 1 + 2^-23]
    device = moegrad.moe_init_routing_v2_grad(call)
    assert device.tolist() == [[U, 1.0]]
    # sequential: ((0 + v0) + v1) + v2: col 0 = (1 + 2^-24) - 1 = 0; col 1 = (2^-24 + 2^-24) + 1 = 1 + 2^-23
    candidate = np.array([[0.0, 1 + 2.0**-23]], dtype=F)
    row = only(explain(call, candidate))
    assert (row.label, row.profile, row.slot, row.source_row) == ("order", "sequential", None, None)
    assert row.evidence.exact and "sequential" in row.evidence.schedules and "ascend950@8.5" in row.evidence.schedules
    assert row.elements.differing == 2 and row.elements.within_bound == (True, True)
    # the candidate is exact in column 1 and the device in column 0
    assert dict(zip(row.elements.column, row.elements.closer, strict=True)) == {0: "device", 1: "candidate"}


def test_order_within_the_bound_when_no_known_schedule_reproduces_it():
    call = call_of(ORDER_ROWS, [0, 1, 2], 3)
    # the correctly rounded sum [2^-24, 1 + 2^-23]: no schedule gives it (reversed gives the device's
    # [2^-24, 1], pairwise the sequential [0, 1 + 2^-23]), and it is within the bound
    candidate = np.array([[U, 1 + 2.0**-23]], dtype=F)
    row = only(explain(call, candidate))
    assert (row.label, row.profile) == ("order", None)
    assert not row.evidence.exact and row.evidence.outside_bound_columns == 0
    assert row.elements.candidate_closer == 1 and row.elements.closer == ("candidate",)  # it is the golden


def test_missing():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [101, 202, 303, 404]  # rows 0 + 2: slot 1 (row 1) left out
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("missing", 1, 1)
    assert row.evidence.exact and row.profile == "ascend910b@9.1"
    assert row.evidence.outside_bound_columns == 4
    assert row.slots.index == (0, 1, 2) and row.slots.row == (0, 1, 2) and row.slots.skipped == (False,) * 3


def test_duplicated():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [121, 242, 363, 484]  # row 1 added twice
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("duplicated", 1, 1)


def test_replaced():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [1011, 2022, 3033, 4044]  # rows 0 + 1 + 3: slot 2 read row 3, its neighbour, not row 2
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("replaced", 2, 3)


def test_extra_with_the_drop_pad_provenance():
    # E = 2 experts, C = 2: rows 0, 1 (expert 0), 2, 3 (expert 1); token 0 reads rows 0 and 2, slot 2 dropped
    grad = INTEGERS[:4].reshape(2, 2, 4)
    call = call_of(grad, [0, 2, -1], 3, drop_pad_mode=1)
    assert moegrad.moe_init_routing_v2_grad(call).tolist() == [[101, 202, 303, 404]]
    candidate = np.array([[1101, 2202, 3303, 4404]], dtype=F)  # -1 read as the last row (3)
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("extra", 2, 3)
    assert row.slots.skipped == (False, False, True)
    assert row.slots.expert == (0, 1, None) and row.slots.capacity_row == (0, 0, None)
    assert explain(call, candidate).capacity == 2


def test_extra_on_the_950_at_9_1_whose_negative_slots_are_zero_rows():
    # dropless on ascend950@9.1: a -1 slot is a +0.0 row (docs/semantics.md section 2)
    call = call_of(INTEGERS[:4], [0, -1, 1, 2], 2, order="ascend950@9.1")
    device = moegrad.moe_init_routing_v2_grad(call)
    assert device.tolist() == [[1, 2, 3, 4], [110, 220, 330, 440]]
    candidate = device.copy()
    candidate[0] = [1001, 2002, 3003, 4004]  # -1 read as the last row (3), Python's way
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("extra", 1, 3)
    assert row.slots.skipped == (False, True) and row.slots.row == (0, None)


def test_active_mode_skips_the_rows_past_active_num():
    call = call_of(INTEGERS[:4], [0, 5, 1, 2, 3, 4], 2, active_num=4)  # slots of index 4, 5 read no row
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [1001, 2002, 3003, 4004]  # index 5 read as row 3 (clamped to the last row)
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("extra", 1, 3)
    assert row.slots.skipped == (False, True) and row.slots.expert == (None, None)


def test_precision():
    # float16, K = 4: rows [2048, 4096] and three of [1, 2]. The device adds in float32 (2051, 4102)
    # and rounds once (ties to even: 2052, 4104); a float16 chain rounds every add: 2048 + 1 = 2049
    # is a tie, to 2048, and so on: [2048, 4096].
    rows = np.array([[2048, 4096], [1, 2], [1, 2], [1, 2]], dtype=np.float16)
    call = call_of(rows, [0, 1, 2, 3], 4)
    assert moegrad.moe_init_routing_v2_grad(call).tolist() == [[2052, 4104]]
    candidate = np.array([[2048, 4096]], dtype=np.float16)
    row = only(explain(call, candidate))
    assert (row.label, row.profile, row.evidence.accumulator) == ("precision", "sequential", "float16")
    assert row.elements.outside_bound == 2  # |2048 - 2051| = 3 > gamma_3 * 2051 + 1 (half an ULP at 2048)


def test_nonfinite_names_the_slot_that_carries_it():
    rows = np.array([[1, 2], [np.nan, 3]], dtype=F)
    call = call_of(rows, [0, 1], 2)
    candidate = np.array([[1, 5]], dtype=F)  # the NaN read as 0
    row = only(explain(call, candidate))
    assert (row.label, row.slot, row.source_row) == ("nonfinite", 1, 1)
    assert row.evidence.nonfinite_columns == (0,)
    no_input_carries_it = explain(call_of(rows[[0, 0]] + np.array([[0], [1]], dtype=F), [0, 1], 2),
                                  np.array([[np.nan, 4]], dtype=F))  # fmt: skip
    assert (only(no_input_carries_it).label, only(no_input_carries_it).slot) == ("nonfinite", None)


def test_unexplained():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [116, 222, 333, 451]  # +5 and +7 in two columns: no summand, no order
    row = only(explain(call, candidate))
    assert row.label == "unexplained" and row.evidence.outside_bound_columns == 2


def test_one_column_is_ambiguous_rather_than_a_guess():
    call = call_of(INTEGERS[:3, :1], [0, 1, 2], 3)  # H = 1: rows 1, 10, 100
    row = only(explain(call, np.array([[101]], dtype=F)))  # 1 + 100: slot 1 missing?
    assert (row.label, row.slot, row.source_row) == ("ambiguous", None, None)
    assert ("missing", 1, 1) in {(h.label, h.slot, h.source_row) for h in row.evidence.candidates}


def test_labels_count_every_label_and_the_text_lists_the_rows():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [101, 202, 303, 404]
    candidate[1] = candidate[1] + 7
    result = explain(call, candidate)
    assert result.labels == {label: int(label in ("missing", "unexplained")) for label in accuracy.LABELS}
    assert result.differing_rows == 2 and result.row(1).label == "unexplained" and result.row(5) is None
    assert "missing" in str(result) and "2 rows differ" in str(result)


# --------------------------------------------------------------------------------------------------
# The planted-fault matrix (support.planted), a deterministic sample: the gates of the issue
# --------------------------------------------------------------------------------------------------

SAMPLE = planted.sample(96)


def _explained(case):
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    return call, explain(call, case.candidate).to_dict()["rows"]


@pytest.mark.parametrize("entry", SAMPLE, ids=lambda e: f"{e[4]}-{e[0]}-{np.dtype(e[1]).name}-K{e[2]}-H{e[3]}-{e[5]}")
def test_planted_faults_meet_the_gates(entry):
    case = planted.build(*entry)
    call, rows = _explained(case)
    kind = planted.PLANTS[case.plant][1]
    given = {row["row"]: row for row in rows}
    assert set(given) <= set(case.planted), "a row the plant left alone is listed"
    assert explain(call, case.device).rows == (), "the device's own bits must give no row"
    for i, want in case.planted.items():
        row = given.get(i)
        if row is None:
            continue  # the fault changed no bit of this row
        label = row["label"]
        if kind == "summand":
            assert label != "order", f"row {i}: a {case.plant} labelled order"
        if kind == "order":
            assert label in ("order", "ambiguous"), f"row {i}: a pure order difference labelled {label}"
        if label in SUMMAND_FAULTS:
            assert (label, row["slot"], row["source_row"]) == (want.label, want.slot, want.source), f"row {i}"
        if case.hidden == 1:
            assert label not in SUMMAND_FAULTS | {"precision"}, f"row {i}: H = 1 cannot carry a fingerprint"
        if case.plant == "nan_input":
            assert (label, row["slot"], row["source_row"]) == ("nonfinite", want.slot, want.source)


def test_the_sample_covers_every_plant_and_both_profiles():
    plants = {entry[4] for entry in SAMPLE}
    assert plants == set(planted.PLANTS)
    assert {entry[5] for entry in SAMPLE} == set(planted.PROFILES)
    assert {entry[3] for entry in SAMPLE} == set(planted.HIDDEN)


def test_the_planted_device_is_the_emulation():
    """The slow loops' device result is moegrad's emulation, bit for bit (so the gates test explain)."""
    for entry in SAMPLE[:20]:
        case = planted.build(*entry)
        device = moegrad.moe_init_routing_v2_grad(MoeInitRoutingV2GradCall(**case.kwargs()))
        nan = np.isnan(device.astype(F))
        assert (nan == np.isnan(case.device.astype(F))).all()
        assert (device[~nan].view(np.uint16 if device.itemsize == 2 else np.uint32)
                == case.device[~nan].view(np.uint16 if device.itemsize == 2 else np.uint32)).all(), case.name


# --------------------------------------------------------------------------------------------------
# The device's own bits, the element figures, the dict form, the profile, the NumPy path
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["ascend910b@9.1", "ascend950@9.1", "ascend950@8.5", "sequential"])
@pytest.mark.parametrize("mode", planted.MODES)
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_the_device_result_gives_no_row(profile, mode, dtype):
    case = planted.build(mode, dtype, 5, 7, "sequential", "ascend910b@9.1")
    call = MoeInitRoutingV2GradCall(**{**case.kwargs(), "order": profile})
    grad = call.grad_expanded_x.copy()
    grad.reshape(-1, 7)[0, 3] = np.nan  # a NaN among the inputs: still no row
    call = call.model_copy(update={"grad_expanded_x": grad})
    assert explain(call, moegrad.moe_init_routing_v2_grad(call)).rows == ()


def test_element_figures_by_hand():
    call = call_of(ORDER_ROWS, [0, 1, 2], 3)
    row = only(explain(call, np.array([[0.0, 1 + 2.0**-23]], dtype=F)))
    figures = dict(zip(row.elements.column, zip(row.elements.candidate, row.elements.device, row.elements.golden,
                   row.elements.ulp_candidate_device, row.elements.ulp_candidate_golden, row.elements.ulp_device_golden,
                   row.elements.bound, strict=True), strict=True))  # fmt: skip
    assert figures[1][:3] == (1 + 2.0**-23, 1.0, math.fsum([U, U, 1.0]))
    assert figures[1][3:6] == (1.0, 0.0, 1.0)  # neighbours; the golden's ULP at 1 + 2^-23 is 2^-23
    gamma2 = 2 * U / (1 - 2 * U)
    assert figures[1][6] == pytest.approx(gamma2 * (1 + 2 * U), rel=1e-9)  # gamma_2 * sum |v|
    # column 0 cancels: 0 against a golden of 2^-24 is 2^23 ULPs of the golden, yet within the bound
    assert figures[0][:3] == (0.0, U, U) and figures[0][4] == 2.0**23 and figures[0][3] == 0x33800000
    assert figures[0][6] == pytest.approx(gamma2 * (2 + U), rel=1e-9)


def test_worst_elements_are_bounded_and_counted():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * 3, 64)).astype(F)
    call = call_of(x, rng.permutation(12), 3)
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[2] += F(1.0)  # every column of row 2 differs
    row = only(explain(call, candidate), row=2)
    assert row.elements.differing == 64 and len(row.elements.column) == accuracy._explanation.WORST_ELEMENTS
    ratios = [abs(c - g) / b for c, g, b in zip(row.elements.candidate, row.elements.golden, row.elements.bound)]
    assert ratios == sorted(ratios, reverse=True)  # the farthest outside the bound first


def test_the_dict_form_is_json_and_comes_back():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate[0] = [101, 202, 303, 404]
    candidate[1, 0] = np.nan
    result = explain(call, candidate)
    document = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert set(document) >= {"rows", "labels", "dtype", "shape", "profile", "differing_rows"}
    assert {row["label"] for row in document["rows"]} == {"missing", "nonfinite"}
    assert {"row", "label", "slot", "source_row", "profile", "evidence", "slots", "elements"} <= set(document["rows"][0])
    assert accuracy.Explanation.from_dict(document).to_dict() == result.to_dict()
    assert accuracy.Explanation.from_dict(document).rows[0].slots == result.rows[0].slots


def test_a_profile_other_than_the_calls():
    call = call_of(ORDER_ROWS, [0, 1, 2], 3)
    sequential = np.array([[0.0, 1 + 2.0**-23]], dtype=F)
    assert explain(call, sequential, profile="sequential").rows == ()  # against Huawei's golden: identical
    row = only(explain(call, moegrad.moe_init_routing_v2_grad(call), profile="ascend950@8.5"))
    assert (row.label, row.profile) == ("order", "ascend910b@9.1")  # a group of profiles: the newest named
    assert explain(call, sequential, profile="ascend950").profile == "ascend950@9.1"


def test_a_device_result_from_elsewhere_is_used_as_given():
    call = integer_call()
    device = moegrad.moe_init_routing_v2_grad(call)
    other = device.copy()
    other[1] += 1  # a device whose row 1 differs from the emulation: the candidate (the emulation) differs there
    result = explain(call, device, device_result=other)
    assert [r.row for r in result.rows] == [1]


@pytest.mark.parametrize(
    "candidate, status, field",
    [
        (None, AclnnStatus.ACLNN_ERR_PARAM_NULLPTR, "candidate"),
        ([[1.0] * 4] * 2, AclnnStatus.ACLNN_ERR_PARAM_INVALID, "candidate"),
        (np.zeros((2, 4), dtype=np.float16), AclnnStatus.ACLNN_ERR_PARAM_INVALID, "candidate"),
        (np.zeros((2, 3), dtype=F), AclnnStatus.ACLNN_ERR_PARAM_INVALID, "candidate"),
    ],
)
def test_bad_candidates_are_refused_by_field(candidate, status, field):
    with pytest.raises(InvalidArgument) as caught:
        explain(integer_call(), candidate)
    assert (caught.value.aclnn_status, caught.value.field) == (status, field)


def test_bad_profiles_and_device_results_are_refused():
    call = integer_call()
    candidate = moegrad.moe_init_routing_v2_grad(call)
    with pytest.raises(InvalidArgument) as caught:
        explain(call, candidate, profile="ascend999")
    assert (caught.value.aclnn_status, caught.value.field) == (AclnnStatus.ACLNN_ERR_PARAM_INVALID, "profile")
    dropless_minus_one = call_of(INTEGERS[:2], [0, -1], 2, order="ascend950@9.1")
    with pytest.raises(InvalidArgument) as caught:  # only 950@9.1 defines a -1 in dropless mode
        explain(dropless_minus_one, np.zeros((1, 4), dtype=F), profile="ascend910b@9.1")
    assert caught.value.field == "expanded_row_idx"
    with pytest.raises(ValueError, match="device_result has shape"):
        explain(call, candidate, device_result=candidate[:1])
    with pytest.raises(TypeError, match="MoeInitRoutingV2GradCall"):
        explain({"grad_expanded_x": INTEGERS}, candidate)


def test_empty_calls_have_nothing_to_explain():
    call = call_of(np.zeros((0, 4), dtype=F), [], 2)
    assert explain(call, np.zeros((0, 4), dtype=F)).rows == ()
    every_slot_dropped = call_of(np.zeros((0, 2, 3), dtype=F), [-1, -1], 2, drop_pad_mode=1)
    row = only(explain(every_slot_dropped, np.array([[0.0, -0.0, 1.0]], dtype=F)))  # must be +0.0
    assert row.label == "unexplained" and row.slots.skipped == (True, True)


def test_the_numpy_path_gives_the_same_explanation(monkeypatch):
    entries = [e for e in SAMPLE if e[4] in ("drop", "neighbour", "accumulate_bf16", "kahan")][:4]
    compiled = [_explained(planted.build(*entry))[1] for entry in entries]
    monkeypatch.setattr(_fused, "_load", lambda: None)  # as where numba does not import
    assert [_explained(planted.build(*entry))[1] for entry in entries] == compiled


@pytest.mark.parametrize("tokens, top_k, hidden", [(600, 2, 1), (1000, 130, 1), (40, 130, 16), (64, 8, 2048)])
def test_the_peak_stays_within_explain_peak_bytes(tokens, top_k, hidden):
    """Every row differs (the worst case): the traced peak is within the reservation."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((tokens * top_k, hidden)) * np.exp2(rng.integers(-8, 8, (tokens * top_k, hidden))))
    call = call_of(x.astype(ml_dtypes.bfloat16), rng.permutation(tokens * top_k), top_k)
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate.view(np.uint16)[...] ^= 1  # every element of every row differs, by one ULP
    explain(call, candidate)  # warm: compiled code, caches
    tracemalloc.start()
    try:
        result = explain(call, candidate)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.differing_rows == tokens
    assert peak <= accuracy.explain_peak_bytes(call)


# --------------------------------------------------------------------------------------------------
# stop: a caller that has gone (a service's client, its deadline) stops the explanation
# --------------------------------------------------------------------------------------------------


class CountingStop(threading.Event):
    """A stop event that counts how often it is looked at, and reads as set from look ``at`` on."""

    def __init__(self, at=None):
        super().__init__()
        self.looks, self.at = 0, at

    def is_set(self):
        self.looks += 1
        return self.at is not None and self.looks >= self.at


def every_row_searched():
    """48 tokens, K = 4, H = 4096 bf16 (one block of rows), the candidate one ULP off everywhere: no
    order or single summand fits, so every row is searched for a wrong summand among the others."""
    rng = np.random.default_rng(11)
    call = call_of(rng.standard_normal((48 * 4, 4096)).astype(ml_dtypes.bfloat16), rng.permutation(48 * 4), 4)
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate.view(np.uint16)[...] ^= 1
    return call, candidate


def test_a_set_stop_event_stops_the_explanation():
    call, candidate = every_row_searched()
    stop = threading.Event()
    stop.set()
    with pytest.raises(moegrad.DeadlineExceeded, match="explanation was stopped"):
        explain(call, candidate, stop=stop)
    assert explain(call, candidate, stop=threading.Event()).labels["unexplained"] == 48


def test_the_stop_is_looked_at_within_a_block_while_its_rows_are_searched():
    """One block of rows: once before it and four times between its searches; every other look is
    within the search of other rows, a few rows at a time (the slow part of an unexplained row)."""
    call, candidate = every_row_searched()
    counted = CountingStop()
    assert explain(call, candidate, stop=counted).labels["unexplained"] == 48
    assert counted.looks > 1 + 4
    for at in (2, counted.looks // 2, counted.looks):
        with pytest.raises(moegrad.DeadlineExceeded):
            explain(call, candidate, stop=CountingStop(at))
