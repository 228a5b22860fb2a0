"""The forward routing, emulated: aclnnMoeInitRoutingV2, whose outputs the backward consumes.

aclnnMoeInitRoutingV2 takes the token features ``x`` [N, H] and each token's K expert choices
``expert_idx`` [N, K], and lays the N*K (token, expert) slots out expert by expert
(docs/semantics.md, "Index layouts and the forward routing"; the operator's documentation and
kernel in hicann/ops-transformer ``moe/moe_init_routing_v2/``):

1. the flat expert ids are sorted with their slot numbers ``s = i*K + t`` as values; slots of one
   expert keep increasing slot order (the documentation's key-value sort; the kernel sorts the
   negated ids, cast to float32, with the slot numbers as indices);
2. ``expanded_row_idx[sorted_row_idx[p]] = p``: for each slot, the row of the expanded tensor it
   landed on (the layout the backward, aclnnMoeInitRoutingV2Grad, reads);
3. ``expanded_x[p] = x[sorted_row_idx[p] // K]``;
4. the per-expert token counts (or their running sum) and, in drop/pad mode, the counts before the
   capacity cut.

Modes: dropless (drop_pad_mode=0, active_num=0) keeps all N*K rows; active (active_num=A>0) keeps
the first min(A, N*K) rows of expanded_x while expanded_row_idx still numbers every slot; drop/pad
(drop_pad_mode=1) gives expert e the rows e*C .. e*C+C-1 of an [E, C, H] expanded_x, in slot order:
slots past the capacity C are dropped (index -1) and unused rows are zero.

``active_expert_range = (start, end)`` is the attribute of the later routings, aclnnMoeInitRoutingV3
and V4 (activeExpertRangeOptional; recursion-ascend/ops-transformer
``moe/moe_init_routing_v4/docs/aclnnMoeInitRoutingV4.md`` and ``tests/assets/golden.py`` @ a093e954):
only the slots whose expert is in [start, end) are routed, onto the first ``availableIdxNum`` rows
in sorted order; every other slot's expanded_row_idx is -1 (rowIdxType 0, the layout the backward
reads). Huawei's Ascend 950 torch binding (``torch_extension/moe_init_routing.py``, same commit)
hands that index to aclnnMoeInitRoutingV2Grad in dropless mode, which only the 950 at CANN 9.1
defines (a negative index contributes a +0.0 row; docs/semantics.md).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from moegrad._dtypes import brief, dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad.operator._call import GRAD_DTYPES

__all__ = [
    "MoeInitRoutingV2Result",
    "expanded_row_idx_layout",
    "expert_range",
    "invert_expanded_row_idx",
    "moe_init_routing_v2",
]

_NULLPTR = AclnnStatus.ACLNN_ERR_PARAM_NULLPTR
_INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
_TILING = AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR
_EXACT_KEY = 2**24  # the kernel sorts ids as float32 keys: exact (and so emulated) only below this


class MoeInitRoutingV2Result(NamedTuple):
    """The four outputs of aclnnMoeInitRoutingV2.

    Attributes:
        expanded_x: [N*K, H] (dropless), [min(A, N*K), H] (active) or [E, C, H] (drop/pad), x's dtype.
        expanded_row_idx: [N*K] int32; slot ``i*K + t`` -> its row of expanded_x (flat ``e*C + r``
            in drop/pad mode, -1 for a dropped slot or, with an ``active_expert_range``, a slot
            whose expert is outside it). This is what the backward takes.
        expert_tokens_count_or_cumsum: [E] int32 in dropless/active mode when
            ``expert_tokens_count_or_cumsum_flag`` is 1 (running sum) or 2 (counts), of the experts
            ``start .. end-1`` ([end - start]) with an ``active_expert_range``; else None.
        expert_tokens_before_capacity: [E] int32 in drop/pad mode when
            ``expert_tokens_before_capacity_flag`` is set (each expert's count before the cut); else None.
    """

    expanded_x: np.ndarray
    expanded_row_idx: np.ndarray
    expert_tokens_count_or_cumsum: np.ndarray | None
    expert_tokens_before_capacity: np.ndarray | None


def _fail(status: AclnnStatus, field: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, aclnn_status=status, field=field)


def _integer(field: str, raw: Any) -> int:
    try:
        if isinstance(raw, (bool, np.bool_)):
            raise TypeError
        return operator.index(raw)
    except TypeError:
        raise _fail(_TILING, field, f"{field}={brief(raw)} must be an integer") from None


def expert_range(
    active_expert_range: Sequence[int] | np.ndarray | None, expert_num: int = 0, drop_pad_mode: int = 0
) -> tuple[int, int] | None:
    """``active_expert_range`` checked as aclnnMoeInitRoutingV3/V4 document it: ``(start, end)``.

    Args:
        active_expert_range: None (every expert), or two integers ``[start, end)`` with
            ``0 <= start < end``, ``end <= expert_num`` when expert_num > 0, and in drop/pad mode
            exactly ``(0, expert_num)`` (V4's documentation, activeExpertRangeOptional and "DropPad
            模式特殊约束").
        expert_num: E, or 0 when the call does not bound the ids.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.

    Returns:
        ``(start, end)`` as ints, or None.

    Raises:
        InvalidArgument: a range that breaks these rules (561002, field ``active_expert_range``, the
            code V4 documents for an attribute out of its range).
    """
    if active_expert_range is None:
        return None
    field = "active_expert_range"
    try:
        if isinstance(active_expert_range, (str, bytes)):
            raise TypeError
        values = list(active_expert_range)
    except TypeError:
        raise _fail(_TILING, field, f"{field}={brief(active_expert_range)} must be two integers [start, end)") from None
    if len(values) != 2:
        raise _fail(_TILING, field, f"{field}={brief(values)} must have two values [start, end)")
    start, end = (_integer(field, value) for value in values)
    if not 0 <= start < end:
        raise _fail(_TILING, field, f"{field}=[{start}, {end}) must have 0 <= start < end")
    if expert_num > 0 and end > expert_num:
        raise _fail(_TILING, field, f"{field}=[{start}, {end}) must end at or before expert_num={expert_num}")
    if drop_pad_mode == 1 and (start, end) != (0, expert_num):
        raise _fail(
            _TILING,
            field,
            f"{field}=[{start}, {end}) must be [0, expert_num) = [0, {expert_num}) in drop/pad mode "
            "(the later routings route every expert there); leave it out",
        )
    return start, end


def moe_init_routing_v2(
    x: np.ndarray,
    expert_idx: np.ndarray,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    *,
    active_expert_range: Sequence[int] | None = None,
) -> MoeInitRoutingV2Result:
    """The outputs of aclnnMoeInitRoutingV2 (the forward of aclnnMoeInitRoutingV2Grad), on the CPU.

    Args:
        x: [N, H] token features; float16, bfloat16 (``ml_dtypes.bfloat16``) or float32.
        expert_idx: [N, K] int32 or int64 expert ids, each >= 0 (and < expert_num in drop/pad mode
            or when counts are asked for).
        active_num: dropless/active mode only: 0 keeps every row of expanded_x, A > 0 the first A.
        expert_capacity: C, rows per expert in drop/pad mode, in (0, N]; ignored otherwise.
        expert_num: E; > 0 in drop/pad mode and when counts are asked for.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        expert_tokens_count_or_cumsum_flag: dropless/active mode: 0 none, 1 running sum, 2 counts.
        expert_tokens_before_capacity_flag: drop/pad mode: return each expert's count before the cut.
        active_expert_range: None, or ``(start, end)`` (aclnnMoeInitRoutingV3/V4's attribute, module
            docstring): dropless/active mode routes only the slots whose expert is in [start, end),
            onto rows 0 .. M-1 (M of them, in sorted order), and gives every other slot the index
            -1; rows M and later of expanded_x, which the device leaves undefined, are zeros here.
            In drop/pad mode only ``(0, expert_num)`` is allowed (and changes nothing).

    Returns:
        A :class:`MoeInitRoutingV2Result`; its expanded_row_idx goes to
        :func:`moegrad.moe_init_routing_v2_grad` as it is, with ``top_k = K``, the same
        drop_pad_mode and ``active_num = min(A, N*K)`` in active mode.

    Raises:
        InvalidArgument: a missing tensor (161001); a dtype the operator does not take, a negative id,
            an id >= expert_num where E bounds them, or an id >= 2**24 (161002); an attribute out of
            its documented range, x or expert_idx not 2-D, or their first dimensions unequal (561002).
            Codes follow the forward's documentation ("Return Value"); the id checks are moegrad's
            (the device does not check the values); an ``active_expert_range`` that
            :func:`expert_range` refuses (561002).

    An index with -1 in dropless or active mode (from an ``active_expert_range``) is accepted by
    the backward only on the Ascend 950 from CANN 9.1 (``order="ascend950@9.1"``), where a
    negative index contributes a +0.0 row; every other profile refuses it (161002).
    """
    _check_tensors(x, expert_idx)
    active, capacity, experts, mode, count_flag = _attributes(
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_count_or_cumsum_flag,
        expert_tokens_before_capacity_flag,
    )
    _check_shapes(x, expert_idx, capacity, experts, mode, count_flag)
    routed_experts = expert_range(active_expert_range, experts, mode)
    bounded = mode == 1 or count_flag > 0
    flat = _checked_ids(expert_idx, experts if bounded else None)
    top_k = expert_idx.shape[1]
    sorted_row_idx = np.argsort(flat, kind="stable")  # stable: one expert's slots stay in slot order
    counts = np.bincount(flat, minlength=experts).astype(np.int32) if bounded else None  # ids < E here
    expanded_row_idx = np.empty(flat.size, dtype=np.int32)
    count_or_cumsum = before_capacity = None
    if mode == 0 and routed_experts is not None:
        expanded_x, count_or_cumsum = _route_range(
            x, flat, top_k, active, count_flag, routed_experts, sorted_row_idx, expanded_row_idx
        )
    elif mode == 0:
        expanded_x, count_or_cumsum = _route_dropless(
            x, top_k, active, count_flag, counts, sorted_row_idx, expanded_row_idx
        )
    else:
        assert counts is not None, "drop/pad mode bounds the ids, so counts was taken"
        expanded_x = _route_drop_pad(x, flat, top_k, capacity, counts, sorted_row_idx, expanded_row_idx)
        if expert_tokens_before_capacity_flag:
            before_capacity = counts
    return MoeInitRoutingV2Result(np.ascontiguousarray(expanded_x), expanded_row_idx, count_or_cumsum, before_capacity)


def _check_tensors(x: Any, expert_idx: Any) -> None:
    """x and expert_idx present, ndarrays, of dtypes the forward takes (161001, 161002)."""
    for field, value in (("x", x), ("expert_idx", expert_idx)):
        if value is None:
            raise _fail(_NULLPTR, field, f"{field} is missing (a null tensor)")
        if not isinstance(value, np.ndarray):
            raise _fail(_INVALID, field, f"{field} must be a numpy.ndarray, got {type(value).__name__}")
    if dtype_name(x.dtype) not in GRAD_DTYPES:
        raise _fail(
            _INVALID,
            "x",
            f"x.dtype={x.dtype} is not one of {', '.join(GRAD_DTYPES)}; cast it first, e.g. x.astype(numpy.float32)",
        )
    if expert_idx.dtype.kind != "i" or expert_idx.dtype.itemsize not in (4, 8):
        raise _fail(
            _INVALID,
            "expert_idx",
            f"expert_idx.dtype={expert_idx.dtype} is not one of int32, int64; "
            "cast it first, e.g. expert_idx.astype(numpy.int32)",
        )


def _attributes(*values: Any) -> tuple[int, int, int, int, int]:
    """The attributes active_num, expert_capacity, expert_num, drop_pad_mode,
    expert_tokens_count_or_cumsum_flag (integers) and expert_tokens_before_capacity_flag (a bool),
    each in its documented range (561002); the five integers."""
    active_num, expert_capacity, expert_num, drop_pad_mode, count_or_cumsum_flag, before_capacity_flag = values
    active = _integer("active_num", active_num)
    capacity = _integer("expert_capacity", expert_capacity)
    experts = _integer("expert_num", expert_num)
    mode = _integer("drop_pad_mode", drop_pad_mode)
    count_flag = _integer("expert_tokens_count_or_cumsum_flag", count_or_cumsum_flag)
    if not isinstance(before_capacity_flag, (bool, np.bool_)):
        raise _fail(
            _TILING,
            "expert_tokens_before_capacity_flag",
            f"expert_tokens_before_capacity_flag={brief(before_capacity_flag)} must be a bool",
        )
    for field, size in (("active_num", active), ("expert_capacity", capacity), ("expert_num", experts)):
        if size < 0:
            raise _fail(_TILING, field, f"{field}={size} must be >= 0")
    if mode not in (0, 1):
        raise _fail(_TILING, "drop_pad_mode", f"drop_pad_mode={mode} must be 0 (dropless/active) or 1 (drop/pad)")
    if count_flag not in (0, 1, 2):
        raise _fail(
            _TILING,
            "expert_tokens_count_or_cumsum_flag",
            f"expert_tokens_count_or_cumsum_flag={count_flag} must be 0 (none), 1 (cumsum) or 2 (count)",
        )
    return active, capacity, experts, mode, count_flag


def _check_shapes(
    x: np.ndarray, expert_idx: np.ndarray, capacity: int, experts: int, mode: int, count_flag: int
) -> None:
    """Both 2-D with one row of experts per token; E and C as the mode needs them (561002)."""
    if x.ndim != 2 or expert_idx.ndim != 2:
        field, array = ("x", x) if x.ndim != 2 else ("expert_idx", expert_idx)
        raise _fail(_TILING, field, f"{field} has rank {array.ndim} (shape {list(array.shape)}); it must be 2-D")
    if x.shape[0] != expert_idx.shape[0]:
        raise _fail(
            _TILING,
            "expert_idx",
            f"expert_idx.shape[0]={expert_idx.shape[0]} must equal "
            f"x.shape[0]={x.shape[0]} (one row of experts per token)",
        )
    if mode == 1:
        if experts == 0 or capacity == 0:
            field = "expert_num" if experts == 0 else "expert_capacity"
            raise _fail(_TILING, field, f"{field}=0: drop/pad mode needs expert_num > 0 and expert_capacity > 0")
        if capacity > x.shape[0]:
            raise _fail(
                _TILING,
                "expert_capacity",
                f"expert_capacity={capacity} must be in (0, N] = (0, {x.shape[0]}] in drop/pad mode",
            )
    elif count_flag > 0 and experts == 0:
        raise _fail(_TILING, "expert_num", "expert_num=0: expert token counts need expert_num > 0")


def _checked_ids(expert_idx: np.ndarray, experts: int | None) -> np.ndarray:
    """The ids, flat int64, each in [0, experts) (None: [0, 2**24), the float32 keys' exact range; 161002)."""
    flat = expert_idx.reshape(-1).astype(np.int64)
    if flat.size:
        limit = _EXACT_KEY if experts is None else experts
        bad = np.flatnonzero((flat < 0) | (flat >= limit))
        if bad.size:
            where = int(bad[0])
            rule = (
                f"[0, expert_num) = [0, {experts})"
                if experts is not None
                else "[0, 2**24) (the device sorts ids as float32 keys)"
            )
            raise _fail(_INVALID, "expert_idx", f"expert_idx.flat[{where}]={int(flat[where])} is outside {rule}")
    return flat


def _route_dropless(
    x: np.ndarray,
    top_k: int,
    active: int,
    count_flag: int,
    counts: np.ndarray | None,
    sorted_row_idx: np.ndarray,
    expanded_row_idx: np.ndarray,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Dropless or active mode: every slot onto its sorted position, expanded_x its first A rows (all
    when A = 0); the counts (count_flag 2) or their running sum (1), else None."""
    slots = expanded_row_idx.size
    expanded_row_idx[sorted_row_idx] = np.arange(slots, dtype=np.int32)
    rows = slots if active == 0 else min(active, slots)
    if not count_flag:
        return x[sorted_row_idx[:rows] // top_k], None
    assert counts is not None, "count_flag > 0 makes the ids bounded, so counts was taken"
    return x[sorted_row_idx[:rows] // top_k], np.cumsum(counts, dtype=np.int32) if count_flag == 1 else counts


def _route_drop_pad(
    x: np.ndarray,
    flat: np.ndarray,
    top_k: int,
    capacity: int,
    counts: np.ndarray,
    sorted_row_idx: np.ndarray,
    expanded_row_idx: np.ndarray,
) -> np.ndarray:
    """Drop/pad mode: each expert's first C slots (in slot order) onto its C rows, the others -1;
    expanded_x [E, C, H] with the rows no slot fills zero."""
    experts, hidden = counts.shape[0], x.shape[1]
    sorted_expert = flat[sorted_row_idx]
    first = np.cumsum(counts, dtype=np.int64) - counts  # each expert's first sorted position
    rank = np.arange(flat.size) - first[sorted_expert]  # a slot's rank among its expert's slots
    kept = rank < capacity
    row = sorted_expert[kept] * capacity + rank[kept]
    expanded_row_idx.fill(-1)
    expanded_row_idx[sorted_row_idx[kept]] = row
    expanded_x = np.zeros((experts * capacity, hidden), dtype=x.dtype)
    expanded_x[row] = x[sorted_row_idx[kept] // top_k]
    return expanded_x.reshape(experts, capacity, hidden)


def _route_range(
    x: np.ndarray,
    flat: np.ndarray,
    top_k: int,
    active: int,
    count_flag: int,
    routed_experts: tuple[int, int],
    sorted_row_idx: np.ndarray,
    expanded_row_idx: np.ndarray,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Dropless/active routing of the experts in [start, end) only: fills expanded_row_idx (-1 for
    the other slots) and returns expanded_x and the range's counts (or running sum), or None."""
    start, end = routed_experts
    slots = flat.size
    inside = (flat >= start) & (flat < end)
    routed = sorted_row_idx[inside[sorted_row_idx]]  # the stable sort's order, the range's slots only
    expanded_row_idx.fill(-1)
    expanded_row_idx[routed] = np.arange(routed.size, dtype=np.int32)
    rows = slots if active == 0 else min(active, slots)
    expanded_x = np.zeros((rows, x.shape[1]), dtype=x.dtype)
    filled = min(rows, routed.size)
    expanded_x[:filled] = x[routed[:filled] // top_k]
    if not count_flag:
        return expanded_x, None
    counts = np.bincount(flat[inside] - start, minlength=end - start).astype(np.int32)
    return expanded_x, (np.cumsum(counts, dtype=np.int32) if count_flag == 1 else counts)


def invert_expanded_row_idx(expanded_row_idx: np.ndarray) -> np.ndarray:
    """Convert a dropless/active index between its two layouts (each is the other's inverse).

    Args:
        expanded_row_idx: [N*K] int32, a permutation of [0, N*K): either slot -> row (what
            aclnnMoeInitRoutingV2 returns and the backward reads) or row -> slot (the sorted slot
            numbers, which some routing code returns instead).

    Returns:
        [N*K] int32, the inverse permutation: ``out[expanded_row_idx[s]] = s``.

    Raises:
        ValueError: the index is not 1-D or not a permutation of [0, N*K) (a drop/pad index, with
            its -1 entries, has no row -> slot twin).
    """
    index = np.asarray(expanded_row_idx)
    if index.ndim != 1 or index.dtype.kind not in "iu":
        raise ValueError(f"expanded_row_idx must be a 1-D integer array, got {index.dtype}{list(index.shape)}")
    n = index.size
    if n and (int(index.min()) < 0 or int(index.max()) >= n or np.unique(index).size != n):
        raise ValueError(
            f"expanded_row_idx is not a permutation of [0, {n}); only a dropless or active index has two layouts"
        )
    out = np.empty(n, dtype=np.int32)
    out[index] = np.arange(n, dtype=np.int32)
    return out


def expanded_row_idx_layout(
    expanded_row_idx: np.ndarray,
    expert_idx: np.ndarray,
) -> Literal["slot_to_row", "row_to_slot", "both"]:
    """Tell which layout a dropless/active index has, from the expert ids it was routed with.

    In the slot -> row layout (the backward's), slot s = i*K + t lands on a row inside the block of
    its expert ``expert_idx.flat[s]``, and the rows run through the experts in increasing order. In
    the row -> slot layout, reading ``expert_idx.flat`` at the index gives non-decreasing expert ids.

    Args:
        expanded_row_idx: [N*K] int32, a permutation of [0, N*K).
        expert_idx: [N, K] expert ids the index was routed from.

    Returns:
        ``"slot_to_row"`` (pass it to the backward as it is), ``"row_to_slot"`` (convert it with
        :func:`invert_expanded_row_idx` first), or ``"both"`` when the two coincide for these ids
        (e.g. the slots are already sorted by expert; then either reading is right).

    Raises:
        ValueError: not a permutation, sizes that differ, or neither layout fits these ids.
    """
    index = np.asarray(expanded_row_idx)
    flat = np.asarray(expert_idx).reshape(-1)
    if index.shape != flat.shape:
        raise ValueError(f"expanded_row_idx has {index.size} entries, expert_idx {flat.size}; they must match")
    inverse = invert_expanded_row_idx(index)
    slot_to_row = bool(np.all(np.diff(flat[inverse]) >= 0))  # rows in order: sorted expert ids
    row_to_slot = bool(np.all(np.diff(flat[index]) >= 0))
    if slot_to_row and row_to_slot:
        return "both"
    if slot_to_row:
        return "slot_to_row"
    if row_to_slot:
        return "row_to_slot"
    raise ValueError(
        "expanded_row_idx sorts these expert ids in neither layout; was it routed from another expert_idx?"
    )
