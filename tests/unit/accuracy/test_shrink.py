"""moegrad.shrink: the smallest call that keeps the same fault; its trigger kept; idempotent.

Oracles: the candidates of tests/support/triggers.py, each written from its own definition (the
A2/A3 bins' order of docs/semantics.md section 3.1 with one summand wrong, under a trigger: H above
a threshold, odd rows, K = 8), so the shrunk call's size follows from that definition (H = 49, an
odd row, K = 8, ...); the fault on the shrunk call is checked again by the test's own replay (the
correct candidate with the planted summand left out, compared bit for bit), not by explain; the
routings come from tests/support/routing.py (the forward's stable sort, written from docs/operator.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import NothingToShrink, ShrinkError, shrink
from support import routing, triggers
from support.bits import same_bits
from support.candidates import bins_tree, slot_values, tree_sum

THRESHOLD = triggers.HIDDEN_THRESHOLD


def routed_call(tokens=24, top_k=8, hidden=64, mode="dropless", dtype=np.float32, seed=0, **routing_options):
    rng = np.random.default_rng(seed)
    routed = routing.route(rng, tokens, top_k, top_k + 4, mode, **routing_options)
    grad = rng.standard_normal(routed.grad_shape(hidden)).astype(dtype)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, **routed.kwargs())


def run(candidate, call):
    return candidate(call.grad_expanded_x, call.expanded_row_idx, call.top_k,
                     drop_pad_mode=call.drop_pad_mode, active_num=call.active_num)


def without_slot(call, token, slot):
    """The correct (bins-order) grad_x with token's slot left out: the missing-summand fault, replayed here."""
    values = slot_values(call.grad_expanded_x, call.expanded_row_idx, call.top_k, call.drop_pad_mode,
                         call.active_num)
    values[slot, token] = 0.0
    return tree_sum(bins_tree(call.top_k), values).astype(call.grad_expanded_x.dtype)


def assert_missing(result, candidate):
    """The candidate's grad_x on the shrunk call is the correct one with the reported slot left out
    of the reported row, and differs from the correct one there."""
    call = result.call
    got = run(candidate, call)
    assert same_bits(got, result.candidate)
    assert same_bits(got[result.row], without_slot(call, result.row, result.slot)[result.row])
    assert not same_bits(got[result.row], run(triggers.correct, call)[result.row])


def assert_same_call(a, b):
    assert same_bits(a.grad_expanded_x, b.grad_expanded_x) and same_bits(a.expanded_row_idx, b.expanded_row_idx)
    assert (a.top_k, a.drop_pad_mode, a.active_num, a.order) == (b.top_k, b.drop_pad_mode, b.active_num, b.order)


# ---- triggers kept -------------------------------------------------------------------------------------


def test_a_fault_above_a_hidden_h_keeps_h_above_it():
    result = shrink(routed_call(hidden=64), triggers.missing_above_h)
    call = result.call
    assert (result.label, result.slot) == ("missing", 1)
    assert call.hidden_size == THRESHOLD + 1  # the smallest H that still triggers it
    # one token; slot 1 must stay the second slot, so K = 2 (removing slot 0 would make it slot 0)
    assert (call.num_tokens, call.top_k) == (1, 2)
    assert_missing(result, triggers.missing_above_h)


def test_a_fault_of_odd_rows_keeps_an_odd_row():
    result = shrink(routed_call(), triggers.missing_odd_rows)
    assert (result.label, result.slot) == ("missing", 0)
    assert result.row % 2 == 1
    # the smallest call with an odd row has two tokens; one slot; two columns (a summand fault's
    # fingerprint needs two columns outside the any-order bound: docs/accuracy.md, "The labels")
    assert (result.call.num_tokens, result.call.top_k, result.call.hidden_size) == (2, 1, 2)
    assert_missing(result, triggers.missing_odd_rows)


