"""Smaller calls made from a call, each valid by the operator's rules of its mode: the shrinker's moves.

Every move keeps the call's mode (dropless, active or drop/pad), its device profile (``order``) and
``allow_duplicate_indices``, and builds the result as a :class:`~moegrad.MoeInitRoutingV2GradCall`,
so that a move the operator's rules refuse raises :class:`~moegrad.InvalidArgument` (or
:class:`ReductionRefused` when the mode itself cannot be kept) instead of yielding a call no device
would take. The rules are docs/operator.md's (rules 5 and 7) and docs/semantics.md's section 2:

- **dropless** (``drop_pad_mode`` 0, ``active_num`` 0): grad_expanded_x has exactly N*K rows and the
  index reads each once (a permutation of [0, N*K); on ``ascend950@9.1`` values outside are slots of
  +0.0). Keeping some tokens or slots keeps the rows their slots read, in their order, renumbered
  0, 1, ... by rank (the relative order of rows is kept, so a candidate whose order of adds follows
  the rows sees the same order); rows no slot reads are added, the lowest first, only where the
  profile's +0.0 slots leave fewer rows read than N'*K'. A value past the rows stays past them
  (shifted by the rows removed); a negative value stays as it is.
- **active** (``active_num`` A > 0): grad_expanded_x has A rows; slots reading [0, A) are kept with
  their rows, renumbered by rank, and A' is the number of rows kept (at least one: A' = 0 would be
  dropless mode); slots that read nothing (values in [A, N*K)) keep their relative order as
  A', A'+1, ..., below N'*K'.
- **drop/pad** (``drop_pad_mode`` 1): grad_expanded_x [E, C, H] is kept whole when tokens or slots
  go (the rows they read stay, as padding); experts and capacity positions are removed by their own
  moves, a slot that read a removed one becoming -1 (dropped), the others renumbered ``e*C' + c``.
- **columns** and **values** change grad_expanded_x alone; the index stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = [
    "ReductionRefused",
    "call_size",
    "keep_capacity",
    "keep_columns",
    "keep_experts",
    "keep_slots",
    "keep_tokens",
    "mode_of",
    "with_values",
]


class ReductionRefused(ValueError):
    """The move would change the call's mode (an active call left with no row read)."""


def mode_of(call: MoeInitRoutingV2GradCall) -> str:
    """``"dropless"``, ``"active"`` or ``"drop_pad"``."""
    if call.drop_pad_mode == 1:
        return "drop_pad"
    return "active" if call.active_num > 0 else "dropless"


def call_size(call: MoeInitRoutingV2GradCall) -> str:
    """The call's sizes in one line: ``N=1 K=6 H=2 float32 dropless [6, 2]`` (the last: grad_expanded_x's shape)."""
    mode = mode_of(call)
    extra = f" A={call.active_num}" if mode == "active" else ""
    if mode == "drop_pad":
        experts, capacity = call.grad_expanded_x.shape[:2]
        extra = f" E={experts} C={capacity}"
    shape = list(call.grad_expanded_x.shape)
    return f"N={call.num_tokens} K={call.top_k} H={call.hidden_size}{extra} {call.dtype_name} {mode} {shape}"


def _made(
    call: MoeInitRoutingV2GradCall, grad: np.ndarray, index: np.ndarray, top_k: int, active: int
) -> MoeInitRoutingV2GradCall:
    return MoeInitRoutingV2GradCall(
        grad_expanded_x=grad,
        expanded_row_idx=np.ascontiguousarray(index, dtype=np.int32),
        top_k=top_k,
        drop_pad_mode=call.drop_pad_mode,
        active_num=active,
        order=call.order,
        allow_duplicate_indices=call.allow_duplicate_indices,
    )


