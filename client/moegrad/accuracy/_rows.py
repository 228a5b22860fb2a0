"""A block of differing rows explained: each row's label, from its fits and replays, and its evidence.

The rules (docs/accuracy.md, "Explaining a mismatch"), for a row whose classes (finite, NaN, +inf,
-inf) agree with the device's:

1. a known schedule reproduces the row bit for bit: ``order`` (``profile`` names it), unless a
   faulty summand or a narrower accumulator reproduces it too: ``ambiguous``;
2. every column within the any-order bound: ``order`` with ``profile`` None, unless a fault's
   replay reproduces the row: ``ambiguous``;
3. outside the bound in exactly one column: one column cannot carry a fingerprint, so whatever fits
   is listed as ``ambiguous`` (``unexplained`` when nothing fits);
4. outside in two or more: the explanations whose replay reproduces the row bit for bit if any,
   else those within the bound; one (a label, a slot, a row) is the row's label, several are
   ``ambiguous``, none is ``unexplained``.

A row whose classes differ somewhere is ``nonfinite``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from moegrad._dtypes import dtype_name
from moegrad.accuracy._bound import ordinal, ulp
from moegrad.accuracy._explanation import ElementTable, Evidence, Hypothesis, RowExplanation, SlotTable
from moegrad.accuracy._fingerprint import Block, Fit, RowIndex, Window, own_slot_fits, row_search_fits
from moegrad.accuracy._matching import match_fits, match_schedules
from moegrad.accuracy._replay import Schedule
from moegrad.accuracy._stop import check_stop

__all__ = ["Searches", "explain_rows"]

_NARROW = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_FITS_PER_ROW = 32
_CANDIDATES = 16
_NONFINITE_COLUMNS = 8
_CLOSER = ("equal", "candidate", "device")
_LISTED = (
    "column",
    "candidate",
    "device",
    "golden",
    "bound",
    "ulp_candidate_device",
    "ulp_candidate_golden",
    "ulp_device_golden",
    "within_bound",
)
_TINY = np.finfo(np.float64).tiny


@dataclass(frozen=True)
class Searches:
    """What the search of a block may use.

    Attributes:
        schedules: every known arithmetic of the call, the device's first (fault and precision replays).
        other_schedules: those a differing row may match (the device's own left out when the device
            result is the emulation, which differs from the row by definition).
        row_index: the sorted key columns of grad_expanded_x, built on first use (None: no rows).
        capacity: drop/pad mode: C; else None.
        stop: set once the explanation's result is no longer wanted (looked at between the
            searches, and within the search of other rows); None: never.
    """

    schedules: tuple[Schedule, ...]
    other_schedules: tuple[Schedule, ...]
    row_index: Callable[[], RowIndex | None]
    capacity: int | None
    stop: threading.Event | None = None

    def check_stop(self) -> None:
        """Raise DeadlineExceeded when :attr:`stop` is set."""
        check_stop(self.stop, "the explanation")

    @property
    def precision_schedules(self) -> tuple[Schedule, ...]:
        """The schedules a narrower accumulator is replayed in: the device's own and the sequential
        chain (a scatter-add in slot order, what a port accumulating in its output dtype most often does)."""
        return tuple(s for i, s in enumerate(self.schedules) if i == 0 or "sequential" in s.names)


def _classes(values: np.ndarray | np.floating) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return np.where(np.isnan(values), 1, np.where(values == np.inf, 2, np.where(values == -np.inf, 3, 0)))


def _mismatches(block: Block) -> dict[int, np.ndarray]:
    """Block rows whose NaN/Inf differs from the device's somewhere -> those columns."""
    odd = np.flatnonzero(~block.eusable)
    if odd.size == 0:
        return {}
    differs = odd[_classes(block.ecand[odd]) != _classes(block.edev[odd])]
    found: dict[int, list[int]] = {}
    for e in differs:
        found.setdefault(int(block.ew[e]), []).append(int(block.eh[e]))
    return {w: np.array(columns, dtype=np.intp) for w, columns in found.items()}


