"""The conditions of one call that a sweep's factor analysis splits its cases by (:func:`call_traits`).

Recorded in each report's :class:`~moegrad.accuracy.ReportContext` (``traits``) when the report is
made, from the call itself, so that a summary (or a merge of shard files) reads them without
opening the case files again; :mod:`moegrad.accuracy._factors` uses them.
"""

from __future__ import annotations

import math

import numpy as np

from moegrad.accuracy._results import CallTraits
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["call_traits", "mode_of"]


def mode_of(drop_pad_mode: int, active_num: int) -> str:
    """The operator's mode: ``"drop_pad"`` (drop_pad_mode 1), ``"active"`` (active_num > 0) or ``"dropless"``."""
    return "drop_pad" if drop_pad_mode == 1 else "active" if active_num > 0 else "dropless"


def call_traits(call: MoeInitRoutingV2GradCall) -> CallTraits:
    """The call's :class:`~moegrad.accuracy.CallTraits`: one pass over expanded_row_idx (a sort,
    for the repeated slots).

    A slot is skipped when its index names no row of grad_expanded_x (-1 in drop/pad mode, an index
    >= active_num in active mode, a negative or past-the-rows index on a profile that skips it:
    docs/semantics.md section 2); validation leaves no other such index.
    """
    top_k = max(call.top_k, 1)
    index = call.expanded_row_idx.reshape(-1).astype(np.int64)
    rows = math.prod(call.grad_expanded_x.shape[:-1])
    skipped = (index < 0) | (index >= rows)
    read = index[~skipped]
    _, inverse, counts = np.unique(read, return_inverse=True, return_counts=True)
    mode = mode_of(call.drop_pad_mode, call.active_num)
    experts = capacity = None
    capacity_edge = False
    if mode == "drop_pad":
        experts, capacity = int(call.grad_expanded_x.shape[0]), int(call.grad_expanded_x.shape[1])
        capacity_edge = bool(capacity and (read % capacity == capacity - 1).any())
    slots = call.num_tokens * top_k
    return CallTraits(
        tokens=call.num_tokens,
        hidden=call.hidden_size,
        mode=mode,
        skipped_slots=int(np.count_nonzero(skipped)),
        repeated_slots=int(np.count_nonzero(counts[inverse] > 1)) if read.size else 0,
        active_edge=mode == "active" and (call.active_num == 1 or call.active_num >= slots),
        capacity_edge=capacity_edge,
        experts=experts,
        capacity=capacity,
    )