def _rows(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    return call.grad_expanded_x.reshape(-1, call.grad_expanded_x.shape[-1])


def keep_tokens(call: MoeInitRoutingV2GradCall, tokens: Sequence[int]) -> MoeInitRoutingV2GradCall:
    """The call of the tokens ``tokens`` (ascending, at least one), each with all its K slots.

    Raises:
        ReductionRefused: an active call whose kept slots read no row.
        InvalidArgument: the operator's rules refuse the result (module docstring).
    """
    index = call.expanded_row_idx.reshape(-1, call.top_k)[np.asarray(tokens, dtype=np.intp)]
    return _with_index(call, index)


def keep_slots(call: MoeInitRoutingV2GradCall, slots: Sequence[int]) -> MoeInitRoutingV2GradCall:
    """The call whose every token keeps only the slot positions ``slots`` (ascending, at least one): K' = len(slots).

    Raises:
        ReductionRefused, InvalidArgument: as :func:`keep_tokens`.
    """
    index = call.expanded_row_idx.reshape(-1, call.top_k)[:, np.asarray(slots, dtype=np.intp)]
    return _with_index(call, index)


def keep_columns(call: MoeInitRoutingV2GradCall, columns: Sequence[int]) -> MoeInitRoutingV2GradCall:
    """The call with grad_expanded_x's columns ``columns`` only (ascending, at least one): H' = len(columns)."""
    grad = call.grad_expanded_x[..., np.asarray(columns, dtype=np.intp)]
    return _made(call, grad, call.expanded_row_idx, call.top_k, call.active_num)


def with_values(call: MoeInitRoutingV2GradCall, grad: np.ndarray) -> MoeInitRoutingV2GradCall:
    """The call with grad_expanded_x replaced by ``grad`` (its shape and dtype)."""
    return _made(call, grad, call.expanded_row_idx, call.top_k, call.active_num)


def _with_index(call: MoeInitRoutingV2GradCall, index: np.ndarray) -> MoeInitRoutingV2GradCall:
    """The call of the [N', K'] ``index`` (the old call's values), its rows and index rebuilt for the mode."""
    top_k = index.shape[1]
    flat = index.reshape(-1).astype(np.int64)
    if call.drop_pad_mode == 1:
        return _made(call, call.grad_expanded_x, flat, top_k, 0)
    rows = _rows(call)
    slots, old_slots = flat.size, call.expanded_row_idx.size
    active = call.active_num
    read = (flat >= 0) & (flat < (active if active > 0 else rows.shape[0]))
    used, rank = np.unique(flat[read], return_inverse=True)
    new = flat.copy()
    beyond = flat >= old_slots  # ascend950@9.1's +0.0 slots past the end stay past it
    new[beyond] = flat[beyond] - old_slots + slots
    if active > 0:
        if used.size == 0:
            raise ReductionRefused("an active call needs a row read (active_num >= 1)")
        new[read] = rank
        parked = (flat >= active) & (flat < old_slots)  # slots of +0.0 rows inside [A, N*K)
        new[parked] = used.size + np.unique(flat[parked], return_inverse=True)[1]
        return _made(call, rows[used], new, top_k, int(used.size))
    spare = np.setdiff1d(np.arange(rows.shape[0]), used, assume_unique=True)[: max(slots - used.size, 0)]
    kept = np.union1d(used, spare)
    new[read] = np.searchsorted(kept, flat[read])
    return _made(call, rows[kept], new, top_k, 0)


def keep_experts(call: MoeInitRoutingV2GradCall, experts: Sequence[int]) -> MoeInitRoutingV2GradCall:
    """Drop/pad: the call with grad_expanded_x's experts ``experts`` only (ascending, at least one).

    A slot that read a removed expert becomes -1 (dropped); the others read ``e'*C + c``, e' the
    expert's rank among those kept.
    """
    kept = np.asarray(experts, dtype=np.intp)
    capacity = call.grad_expanded_x.shape[1]
    position = np.full(call.grad_expanded_x.shape[0], -1, dtype=np.int64)
    position[kept] = np.arange(kept.size)
    return _renumbered(call, call.grad_expanded_x[kept], position, capacity, capacity, by_expert=True)


def keep_capacity(call: MoeInitRoutingV2GradCall, positions: Sequence[int]) -> MoeInitRoutingV2GradCall:
    """Drop/pad: the call with the capacity positions ``positions`` of every expert only (ascending,
    at least one): C' = len(positions). A slot that read a removed position becomes -1 (dropped)."""
    kept = np.asarray(positions, dtype=np.intp)
    capacity = call.grad_expanded_x.shape[1]
    position = np.full(capacity, -1, dtype=np.int64)
    position[kept] = np.arange(kept.size)
    return _renumbered(call, call.grad_expanded_x[:, kept], position, capacity, kept.size, by_expert=False)


def _renumbered(
    call: MoeInitRoutingV2GradCall,
    grad: np.ndarray,
    position: np.ndarray,
    capacity: int,
    new_capacity: int,
    *,
    by_expert: bool,
) -> MoeInitRoutingV2GradCall:
    """Drop/pad: the index of ``grad`` [E', C', H] after an expert (``by_expert``) or capacity move;
    ``position`` maps the old expert (or capacity position) to the new one, -1 when removed."""
    flat = call.expanded_row_idx.astype(np.int64)
    read = (flat >= 0) & (flat < call.grad_expanded_x.shape[0] * capacity)
    expert, row = np.divmod(flat[read], capacity)
    if by_expert:
        expert = position[expert]
        gone = expert < 0
    else:
        row = position[row]
        gone = row < 0
    new = flat.copy()
    new[read] = np.where(gone, -1, expert * new_capacity + row)
    return _made(call, grad, new, call.top_k, 0)