def explain_rows(block: Block, searches: Searches) -> list[RowExplanation]:
    """Every row of ``block`` explained, in block order.

    Raises:
        DeadlineExceeded: ``searches.stop`` was set (looked at between the searches).
    """
    count = block.row.size
    mismatch = _mismatches(block)
    rest = np.array([w for w in range(count) if w not in mismatch], dtype=np.intp)
    outside, worst_ratio = block.outside, block.worst
    quiet, faulty = rest[outside[rest] == 0], rest[outside[rest] >= 1]
    window = Window(block, rest)
    matched = dict(zip(quiet.tolist(), match_schedules(block, quiet, searches.other_schedules, window), strict=True))
    searches.check_stop()
    hypotheses: dict[int, list[Hypothesis]] = {}
    own = own_slot_fits(block, rest, window)
    _replayed(block, own + _extras_of_own_rows(block, own), searches.schedules, hypotheses)
    searches.check_stop()
    # the rest of grad_expanded_x is searched for rows none of their own slots fits (docs/accuracy.md)
    alone = np.array([w for w in faulty if int(w) not in hypotheses], dtype=np.intp)
    index = searches.row_index() if alone.size else None
    cut: set[int] = set()
    if index is not None:
        found, cut = row_search_fits(block, alone, index, searches.check_stop)
        _replayed(block, found, searches.schedules, hypotheses)
        searches.check_stop()
    precision = _precision(block, faulty, searches.precision_schedules, window)
    searches.check_stop()
    tables = _element_tables(block)
    slot_tables = _slot_tables(block, searches.capacity)
    explained = []
    for w in range(count):
        if w in mismatch:
            decision = _nonfinite(block, w, mismatch[w])
        else:
            decision = _decide(
                matched.get(w), int(outside[w]), hypotheses.get(w, []), precision.get(w), float(worst_ratio[w])
            )
        label, slot, source, profile, evidence = decision
        if w in cut:
            summary = (
                evidence.summary + " (some rows of grad_expanded_x were not searched: too many lay near the target)"
            )
            evidence = dataclasses.replace(evidence, summary=summary, search_complete=False)
        explained.append(
            RowExplanation(
                row=int(block.row[w]),
                label=label,  # type: ignore[arg-type]  # one of LABELS, by construction
                slot=slot,
                source_row=source,
                profile=profile,
                evidence=evidence,
                slots=slot_tables[w],
                elements=tables[w],
            )
        )
    return explained


def _extras_of_own_rows(block: Block, fits: list[Fit]) -> list[Fit]:
    """A duplicated slot's fingerprint is also that of a skipped slot reading the same row: the
    extra summands that read one of the row's own rows, for each such fit."""
    extras = []
    for fit in fits:
        if fit.label == "duplicated":
            extras += [Fit(fit.w, "extra", int(u), fit.source, fit.ratio) for u in np.flatnonzero(block.skip[fit.w])]
    return extras


def _replayed(block: Block, fits: list[Fit], schedules: Sequence[Schedule], into: dict[int, list[Hypothesis]]) -> None:
    """Each fit (at most ``_FITS_PER_ROW`` per row, the closest) replayed, as a hypothesis of its row."""
    fits = _capped(fits)
    for fit, schedule in zip(fits, match_fits(block, fits, schedules), strict=True):
        into.setdefault(fit.w, []).append(_fit_hypothesis(fit, schedule))


def _capped(fits: list[Fit]) -> list[Fit]:
    """At most ``_FITS_PER_ROW`` fits per row, the closest (lowest ratio) first."""
    by_row: dict[int, list[Fit]] = {}
    for fit in fits:
        by_row.setdefault(fit.w, []).append(fit)
    kept: list[Fit] = []
    for row_fits in by_row.values():
        kept += sorted(row_fits, key=lambda fit: (fit.ratio, fit.slot, fit.source))[:_FITS_PER_ROW]
    return kept


def _fit_hypothesis(fit: Fit, schedule: Schedule | None) -> Hypothesis:
    name = None if schedule is None else schedule.name
    return Hypothesis(fit.label, fit.slot, fit.source, name, schedule is not None, fit.ratio)


def _precision(
    block: Block, w: np.ndarray, schedules: Sequence[Schedule], window: Window
) -> dict[int, tuple[str, Schedule]]:
    """Block rows that a replay accumulating in float16 or bfloat16 reproduces, with the dtype and schedule."""
    found: dict[int, tuple[str, Schedule]] = {}
    left = w
    for accumulator in _NARROW:
        if left.size == 0:
            break
        matched = match_schedules(block, left, schedules, window, accumulator)
        name = dtype_name(accumulator) or str(accumulator)
        found.update({int(p): (name, s) for p, s in zip(left, matched, strict=True) if s is not None})
        left = np.array([p for p, s in zip(left, matched, strict=True) if s is None], dtype=np.intp)
    return found


Decision = tuple[str, "int | None", "int | None", "str | None", Evidence]


def _evidence(
    summary: str, chosen: Hypothesis | None, outside: int, *, schedules: tuple[str, ...] = (), **fields: object
) -> Evidence:
    return Evidence(
        summary=summary,
        exact=bool(chosen is not None and chosen.exact),
        schedules=schedules,
        accumulator=fields.get("accumulator"),  # type: ignore[arg-type]
        residual_ratio=math.nan if chosen is None else chosen.residual_ratio,
        outside_bound_columns=outside,
        nonfinite_columns=fields.get("nonfinite_columns", ()),  # type: ignore[arg-type]
        candidates=fields.get("candidates", ()),  # type: ignore[arg-type]
    )


