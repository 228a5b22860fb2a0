"""moegrad.probe_order: the FPRev order probe recovers known trees of adds and refuses what no tree explains.

Oracles: the candidates of tests/support/candidates.py, whose trees are written from their
definitions and from docs/semantics.md's rules (never from moegrad's schedules), and their
expressions written by that module's own ``expression_of``; a few expressions by hand from
docs/semantics.md's worked examples. The profile emulations are probed as black boxes and must
come back as the support module's tree of their kernel (bins, chain, groups of four per chunk).
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import Candidate, InconsistentOrder, MultiTermOrder, probe_order
from moegrad.accuracy import probe_scale
from support.candidates import (
    bins_tree,
    chain_tree,
    expression_of,
    faulty,
    float64_sum,
    groups_tree,
    pairwise_tree,
    random_tree,
    random_tree_per_call,
    reversed_tree,
    row_order,
    shuffled_rows,
    sorted_by_magnitude,
    tree_candidate,
)
from support.slow_loops import SLOW_PROFILES

DTYPES = ["float32", "float16", "bfloat16"]
KS = [2, 3, 4, 7, 8, 16, 65]
A2A3 = {f"{chip}@{release}" for chip in ("ascend910b", "ascend910_93") for release in ("8.5", "9.0", "9.1")}


def known_trees(top_k: int) -> dict[str, object]:
    rng = np.random.default_rng(top_k)
    return {
        "chain": chain_tree(top_k),
        "reversed": reversed_tree(top_k),
        "pairwise": pairwise_tree(0, top_k),
        "random-1": random_tree(top_k, rng),
        "random-2": random_tree(top_k, rng),
        "bins": bins_tree(top_k),
        "groups": groups_tree(top_k, top_k),
        "groups-chunk-6": groups_tree(top_k, 6),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", KS)
def test_known_trees_are_recovered_exactly(top_k, dtype):
    for label, tree in known_trees(top_k).items():
        probe = probe_order(tree_candidate(tree), top_k, dtype)
        assert probe.expression == expression_of(tree), label
        assert expression_of(probe.tree) == probe.expression, label
        assert probe.top_k == top_k and probe.dtype == dtype


def test_expressions_match_the_documented_worked_examples():
    # docs/semantics.md 3.1 (A2/A3, K = 3, 6, 8) and 7.2 (950, K = 6 and 9 in one pass)
    cases = [
        (bins_tree(3), 3, "((v0+v2)+v1)"),
        (bins_tree(6), 6, "((((v0+v4)+v1)+v5)+(v2+v3))"),
        (bins_tree(8), 8, "(((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)))"),
        (groups_tree(6, 6), 6, "((((v0+v1)+(v2+v3))+v4)+v5)"),
        (groups_tree(9, 9), 9, "((((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)))+v8)"),
    ]
    for tree, top_k, text in cases:
        assert probe_order(tree_candidate(tree), top_k).expression == text


def kernel_tree(profile: str, top_k: int, chunk: int):
    kind = SLOW_PROFILES[profile][0]
    if kind == "bins":
        return bins_tree(top_k)
    if kind == "groups":
        return groups_tree(top_k, chunk)
    return chain_tree(top_k)  # "chain" (sequential) and "chain950" (950 at 8.5)


def emulation(profile: str, **platform):
    def candidate(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        return moegrad.moe_init_routing_v2_grad(
            grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order=profile, **platform
        )

    return candidate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("profile", list(moegrad.PROFILES))
def test_every_profile_emulation_is_probed_and_named(profile, dtype):
    for top_k in KS:
        probe = probe_order(emulation(profile), top_k, dtype)
        # the default probe shape (H = 64) is one pass on the 950 (FullLoad): docs/semantics.md 7.1
        want = expression_of(kernel_tree(profile, top_k, top_k))
        assert probe.expression == want, (profile, top_k)
        same = {other for other in moegrad.PROFILES if expression_of(kernel_tree(other, top_k, top_k)) == want}
        assert set(probe.profiles) == same and profile in same
        assert all(probe.distances[other] == 0 for other in same)
        assert all(probe.distances[other] > 0 for other in set(moegrad.PROFILES) - same)
        assert probe.closest == probe.profiles
        if top_k in (7, 16, 65):  # the bins, the chain and the groups of four all differ (K = 3: no group)
            assert same in (A2A3, {"ascend950@8.5", "sequential"}, {"ascend950@9.0", "ascend950@9.1"})


def test_the_950_chunk_follows_the_probe_shape():
    # docs/semantics.md 7.2: K = 17 float32, H = 8, UB 448 bytes -> Regbase with chunks of 6
    platform = {"ub_size_bytes": 448}
    probe = probe_order(emulation("ascend950@9.1", **platform), 17, "float32", hidden_size=8, **platform)
    assert probe.expression == expression_of(groups_tree(17, 6))
    assert probe.hidden_size == 8
    assert set(probe.profiles) == {"ascend950@9.0", "ascend950@9.1"}
    one_pass = probe_order(emulation("ascend950@9.1"), 17, "float32", hidden_size=8)
    assert one_pass.expression == expression_of(groups_tree(17, 17))
    assert probe.expression != one_pass.expression
    # the same candidate named at the other platform: its tree is no 950 profile's there
    assert "ascend950@9.1" not in probe_order(emulation("ascend950@9.1", **platform), 17, hidden_size=8).profiles


def test_probe_calls_are_batched():
    counted = Candidate(tree_candidate(bins_tree(65)))
    probe = probe_order(counted, 65)
    # 2080 pairs fit one call of N = 33 x H = 64 cells; then two check calls
    assert (probe.pairs, probe.num_tokens, probe.hidden_size, probe.calls, counted.calls) == (2080, 33, 64, 3, 3)
    small = probe_order(tree_candidate(chain_tree(4)), 4, num_tokens=1, hidden_size=1)
    assert small.calls == 6 + 2  # one pair per call at [N=1, H=1]
    wide = probe_order(tree_candidate(chain_tree(8)), 8, num_tokens=2)  # H = ceil(28 / 2)
    assert (wide.num_tokens, wide.hidden_size, wide.calls) == (2, 14, 3)


def test_probe_scale_keeps_counts_exact():
    # 63 units stay below half an ULP of the binade under M: 2**31 * 2**-25 = 64 > 63
    assert probe_scale(65, "float32") == (2.0**31, 1.0)
    assert probe_scale(65, "bfloat16") == (2.0**31, 1.0)
    assert probe_scale(66, "float32") == (2.0**32, 1.0)  # 64 units: one more bit
    assert probe_scale(65, "float16") == (2.0**15, 2.0**-16)  # 63 * 2**-16 < 2**15 * 2**-25
    assert probe_scale(2, "float32") == (2.0**25, 1.0)


def test_a_new_order_every_call_is_refused():
    with pytest.raises(InconsistentOrder, match="run to run") as caught:
        probe_order(random_tree_per_call(seed=1), 8)
    assert caught.value.calls == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_order_per_row_is_refused(dtype):
    with pytest.raises(InconsistentOrder, match="row to row"):
        probe_order(shuffled_rows(seed=2), 16, dtype)


def test_an_order_that_follows_the_index_is_refused():
    # with the identity index the rows are in slot order (a chain); a random index moves them
    with pytest.raises(InconsistentOrder, match="follows the rows of grad_expanded_x") as caught:
        probe_order(row_order, 5)
    assert caught.value.calls == 4  # the probe, two checks, and the check through the identity index


def test_an_order_that_is_not_float32_adds_is_refused():
    def float16_chain(grad_expanded_x, expanded_row_idx, top_k, **attributes):
        values = grad_expanded_x[expanded_row_idx.reshape(-1, top_k)].astype(np.float16)
        total = values[:, 0]
        for t in range(1, top_k):
            total = total + values[:, t]  # float16 adds: the probe's counts survive, the replay does not
        return total.astype(grad_expanded_x.dtype)

    with pytest.raises(InconsistentOrder, match="does not accumulate in float32"):
        probe_order(float16_chain, 5, "float16")


def test_an_order_that_follows_the_values_is_a_multi_term_add():
    with pytest.raises(MultiTermOrder, match="8 operands at once") as caught:
        probe_order(sorted_by_magnitude, 8)
    assert caught.value.expression == "(v0+v1+v2+v3+v4+v5+v6+v7)"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_float64_accumulator_is_an_exact_multi_term_add(dtype):
    with pytest.raises(MultiTermOrder, match="sums exactly") as caught:
        probe_order(float64_sum, 7, dtype)
    assert caught.value.expression == "(v0+v1+v2+v3+v4+v5+v6)"
    # K = 2: one add, whatever the accumulator
    assert probe_order(float64_sum, 2, dtype).expression == "(v0+v1)"


def test_a_candidate_with_a_wrong_summand_is_not_a_sum():
    with pytest.raises(InconsistentOrder, match="not a count"):
        probe_order(faulty("drop", token=0, slot=1), 4)


def test_k_1_is_one_slot():
    probe = probe_order(tree_candidate(0), 1)
    assert (probe.expression, probe.tree, probe.calls) == ("v0", 0, 2)
    assert set(probe.profiles) == set(moegrad.PROFILES)


@pytest.mark.parametrize(
    ("top_k", "dtype", "match"),
    [(0, "float32", "top_k"), (513, "float32", "K <= 512"), (259, "bfloat16", "K <= 258"), (4, "int32", "dtype"),
     (True, "float32", "top_k")],
)
def test_limits_are_refused_with_the_reason(top_k, dtype, match):
    with pytest.raises(ValueError, match=match):
        probe_order(tree_candidate(0), top_k, dtype)


def test_the_bfloat16_limit_is_reached_exactly():
    assert probe_order(tree_candidate(pairwise_tree(0, 258)), 258, "bfloat16").expression == expression_of(
        pairwise_tree(0, 258)
    )