def test_a_fault_only_at_k_8_keeps_k_8():
    result = shrink(routed_call(), triggers.missing_at_k8)
    assert (result.label, result.slot) == ("missing", 5)
    assert (result.call.num_tokens, result.call.top_k, result.call.hidden_size) == (1, 8, 2)
    assert_missing(result, triggers.missing_at_k8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_calls_keep_their_dtype(dtype):
    result = shrink(routed_call(dtype=moegrad.DTYPES[dtype]), triggers.missing_odd_rows)
    assert result.call.dtype_name == dtype and result.candidate.dtype == moegrad.DTYPES[dtype]
    assert result.row % 2 == 1
    assert_missing(result, triggers.missing_odd_rows)


def test_values_go_toward_small_integers():
    result = shrink(routed_call(), triggers.missing_at_k8)
    values = result.call.grad_expanded_x.astype(np.float64)
    assert np.all(values == np.rint(values)) and np.abs(values).max() <= 1
    assert result.call.grad_expanded_x[result.call.expanded_row_idx[5]].any()  # the missing summand is not 0


# ---- no drift to another bug ---------------------------------------------------------------------------


def test_it_does_not_drift_to_another_label():
    # even rows: slot 0 duplicated, always; odd rows: slot 2 missing, only above the threshold
    fn = triggers.duplicated_even_missing_odd_above_h
    missing = shrink(routed_call(), fn, label="missing")
    assert (missing.label, missing.slot) == ("missing", 2)
    assert missing.row % 2 == 1 and missing.call.hidden_size > THRESHOLD
    assert_missing(missing, fn)
    duplicated = shrink(routed_call(), fn, label="duplicated")
    assert (duplicated.label, duplicated.slot) == ("duplicated", 0)
    assert duplicated.row % 2 == 0 and duplicated.call.hidden_size <= THRESHOLD


def test_it_does_not_drift_to_another_slot_of_the_same_label():
    # even rows: slot 1 missing, always; odd rows: slot 6 missing, only at K = 8
    fn = triggers.missing_slot1_even_slot6_odd_at_k8
    result = shrink(routed_call(), fn, row=1)
    assert (result.label, result.slot) == ("missing", 6)
    assert result.call.top_k == 8 and result.row % 2 == 1
    assert_missing(result, fn)
    other = shrink(routed_call(), fn, row=0)
    assert (other.label, other.slot, other.call.top_k) == ("missing", 1, 2)


# ---- every mode stays valid and keeps its role ---------------------------------------------------------


def test_a_dropped_slot_read_in_drop_pad_mode_stays_a_dropped_slot():
    call = routed_call(mode="drop_pad", capacity=3)
    result = shrink(call, triggers.extra_dropped_as_last_row)
    shrunk = result.call
    assert (result.label, shrunk.drop_pad_mode) == ("extra", 1)
    assert shrunk.expanded_row_idx.reshape(-1, shrunk.top_k)[result.row, result.slot] == -1
    experts, capacity, _ = shrunk.grad_expanded_x.shape
    assert experts * capacity <= 2 and shrunk.num_tokens == 1


def test_the_slot_past_the_active_rows_stays_the_first_past_them():
    # (a seed whose faulty token skips one slot only: with two, explain cannot tell which was added)
    call = routed_call(mode="active", active_num=150)
    result = shrink(call, triggers.extra_active_as_last_row)
    shrunk = result.call
    assert (result.label, shrunk.drop_pad_mode) == ("extra", 0)
    assert 0 < shrunk.active_num == shrunk.grad_expanded_x.shape[0] < call.active_num
    assert shrunk.expanded_row_idx.reshape(-1, shrunk.top_k)[result.row, result.slot] == shrunk.active_num


def valid_by_the_documented_rules(grad, index, top_k, drop_pad_mode, active_num):
    """docs/operator.md's rules, written here: dropless: grad [N*K, H] and the index a permutation of
    [0, N*K); active: grad [A, H] and the index N*K distinct values in [0, N*K); drop/pad: grad
    [E, C, H] and the index -1 or distinct values in [0, E*C)."""
    slots = index.size
    if slots % top_k or index.dtype != np.int32:
        return False
    if drop_pad_mode == 1:
        read = index[index != -1]
        rows = grad.shape[0] * grad.shape[1]
        return grad.ndim == 3 and bool(((read >= 0) & (read < rows)).all()) and len(set(read.tolist())) == read.size
    if active_num > 0:
        return (grad.shape[0] == active_num and bool(((index >= 0) & (index < slots)).all())
                and len(set(index.tolist())) == slots)
    return grad.shape[0] == slots and sorted(index.tolist()) == list(range(slots))


@pytest.mark.parametrize(("name", "mode", "options"), [
    ("missing_odd_rows", "dropless", {}),
    ("extra_active_as_last_row", "active", {"active_num": 150}),
    ("extra_dropped_as_last_row", "drop_pad", {"capacity": 3}),
])
def test_every_call_the_candidate_sees_is_valid_in_its_mode(name, mode, options):
    seen = []

    def recording(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        seen.append((mode == "active") == (active_num > 0) and (drop_pad_mode == 1) == (mode == "drop_pad")
                    and valid_by_the_documented_rules(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode,
                                                      active_num))
        return getattr(triggers, name)(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=drop_pad_mode,
                                       active_num=active_num)

    result = shrink(routed_call(mode=mode, **options), recording)
    assert len(seen) == result.tests > 10 and all(seen)


# ---- idempotence ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["missing_above_h", "missing_odd_rows", "missing_at_k8",
                                  "extra_dropped_as_last_row"])