def _key(h: Hypothesis) -> tuple[str, int | None, int | None]:
    return h.label, h.slot, h.source_row


def _distinct(hypotheses: Sequence[Hypothesis]) -> list[Hypothesis]:
    seen: dict[tuple[str, int | None, int | None], Hypothesis] = {}
    for h in hypotheses:
        seen.setdefault(_key(h), h)
    return list(seen.values())


def _ambiguous(candidates: Sequence[Hypothesis], outside: int, why: str) -> Decision:
    listed = _distinct(candidates)
    names = ", ".join(_short(h) for h in listed[:4]) + (", ..." if len(listed) > 4 else "")
    summary = f"{len(listed)} explanations fit ({names}): {why}"
    if len({(h.label, h.source_row) for h in listed}) == 1 and listed[0].label in ("extra", "duplicated"):
        slots = ", ".join(str(h.slot) for h in listed)
        summary = (
            f"a {listed[0].label} summand reading row {listed[0].source_row} fits in slot {slots} alike: "
            "the replays of those slots are the same adds, or reproduce the row equally"
        )
    evidence = _evidence(summary, None, outside, candidates=tuple(listed[:_CANDIDATES]))
    return "ambiguous", None, None, None, evidence


def _short(h: Hypothesis) -> str:
    if h.label in ("order", "precision"):
        return f"{h.label} ({h.profile or 'within the bound'})"
    return f"{h.label} slot {h.slot} row {h.source_row}"


def _decide(
    schedule: Schedule | None,
    outside: int,
    fits: list[Hypothesis],
    precision: tuple[str, Schedule] | None,
    ratio: float,
) -> Decision:
    """The label of a row whose classes agree with the device's (module docstring, rules 1-4)."""
    exact = [h for h in fits if h.exact]
    if precision is not None:
        exact.append(Hypothesis("precision", None, None, precision[1].name, True, math.nan))
    bounded = [h for h in fits if not h.exact]
    if schedule is not None or outside == 0:
        order = Hypothesis(
            "order", None, None, None if schedule is None else schedule.name, schedule is not None, ratio
        )
        if exact:
            return _ambiguous([order, *exact], outside, "another schedule and a replayed fault both reproduce the row")
        if schedule is not None:
            summary = f"the {schedule.name} schedule reproduces the row bit for bit"
            return "order", None, None, schedule.name, _evidence(summary, order, outside, schedules=schedule.names)
        summary = (
            f"every column lies within the any-order bound (at most {ratio:.3g} of it); "
            "no known schedule reproduces the row"
        )
        return "order", None, None, None, _evidence(summary, order, outside, candidates=tuple(bounded[:_CANDIDATES]))
    everything = [*exact, *bounded]
    if not everything:
        summary = (
            f"{outside} columns lie outside the any-order bound and no single wrong summand "
            "or narrower accumulator fits"
        )
        return "unexplained", None, None, None, _evidence(summary, None, outside)
    if outside == 1:
        return _ambiguous(everything, outside, "only one column lies outside the bound, too few to carry a fingerprint")
    pool = _distinct(exact or bounded)
    if len(pool) > 1:
        return _ambiguous(pool, outside, "they fit equally")
    chosen = pool[0]
    rivals = tuple(h for h in _distinct(everything) if _key(h) != _key(chosen))[:_CANDIDATES]
    if chosen.label == "precision":
        assert precision is not None
        summary = f"accumulating in {precision[0]} in the {precision[1].name} schedule reproduces the row bit for bit"
        evidence = _evidence(
            summary, chosen, outside, schedules=precision[1].names, accumulator=precision[0], candidates=rivals
        )
        return "precision", None, None, precision[1].name, evidence
    summary = _fault_summary(chosen)
    schedules = () if chosen.profile is None else (chosen.profile,)
    evidence = _evidence(summary, chosen, outside, schedules=schedules, candidates=rivals)
    return chosen.label, chosen.slot, chosen.source_row, chosen.profile, evidence


def _fault_summary(h: Hypothesis) -> str:
    what = {
        "missing": f"slot {h.slot} (row {h.source_row}) is missing: candidate - golden = -x[{h.source_row}]",
        "duplicated": f"slot {h.slot} (row {h.source_row}) is added twice: candidate - golden = +x[{h.source_row}]",
        "replaced": f"slot {h.slot} read row {h.source_row} instead of its own",
        "extra": f"skipped slot {h.slot} was added, reading row {h.source_row}",
    }[h.label]
    how = (
        f"; the {h.profile} schedule with that summand reproduces the row bit for bit"
        if h.exact
        else f", within the any-order bound in every column ({h.residual_ratio:.3g} of it at most)"
    )
    return what + how


