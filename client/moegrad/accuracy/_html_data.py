"""The numbers of a case's HTML page (:mod:`moegrad.accuracy._html`): the error map, the error by
slot position, the worst rows (docs/accuracy.md, "A page to look at").

Every figure is the *scaled error* of an element, ``|candidate - golden| / max(magnitude,
small_value)`` (the figure the ``dual_thousandth`` standard counts; defined for every finite
element, small values included), inf where the candidate's NaN/Inf class differs from the golden's.
grad_x is read in blocks of rows, each block with its golden and summands' magnitude, as
:func:`~moegrad.accuracy.row_errors` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moegrad._dtypes import DTYPES, dtype_name
from moegrad.accuracy._bound import sum_bound
from moegrad.accuracy._explain import _device, _Golden, _rows2d
from moegrad.accuracy._explanation import SUMMAND_FAULTS, Explanation, RowExplanation
from moegrad.accuracy._results import SlotTable
from moegrad.accuracy._standards import DTYPE_LIMITS
from moegrad.accuracy._where import slot_table
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["MAP_BLOCKS", "SLOT_LABELS", "WORST_ROWS", "CaseView", "ErrorMap", "SlotErrors", "WorstRow", "case_view"]

#: The most blocks of the error map along each axis.
MAP_BLOCKS = 32
#: The rows the page lists, worst first.
WORST_ROWS = 20
#: The labels that name a slot, counted per slot position.
SLOT_LABELS: tuple[str, ...] = (*SUMMAND_FAULTS, "nonfinite")
_BLOCK_ELEMENTS = 1 << 19
_F64 = np.dtype(np.float64)


@dataclass(frozen=True)
class ErrorMap:
    """The largest scaled error per block of grad_x.

    Attributes:
        kind: ``"rows"`` (row blocks x column blocks) or ``"experts"`` (drop/pad mode: expert
            blocks x capacity-row blocks, each cell the largest row error of the tokens whose
            slots read that place; NaN where no slot reads one).
        row_edges, column_edges: each block's first index, then one past the last.
        values: [blocks, blocks] float64.
    """

    kind: str
    row_edges: tuple[int, ...]
    column_edges: tuple[int, ...]
    values: np.ndarray


@dataclass(frozen=True)
class SlotErrors:
    """The error by slot position t = 0..K-1.

    Attributes:
        labels: label of :data:`SLOT_LABELS` -> [K] rows the explanation gives that label at slot t
            (None without an explanation).
        coefficient: [K] the least-squares coefficient of the residual (candidate - golden) on slot
            t's summand, over the finite elements of the rows outside the any-order bound (NaN where
            no such row reads slot t): -1 for a slot left out, +1 for a slot added twice, near 0 for
            a slot added right.
        rows: the rows outside the any-order bound the coefficients rest on.
    """

    labels: dict[str, list[int]] | None
    coefficient: np.ndarray
    rows: int


@dataclass(frozen=True)
class WorstRow:
    """One of the rows with the largest scaled error.

    Attributes:
        row, column: the row and its worst column.
        error: the largest scaled error of the row (inf: a NaN/Inf unlike the golden).
        candidate, device, golden: the three values at that column.
        slots: the row's provenance.
        explained: the row's explanation, when the case was explained and the row differs.
    """

    row: int
    column: int
    error: float
    candidate: float
    device: float
    golden: float
    slots: SlotTable
    explained: RowExplanation | None


@dataclass(frozen=True)
class CaseView:
    """A case's page numbers: :class:`ErrorMap`, :class:`SlotErrors`, the :class:`WorstRow` s."""

    map: ErrorMap
    slots: SlotErrors
    worst: tuple[WorstRow, ...]


def _edges(count: int) -> np.ndarray:
    blocks = max(1, min(count, MAP_BLOCKS))
    return (np.arange(blocks + 1) * count) // blocks


