"""A batch's plan: which of its calls run, in which worker's share, in which parts; a pure function.

``DataPlane.infer_batch`` runs a batch in three steps: it checks each item's order, plans the rest
here (:func:`plan_batch`: no pool, no HTTP, nothing runs), then runs each share of the plan as one
queue entry (``StreamPool.run_parts``) and judges the comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moegrad import CallGroup, MoeInitRoutingV2GradCall
from moegrad_service.dataplane.records import Comparison, GroupMember

__all__ = ["BATCH_CHUNK_CALLS", "BATCH_PART_BYTES", "BATCH_PART_CALLS", "BatchPlan", "Part", "plan_batch"]

#: The fewest grad calls a batch hands to one worker at once (fewer only when the batch has fewer).
BATCH_CHUNK_CALLS = 16
#: The most calls, and input bytes, of one part of a batch's share: a worker checks the deadline
#: (and whether the caller is still there) before each part, so a batch past its deadline stops
#: within about one part's compute instead of running to its end.
BATCH_PART_CALLS = 64
BATCH_PART_BYTES = 4 << 20


class Part(NamedTuple):
    """One part of a worker's share and the places (indices in the batch) of its calls.

    Attributes:
        work: a run of consecutive grad calls (a tuple: run one after another, or all at once where
            the backend can), or a chunk of a group (a :class:`moegrad.CallGroup`: its members in one
            computation where the backend can); either is one part of ``StreamPool.run_parts``.
        places: the batch index each of its calls answers, in order.
    """

    work: tuple[MoeInitRoutingV2GradCall, ...] | CallGroup
    places: tuple[int, ...]


@dataclass(frozen=True)
class BatchPlan:
    """How a batch runs.

    Attributes:
        empty: (place, call) of each call with N = 0 or H = 0: answered zeros, never run.
        shares: the parts each queue entry runs, one list per worker share: the groups' chunks first
            (each group in order of its first member), then the runs of single calls in batch order.
        comparisons: (place, comparison) of each comparison: its call is planned as the others
            (in ``empty`` or a share), and it is judged once that call has answered.
    """

    empty: list[tuple[int, MoeInitRoutingV2GradCall]]
    shares: list[list[Part]]
    comparisons: list[tuple[int, Comparison]]


def plan_batch(items: Sequence[object], *, workers: int) -> BatchPlan:
    """Plan a batch's items into shares and parts.

    The grad calls, the groups' members and the comparisons' calls go to as many shares as
    ``workers`` (the most shares that run at once and fit the queue), each share at least
    BATCH_CHUNK_CALLS calls (fewer only when the batch has fewer): one queue entry and one hand-off
    each, however many calls and groups. Within a share, a group is cut into chunks of at most
    BATCH_PART_BYTES of grad_expanded_x (one member at least) and consecutive single calls into runs
    of at most BATCH_PART_CALLS calls and BATCH_PART_BYTES of grad_expanded_x (one call at least).

    Args:
        items: the batch's items, in order: validated calls, group members
            (:class:`~moegrad_service.dataplane.records.GroupMember`), comparisons, or anything
            else (an item already answered: an error), which the plan leaves out.
        workers: the most shares (>= 1).

    Returns:
        The plan; every call appears once, in ``empty`` or in one part of one share.
    """
    grads: list[tuple[int, MoeInitRoutingV2GradCall]] = []
    groups: dict[int, tuple[CallGroup, list[int]]] = {}  # id(group) -> (group, each member's place)
    empty: list[tuple[int, MoeInitRoutingV2GradCall]] = []
    comparisons: list[tuple[int, Comparison]] = []
    for index, item in enumerate(items):
        if type(item) is GroupMember:
            entry = groups.get(id(item.group))
            if entry is None:
                entry = groups[id(item.group)] = (item.group, [0] * len(item.group))
            entry[1][item.member] = index
            continue
        call = item.call if isinstance(item, Comparison) else item
        if isinstance(item, Comparison):  # its call runs with the others; it is judged after
            comparisons.append((index, item))
        if isinstance(call, MoeInitRoutingV2GradCall):
            if call.num_tokens == 0 or call.hidden_size == 0:
                empty.append((index, call))
            else:
                grads.append((index, call))

    total = len(grads) + sum(len(group) for group, _ in groups.values())
    size = max(BATCH_CHUNK_CALLS, -(-total // max(workers, 1)))
    shares: list[list[Part]] = [[]]
    room = size

    def take(count: int) -> int:
        """Room for ``count`` more calls in the current share (a new share when it is full)."""
        nonlocal room
        if room == 0:
            shares.append([])
            room = size
        taken = min(room, count)
        room -= taken
        return taken

    for group, places in groups.values():
        per_part = max(1, BATCH_PART_BYTES // max(group.like.grad_expanded_x.nbytes, 1))
        start = 0
        while start < len(group):
            stop = start + take(min(len(group) - start, per_part))
            shares[-1].append(Part(group[start:stop], tuple(places[start:stop])))
            start = stop
    start = 0
    while start < len(grads):
        stop, part_bytes = start + 1, grads[start][1].grad_expanded_x.nbytes
        while stop < len(grads) and stop - start < BATCH_PART_CALLS:
            part_bytes += grads[stop][1].grad_expanded_x.nbytes
            if part_bytes > BATCH_PART_BYTES:
                break
            stop += 1
        stop = start + take(stop - start)
        run = grads[start:stop]
        shares[-1].append(Part(tuple(call for _, call in run), tuple(index for index, _ in run)))
        start = stop
    return BatchPlan(empty, [share for share in shares if share], comparisons)