def test_shrinking_twice_changes_nothing(name):
    fn = getattr(triggers, name)
    call = routed_call(mode="drop_pad", capacity=3) if "dropped" in name else routed_call()
    once = shrink(call, fn)
    twice = shrink(once.call, fn)
    assert not once.exhausted and not twice.exhausted
    assert_same_call(twice.call, once.call)
    assert twice.history == () and (twice.label, twice.slot, twice.row) == (once.label, once.slot, once.row)
    assert same_bits(twice.candidate, once.candidate)


def test_shrinking_twice_changes_nothing_with_the_label_and_row_given():
    fn = triggers.missing_slot1_even_slot6_odd_at_k8
    once = shrink(routed_call(), fn, row=1)
    twice = shrink(once.call, fn, label=once.label, row=once.row)
    assert_same_call(twice.call, once.call) and twice.history == ()


# ---- what it refuses -----------------------------------------------------------------------------------


def test_a_correct_candidate_has_nothing_to_shrink():
    with pytest.raises(NothingToShrink, match="device's bits"):
        shrink(routed_call(), triggers.correct)


def test_a_label_or_row_without_a_fault_is_refused_with_what_there_is():
    with pytest.raises(ValueError, match=r"label='precision'.*missing"):
        shrink(routed_call(), triggers.missing_odd_rows, label="precision")
    with pytest.raises(ValueError, match="row=0: that row agrees"):
        shrink(routed_call(), triggers.missing_odd_rows, row=0)
    with pytest.raises(ValueError, match="max_tests"):
        shrink(routed_call(), triggers.missing_odd_rows, max_tests=0)


def test_a_candidate_that_changes_its_bits_is_refused():
    with pytest.raises(ShrinkError, match="same bits twice"):
        shrink(routed_call(), triggers.missing_first_calls(5))


def test_running_out_of_tests_returns_the_smallest_kept_so_far():
    call = routed_call()
    early = shrink(call, triggers.missing_above_h, max_tests=20)
    assert early.exhausted and early.tests <= 21  # the budget, and the final check
    assert early.call.hidden_size > THRESHOLD and (early.label, early.slot) == ("missing", 1)
    assert_missing(early, triggers.missing_above_h)
    assert shrink(early.call, triggers.missing_above_h).call.hidden_size == THRESHOLD + 1


def test_the_history_counts_each_kept_call():
    result = shrink(routed_call(), triggers.missing_at_k8)
    phases = [step.phase for step in result.history]
    assert phases[:2] == ["tokens", "columns"]
    assert all(a.tests < b.tests for a, b in zip(result.history, result.history[1:], strict=False))
    assert result.history[-1].size == result.size
    assert "-> N=1 K=8 H=2 float32 dropless [8, 2]" in str(result)