def _classes(values: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return np.where(np.isnan(values), 1, np.where(values == np.inf, 2, np.where(values == -np.inf, 3, 0)))


def _scaled(values: np.ndarray, golden: np.ndarray, magnitude: np.ndarray, small: float, dtype: str) -> np.ndarray:
    """Each element's scaled error: inf where its class (finite, NaN, +inf, -inf) differs from the
    golden's rounded to ``dtype``, 0 where both are the same NaN/Inf."""
    with np.errstate(all="ignore"):
        value_class, golden_class = _classes(values), _classes(golden.astype(DTYPES[dtype]).astype(_F64))
        error = np.abs(values - golden) / np.maximum(magnitude, small)
    error = np.where((value_class == 0) & np.isfinite(error), error, 0.0)
    return np.where(value_class == golden_class, error, np.inf)


def case_view(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    device_result: np.ndarray | None = None,
    explanation: Explanation | None = None,
) -> CaseView:
    """The numbers of one case's page (the module docstring).

    Args:
        call: the validated call.
        candidate: [N, H], the call's dtype or float32.
        device_result: the device's grad_x; default the emulation of ``call.order``.
        explanation: the case's :func:`~moegrad.explain`, for the slot counts and the worst rows' labels.
    """
    device = _device(call, device_result)
    n, hidden, top_k = call.num_tokens, call.hidden_size, max(call.top_k, 1)
    rows2d = _rows2d(call)
    golden_of = _Golden(call, rows2d)
    dtype = dtype_name(candidate.dtype) or call.dtype_name
    small = DTYPE_LIMITS[call.dtype_name].small_value
    index_all = call.expanded_row_idx.reshape(-1, top_k)
    row_edges, column_edges = _edges(n), _edges(hidden)
    blocks = np.full((row_edges.size - 1, column_edges.size - 1), np.nan)
    row_error, row_column = np.zeros(n), np.zeros(n, dtype=np.int64)
    numerator, denominator = np.zeros(top_k), np.zeros(top_k)
    outside_rows = 0
    step = max(1, _BLOCK_ELEMENTS // max(hidden, 1))
    for start in range(0, n, step):
        stop = min(n, start + step)
        index = index_all[start:stop].astype(np.int64)
        skip = (index < 0) | (index >= rows2d.shape[0])
        golden, magnitude = golden_of(np.arange(start, stop, dtype=np.int64), index, skip)
        values = candidate[start:stop].astype(_F64)
        scaled = _scaled(values, golden, magnitude, small, dtype)
        if hidden:
            row_column[start:stop] = np.argmax(scaled, axis=1)
            row_error[start:stop] = scaled[np.arange(stop - start), row_column[start:stop]]
            _fill_blocks(blocks, scaled, start, row_edges, column_edges)
        with np.errstate(all="ignore"):
            residual = values - golden
            finite = np.isfinite(residual)
            outside = finite & (np.abs(residual) > sum_bound(magnitude, (top_k - skip.sum(1))[:, None], values, dtype))
        faulty = np.flatnonzero(outside.any(axis=1)) if hidden else np.empty(0, np.int64)
        outside_rows += faulty.size
        for t in range(top_k):
            reading = faulty[~skip[faulty, t]]
            if reading.size:
                x = rows2d[index[reading, t]].astype(_F64)
                usable = finite[reading] & np.isfinite(x)
                numerator[t] += float(np.sum(np.where(usable, residual[reading] * x, 0.0)))
                denominator[t] += float(np.sum(np.where(usable, x * x, 0.0)))
    error_map = _expert_map(call, index_all, row_error) if call.drop_pad_mode == 1 else None
    with np.errstate(all="ignore"):
        coefficient = np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)
    worst = _worst_rows(call, candidate, device, row_error, row_column, explanation, golden_of)
    return CaseView(
        map=error_map or ErrorMap("rows", tuple(map(int, row_edges)), tuple(map(int, column_edges)), blocks),
        slots=SlotErrors(_slot_labels(explanation, top_k), coefficient, outside_rows),
        worst=worst,
    )


def _fill_blocks(blocks: np.ndarray, scaled: np.ndarray, start: int, row_edges: np.ndarray, edges: np.ndarray) -> None:
    """Fold a block of rows [start, start + len) into the map's row blocks (their largest value)."""
    by_column = np.maximum.reduceat(scaled, edges[:-1], axis=1)  # [rows, column blocks]
    stop = start + scaled.shape[0]
    for b in range(row_edges.size - 1):
        low, high = max(row_edges[b], start), min(row_edges[b + 1], stop)
        if low < high:
            part = by_column[low - start : high - start].max(axis=0)
            blocks[b] = np.fmax(blocks[b], part)


def _expert_map(call: MoeInitRoutingV2GradCall, index: np.ndarray, row_error: np.ndarray) -> ErrorMap:
    """Drop/pad mode: expert blocks x capacity-row blocks, each cell the largest error of a row
    whose slot reads a place in it."""
    experts, capacity = int(call.grad_expanded_x.shape[0]), int(call.grad_expanded_x.shape[1])
    expert_edges, capacity_edges = _edges(experts), _edges(capacity)
    values = np.full((expert_edges.size - 1, capacity_edges.size - 1), np.nan)
    read = (index >= 0) & (index < experts * capacity)
    tokens, _ = np.nonzero(read)
    places = index[read]
    if places.size and capacity:
        e = np.searchsorted(expert_edges, places // capacity, side="right") - 1
        c = np.searchsorted(capacity_edges, places % capacity, side="right") - 1
        flat = np.full(values.size, -np.inf)
        np.maximum.at(flat, e * values.shape[1] + c, row_error[tokens])
        values = np.where(flat == -np.inf, np.nan, flat).reshape(values.shape)
    return ErrorMap("experts", tuple(map(int, expert_edges)), tuple(map(int, capacity_edges)), values)


def _slot_labels(explanation: Explanation | None, top_k: int) -> dict[str, list[int]] | None:
    if explanation is None:
        return None
    counts = {label: [0] * top_k for label in SLOT_LABELS}
    for row in explanation.rows:
        if row.label in counts and row.slot is not None and 0 <= row.slot < top_k:
            counts[row.label][row.slot] += 1
    return counts


def _worst_rows(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    device: np.ndarray,
    row_error: np.ndarray,
    row_column: np.ndarray,
    explanation: Explanation | None,
    golden_of: _Golden,
) -> tuple[WorstRow, ...]:
    """The rows with the largest scaled error (the lower row first on ties), none of error 0."""
    if row_error.size == 0:
        return ()
    order = np.lexsort((np.arange(row_error.size), -row_error))[:WORST_ROWS]
    explained = {} if explanation is None else {r.row: r for r in explanation.rows}
    index = call.expanded_row_idx.reshape(-1, max(call.top_k, 1))[order].astype(np.int64)
    skip = (index < 0) | (index >= golden_of.rows.shape[0])
    golden_rows = golden_of(order.astype(np.int64), index, skip)[0][np.arange(order.size), row_column[order]]
    worst = []
    for i, golden in zip(order.tolist(), golden_rows.tolist(), strict=True):
        if not row_error[i] > 0:
            break
        column = int(row_column[i])
        worst.append(
            WorstRow(
                row=i,
                column=column,
                error=float(row_error[i]),
                candidate=float(candidate[i, column]),
                device=float(device[i, column]),
                golden=golden,
                slots=slot_table(call, i),
                explained=explained.get(i),
            )
        )
    return tuple(worst)
