"""moegrad.order_free_inputs: every order of adds gives the golden's bits; every planted fault shows.

Oracles: the float64 sum of tests/support/candidates.py (slot after slot in float64: exact on these
inputs, since every element's values are multiples of one power of two within 2**24 of it), the
known-order candidates of the same module (chain, reversed, pairwise, random trees, the A2/A3 bins,
the 950's groups of four), and each profile's emulation as a black box. Bits are compared as
unsigned integers.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import ORDER_FREE_LIMITS, order_free_inputs
from support.bits import same_bits
from support.candidates import (
    bins_tree,
    chain_tree,
    faulty,
    float64_sum,
    groups_tree,
    pairwise_tree,
    random_tree,
    reversed_tree,
    tree_candidate,
)

DTYPES = ["float32", "float16", "bfloat16"]
MODES = {"dropless": {}, "active": {"active_num": 20}, "drop_pad": {"drop_pad_mode": 1}}


def run(candidate, call):
    return candidate(
        call.grad_expanded_x, call.expanded_row_idx, call.top_k,
        drop_pad_mode=call.drop_pad_mode, active_num=call.active_num,
    )


def golden_bits(call):
    """The exact sums (float64, slot after slot), rounded once to the dtype."""
    exact = float64_sum(call.grad_expanded_x.astype(np.float64), call.expanded_row_idx, call.top_k,
                        drop_pad_mode=call.drop_pad_mode, active_num=call.active_num)
    return exact.astype(call.grad_expanded_x.dtype)


def orders(top_k: int, rng: np.random.Generator):
    trees = [chain_tree(top_k), reversed_tree(top_k), pairwise_tree(0, top_k), bins_tree(top_k),
             groups_tree(top_k, top_k), groups_tree(top_k, 3), random_tree(top_k, rng), random_tree(top_k, rng)]
    return [tree_candidate(tree) for tree in trees]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 3, 8, 16, 65])
def test_every_order_gives_the_golden_bits(top_k, dtype, mode):
    if dtype == "bfloat16" and top_k > 64:
        top_k = 64
    call = order_free_inputs(12, top_k, 24, dtype, seed=top_k, **MODES[mode])
    want = golden_bits(call)
    assert same_bits(moegrad.moe_init_routing_v2_grad_golden(call).astype(want.dtype), want)
    for candidate in orders(top_k, np.random.default_rng(top_k)):
        assert same_bits(run(candidate, call), want)
    for profile in moegrad.PROFILES:
        got = moegrad.moe_init_routing_v2_grad(
            call.grad_expanded_x, call.expanded_row_idx, top_k, call.drop_pad_mode, call.active_num, order=profile
        )
        assert same_bits(got, want), profile


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_limit_k_still_gives_the_golden_bits(dtype):
    top_k = min(ORDER_FREE_LIMITS[dtype], 1024)
    call = order_free_inputs(3, top_k, 8, dtype, seed=5, expert_num=top_k)
    want = golden_bits(call)
    rng = np.random.default_rng(1)
    for tree in (chain_tree(top_k), reversed_tree(top_k), pairwise_tree(0, top_k), random_tree(top_k, rng)):
        assert same_bits(run(tree_candidate(tree), call), want)


@pytest.mark.parametrize("kind", ["drop", "duplicate", "neighbour"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_planted_fault_is_caught(kind, mode, dtype):
    top_k = 8
    call = order_free_inputs(10, top_k, 16, dtype, seed=3, **MODES[mode])
    want = golden_bits(call)
    rows = call.grad_expanded_x.reshape(-1, call.hidden_size).shape[0]
    limit = call.active_num if call.active_num else rows
    read = (call.expanded_row_idx >= 0) & (call.expanded_row_idx < limit)
    for slot_index in np.flatnonzero(read):  # every slot a correct candidate reads
        token, slot = divmod(int(slot_index), top_k)
        got = run(faulty(kind, token, slot), call)
        assert not same_bits(got, want), (kind, token, slot)
        changed = np.flatnonzero((got.view(np.uint8).reshape(got.shape[0], -1)
                                  != want.view(np.uint8).reshape(want.shape[0], -1)).any(axis=1))
        assert changed.tolist() == [token]
        if kind != "neighbour":  # a missing or repeated summand changes every column
            assert (got[token] != want[token]).all()


def test_values_are_nonzero_both_signs_and_spread():
    call = order_free_inputs(256, 8, 64, "float32", seed=0)
    values = call.grad_expanded_x.astype(np.float64)
    assert (values != 0).all()
    assert 0.45 < (values > 0).mean() < 0.55
    binades = np.log2(np.abs(values))
    # q from 2**-126 to 2**(127 - 24), m up to 2**(23 - 3): |value| < 2**124
    assert binades.min() >= -126 and binades.max() < 124
    assert binades.max() - binades.min() > 200
    # within one element (token 0, column 0): multiples of one power of two q, |m| <= 2**20, sum |m| <= 2**23
    token0 = values[call.expanded_row_idx[:8], 0]
    mantissa, exponent = np.frexp(np.abs(token0))
    significand = (mantissa * 2.0**53).astype(np.int64)
    lowest_bit = exponent - 53 + np.array([(int(m) & -int(m)).bit_length() - 1 for m in significand])
    multiples = np.abs(token0) / 2.0 ** lowest_bit.min()
    assert multiples.max() <= 2**20 and multiples.sum() <= 2**23


def test_modes_skip_slots_and_calls_validate():
    active = order_free_inputs(10, 4, 8, "float16", active_num=20, seed=1)
    assert active.grad_expanded_x.shape == (20, 8) and (active.expanded_row_idx >= 20).any()
    padded = order_free_inputs(10, 4, 8, "bfloat16", drop_pad_mode=1, expert_num=8, expert_capacity=3, seed=1)
    assert padded.grad_expanded_x.shape == (8, 3, 8) and (padded.expanded_row_idx == -1).any()
    dropless = order_free_inputs(10, 4, 8, seed=1, order="ascend950@9.1")
    assert sorted(dropless.expanded_row_idx.tolist()) == list(range(40)) and dropless.order == "ascend950@9.1"


def test_the_seed_reproduces_the_call():
    first, second = (order_free_inputs(5, 3, 4, "float16", drop_pad_mode=1, seed=9) for _ in range(2))
    assert same_bits(first.grad_expanded_x, second.grad_expanded_x)
    assert same_bits(first.expanded_row_idx, second.expanded_row_idx)


@pytest.mark.parametrize(
    ("args", "options", "match"),
    [
        ((4, 129, 8, "bfloat16"), {}, "K <= 128"),
        ((4, 1025, 8, "float16"), {"expert_num": 2000}, "K <= 1024"),
        ((0, 4, 8), {}, "n=0"),
        ((4, 4, 8, "int32"), {}, "dtype"),
        ((4, 4, 8), {"drop_pad_mode": 2}, "drop_pad_mode"),
        ((4, 8, 8), {"expert_num": 4}, "expert_num=4 must be >= top_k=8"),
        ((4, 2, 8), {"drop_pad_mode": 1, "expert_capacity": 5}, "expert_capacity=5 must be <= n=4"),
    ],
)
def test_out_of_range_arguments_say_why(args, options, match):
    with pytest.raises(ValueError, match=match):
        order_free_inputs(*args, **options)


def test_limits_per_dtype():
    assert dict(ORDER_FREE_LIMITS) == {"float32": 2**23, "float16": 2**10, "bfloat16": 2**7}