def _nonfinite(block: Block, w: int, columns: np.ndarray) -> Decision:
    """A row whose NaN/Inf differs from the device's; the first slot (not skipped) whose row carries
    a NaN or an infinity in one of those columns."""
    names = ("finite", "NaN", "+inf", "-inf")
    first = int(columns[0])
    cand = names[int(_classes(np.float64(block.candidate[w, first])))]
    dev = names[int(_classes(np.float64(block.device[w, first])))]
    slot = source = None
    for t in np.flatnonzero(~block.skip[w]):
        row = int(block.index[w, t])
        if not np.isfinite(block.rows[row, columns].astype(np.float64)).all():
            slot, source = int(t), row
            break
    summary = f"NaN/Inf differs in {columns.size} columns (column {first}: candidate {cand}, device {dev})"
    summary += (
        f"; slot {slot} (row {source}) carries it" if slot is not None else "; no slot the device adds carries it"
    )
    evidence = _evidence(summary, None, 0, nonfinite_columns=tuple(int(c) for c in columns[:_NONFINITE_COLUMNS]))
    return "nonfinite", slot, source, None, evidence


def _slot_tables(block: Block, capacity: int | None) -> list[SlotTable]:
    """Every block row's :class:`SlotTable`, built column by column (None where a slot is skipped)."""
    rows, top_k = block.index.shape
    read = block.index.astype(object)
    read[block.skip] = None
    nothing = (None,) * top_k
    if capacity:
        expert, place = (block.index // capacity).astype(object), (block.index % capacity).astype(object)
        expert[block.skip] = None
        place[block.skip] = None
        experts, places = [tuple(r) for r in expert.tolist()], [tuple(r) for r in place.tolist()]
    else:
        experts = places = [nothing] * rows
    t = tuple(range(top_k))
    index, skipped, reads = block.index.tolist(), block.skip.tolist(), read.tolist()
    return [
        SlotTable(t, tuple(index[w]), tuple(reads[w]), tuple(skipped[w]), experts[w], places[w]) for w in range(rows)
    ]


def _element_tables(block: Block) -> list[ElementTable]:
    """Every block row's :class:`ElementTable`: counts over its differing elements, and the worst
    (``block.top``: farthest outside the any-order bound) with their ULP figures."""
    rows = block.row.size
    with np.errstate(invalid="ignore"):
        error_c, error_d = np.abs(block.ecand - block.egold), np.abs(block.edev - block.egold)
        within = block.eusable & (block.eratio <= 1.0)
        # a NaN error (a non-finite element) is never the closer one: compare as +inf
        near_c = np.where(np.isnan(error_c), np.inf, error_c)
        near_d = np.where(np.isnan(error_d), np.inf, error_d)
    w = block.ew
    weights = np.stack([within, near_c < near_d, near_d < near_c]).astype(np.float64)
    counts = [[int(n) for n in np.bincount(w, weights=part, minlength=rows)] for part in weights]
    differing = np.bincount(w, minlength=rows).tolist()
    closer = np.where(near_c < near_d, 1, np.where(near_d < near_c, 2, 0))
    pick = block.top[block.top >= 0]
    with np.errstate(invalid="ignore"):
        unit = ulp(block.egold[pick], block.dtype)
        ulp_cg, ulp_dg = error_c[pick] / unit, error_d[pick] / unit
        at = (w[pick], block.eh[pick])
        steps = np.abs(ordinal(block.candidate[at]) - ordinal(block.device[at])).astype(np.float64)
        steps[~block.eusable[pick]] = np.nan
    fields = [block.eh[pick], block.ecand[pick], block.edev[pick], block.egold[pick], block.ebound[pick],
              steps, ulp_cg, ulp_dg, within[pick]]  # fmt: skip
    columns = [f.tolist() for f in fields]
    names = [_CLOSER[c] for c in closer[pick].tolist()]
    ends = np.cumsum((block.top >= 0).sum(axis=1)).tolist()
    tables, start = [], 0
    for r in range(rows):
        end = ends[r]
        listed: dict[str, Any] = {name: tuple(column[start:end]) for name, column in zip(_LISTED, columns, strict=True)}
        tables.append(
            ElementTable(
                differing=differing[r],
                outside_bound=differing[r] - counts[0][r],
                candidate_closer=counts[1][r],
                device_closer=counts[2][r],
                closer=tuple(names[start:end]),
                **listed,
            )
        )
        start = end
    return tables
