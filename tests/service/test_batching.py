"""A batch's plan (moegrad_service.dataplane.batching.plan_batch), with no HTTP, no pool and no dataplane.

Every expected plan is written here by hand from the rules in the function's docstring: shares of
at least 16 calls (BATCH_CHUNK_CALLS), as many as the workers, the groups' chunks first; parts of at
most 64 calls (BATCH_PART_CALLS) and 4 MiB of grad_expanded_x (BATCH_PART_BYTES), one call or member
at least; empty calls answered without a run; comparisons judged after their calls ran.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import CallGroup, MoeInitRoutingV2GradCall
from moegrad_service.dataplane import Comparison, GroupMember, plan_batch

MiB = 1 << 20


def small_call(value: float = 1.0) -> MoeInitRoutingV2GradCall:
    """A call with 4 slots of H = 2 (32 bytes of grad_expanded_x)."""
    grad = np.full((4, 2), value, np.float32)
    return MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2)


def call_of(nbytes: int) -> MoeInitRoutingV2GradCall:
    """A call whose grad_expanded_x has ``nbytes`` (float32, H = 1024, top_k 1)."""
    rows = nbytes // (4 * 1024)
    grad = np.zeros((rows, 1024), np.float32)
    return MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(rows, dtype=np.int32), top_k=1)


def group_of(like: MoeInitRoutingV2GradCall, members: int) -> CallGroup:
    """A group of ``members`` calls shaped as ``like`` (stacked views: no memory per member)."""
    grad = np.broadcast_to(like.grad_expanded_x, (members, *like.grad_expanded_x.shape))
    idx = np.broadcast_to(like.expanded_row_idx, (members, *like.expanded_row_idx.shape))
    return CallGroup(like, grad, idx)


def layout(plan) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Each share as [(kind, places)]: "calls" for a run of single calls, "group" for a group's chunk."""
    return [
        [("group" if isinstance(part.work, CallGroup) else "calls", part.places) for part in share]
        for share in plan.shares
    ]


def test_a_mixed_batch_plans_each_kind_of_item_its_own_way():
    calls = [small_call(n) for n in range(4)]
    empty = MoeInitRoutingV2GradCall(
        grad_expanded_x=np.zeros((0, 2), np.float32), expanded_row_idx=np.zeros(0, np.int32), top_k=2
    )
    group = group_of(small_call(), 3)
    comparison = Comparison.checked(calls[1], np.zeros((2, 2), np.float32), None, False)
    refused = moegrad.MalformedRequest("op='x' is not one of ['grad', 'compare']", field="op")
    named = MoeInitRoutingV2GradCall(**{**dict(calls[3]), "order": "ascend910b"})
    items = [
        calls[0],  # 0: a single call
        refused,  # 1: already answered: not planned
        GroupMember(group, 0),  # 2
        comparison,  # 3: its call runs with the single calls; judged after
        empty,  # 4: answered without a run
        GroupMember(group, 1),  # 5
        calls[2],  # 6
        named,  # 7: a call that names its profile runs as any other
        GroupMember(group, 2),  # 8
    ]
    plan = plan_batch(items, workers=4)
    # 7 calls: one share (16 at least), the group's chunk first, then one run of the single calls
    assert layout(plan) == [[("group", (2, 5, 8)), ("calls", (0, 3, 6, 7))]]
    chunk, run = plan.shares[0]
    assert chunk.work.like is group.like and len(chunk.work) == 3
    assert run.work == (calls[0], calls[1], calls[2], named)
    assert plan.empty == [(4, empty)]
    assert plan.comparisons == [(3, comparison)]


def test_members_are_placed_by_their_member_number_not_their_order_in_the_batch():
    group = group_of(small_call(), 3)
    plan = plan_batch([GroupMember(group, 2), GroupMember(group, 0), GroupMember(group, 1)], workers=1)
    assert layout(plan) == [[("group", (1, 2, 0))]]


@pytest.mark.parametrize(
    ("calls", "workers", "shares"),
    [
        (40, 2, [(0, 20), (20, 40)]),  # 40 over 2 workers: 20 each
        (40, 4, [(0, 16), (16, 32), (32, 40)]),  # 10 each would be under 16: shares of 16
        (10, 4, [(0, 10)]),  # fewer than 16 calls: one share
        (33, 1, [(0, 33)]),  # one worker: one share
    ],
)
def test_single_calls_are_shared_among_the_workers_at_least_16_a_share(calls, workers, shares):
    batch = [small_call() for _ in range(calls)]
    plan = plan_batch(batch, workers=workers)
    assert layout(plan) == [[("calls", tuple(range(start, stop)))] for start, stop in shares]


def test_a_run_of_single_calls_is_cut_every_64_calls():
    plan = plan_batch([small_call() for _ in range(100)], workers=1)
    assert layout(plan) == [[("calls", tuple(range(64))), ("calls", tuple(range(64, 100)))]]


def test_a_run_of_single_calls_is_cut_before_it_passes_4_mib():
    # 1.5 MiB each: two make 3 MiB, a third would make 4.5; a 5 MiB call is a part on its own
    calls = [call_of(3 * MiB // 2)] * 5 + [call_of(5 * MiB), call_of(MiB)]
    plan = plan_batch(calls, workers=1)
    assert layout(plan) == [[("calls", (0, 1)), ("calls", (2, 3)), ("calls", (4,)), ("calls", (5,)), ("calls", (6,))]]


def test_a_group_is_cut_into_chunks_of_at_most_4_mib():
    group = group_of(call_of(3 * MiB // 2), 5)  # two members make 3 MiB: chunks of 2
    plan = plan_batch([GroupMember(group, member) for member in range(5)], workers=1)
    assert layout(plan) == [[("group", (0, 1)), ("group", (2, 3)), ("group", (4,))]]
    assert [len(part.work) for part in plan.shares[0]] == [2, 2, 1]


def test_a_group_larger_than_a_share_spills_into_the_next_and_single_calls_follow():
    group = group_of(small_call(), 20)
    items = [GroupMember(group, member) for member in range(20)] + [small_call() for _ in range(12)]
    # 32 calls over 2 workers: shares of 16; the group fills the first and 4 of the second
    plan = plan_batch(items, workers=2)
    assert layout(plan) == [
        [("group", tuple(range(16)))],
        [("group", tuple(range(16, 20))), ("calls", tuple(range(20, 32)))],
    ]


def test_a_batch_of_errors_and_empty_calls_runs_nothing():
    empty = MoeInitRoutingV2GradCall(
        grad_expanded_x=np.zeros((4, 0), np.float32), expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2
    )
    plan = plan_batch([moegrad.DeviceBusy("busy", retry_after_s=1.0), empty], workers=2)
    assert plan.shares == [] and plan.empty == [(1, empty)] and plan.comparisons == []
