"""Candidates whose fault fires only under a trigger, for the shrinker's tests (``moegrad.shrink``).

Nothing here imports moegrad. Every candidate sums each token's K slots in the Atlas A2/A3 bins'
order (docs/semantics.md section 3.1, :func:`support.candidates.bins_tree`: the ascend910b@9.1
profile's order) with float32 adds and rounds once to the dtype, so a row the trigger leaves alone
has the device's bits; on the rows it hits, one summand is wrong:

- :func:`missing_above_h`: slot 1 left out of every token, only when H > :data:`HIDDEN_THRESHOLD`;
- :func:`missing_odd_rows`: slot 0 left out, only in odd tokens (i = 1, 3, ...);
- :func:`missing_at_k8`: slot 5 left out of every token, only when K = 8;
- :func:`duplicated_even_missing_odd_above_h`: two bugs. Even tokens add slot 0 twice, always; odd
  tokens leave slot 2 out, only when H > :data:`HIDDEN_THRESHOLD`. Shrinking the missing slot must
  not drift to the duplicated one;
- :func:`missing_slot1_even_slot6_odd_at_k8`: two bugs of one label. Even tokens leave slot 1 out,
  always; odd tokens leave slot 6 out, only when K = 8. Shrinking slot 6's fault must keep K = 8;
- :func:`extra_dropped_as_last_row`: drop/pad mode, a token's first dropped slot (-1) read as the
  last row of grad_expanded_x (an index wrapped around instead of skipped);
- :func:`extra_active_as_last_row`: active mode, the slot whose index is A (the first row past the
  active ones) read as row A-1 (a clamping gather);
- :data:`atomic_order`: each token's slots added in a random order of its own, new every call (as
  atomic adds give: :func:`support.candidates.shuffled_rows`);
- :func:`negated`: every row's sign flipped (a fault no single summand explains);
- :func:`missing_first_calls`: slot 0 left out of every token on its first few calls only (a
  candidate that does not give the same bits twice).

Each takes ``(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0)`` and is
defined at the module's top level, so ``"support.triggers:<name>"`` imports it.
"""

from __future__ import annotations

import numpy as np

from support.candidates import bins_tree, shuffled_rows, slot_values, tree_sum

__all__ = [
    "HIDDEN_THRESHOLD",
    "atomic_order",
    "correct",
    "duplicated_even_missing_odd_above_h",
    "extra_active_as_last_row",
    "extra_dropped_as_last_row",
    "missing_above_h",
    "missing_at_k8",
    "missing_first_calls",
    "missing_odd_rows",
    "missing_slot1_even_slot6_odd_at_k8",
    "negated",
]

#: The hidden size above which :func:`missing_above_h` drops a slot.
HIDDEN_THRESHOLD = 48


def _total(values: np.ndarray, top_k: int, dtype) -> np.ndarray:
    return tree_sum(bins_tree(top_k), values).astype(dtype)


def correct(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """No fault: the A2/A3 bins' order."""
    values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
    return _total(values, top_k, grad_expanded_x.dtype)


def _dropping(grad, index, top_k, drop_pad_mode, active_num, slot, tokens):
    values = slot_values(grad, index, top_k, drop_pad_mode, active_num)
    if slot < top_k:
        values[slot, tokens] = 0.0
    return _total(values, top_k, grad.dtype)


def missing_above_h(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Slot 1 left out of every token when H > HIDDEN_THRESHOLD."""
    tokens = np.arange(expanded_row_idx.size // top_k)
    if grad_expanded_x.shape[-1] <= HIDDEN_THRESHOLD:
        tokens = tokens[:0]
    return _dropping(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, 1, tokens)


def missing_odd_rows(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Slot 0 left out of the odd tokens."""
    tokens = np.arange(1, expanded_row_idx.size // top_k, 2)
    return _dropping(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, 0, tokens)


def missing_at_k8(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Slot 5 left out of every token when K = 8."""
    tokens = np.arange(expanded_row_idx.size // top_k) if top_k == 8 else np.arange(0)
    return _dropping(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, 5, tokens)


def duplicated_even_missing_odd_above_h(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Even tokens: slot 0 added twice (after the schedule), always. Odd tokens: slot 2 left out when H > threshold."""
    values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
    tokens = np.arange(values.shape[1])
    odd, even = tokens[1::2], tokens[0::2]
    if grad_expanded_x.shape[-1] > HIDDEN_THRESHOLD and top_k > 2:
        values[2, odd] = 0.0
    total = tree_sum(bins_tree(top_k), values)
    total[even] = np.add(total[even], values[0, even], dtype=np.float32)
    return total.astype(grad_expanded_x.dtype)


def missing_slot1_even_slot6_odd_at_k8(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Even tokens: slot 1 left out, always (K > 1). Odd tokens: slot 6 left out when K = 8."""
    values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
    tokens = np.arange(values.shape[1])
    if top_k > 1:
        values[1, tokens[0::2]] = 0.0
    if top_k == 8:
        values[6, tokens[1::2]] = 0.0
    return _total(values, top_k, grad_expanded_x.dtype)


def _reading(grad, index, top_k, drop_pad_mode, active_num, wrong):
    """The sum with each token's first slot that ``wrong`` (an [N, K] mask) marks read as the last row."""
    values = slot_values(grad, index, top_k, drop_pad_mode, active_num)
    rows = grad.reshape(-1, grad.shape[-1]).astype(np.float32)
    last = (active_num if drop_pad_mode == 0 and active_num > 0 else rows.shape[0]) - 1
    marked = wrong.reshape(-1, top_k)
    for token in np.flatnonzero(marked.any(axis=1)):
        values[int(np.argmax(marked[token])), token] = rows[last]
    return _total(values, top_k, grad.dtype)


def extra_dropped_as_last_row(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Drop/pad: a token's first dropped slot (-1) read as the last row of grad_expanded_x."""
    wrong = (expanded_row_idx < 0) if drop_pad_mode == 1 else np.zeros(expanded_row_idx.shape, bool)
    return _reading(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, wrong)


def extra_active_as_last_row(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Active: the slot whose index is A read as row A-1 (a gather that clamps instead of skipping)."""
    active = drop_pad_mode == 0 and active_num > 0
    wrong = (expanded_row_idx == active_num) if active else np.zeros(expanded_row_idx.shape, bool)
    return _reading(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, wrong)


#: A candidate whose order of adds changes with every call and token (``support.triggers:atomic_order``).
atomic_order = shuffled_rows(seed=11)


def negated(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Every row of the correct grad_x with its sign flipped."""
    return -correct(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=drop_pad_mode, active_num=active_num)


def missing_first_calls(count: int):
    """A candidate that leaves slot 0 out of every token on its first ``count`` calls, then adds it."""
    calls = []

    def candidate(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        calls.append(1)
        tokens = np.arange(expanded_row_idx.size // top_k if len(calls) <= count else 0)
        return _dropping(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, 0, tokens)

    return candidate
