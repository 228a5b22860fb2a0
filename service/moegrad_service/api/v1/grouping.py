"""A batch's small calls of one shape, checked and run as a group instead of one by one.

A batch of an accuracy sweep holds hundreds of calls that differ only in their tensors' values.
Each is checked as :class:`moegrad.MoeInitRoutingV2GradCall` checks it, but at a call's size that
costs more than the computation. So the calls that share every attribute, dtype and shape are
checked once for what they share and together for what they do not:

- Rules 1-6 (presence, dtypes, attributes, ranks, dim 0, divisibility: :mod:`moegrad.operator`)
  depend only on what the members share. The group's ``like`` call is built and validated from the
  first member's own document, with an index that keeps rule 7 by construction (0, 1, 2 ... in
  dropless/active mode, all -1 in drop/pad mode). If it is refused, every member goes the single
  call's way, so each gets that way's error.
- Rule 7 (index range and uniqueness) is checked for all members at once
  (:meth:`CallGroup.breaking_rule_7`, the same predicate); a member that breaks it, or whose tensor
  bytes do not fit its shape, goes the single call's way and gets the error naming its culprit.

A member joins only when every value it shares has exactly the type the checks need (int, not
bool, float or None; bool for ``allow_duplicate_indices``; a str or no ``order``; a list of int
shapes): equal keys then mean equal rules. Anything else, every call with a tensor over
:data:`GROUP_CALL_BYTES`, and every call alone of its shape goes the single call's way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from moegrad import DTYPES, CallGroup, MoegradError, MoeInitRoutingV2GradCall
from moegrad_service.dataplane import DataPlane, GroupMember

__all__ = ["GROUP_CALL_BYTES", "group_calls"]

log = logging.getLogger("moegrad_service.api")

#: A call whose grad_expanded_x or expanded_row_idx holds more bytes than this is checked and run on
#: its own (its checks then cost little next to its computation, and a group would copy its bytes).
GROUP_CALL_BYTES = 64 << 10
_FIELDS = frozenset(
    ("grad_expanded_x", "expanded_row_idx", "top_k", "drop_pad_mode", "active_num", "order", "allow_duplicate_indices")
)
_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))


def _int_shape(shape: Any) -> tuple[int, ...] | None:
    if type(shape) is not list:
        return None
    for size in shape:
        if type(size) is not int or size < 0:
            return None
    return tuple(shape)


def _key(item: dict[str, Any]) -> tuple | None:
    """What a call shares with the others of its group, or None: it goes the single call's way."""
    if not _FIELDS.issuperset(item):
        return None
    grad, idx = item.get("grad_expanded_x"), item.get("expanded_row_idx")
    if type(grad) is not dict or type(idx) is not dict or grad.keys() != _TENSOR_KEYS or idx.keys() != _TENSOR_KEYS:
        return None
    grad_name, idx_name, grad_data = grad["dtype"], idx["dtype"], grad["data"]
    if type(grad_name) is not str or type(idx_name) is not str or type(grad_data) is not bytes:
        return None
    idx_data = idx["data"]
    if type(idx_data) is not bytes or len(grad_data) > GROUP_CALL_BYTES or len(idx_data) > GROUP_CALL_BYTES:
        return None
    top_k, mode, active = item.get("top_k"), item.get("drop_pad_mode", 0), item.get("active_num", 0)
    if type(top_k) is not int or type(mode) is not int or type(active) is not int:
        return None
    order, allow = item.get("order"), item.get("allow_duplicate_indices", False)
    if (order is not None and type(order) is not str) or type(allow) is not bool:
        return None
    grad_shape, idx_shape = _int_shape(grad["shape"]), _int_shape(idx["shape"])
    if grad_shape is None or idx_shape is None:
        return None
    return (grad_name, grad_shape, idx_name, idx_shape, top_k, mode, active, order, allow)


