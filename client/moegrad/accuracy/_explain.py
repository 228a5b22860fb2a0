"""Why a candidate grad_x differs from the device's: :func:`explain`, row by row.

One vectorised comparison finds the rows whose bits differ; only those are examined, in blocks of
about half a million elements of grad_x, each block with its golden (the exact sum, rounded once to
float64), the summands' magnitude and the any-order bound (:mod:`moegrad.accuracy._bound`). Then
each row is replayed by the known schedules (:mod:`moegrad.accuracy._replay`), searched for a wrong
summand (:mod:`moegrad.accuracy._fingerprint`) and labelled (:mod:`moegrad.accuracy._rows`).
docs/accuracy.md, "Explaining a mismatch", gives the method, the labels and worked examples.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad.accuracy import _fused
from moegrad.accuracy._bound import sum_bound
from moegrad.accuracy._explanation import LABELS, WORST_ELEMENTS, Explanation, RowExplanation
from moegrad.accuracy._fingerprint import WINDOW, Block, RowIndex, take_rows
from moegrad.accuracy._matching import same_rows
from moegrad.accuracy._replay import known_schedules
from moegrad.accuracy._rows import Searches, explain_rows
from moegrad.accuracy._stop import check_stop
from moegrad.numerics import _reference
from moegrad.numerics._reference import moe_init_routing_v2_grad, moe_init_routing_v2_grad_golden
from moegrad.operator._call import GRAD_DTYPES, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import resolve_profile

__all__ = ["check_explain_arguments", "differing_rows", "explain", "explain_peak_bytes"]

_BLOCK_ELEMENTS = 1 << 19  # elements of grad_x per block of differing rows
_SCAN_ELEMENTS = 1 << 20  # elements of grad_x per step of the scan for differing rows
_SPREAD_ADDS = 1 << 18  # adds of a block below which its golden runs on the calling thread (a hand-off costs more)
_F64 = np.dtype(np.float64)
_UINT = {2: np.uint16, 4: np.uint32}
_INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
_WORK = "the explanation"


def explain(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    profile: str | None = None,
    device_result: np.ndarray | None = None,
    stop: threading.Event | None = None,
) -> Explanation:
    """Explain every row of ``candidate`` whose bits differ from the device's: one label and its evidence.

    The labels (docs/accuracy.md, "Explaining a mismatch"): ``order`` (the device's summands in
    another order: a known schedule reproduces the row bit for bit, named in ``profile``, or every
    column lies within the any-order bound), ``missing``, ``duplicated``, ``replaced``, ``extra`` (one
    wrong summand; ``slot`` and ``source_row`` name it), ``precision`` (accumulated in float16 or
    bfloat16), ``nonfinite`` (NaN/Inf where the device has none, or the reverse), ``unexplained``,
    ``ambiguous`` (several explanations fit; listed in the evidence).

    Args:
        call: the validated call (:class:`~moegrad.MoeInitRoutingV2GradCall`).
        candidate: [N, H] grad_x from the implementation under test, in the call's dtype (bits are
            compared; bfloat16 as ``ml_dtypes.bfloat16``), any strides and byte order.
        profile: the device profile the candidate is held against (a name or alias of
            :data:`moegrad.PROFILES`); default the call's ``order``. The call is validated again on it.
        device_result: [N, H] in the call's dtype: the device's grad_x when it is not the emulation
            (a service that ran the NPU); default :func:`moegrad.moe_init_routing_v2_grad` of the
            call on the profile.
        stop: set it (from another thread) to stop the explanation at its next block of rows, or
            within a block between the searches of a few rows (a service whose caller has gone, or
            whose deadline passed); None: it runs to the end.

    Returns:
        An :class:`~moegrad.accuracy.Explanation`; rows that agree with the device are not listed.

    Raises:
        InvalidArgument: the candidate is missing (161001), not an ndarray, of another dtype or
            shape (161002, field ``candidate``); an unknown profile (161002, field ``profile``); the
            profile refuses the call (its own status and field); an empty call of a dtype that is
            not floating (161002, field ``grad_expanded_x``).
        DeadlineExceeded: ``stop`` was set before the explanation ended.
        TypeError: ``call`` is not a call; ``device_result`` is not an ndarray of the call's dtype.
        ValueError: ``device_result`` has another shape than [N, H].
    """
    call = _on_profile(call, profile)
    candidate = check_explain_arguments(call, candidate)
    device = _device(call, device_result)
    rows = _rows2d(call)
    differing = differing_rows(candidate, device)
    capacity = int(call.grad_expanded_x.shape[1]) if call.drop_pad_mode == 1 else None
    explained: list[RowExplanation] = []
    if differing.size:
        schedules = known_schedules(call)
        # the device's own arithmetic cannot give a row that differs from its emulation; a result from
        # elsewhere (a real device) may still match it, so it is tried then, last
        own = (*schedules[1:], schedules[0]) if device_result is not None else schedules[1:]
        cache: dict[str, RowIndex | None] = {}

        def row_index() -> RowIndex | None:
            if "index" not in cache:
                cache["index"] = RowIndex(rows) if rows.shape[0] else None
            return cache["index"]

        searches = Searches(schedules, own, row_index, capacity, stop)
        golden = _Golden(call, rows)
        for block_rows in _blocks(differing, _row_elements(call)):
            check_stop(stop, _WORK)
            explained += explain_rows(_block(call, rows, candidate, device, golden, block_rows), searches)
    labels = dict.fromkeys(LABELS, 0)
    for row in explained:
        labels[row.label] += 1
    return Explanation(
        dtype=call.dtype_name,
        shape=(call.num_tokens, call.hidden_size),
        profile=call.order,
        differing_rows=len(explained),
        labels=labels,
        rows=tuple(explained),
        capacity=capacity,
    )


def _on_profile(call: Any, profile: str | None) -> MoeInitRoutingV2GradCall:
    if not isinstance(call, MoeInitRoutingV2GradCall):
        raise TypeError(f"call must be a MoeInitRoutingV2GradCall, got {type(call).__name__}")
    if profile is None:
        return call
    try:
        name = resolve_profile(profile).name
    except ValueError as exc:
        raise InvalidArgument(str(exc), aclnn_status=_INVALID, field="profile") from None
    if name == call.order:
        return call
    fields = ("grad_expanded_x", "expanded_row_idx", "top_k", "drop_pad_mode", "active_num", "allow_duplicate_indices")
    return MoeInitRoutingV2GradCall(**{field: getattr(call, field) for field in fields}, order=name)


def check_explain_arguments(call: MoeInitRoutingV2GradCall, candidate: Any) -> np.ndarray:
    """Check an explanation's candidate without computing anything (a service runs this before its device).

    Args:
        call: the validated call.
        candidate: the implementation's grad_x: a numpy.ndarray [N, H] in the call's dtype (explain
            compares bits; bfloat16 as ``ml_dtypes.bfloat16``), any strides and byte order.

    Returns:
        The candidate, C-contiguous in native byte order (a copy only when it is not already).

    Raises:
        InvalidArgument: the candidate is missing (161001), not an ndarray, of another dtype or
            shape (161002), field ``candidate``; an empty call of a dtype that is not floating
            (161002, field ``grad_expanded_x``).
        TypeError: ``call`` is not a :class:`~moegrad.MoeInitRoutingV2GradCall`.
    """
    if not isinstance(call, MoeInitRoutingV2GradCall):
        raise TypeError(f"call must be a MoeInitRoutingV2GradCall, got {type(call).__name__}")
    if call.dtype_name not in GRAD_DTYPES:
        raise InvalidArgument(
            f"grad_expanded_x.dtype={call.dtype_name}: this empty call is valid on {call.order}, but explain "
            f"compares {', '.join(GRAD_DTYPES)} results only; send the call in one of those dtypes",
            aclnn_status=_INVALID,
            field="grad_expanded_x",
        )
    if candidate is None:
        raise InvalidArgument(
            "candidate is missing: send the implementation's grad_x [N, H]",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_NULLPTR,
            field="candidate",
        )
    if not isinstance(candidate, np.ndarray):
        raise InvalidArgument(
            f"candidate must be a numpy.ndarray, got {type(candidate).__name__}",
            aclnn_status=_INVALID,
            field="candidate",
        )
    native = call.grad_expanded_x.dtype.newbyteorder("=")
    if candidate.dtype.newbyteorder("=") != native:
        raise InvalidArgument(
            f"candidate.dtype={candidate.dtype} must be grad_expanded_x's dtype {call.dtype_name}: explain compares "
            "bits with the device's result (a float32 candidate of a half-precision call can be judged by compare)",
            aclnn_status=_INVALID,
            field="candidate",
        )
    shape = (call.num_tokens, call.hidden_size)
    if candidate.shape != shape:
        raise InvalidArgument(
            f"candidate has shape {list(candidate.shape)}; grad_x of this call is {list(shape)} [N, H]",
            aclnn_status=_INVALID,
            field="candidate",
        )
    return np.ascontiguousarray(candidate).astype(native, copy=False)


def _device(call: MoeInitRoutingV2GradCall, device_result: Any) -> np.ndarray:
    if device_result is None:
        return moe_init_routing_v2_grad(call)
    if not isinstance(device_result, np.ndarray):
        raise TypeError(f"device_result must be a numpy.ndarray, got {type(device_result).__name__}")
    native = call.grad_expanded_x.dtype.newbyteorder("=")
    if device_result.dtype.newbyteorder("=") != native:
        raise TypeError(f"device_result.dtype={device_result.dtype} is not the operator's dtype {call.dtype_name}")
    shape = (call.num_tokens, call.hidden_size)
    if device_result.shape != shape:
        raise ValueError(f"device_result has shape {list(device_result.shape)}; grad_x of this call is {list(shape)}")
    return np.ascontiguousarray(device_result).astype(native, copy=False)


def _rows2d(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """grad_expanded_x as C-contiguous [R, H] in native byte order (a copy only when it is not already)."""
    grad = call.grad_expanded_x
    native = grad.dtype.newbyteorder("=")
    rows = grad.reshape(-1, call.hidden_size) if grad.flags.c_contiguous else np.ascontiguousarray(grad)
    return np.ascontiguousarray(rows.reshape(-1, call.hidden_size)).astype(native, copy=False)


def differing_rows(candidate: np.ndarray, device: np.ndarray) -> np.ndarray:
    """The rows of two [N, H] arrays of one dtype whose bits differ somewhere (a NaN matching any NaN), int64."""
    tokens, hidden = candidate.shape
    if tokens == 0 or hidden == 0:
        return np.empty(0, dtype=np.int64)
    words = _UINT[candidate.dtype.itemsize]
    a, b = candidate.view(words), device.view(words)
    step = max(1, _SCAN_ELEMENTS // hidden)
    found = []
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        suspect = np.flatnonzero((a[start:stop] != b[start:stop]).any(axis=1))
        if suspect.size:
            rows = start + suspect
            found.append(rows[~same_rows(take_rows(candidate, rows), take_rows(device, rows))])
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _row_elements(call: MoeInitRoutingV2GradCall) -> int:
    """The elements a row takes in a block: its H columns, or its K slots' window of columns
    (min(16, H) each), whichever is more."""
    hidden = max(call.hidden_size, 1)
    return max(hidden, call.top_k * min(hidden, WINDOW))


def _blocks(rows: np.ndarray, per_row: int) -> Iterator[np.ndarray]:
    step = max(1, _BLOCK_ELEMENTS // per_row)
    for start in range(0, rows.size, step):
        yield rows[start : start + step]


class _Golden:
    """The golden and the summands' magnitude of chosen rows: compiled (the comparison's own
    per-row kernel, when numba is installed), else the reference module's compensated NumPy sum."""

    def __init__(self, call: MoeInitRoutingV2GradCall, rows: np.ndarray) -> None:
        self.call, self.rows = call, rows
        self.jit = _fused._load()
        self.bits = _fused._view(rows) if rows.shape[0] else None
        index = np.ascontiguousarray(call.expanded_row_idx.reshape(-1, call.top_k), dtype=np.int32)
        self.index = _fused._read_only(index)

    def __call__(self, grad_rows: np.ndarray, index: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        count, hidden = grad_rows.size, self.rows.shape[1]
        if self.rows.shape[0] == 0:
            return np.zeros((count, hidden)), np.zeros((count, hidden))
        if self.jit is not None and self.bits is not None:
            golden, magnitude = np.empty((count, hidden)), np.empty((count, hidden))
            self._compiled(grad_rows, golden, magnitude)
            return golden, magnitude
        flat = np.where(skip, self.rows.shape[0], index).reshape(-1).astype(np.int32)
        sub = MoeInitRoutingV2GradCall.model_construct(
            grad_expanded_x=self.rows,
            expanded_row_idx=flat,
            top_k=self.call.top_k,
            drop_pad_mode=0,
            active_num=self.rows.shape[0],
            order=self.call.order,
            allow_duplicate_indices=True,
        )
        golden = moe_init_routing_v2_grad_golden(sub)
        magnitude = np.zeros((count, hidden))
        for t in range(index.shape[1]):
            summand = take_rows(self.rows, np.where(skip[:, t], 0, index[:, t])).astype(_F64)
            magnitude += np.where(skip[:, t, None], 0.0, np.abs(summand))
        return golden, magnitude

    def _compiled(self, grad_rows: np.ndarray, golden: np.ndarray, magnitude: np.ndarray) -> None:
        jit, hidden, limit = self.jit, self.rows.shape[1], self.rows.shape[0]
        assert jit is not None

        chosen = np.ascontiguousarray(grad_rows, dtype=np.int64)

        def run(start: int, stop: int) -> None:
            total, comp, rounded = np.empty(hidden), np.empty(hidden), np.empty(hidden, dtype=np.bool_)
            partials = np.empty(64)
            # mode 2: a slot outside [0, R) adds nothing
            jit._golden_rows(
                self.bits,
                self.index,
                chosen[start:stop],
                2,
                limit,
                total,
                comp,
                magnitude[start:stop],
                golden[start:stop],
                rounded,
                partials,
            )

        # one task per thread of the pool (each row is a long loop already), or one for a small block
        threads = _reference.kernel_threads() if grad_rows.size * self.index.shape[1] * hidden >= _SPREAD_ADDS else 1
        _reference._map_chunks(run, grad_rows.size, max(1, -(-grad_rows.size // threads)))


def _block(
    call: MoeInitRoutingV2GradCall,
    rows: np.ndarray,
    candidate: np.ndarray,
    device: np.ndarray,
    golden_of: _Golden,
    grad_rows: np.ndarray,
) -> Block:
    index = call.expanded_row_idx.reshape(-1, call.top_k)[grad_rows].astype(np.int64)
    skip = (index < 0) | (index >= rows.shape[0])
    count = call.top_k - skip.sum(axis=1)
    golden, magnitude = golden_of(grad_rows, index, skip)
    cand_rows, dev_rows = take_rows(candidate, grad_rows), take_rows(device, grad_rows)
    words = _UINT[cand_rows.dtype.itemsize]
    ew, eh = np.nonzero(cand_rows.view(words) != dev_rows.view(words))
    ecand, edev = cand_rows[ew, eh].astype(_F64), dev_rows[ew, eh].astype(_F64)
    keep = ~(np.isnan(ecand) & np.isnan(edev))
    ew, eh, ecand, edev = ew[keep], eh[keep], ecand[keep], edev[keep]
    egold = golden[ew, eh]
    ebound = sum_bound(magnitude[ew, eh], count[ew], ecand, call.dtype_name)
    with np.errstate(invalid="ignore", divide="ignore"):
        error = np.abs(ecand - egold)
        eratio = np.where(error == 0, 0.0, error / ebound)
    eusable = np.isfinite(ecand) & np.isfinite(edev)
    out = eusable & (eratio > 1.0)
    worst = np.zeros(grad_rows.size)
    starts = np.searchsorted(ew, np.arange(grad_rows.size))  # ew is row-major: each row's elements in a run
    present = np.flatnonzero(np.diff(np.append(starts, ew.size)) > 0)
    if present.size:
        worst[present] = np.maximum.reduceat(np.where(eusable, eratio, 0.0), starts[present])
    top = _top(ew, eh, np.where(eusable, eratio, np.inf), grad_rows.size, call.hidden_size)
    return Block(
        call, call.dtype_name, rows, grad_rows, index, skip, count, cand_rows, dev_rows, golden, magnitude,
        ew, eh, ecand, edev, egold, ebound, eratio, eusable, np.bincount(ew[out], minlength=grad_rows.size), worst, top,
    )  # fmt: skip


def _top(ew: np.ndarray, eh: np.ndarray, key: np.ndarray, count: int, hidden: int) -> np.ndarray:
    """[count, WORST_ELEMENTS] per row, its elements with the largest ``key`` (ties: the lower
    column first), largest first; -1 past the row's elements."""
    width = WORST_ELEMENTS
    top = np.full((count, width), -1, dtype=np.intp)
    if ew.size == 0:
        return top
    if ew.size <= 8 * count * width or hidden <= width:
        order = np.lexsort((eh, -key, ew))
        ranked = ew[order]
        rank = np.arange(ew.size) - np.searchsorted(ranked, ranked)
        keep = rank < width
        top[ranked[keep], rank[keep]] = order[keep]
        return top
    dense = np.full((count, hidden), -np.inf)
    dense[ew, eh] = key
    position = np.full((count, hidden), -1, dtype=np.intp)
    position[ew, eh] = np.arange(ew.size)
    columns = np.argpartition(-dense, width - 1, axis=1)[:, :width]
    chosen = np.take_along_axis(dense, columns, axis=1)
    columns = np.take_along_axis(columns, np.lexsort((columns, -chosen), axis=1), axis=1)
    chosen = np.take_along_axis(dense, columns, axis=1)
    return np.where(chosen > -np.inf, np.take_along_axis(position, columns, axis=1), -1)


#: Bytes per element of a block that its arrays take at most (float64 golden and magnitude, the rows
#: gathered, the differing elements' seven float64 figures, their indices, the ranking's dense keys).
BLOCK_BYTES_PER_ELEMENT = 176
#: Bytes the searches hold at most beside a block: the checks (2^18-element float64 arrays, about 16
#: alive), or the fault replays' summands (2^22 elements, gathered twice, widened once).
SEARCH_BYTES = 40 << 20
#: Bytes of the result per differing row: per slot (six fields) and per listed element (ten fields),
#: and the row's own objects.
RESULT_BYTES_PER_SLOT, RESULT_BYTES_PER_ELEMENT, RESULT_BYTES_PER_ROW = 200, 400, 6144


def explain_peak_bytes(call: MoeInitRoutingV2GradCall, *, device_result: bool = False, reply: bool = False) -> int:
    """An upper bound on the memory :func:`explain` allocates for ``call``, beyond its inputs, in bytes.

    The worst case, every row differing: the device's result (unless given), a C-contiguous copy
    of grad_expanded_x when it is not one, the sorted key columns of the row search, one block of
    about 2^19 elements (rows of max(H, K * min(16, H)) elements each), the searches' working set,
    and the result (per differing row, its K slots and its worst elements). docs/accuracy.md gives
    the formula.

    Args:
        call: the call to be explained.
        device_result: True when the caller passes the device's result (none is computed).
        reply: also the result's dict form and its msgpack encoding, as a service answers it (as
            much again as the result).

    Returns:
        Bytes, for a service's reservation.
    """
    tokens, hidden, top_k = call.num_tokens, call.hidden_size, call.top_k
    item = call.grad_expanded_x.dtype.itemsize
    rows = math.prod(call.grad_expanded_x.shape[:-1])
    per_row = _row_elements(call)
    block = min(tokens, max(1, _BLOCK_ELEMENTS // per_row)) * per_row
    total = 0 if device_result else tokens * hidden * item
    if not call.grad_expanded_x.flags.c_contiguous:
        total += rows * hidden * item
    total += RowIndex.nbytes(rows, hidden)
    total += block * BLOCK_BYTES_PER_ELEMENT + SEARCH_BYTES
    per_row = RESULT_BYTES_PER_ROW + top_k * RESULT_BYTES_PER_SLOT + WORST_ELEMENTS * RESULT_BYTES_PER_ELEMENT
    return int(total + tokens * per_row * (2 if reply else 1))
