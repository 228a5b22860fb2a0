"""Where a candidate's error lives, row by row: :func:`row_errors` (docs/accuracy.md, "Where the error lives").

A report's metrics say how large the error is over all of grad_x; this says how it spreads over the
rows: how many rows differ from the device, how many break an element's limit (the candidate's and
the device's), how many lie beyond every order of adds, the percentiles of each row's largest
relative error and ULP distance, and the first row holding a NaN or an Inf with the K slots that
feed it. Rows are measured in blocks of about 2^19 elements of grad_x, each block with its golden
and its summands' magnitude (:class:`moegrad.accuracy._explain._Golden`), so memory stays bounded
whatever the call's size; a block whose values, golden and magnitude are all finite is measured in
one compiled pass where numba is installed (:func:`moegrad.accuracy._fused_jit.row_figures`, the
same bits as the NumPy path). The renderings for the report's text, markdown and CSV are here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from moegrad._dtypes import dtype_name
from moegrad.accuracy._bound import gamma, sum_bound
from moegrad.accuracy._compare import check_compare_arguments, skipped_rows
from moegrad.accuracy._explain import _device, _Golden, _rows2d
from moegrad.accuracy._explanation import labels_line
from moegrad.accuracy._fused import _OVERFLOW_AT
from moegrad.accuracy._results import ComparisonReport, NonfiniteRow, RowErrors, RowPercentiles, SlotTable
from moegrad.accuracy._standards import DTYPE_LIMITS, THRESHOLDS
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = [
    "PERCENTILES",
    "ROW_ERROR_COLUMNS",
    "nearest_rank",
    "row_error_cells",
    "row_error_lines",
    "row_error_table",
    "row_errors",
    "slot_table",
    "with_row_errors",
]

#: The percentiles of :class:`~moegrad.accuracy.RowPercentiles`, besides the maximum.
PERCENTILES: tuple[int, ...] = (50, 90, 99)
_BLOCK_ELEMENTS = 1 << 19
_LISTED_COLUMNS = 8
_F64 = np.dtype(np.float64)
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _limit(standard: str, dtype: str, measure: str) -> float:
    """The limit of ``measure`` in ``standard``'s criteria for ``dtype`` (:data:`THRESHOLDS`)."""
    return next(c.limit for c in THRESHOLDS[(standard, dtype)] if c.measure == measure)


@dataclass
class _Rows:
    """One side's per-row figures ([N] each), filled block by block."""

    relative: np.ndarray
    ulp: np.ndarray
    failing: np.ndarray
    nonfinite: np.ndarray

    @classmethod
    def empty(cls, n: int) -> _Rows:
        return cls(np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, np.bool_), np.zeros(n, np.bool_))


def _widened(values: np.ndarray) -> np.ndarray:
    """``values`` as float64 in C order (one compiled signature whatever the caller's order); a
    signalling NaN becomes a quiet one, as any cast makes it, without NumPy's "invalid value" warning."""
    with np.errstate(invalid="ignore"):
        return values.astype(_F64, order="C")