def _like(item: dict[str, Any], dataplane: DataPlane, max_elements: int) -> MoeInitRoutingV2GradCall | None:
    """The group's shared call: the first member's document with an index that keeps rule 7,
    validated; None when its rules 1-6 refuse it, or it is empty. The profile it names (or none) is
    the dataplane's to check, for every member at once (it is part of what they share)."""
    idx = item["expanded_row_idx"]
    if idx["dtype"] != "int32" or len(idx["shape"]) != 1 or item.get("drop_pad_mode", 0) not in (0, 1):
        return None
    slots = idx["shape"][0]
    if len(idx["data"]) != 4 * slots:  # the declared shape is not the bytes' (never allocate for it)
        return None
    values = np.full(slots, -1, np.int32) if item.get("drop_pad_mode", 0) == 1 else np.arange(slots, dtype=np.int32)
    document = {**item, "expanded_row_idx": {**idx, "data": values.astype("<i4").tobytes()}}
    try:
        like = MoeInitRoutingV2GradCall.from_wire(
            document, max_elements=max_elements, default_order=dataplane.default_order
        )
    except MoegradError:
        return None
    return like if like.num_tokens and like.hidden_size else None


def group_calls(
    items: Sequence[dict[str, Any] | BaseException], dataplane: DataPlane, *, max_elements: int
) -> list[GroupMember | None]:
    """Group a batch's small calls of one shape (see the module's docstring).

    Args:
        items: the batch's decoded items (:func:`moegrad.decode_batch`): call maps, or the error
            an item already earned.
        dataplane: its ``default_order`` is the single call's.
        max_elements: the largest element count a tensor may have (as the single call's).

    Returns:
        One entry per item: its place in a validated group, or None where it goes the single
        call's way (not a plain call map, alone of its shape, or refused by a check).
    """
    placed: list[GroupMember | None] = [None] * len(items)
    shapes: dict[tuple, list[int]] = {}
    for index, item in enumerate(items):
        if type(item) is dict:
            key = _key(item)
            if key is not None:
                shapes.setdefault(key, []).append(index)
    for members in shapes.values():
        if len(members) < 2:
            continue
        try:
            group = _group(items, members, dataplane, max_elements)
        except Exception:  # a bug here must not fail the batch: its calls go the single call's way
            log.exception("grouping %d calls of one shape failed; checking them one by one", len(members))
            continue
        if group is not None:
            for member, index in enumerate(group[1]):
                placed[index] = GroupMember(group[0], member)
    return placed


def _group(
    items: Sequence[dict[str, Any] | BaseException], members: list[int], dataplane: DataPlane, max_elements: int
) -> tuple[CallGroup, list[int]] | None:
    """The validated group of the calls at ``members`` (one key) and the places of those that joined
    it, or None when fewer than two can."""
    first = items[members[0]]
    assert isinstance(first, dict)
    like = _like(first, dataplane, max_elements)
    if like is None:
        return None
    grad_bytes, idx_bytes = like.grad_expanded_x.nbytes, like.expanded_row_idx.nbytes
    documents = cast(list[dict[str, Any]], [items[index] for index in members])
    tensors = [(item["grad_expanded_x"]["data"], item["expanded_row_idx"]["data"]) for item in documents]
    fits = [len(grad) == grad_bytes and len(idx) == idx_bytes for grad, idx in tensors]
    if not all(fits):
        members = [index for index, fit in zip(members, fits, strict=True) if fit]
        tensors = [pair for pair, fit in zip(tensors, fits, strict=True) if fit]
    if len(members) < 2:
        return None
    idx = np.frombuffer(b"".join(idx for _, idx in tensors), DTYPES["int32"]).reshape(len(members), -1)
    grad = np.frombuffer(b"".join(grad for grad, _ in tensors), like.grad_expanded_x.dtype)
    grad = grad.reshape(len(members), *like.grad_expanded_x.shape)
    broken = CallGroup.breaking_rule_7(like, idx)
    if broken.any():  # each goes the single call's way, for the error naming its culprit
        keep = ~broken
        members = [index for index, bad in zip(members, broken.tolist(), strict=True) if not bad]
        grad, idx = grad[keep], idx[keep]
    if len(members) < 2:
        return None
    return CallGroup(like, grad, idx), members
