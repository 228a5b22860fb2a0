"""Many small calls computed as one, with each call's own bits: ``moe_init_routing_v2_grad_many``
(any validated calls) and ``moe_init_routing_v2_grad_group`` (a :class:`~moegrad.CallGroup`).

Every row of grad_x depends only on its own K slots, and the schedule of its adds only on K and the
profile's kernel schedule (the 950's groups of four: also on the tiling's k_chunk), so calls that share
those are stacked into one drop/pad call over their rows and run through :mod:`moegrad.numerics._reference`'s
kernels once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from moegrad.numerics._ascend950 import (
    ASCEND950,
    UB_SIZE_BYTES,
    VECTOR_CORE_COUNT,
    ascend950_schedule,
    ascend950_tiling,
)
from moegrad.numerics._reference import accumulate, moe_init_routing_v2_grad
from moegrad.numerics._schedules import schedule_steps
from moegrad.operator._call import CallGroup, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import GROUPS_OF_FOUR

__all__ = ["moe_init_routing_v2_grad_group", "moe_init_routing_v2_grad_many"]

#: moe_init_routing_v2_grad_many stacks calls of at most this many input bytes (a larger call runs
#: alone: stacking would copy it for no saving), into stacks of at most _STACK_BYTES.
_STACK_CALL_BYTES = 1 << 20
_STACK_BYTES = 16 << 20
_F32 = np.dtype(np.float32)


def moe_init_routing_v2_grad_many(
    calls: Sequence[MoeInitRoutingV2GradCall],
    *,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> list[np.ndarray]:
    """grad_x of each of many validated calls: bit for bit what :func:`moe_init_routing_v2_grad`
    gives each one, for a fraction of the per-call cost when the calls are small.

    Every row of grad_x depends only on its own K slots, and the schedule of its adds only on K and the
    profile's kernel schedule (the 950's groups of four: also on the tiling's k_chunk). So small calls
    that share the dtype, K, H, the kernel schedule and its k_chunk are computed as one: their rows
    stacked, each call's indices shifted past the rows before it, a skipped slot (an index outside
    the call's rows: -1 in drop/pad mode, >= active_num in active mode, and on 950@9.1 any
    negative or dropless >= N*K) marked -1, and the result rows split back. Calls of more than 1 MiB of input run alone.

    Args:
        calls: validated calls (:class:`MoeInitRoutingV2GradCall`), any modes, dtypes and profiles.
        ub_size_bytes, vector_core_count: as for :func:`moe_init_routing_v2_grad` (950 profiles only).

    Returns:
        One grad_x per call, in order: [N, H], C-contiguous, the call's dtype in native byte order.
        The grad_x of stacked calls are row ranges of one array.

    Raises:
        ValueError / TypeError: ``ub_size_bytes`` or ``vector_core_count`` is not a positive integer.
    """
    results: list[np.ndarray | None] = [None] * len(calls)
    stacks: dict[tuple, list[int]] = {}
    for position, call in enumerate(calls):
        tokens, hidden = call.num_tokens, call.hidden_size
        grad = call.grad_expanded_x
        if tokens == 0 or hidden == 0 or grad.nbytes > _STACK_CALL_BYTES:
            results[position] = moe_init_routing_v2_grad(
                call, ub_size_bytes=ub_size_bytes, vector_core_count=vector_core_count
            )
            continue
        chunking = _chunking(call, ub_size_bytes, vector_core_count)
        stacks.setdefault((grad.dtype, call.top_k, hidden, call.profile.schedule, chunking), []).append(position)
    for (_, top_k, hidden, kernel_schedule, chunking), positions in stacks.items():
        schedule = _stack_schedule(top_k, kernel_schedule, chunking)
        start = 0
        while start < len(positions):  # stacks of at most _STACK_BYTES of input
            stop, size = start, 0
            while stop < len(positions) and (stop == start or size < _STACK_BYTES):
                size += calls[positions[stop]].grad_expanded_x.nbytes
                stop += 1
            members = [calls[position] for position in positions[start:stop]]
            stacked = _stacked(members, top_k, hidden, schedule, chunking)
            for position, grad_x in zip(positions[start:stop], stacked, strict=True):
                results[position] = grad_x
            start = stop
    return cast(list[np.ndarray], results)


def _chunking(call: MoeInitRoutingV2GradCall, ub_size_bytes: int, vector_core_count: int) -> tuple[int, bool] | None:
    """A non-empty call's 950 tiling as (k_chunk, True), which the groups of four depend on; None
    for the other kernels' schedules (the bins, and the chain, which no chunking changes)."""
    profile = call.profile
    if profile.chip != ASCEND950:
        return None
    tiling = ascend950_tiling(  # also for the chain: a bad platform setting never passes unnoticed
        call.dtype_name,
        call.num_tokens,
        call.top_k,
        call.hidden_size,
        ub_size_bytes=ub_size_bytes,
        vector_core_count=vector_core_count,
    )
    return (tiling.k_chunk, True) if profile.schedule == GROUPS_OF_FOUR else None


