"""moegrad.check_determinism and moegrad.any_order_bound.

Oracles: tests/support/candidates.py's shuffled-order candidate (a new order per token and call, as
atomic adds give) must vary exactly on the rows with two or more slots read, a steady one never;
the bound's values by hand from its definition (gamma_n = n u / (1 - n u), u = 2**-24, plus half an
ULP of a float16/bfloat16 output); a candidate that loses an add in some runs lands outside it.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import any_order_bound, check_determinism
from support.candidates import chain_tree, faulty, shuffled_rows, tree_candidate

U = 2.0**-24


def wide_call(mode: str, dtype=np.float32, top_k=8, tokens=48, hidden=32, seed=0):
    """Random values, a random index; in active mode token 0 reads one slot and token 1 none."""
    rng = np.random.default_rng(seed)
    slots = tokens * top_k
    index = rng.permutation(slots).astype(np.int32)
    attributes, rows = {}, slots
    if mode == "active":
        rows = slots - 2 * top_k + 1  # A: the 2K - 1 values A .. N*K-1 are never materialised
        skipped = np.r_[1:top_k, top_k:2 * top_k]  # token 0's slots but the first, all of token 1's
        index[skipped] = rng.permutation(np.arange(rows, slots))
        index[np.setdiff1d(np.arange(slots), skipped)] = rng.permutation(rows)
        attributes = {"active_num": rows}
    grad = (rng.standard_normal((rows, hidden)) * np.exp2(rng.integers(-12, 6, (rows, hidden)))).astype(dtype)
    if dtype == np.float16:
        # float16 values over a few binades sum exactly in float32, in any order; +-2**14 in slots 0
        # and 1 of every token that reads all its slots make the small values round away differently
        first_full = 2 if mode == "active" else 0  # in active mode tokens 0 and 1 read fewer slots
        grad[index[first_full * top_k:].reshape(-1, top_k)[:, :2]] = np.array([2.0**14, -(2.0**14)], dtype)[:, None]
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=top_k, **attributes)


def rows_reading(call, at_least: int) -> np.ndarray:
    limit = call.active_num or call.grad_expanded_x.shape[0]
    read = ((call.expanded_row_idx >= 0) & (call.expanded_row_idx < limit)).reshape(-1, call.top_k).sum(axis=1)
    return np.flatnonzero(read >= at_least)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mode", ["dropless", "active"])
def test_a_shuffled_order_is_flagged_on_the_rows_with_several_slots(mode, dtype):
    call = wide_call(mode, dtype)
    result = check_determinism(shuffled_rows(seed=1), call, runs=8)
    # two slots have one add whatever the order (a + b = b + a): from three on, the order shows
    assert result.varying_rows.tolist() == rows_reading(call, 3).tolist()
    assert result.within_bound and result.outside_rows.size == 0
    assert not result.deterministic
    for row, variants in result.variants.items():
        assert variants.shape == (result.distinct_per_row[row], call.hidden_size)
        assert len({v.tobytes() for v in variants}) == len(variants)
    assert len(result.variants) == 16
    assert "atomic accumulation" in str(result)


def test_a_steady_candidate_is_never_flagged():
    call = wide_call("active")

    def emulation(grad_expanded_x, expanded_row_idx, top_k, **attributes):
        return moegrad.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k, **attributes)

    for candidate in (tree_candidate(chain_tree(8)), emulation):
        result = check_determinism(candidate, call, runs=4)
        assert result.deterministic and result.within_bound
        assert (result.distinct_per_row == 1).all() and result.variants == {}
        assert str(result).startswith("the same bits in all 4 runs")


def test_a_lost_add_lands_outside_the_bound():
    call = wide_call("dropless")
    runs = iter(range(100))
    shuffled, lossy = shuffled_rows(seed=3), faulty("drop", token=5, slot=2)

    def sometimes_lossy(*args, **kwargs):
        return lossy(*args, **kwargs) if next(runs) % 2 else shuffled(*args, **kwargs)

    result = check_determinism(sometimes_lossy, call, runs=4)
    assert not result.within_bound and result.outside_rows.tolist() == [5]
    assert "a fault, not rounding" in str(result)


def test_the_bound_by_hand():
    grad = np.array([[1.0, -3.0], [2.0**-10, 1.0], [-0.5, 0.25], [8.0, 0.0]], np.float32)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(4, dtype=np.int32),
                                            top_k=2)
    gamma1 = U / (1 - U)
    want = gamma1 * np.array([[1.0 + 2.0**-10, 4.0], [8.5, 0.25]])
    assert_bound(any_order_bound(call), want)
    # bfloat16: plus half an ULP of the output at |golden| + bound: 2**-7 in [1, 2), 2**-6 in [2, 4),
    # 2**-5 in [4, 8), 2**-9 in [0.25, 0.5)
    narrow = call.model_copy(update={"grad_expanded_x": grad.astype(moegrad.DTYPES["bfloat16"])})
    golden = np.array([[1.0 + 2.0**-10, -2.0], [7.5, 0.25]])
    half_ulp = np.array([[2.0**-8, 2.0**-7], [2.0**-6, 2.0**-10]])
    assert_bound(any_order_bound(narrow, golden), gamma1 * np.array([[1.0 + 2.0**-10, 4.0], [8.5, 0.25]]) + half_ulp)
    # K = 1: one slot, no add: only the cast (none in float32, where only the evaluation slack is left)
    single = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(4, dtype=np.int32),
                                              top_k=1)
    assert_bound(any_order_bound(single), np.zeros((4, 2)))
    # a skipped slot adds nothing: drop/pad, token 1 reads one slot, so its row has no add at all
    capacity = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad.reshape(2, 2, 2),
                                                expanded_row_idx=np.array([0, 1, 2, -1], np.int32), top_k=2,
                                                drop_pad_mode=1)
    assert_bound(any_order_bound(capacity)[1], np.zeros(2))


def assert_bound(got: np.ndarray, want: np.ndarray) -> None:
    """``got`` is ``want`` plus at most the bound's documented evaluation slack, 2**-50 * (sum |x_t| +
    |result|) (docs/accuracy.md, "The any-order bound"): under 2**-47 relative to these sums."""
    assert got.shape == want.shape
    assert (got >= want).all()
    assert (got - want <= 2.0**-44 * (np.abs(want) + 16.0)).all(), got - want


def test_runs_must_be_two_or_more():
    with pytest.raises(ValueError, match="runs=1"):
        check_determinism(tree_candidate(0), wide_call("dropless", top_k=1), runs=1)