def _classes(values: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return np.where(np.isnan(values), 1, np.where(values == np.inf, 2, np.where(values == -np.inf, 3, 0)))


def _row_max(values: np.ndarray, defined: np.ndarray) -> np.ndarray:
    """Each row's largest value where ``defined``; NaN for a row with none."""
    if values.shape[1] == 0:
        return np.full(values.shape[0], np.nan)
    largest = np.where(defined, values, -np.inf).max(axis=1)
    return np.where(defined.any(axis=1), largest, np.nan)


@dataclass
class _Block:
    """What both sides of a block share: the golden, the magnitude, the zero rows; and, once asked,
    what depends only on a dtype (:meth:`scale`, :meth:`golden_finite`)."""

    golden: np.ndarray
    magnitude: np.ndarray
    zero_rows: np.ndarray
    _by_dtype: dict[tuple[str, str], np.ndarray] = dataclasses.field(default_factory=dict)

    def _cached(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self._by_dtype:
            with np.errstate(all="ignore"):
                self._by_dtype[key] = make()
        return self._by_dtype[key]

    def golden_finite(self, value_dtype: str) -> np.ndarray:
        """Where the golden stays finite once rounded to ``value_dtype`` (NaN and inf: False)."""
        return self._cached(("finite", value_dtype), lambda: np.abs(self.golden) < _OVERFLOW_AT[value_dtype])

    def all_finite(self, value_dtype: str) -> bool:
        """Whether the golden (rounded to ``value_dtype``) and the magnitude are finite everywhere."""
        return bool(self.golden_finite(value_dtype).all()) and bool(np.isfinite(self.magnitude).all())

    def scale(self, value_dtype: str) -> np.ndarray:
        """The power of two that turns an error into ULPs of ``value_dtype`` at the golden: p - e, e
        the golden's binade (at least the smallest normal's; zero has that one)."""

        def make() -> np.ndarray:
            limits = DTYPE_LIMITS[value_dtype]
            lowest = limits.min_exponent
            _, exponent = np.frexp(self.golden)  # |g| = m * 2^exponent, 0.5 <= m < 1: the binade is exponent - 1
            binade = np.where(self.golden == 0, lowest, np.maximum(exponent - 1, lowest))
            return (limits.mantissa_bits - binade).astype(np.int32)

        return self._cached(("scale", value_dtype), make)

    def normal(self, call_dtype: str) -> np.ndarray:
        """Where the magnitude is at least the call dtype's small value (with a finite magnitude:
        where a relative error is defined)."""
        return self._cached(("normal", call_dtype), lambda: self.magnitude >= DTYPE_LIMITS[call_dtype].small_value)


def _measure(
    values: np.ndarray, value_dtype: str, block: _Block, call_dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of a block: largest relative error, largest ULP distance, failing, NaN/Inf; and the
    [rows, H] mask of finite elements.

    ``values`` is [rows, H] float64 (widened from ``value_dtype``). The golden's class is read
    after rounding it to ``value_dtype`` (an overflow to inf is the right answer): a finite golden
    rounds to inf at or beyond half the top ULP above the largest value (``_OVERFLOW_AT``). A ULP
    at the golden is 2^(e - p), e its binade (at least the smallest normal's; zero has that one), so
    ``|v - g| / ulp`` is ``ldexp(|v - g|, p - e)``.
    """
    value_finite = np.isfinite(values)
    if block.all_finite(value_dtype) and values.size and value_finite.all():
        return _measure_finite(values, value_dtype, block, call_dtype, value_finite)
    limits = DTYPE_LIMITS[call_dtype]
    golden, magnitude, top = block.golden, block.magnitude, _OVERFLOW_AT[value_dtype]
    max_relative = _limit("threshold", call_dtype, "max_relative_error")
    bound = _limit("accumulative", call_dtype, "max_accumulative_error")
    with np.errstate(all="ignore"):
        golden_finite = block.golden_finite(value_dtype)
        mismatch = value_finite != golden_finite
        odd = np.nonzero(~value_finite & ~golden_finite)
        if odd[0].size:  # both NaN/Inf: the same class, or not
            rounded = np.where(np.abs(golden[odd]) >= top, np.sign(golden[odd]) * np.inf, golden[odd])
            mismatch[odd] = _classes(values[odd]) != _classes(rounded)
        finite = value_finite & golden_finite & np.isfinite(magnitude)
        error = np.where(finite, np.abs(values - golden), 0.0)
        normal = finite & block.normal(call_dtype)
        relative = np.where(normal, error / np.where(normal, magnitude, 1.0), 0.0)
        ulps = np.ldexp(error, block.scale(value_dtype))
        accumulative = error / np.maximum(magnitude, limits.accumulative_small_value)
    failing = (mismatch | (normal & (relative >= max_relative)) | (finite & (accumulative > bound))).any(axis=1)
    if block.zero_rows.any():  # a row whose every slot is skipped must be +0.0, bit for bit
        failing |= _not_positive_zero(values, block.zero_rows)
    nonfinite = ~value_finite.all(axis=1)
    return _row_max(relative, normal), _row_max(ulps, finite), failing, nonfinite, finite


def _measure_finite(
    values: np.ndarray, value_dtype: str, block: _Block, call_dtype: str, finite: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_measure` where every value, the golden and the magnitude are finite: the same
    figures with no class to compare and nothing to mask. A row's largest relative error is its
    largest over all elements (those without one hold 0, and errors are >= 0) where it has an
    element that has one, else NaN."""
    limits = DTYPE_LIMITS[call_dtype]
    normal = block.normal(call_dtype)
    with np.errstate(all="ignore"):
        error = np.abs(values - block.golden)
        relative = np.where(normal, error / np.where(normal, block.magnitude, 1.0), 0.0)
        ulps = np.ldexp(error, block.scale(value_dtype))
        accumulative = error / np.maximum(block.magnitude, limits.accumulative_small_value)
    max_relative = _limit("threshold", call_dtype, "max_relative_error")
    bound = _limit("accumulative", call_dtype, "max_accumulative_error")
    failing = ((normal & (relative >= max_relative)) | (accumulative > bound)).any(axis=1)
    if block.zero_rows.any():
        failing |= _not_positive_zero(values, block.zero_rows)
    largest_relative = np.where(normal.any(axis=1), relative.max(axis=1), np.nan)
    return largest_relative, ulps.max(axis=1), failing, np.zeros(values.shape[0], np.bool_), finite


def _measure_compiled(
    jit: ModuleType | None,
    values: np.ndarray,
    value_dtype: str,
    block: _Block,
    call_dtype: str,
    gammas: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """:func:`_measure_finite`'s per-row figures by the compiled kernel (one pass, the same bits),
    and with ``gammas`` ([rows]: gamma_(n-1) of each row's n summands added) each row's "outside the
    any-order bound" (:func:`~moegrad.accuracy._bound.sum_bound` in ``value_dtype``); None without
    numba, or when the block holds a value, golden or magnitude that is not finite (then
    :func:`_measure` classifies it)."""
    if jit is None or values.size == 0:
        return None
    rows = values.shape[0]
    limits, calls = DTYPE_LIMITS[value_dtype], DTYPE_LIMITS[call_dtype]
    row_gammas = np.empty(0) if gammas is None else gammas  # empty: no bound to test
    parameters = np.array(
        [
            calls.small_value,
            calls.accumulative_small_value,
            _limit("threshold", call_dtype, "max_relative_error"),
            _limit("accumulative", call_dtype, "max_accumulative_error"),
            limits.mantissa_bits,
            limits.min_exponent,
            _OVERFLOW_AT[value_dtype],
            0.0 if value_dtype == "float32" else 1.0,  # cast_term: half an ULP, except for float32
        ]
    )
    relative, ulps = np.empty(rows), np.empty(rows)
    failing, beyond = np.empty(rows, np.bool_), np.empty(rows if gammas is not None else 0, np.bool_)
    if not jit.row_figures(
        values, block.golden, block.magnitude, block.zero_rows, parameters, row_gammas, relative, ulps, failing, beyond
    ):
        return None
    return relative, ulps, failing, np.zeros(rows, np.bool_), beyond if gammas is not None else None


def _not_positive_zero(values: np.ndarray, zero_rows: np.ndarray) -> np.ndarray:
    """The rows that must be +0.0, bit for bit (every slot skipped), and are not."""
    positive_zero = (values == 0) & ~np.signbit(values)
    return zero_rows & ~positive_zero.all(axis=1)


def nearest_rank(values: np.ndarray, percent: int) -> float:
    """The nearest-rank percentile: the value of rank ``ceil(percent * n / 100)`` in ascending order
    (NaN for no values)."""
    n = values.size
    if n == 0:
        return math.nan
    rank = _rank(n, percent)
    return float(np.partition(values, rank - 1)[rank - 1])


def _rank(n: int, percent: int) -> int:
    """The 1-based rank of :func:`nearest_rank` among ``n`` values: ``ceil(percent * n / 100)``, at least 1."""
    return max(1, -(-percent * n // 100))


def _percentiles(per_row: np.ndarray) -> RowPercentiles:
    defined = np.flatnonzero(~np.isnan(per_row))
    values = per_row[defined]
    if values.size == 0:
        return RowPercentiles(rows=0, p50=math.nan, p90=math.nan, p99=math.nan, max=math.nan, max_row=None)
    ordered = np.sort(values)  # every nearest rank from one sort
    p50, p90, p99 = (float(ordered[_rank(values.size, p) - 1]) for p in PERCENTILES)
    return RowPercentiles(
        rows=int(values.size),
        p50=p50,
        p90=p90,
        p99=p99,
        max=float(ordered[-1]),
        max_row=int(defined[int(np.argmax(values))]),
    )


def slot_table(call: MoeInitRoutingV2GradCall, row: int) -> SlotTable:
    """Row ``row``'s K slots: index, the row of grad_expanded_x read (None: skipped), and in
    drop/pad mode the expert and capacity row (docs/accuracy.md, "The labels")."""
    top_k = call.top_k
    rows = math.prod(call.grad_expanded_x.shape[:-1])
    index = [int(v) for v in call.expanded_row_idx.reshape(-1, top_k)[row]]
    skipped = tuple((v < 0) or (v >= rows) for v in index)
    capacity = int(call.grad_expanded_x.shape[1]) if call.drop_pad_mode == 1 else None
    nothing = (None,) * top_k
    return SlotTable(
        t=tuple(range(top_k)),
        index=tuple(index),
        row=tuple(None if s else v for v, s in zip(index, skipped, strict=True)),
        skipped=skipped,
        expert=nothing
        if capacity is None
        else tuple(None if s else v // capacity for v, s in zip(index, skipped, strict=True)),
        capacity_row=nothing
        if capacity is None
        else tuple(None if s else v % capacity for v, s in zip(index, skipped, strict=True)),
    )


def _first_nonfinite(
    call: MoeInitRoutingV2GradCall,
    rows2d: np.ndarray,
    row: int,
    candidate: np.ndarray,
    device: np.ndarray,
    golden: np.ndarray,
) -> NonfiniteRow:
    """The :class:`NonfiniteRow` of ``row`` (``golden`` is its float64 golden, [H])."""
    values = _widened(candidate[row])
    columns = np.flatnonzero(~np.isfinite(values))
    slots = slot_table(call, row)
    carriers = []
    for t, read in zip(slots.t, slots.row, strict=True):
        if read is not None and columns.size and not np.isfinite(_widened(rows2d[read, columns])).all():
            carriers.append(t)
    return NonfiniteRow(
        row=row,
        count=int(columns.size),
        columns=tuple(int(c) for c in columns[:_LISTED_COLUMNS]),
        device_count=int(np.count_nonzero(~np.isfinite(_widened(device[row])))),
        golden_count=int(np.count_nonzero(~np.isfinite(golden))),
        slots=slots,
        carriers=tuple(carriers),
    )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype hold the same bits."""
    words = _WORDS[a.dtype.itemsize]
    return bool(np.array_equal(a.view(words), b.view(words)))


def row_errors(
    call: MoeInitRoutingV2GradCall, candidate: np.ndarray, *, device_result: np.ndarray | None = None
) -> RowErrors:
    """Where the candidate's error lives, row by row, beside the device's (:class:`RowErrors`).

    Args:
        call: the validated call.
        candidate: [N, H] grad_x from the implementation under test, the call's dtype or float32.
        device_result: [N, H] in the call's dtype, the device's grad_x; default the emulation of
            ``call.order``.

    Returns:
        A :class:`~moegrad.accuracy.RowErrors`; relative errors against the summands' magnitude,
        ULPs of the golden in each array's own dtype (docs/accuracy.md, "Metrics").

    Raises:
        InvalidArgument: as :func:`~moegrad.accuracy.check_compare_arguments` (field ``candidate``).
        TypeError, ValueError: ``device_result`` is not [N, H] in the call's dtype.
    """
    check_compare_arguments(call, candidate)
    device = _device(call, device_result)
    n, hidden = call.num_tokens, call.hidden_size
    rows2d = _rows2d(call)
    golden_of = _Golden(call, rows2d)
    candidate_dtype, dtype = dtype_name(candidate.dtype) or "float32", call.dtype_name
    zero = skipped_rows(call)
    mine, theirs = _Rows.empty(n), _Rows.empty(n)
    differing, outside = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    index_all = call.expanded_row_idx.reshape(-1, max(call.top_k, 1))
    first: NonfiniteRow | None = None
    every_identical = True  # every block's candidate has the device's bits: the device's figures are its own
    step = max(1, _BLOCK_ELEMENTS // max(hidden, 1))
    for start in range(0, n, step):
        stop = min(n, start + step)
        grad_rows = np.arange(start, stop, dtype=np.int64)
        index = index_all[start:stop].astype(np.int64)
        skip = (index < 0) | (index >= rows2d.shape[0])
        golden, magnitude = golden_of(grad_rows, index, skip)
        block = _Block(golden, magnitude, zero[start:stop])
        c = _widened(candidate[start:stop])
        added = call.top_k - skip.sum(axis=1)
        compiled = _measure_compiled(golden_of.jit, c, candidate_dtype, block, dtype, gamma(added - 1))
        if compiled is not None:
            *figures, beyond = compiled
            outside[start:stop] = beyond
        else:
            *figures, finite = _measure(c, candidate_dtype, block, dtype)
            with np.errstate(all="ignore"):
                bound = sum_bound(magnitude, added[:, None], c, candidate_dtype)
                outside[start:stop] = (finite & (np.abs(c - golden) > bound)).any(axis=1) if hidden else False
        # a candidate with the device's bits has the device's figures (the common case of a sweep)
        device_figures = figures
        if not (candidate_dtype == dtype and _same_bits(candidate[start:stop], device[start:stop])):
            every_identical = False
            d = _widened(device[start:stop])
            compiled = _measure_compiled(golden_of.jit, d, dtype, block, dtype, None)
            device_figures = list(compiled[:4] if compiled is not None else _measure(d, dtype, block, dtype)[:4])
            same = ((c == d) & (np.signbit(c) == np.signbit(d))) | (np.isnan(c) & np.isnan(d))
            differing[start:stop] = ~same.all(axis=1) if hidden else False
        for side, got in ((mine, figures), (theirs, device_figures)):
            side.relative[start:stop], side.ulp[start:stop], side.failing[start:stop], side.nonfinite[start:stop] = got
        if first is None and mine.nonfinite[start:stop].any():
            row = start + int(np.argmax(mine.nonfinite[start:stop]))
            first = _first_nonfinite(call, rows2d, row, candidate, device, golden[row - start])
    relative, ulp = _percentiles(mine.relative), _percentiles(mine.ulp)
    return RowErrors(
        rows=n,
        differing=int(np.count_nonzero(differing)),
        failing=int(np.count_nonzero(mine.failing)),
        device_failing=int(np.count_nonzero(theirs.failing)),
        outside_bound=int(np.count_nonzero(outside)),
        nonfinite=int(np.count_nonzero(mine.nonfinite)),
        device_nonfinite=int(np.count_nonzero(theirs.nonfinite)),
        relative_error=relative,
        device_relative_error=relative if every_identical else _percentiles(theirs.relative),
        ulp_error=ulp,
        device_ulp_error=ulp if every_identical else _percentiles(theirs.ulp),
        first_nonfinite=first,
    )


def with_row_errors(
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    device_result: np.ndarray | None = None,
) -> ComparisonReport:
    """``report`` with :attr:`~moegrad.ComparisonReport.row_errors` set (:func:`row_errors`; a pass
    over the call, so it is asked for, not done by every comparison). Same errors as that function."""
    return dataclasses.replace(report, row_errors=row_errors(call, candidate, device_result=device_result))


# --------------------------------------------------------------------------------------------------
# Renderings


def _figure(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4g}"


def _spread(p: RowPercentiles) -> str:
    if p.rows == 0:
        return "n/a (no row measured)"
    return f"p50 {_figure(p.p50)}, p90 {_figure(p.p90)}, p99 {_figure(p.p99)}, max {_figure(p.max)} (row {p.max_row})"


def row_error_table(report: ComparisonReport) -> tuple[str, Sequence[str], list[list[str]]] | None:
    """The report's "where the error lives" table (title, headers, rows), or None without row errors."""
    r = report.row_errors
    if r is None:
        return None
    rows = [
        ["rows", str(r.rows), str(r.rows)],
        ["rows that differ from the device", str(r.differing), "0"],
        ["rows past an element's limit", str(r.failing), str(r.device_failing)],
        ["rows outside the any-order bound", str(r.outside_bound), "-"],
        ["rows holding NaN/Inf", str(r.nonfinite), str(r.device_nonfinite)],
        ["row max relative error", _spread(r.relative_error), _spread(r.device_relative_error)],
        ["row max ULP error", _spread(r.ulp_error), _spread(r.device_ulp_error)],
    ]
    return "where the error lives (per row)", ("figure", "candidate", "device"), rows


def _slots_text(slots: SlotTable) -> str:
    parts = []
    for t, index, read, skipped, expert, place in zip(
        slots.t, slots.index, slots.row, slots.skipped, slots.expert, slots.capacity_row, strict=True
    ):
        where = f"expert {expert}, capacity row {place}, " if expert is not None else ""
        parts.append(f"t={t}: index {index}, " + ("skipped" if skipped else f"{where}row {read}"))
    return "; ".join(parts)


def row_error_lines(report: ComparisonReport) -> list[str]:
    """The lines after the table: the first NaN/Inf row with its slots, the label counts."""
    lines = []
    r = report.row_errors
    if r is not None:
        f = r.first_nonfinite
        if f is None:
            lines.append("first NaN/Inf row: none")
        else:
            carried = ", ".join(f"slot {t} (row {f.slots.row[t]})" for t in f.carriers) or "no slot's input"
            lines.append(
                f"first NaN/Inf row: {f.row}, {f.count} elements (columns {', '.join(map(str, f.columns))}"
                f"{', ...' if f.count > len(f.columns) else ''}); the device {f.device_count}, the golden "
                f"{f.golden_count}; carried by {carried}; slots: {_slots_text(f.slots)}"
            )
    if report.explained is not None:
        lines.append(f"explained: {labels_line(report.explained) or 'every row bit-identical to the device'}")
    return lines


#: The CSV columns of the row errors, after every other column of :func:`~moegrad.accuracy.csv_rows`.
ROW_ERROR_COLUMNS: tuple[str, ...] = (
    "rows_differing",
    "rows_failing",
    "rows_outside_bound",
    "rows_nonfinite",
    *(f"row_relative_error_{p}" for p in (*(f"p{q}" for q in PERCENTILES), "max")),
    *(f"row_ulp_error_{p}" for p in (*(f"p{q}" for q in PERCENTILES), "max")),
    "first_nonfinite_row",
    "first_nonfinite_slots",
    "explained",
)


def _cell(value: float) -> str:
    return "nan" if math.isnan(value) else repr(value)


def _percentile_cells(name: str, p: RowPercentiles) -> dict[str, str]:
    return {f"{name}_p{q}": _cell(getattr(p, f"p{q}")) for q in PERCENTILES} | {f"{name}_max": _cell(p.max)}


def row_error_cells(report: ComparisonReport, role: str) -> dict[str, str]:
    """:data:`ROW_ERROR_COLUMNS` of the CSV's ``"candidate"`` or ``"device"`` row (empty cells
    without row errors; the device's row leaves the candidate-only figures empty)."""
    cells = dict.fromkeys(ROW_ERROR_COLUMNS, "")
    r = report.row_errors
    mine = role == "candidate"
    if mine and report.explained is not None:
        cells["explained"] = labels_line(report.explained) or "none"
    if r is None:
        return cells
    cells |= {
        "rows_differing": str(r.differing if mine else 0),
        "rows_failing": str(r.failing if mine else r.device_failing),
        "rows_nonfinite": str(r.nonfinite if mine else r.device_nonfinite),
        **_percentile_cells("row_relative_error", r.relative_error if mine else r.device_relative_error),
        **_percentile_cells("row_ulp_error", r.ulp_error if mine else r.device_ulp_error),
    }
    if mine:
        cells["rows_outside_bound"] = str(r.outside_bound)
        if r.first_nonfinite is not None:
            cells["first_nonfinite_row"] = str(r.first_nonfinite.row)
            cells["first_nonfinite_slots"] = _slots_text(r.first_nonfinite.slots)
    return cells