def _stack_schedule(
    top_k: int, kernel_schedule: str, chunking: tuple[int, bool] | None
) -> Sequence[tuple[str, int, int]]:
    """The schedule of adds of stacked calls with this K, kernel schedule (``Profile.schedule``) and
    :func:`_chunking`."""
    return schedule_steps(top_k, kernel_schedule) if chunking is None else ascend950_schedule(top_k, *chunking)


def _stacked(
    members: list[MoeInitRoutingV2GradCall],
    top_k: int,
    hidden: int,
    schedule: Sequence[tuple[str, int, int]],
    chunking: tuple[int, bool] | None,
) -> list[np.ndarray]:
    """The members' grad_x, computed as one drop/pad call over their stacked rows (see
    :func:`moe_init_routing_v2_grad_many`); they share dtype, K, H and schedule."""
    rows = np.concatenate([member.grad_expanded_x.reshape(-1, hidden) for member in members])
    row_counts = np.array([member.grad_expanded_x.size // hidden for member in members], dtype=np.int64)
    slot_counts = np.array([member.expanded_row_idx.shape[0] for member in members], dtype=np.int64)
    index = np.concatenate([member.expanded_row_idx for member in members]).astype(np.int64)
    first_row = np.repeat(np.cumsum(row_counts) - row_counts, slot_counts)
    # each member's own skip rule in one: a valid index is below its own row count (dropless: N*K,
    # active: A, drop/pad: E*C), and what is skipped (-1, or >= A) is outside [0, rows)
    skipped = (index < 0) | (index >= np.repeat(row_counts, slot_counts))
    stacked_index = np.where(skipped, -1, index + first_row).astype(np.int32)
    out = _run_stacked(rows, stacked_index, top_k, members[0].order, schedule, chunking)
    bounds = np.cumsum(slot_counts // top_k).tolist()
    return [out[stop - tokens : stop] for stop, tokens in zip(bounds, (slot_counts // top_k).tolist(), strict=True)]


def _run_stacked(
    rows: np.ndarray,
    stacked_index: np.ndarray,
    top_k: int,
    order: str,
    schedule: Sequence[tuple[str, int, int]],
    chunking: tuple[int, bool] | None,
) -> np.ndarray:
    """grad_x of one drop/pad call over ``rows`` ([M, H]) with ``stacked_index`` ([S] int32, -1 for
    a skipped slot): the stacked form of many calls (:func:`_stacked`, :func:`moe_init_routing_v2_grad_group`)."""
    hidden = rows.shape[1]
    stacked = MoeInitRoutingV2GradCall.model_construct(  # valid by construction: the members were validated
        grad_expanded_x=rows.reshape(-1, 1, hidden),
        expanded_row_idx=stacked_index,
        top_k=top_k,
        drop_pad_mode=1,
        active_num=0,
        order=order,
        allow_duplicate_indices=True,
    )
    out = np.empty((stacked_index.shape[0] // top_k, hidden), dtype=rows.dtype.newbyteorder("="))
    return accumulate(stacked, schedule, out, chunking=chunking)


def moe_init_routing_v2_grad_group(
    group: CallGroup, *, ub_size_bytes: int = UB_SIZE_BYTES, vector_core_count: int = VECTOR_CORE_COUNT
) -> np.ndarray:
    """grad_x of every member of a :class:`~moegrad.CallGroup`, computed as one: bit for bit
    what :func:`moe_init_routing_v2_grad` gives each member (the stacking of
    :func:`moe_init_routing_v2_grad_many`, with no per-call work).

    Args:
        group: B validated calls of one shape, dtype and attribute set, stacked.
        ub_size_bytes, vector_core_count: as for :func:`moe_init_routing_v2_grad` (950 profiles only).

    Returns:
        [B, N, H], C-contiguous, the members' dtype in native byte order: member b's grad_x is ``[b]``.

    Raises:
        ValueError / TypeError: ``ub_size_bytes`` or ``vector_core_count`` is not a positive integer.
    """
    like = group.like
    members, tokens, hidden = len(group), like.num_tokens, like.hidden_size
    if members == 0 or tokens == 0 or hidden == 0:
        return np.zeros((members, tokens, hidden), dtype=like.grad_expanded_x.dtype.newbyteorder("="))
    chunking = _chunking(like, ub_size_bytes, vector_core_count)
    schedule = _stack_schedule(like.top_k, like.profile.schedule, chunking)
    row_count = like.grad_expanded_x.size // hidden  # dropless N*K, active A, drop/pad E*C
    rows = group.grad_expanded_x.reshape(members * row_count, hidden)
    index = group.expanded_row_idx.astype(np.int64)
    # a valid slot is in [0, row_count); what is skipped (-1, or >= A in active mode) is not
    skipped = (index < 0) | (index >= row_count)
    first_row = (np.arange(members, dtype=np.int64) * row_count)[:, None]
    stacked_index = np.where(skipped, -1, index + first_row).astype(np.int32).reshape(-1)
    return _run_stacked(rows, stacked_index, like.top_k, like.order, schedule, chunking).reshape(
        members, tokens, hidden
    )
