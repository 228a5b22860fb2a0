"""Replays: rows of grad_x summed again by a known schedule, on chosen summands, in a chosen precision.

:func:`moegrad.explain` asks "would this schedule, on these summands, give the candidate's bits?".
The schedules are the ones moegrad already writes out (:mod:`moegrad.numerics._schedules`,
:mod:`moegrad.numerics._ascend950`): every device profile's for the call's shape, plus two schedules
a port commonly uses, written in the same vocabulary of steps: ``"pairwise"`` (adjacent slots added
in pairs, then pairs of pairs, a leftover passed up) and ``"reversed"`` (a chain from +0.0 over the
slots K-1 down to 0). A replay runs through the reference module's accumulation engine (the
compiled kernel for float32, NumPy otherwise), on any rows: a replay's summands are rows of a 2-D
array, read through an index in which a slot outside [0, rows) is skipped, exactly as the device
skips one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moegrad.numerics import _reference
from moegrad.numerics._ascend950 import ascend950_schedule, ascend950_tiling
from moegrad.numerics._schedules import schedule_steps
from moegrad.operator._call import MoeInitRoutingV2GradCall
from moegrad.operator._profiles import BINS, CHAIN, CHIPS, GROUPS_OF_FOUR, PROFILES, RELEASES

__all__ = ["PAIRWISE", "REVERSED", "Schedule", "known_schedules", "replay"]

SEQUENTIAL = "sequential"
PAIRWISE = "pairwise"
REVERSED = "reversed"
_F32 = np.dtype(np.float32)
Steps = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class Schedule:
    """One arithmetic of a row: the steps of :func:`moegrad.accumulation_schedule`'s vocabulary.

    Attributes:
        names: every profile, or ``"pairwise"`` / ``"reversed"``, whose adds for this call are these.
        steps: the steps of one row.
        chunking: ``(k_chunk, True)`` for the Ascend 950's groups of four (the compiled kernel's
            form of those steps), else None.
    """

    names: tuple[str, ...]
    steps: Steps
    chunking: tuple[int, bool] | None = None

    @property
    def name(self) -> str:
        """The first name: the one a row's ``profile`` field gives."""
        return self.names[0]


@functools.lru_cache(maxsize=256)
def _pairwise(top_k: int) -> Steps:
    """Slot t in bin t; then bin j-s += bin j for s = 1, 2, 4, ... and j = s, 3s, 5s, ... < K."""
    steps = [("set", t, t) for t in range(top_k)]
    stride = 1
    while stride < top_k:
        steps += [("merge", j - stride, j) for j in range(stride, top_k, 2 * stride)]
        stride *= 2
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def _reversed(top_k: int) -> Steps:
    return (("zero", 0, 0), *(("add", 0, t) for t in reversed(range(top_k))))


@functools.lru_cache(maxsize=4096)
def _arithmetic(steps: Steps) -> str:
    """The expression a row's steps compute, adds written with sorted operands (IEEE addition is
    commutative), so two step lists of the same arithmetic give the same string."""
    bins: dict[int, str] = {}

    def add(a: str, b: str) -> str:
        return "(" + "+".join(sorted((a, b))) + ")"

    for op, dst, src in steps:
        if op == "zero":
            bins[dst] = "0"
        elif op == "set":
            bins[dst] = f"v{src}"
        elif op == "add":
            bins[dst] = add(bins[dst], f"v{src}")
        else:
            bins[dst] = add(bins[dst], bins[src])
    return bins[0]


def _profile_schedule(call: MoeInitRoutingV2GradCall, name: str) -> Schedule:
    """A profile's schedule for ``call``'s shape, in the form the reference kernels run it."""
    profile = PROFILES[name]
    if profile.schedule in (BINS, CHAIN):
        return Schedule((name,), schedule_steps(call.top_k, profile.schedule))
    assert profile.schedule == GROUPS_OF_FOUR
    tiling = ascend950_tiling(call.dtype_name, max(call.num_tokens, 1), call.top_k, max(call.hidden_size, 1))
    return Schedule((name,), ascend950_schedule(call.top_k, tiling.k_chunk), (tiling.k_chunk, True))


_CHIPS = (*CHIPS, None)


def _newest(name: str) -> int:
    release = PROFILES[name].release
    return -RELEASES.index(release) if release else 0


def known_schedules(call: MoeInitRoutingV2GradCall) -> tuple[Schedule, ...]:
    """Every distinct arithmetic a known schedule gives ``call``: the call's own profile first, then
    ``"sequential"`` (the schedule ports most often use), the other profiles chip by chip, the newest
    release first (a group is named after its newest), then ``"pairwise"`` and ``"reversed"``;
    schedules of the same arithmetic are one entry carrying all their names.

    Raises:
        ValueError: the call has no floating dtype (an empty call of another dtype).
    """
    newest_first = sorted(PROFILES, key=lambda name: (_CHIPS.index(PROFILES[name].chip), _newest(name)))
    names = [call.order, SEQUENTIAL, *newest_first]
    candidates = [_profile_schedule(call, name) for name in dict.fromkeys(names)]
    candidates += [Schedule((PAIRWISE,), _pairwise(call.top_k)), Schedule((REVERSED,), _reversed(call.top_k))]
    merged: dict[str, Schedule] = {}
    for schedule in candidates:
        key = _arithmetic(schedule.steps)
        if key in merged:
            first = merged[key]
            merged[key] = Schedule(first.names + schedule.names, first.steps, first.chunking)
        else:
            merged[key] = schedule
    return tuple(merged.values())


def replay(
    call: MoeInitRoutingV2GradCall,
    rows: np.ndarray,
    index: np.ndarray,
    schedule: Schedule,
    *,
    accumulator: np.dtype = _F32,
    out_dtype: np.dtype | None = None,
) -> np.ndarray:
    """Rows of grad_x summed by ``schedule``: ``out[i] = sum over t of rows[index[i*K + t]]``.

    Args:
        call: the call whose top_k and profile (for its name only) apply.
        rows: [R, H] summands, the call's dtype, C-contiguous.
        index: [n*K] integers; a slot outside [0, R) is skipped (as the device skips one).
        schedule: the schedule of adds.
        accumulator: the dtype every add rounds to: float32 (the kernels'), or float16 /
            bfloat16 (a port that accumulates in a narrower type; each summand is cast to it first).
        out_dtype: the result's dtype: the call's (default; one rounding at the end) or float32 (the
            accumulator as it stands, to add more to it).

    Returns:
        [n, H] of ``out_dtype``.
    """
    hidden = rows.shape[1]
    top_k = call.top_k
    count = rows.shape[0]
    flat = np.ascontiguousarray(index, dtype=np.int32).reshape(-1)
    flat = np.where((flat < 0) | (flat >= count), count, flat).astype(np.int32)
    out = np.empty((flat.shape[0] // top_k, hidden), dtype=rows.dtype if out_dtype is None else out_dtype)
    if out.size == 0:
        return out
    if count == 0:
        out.fill(0.0)
        return out
    # every skipped slot reads index R, which active mode with active_num = R skips on every profile
    sub = MoeInitRoutingV2GradCall.model_construct(
        grad_expanded_x=rows,
        expanded_row_idx=flat,
        top_k=top_k,
        drop_pad_mode=0,
        active_num=count,
        order=call.order,
        allow_duplicate_indices=True,
    )
    chunking = schedule.chunking if np.dtype(accumulator) == _F32 else None
    return _reference.accumulate(sub, schedule.steps, out, chunking=chunking, accumulator=np.dtype(accumulator))
