"""The result of :func:`moegrad.explain`: one label and its evidence per row of grad_x that differs.

The objects are frozen dataclasses with the ``to_dict`` / ``from_dict`` of the comparison's results
(:mod:`moegrad.accuracy._results`): JSON- and msgpack-safe, a non-finite float written as ``"nan"``,
``"inf"`` or ``"-inf"``. The per-slot and per-element tables are kept column by column (one tuple
per field) and every class is slotted (no per-object dict), so that an explanation of every row of a
large call stays small and quick to build, with few objects for the garbage collector to visit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from moegrad.accuracy._results import Bool, Int, SlotTable, Str, WireFloat, _Serializable

__all__ = [
    "LABELS",
    "SUMMAND_FAULTS",
    "WORST_ELEMENTS",
    "ElementTable",
    "Evidence",
    "Explanation",
    "Hypothesis",
    "Label",
    "RowExplanation",
    "SlotTable",
    "labels_line",
]

Label = Literal[
    "order", "missing", "duplicated", "replaced", "extra", "precision", "nonfinite", "unexplained", "ambiguous"
]
#: Every label, in the order a summary lists them.
LABELS: tuple[str, ...] = (
    "order",
    "missing",
    "duplicated",
    "replaced",
    "extra",
    "precision",
    "nonfinite",
    "unexplained",
    "ambiguous",
)
#: The labels that name one wrong summand (a slot and the row it read).
SUMMAND_FAULTS: tuple[str, ...] = ("missing", "duplicated", "replaced", "extra")
#: How many of a row's differing elements :attr:`ElementTable` lists (the worst), at most.
WORST_ELEMENTS = 8


@dataclass(frozen=True, slots=True)
class ElementTable(_Serializable):
    """A row's differing elements: counts over all of them, and the worst few, one list per field.

    The worst are the ``WORST_ELEMENTS`` largest ``ulp_candidate_golden`` (non-finite first, then
    the lower column on ties). ULPs are of grad_x's dtype: ``ulp_candidate_device`` counts the
    representable values from one to the other (+0.0 and -0.0 are 0 apart); the golden ones are
    ``|value - golden| / ulp(golden)`` (docs/accuracy.md, "Metrics").

    Attributes:
        differing: elements whose bits differ from the device's (NaN matching NaN).
        outside_bound: of those, elements where ``|candidate - golden|`` exceeds the any-order bound.
        candidate_closer, device_closer: of those, elements where the candidate (the device) is
            strictly closer to the golden.
        column, candidate, device, golden, bound, ulp_candidate_device, ulp_candidate_golden,
        ulp_device_golden, within_bound, closer: per listed element; ``bound`` is the any-order
            bound at the candidate's value; ``closer`` is "candidate", "device" or "equal".
    """

    differing: Int
    outside_bound: Int
    candidate_closer: Int
    device_closer: Int
    column: tuple[Int, ...]
    candidate: tuple[WireFloat, ...]
    device: tuple[WireFloat, ...]
    golden: tuple[WireFloat, ...]
    bound: tuple[WireFloat, ...]
    ulp_candidate_device: tuple[WireFloat, ...]
    ulp_candidate_golden: tuple[WireFloat, ...]
    ulp_device_golden: tuple[WireFloat, ...]
    within_bound: tuple[Bool, ...]
    closer: tuple[Str, ...]


@dataclass(frozen=True, slots=True)
class Hypothesis(_Serializable):
    """One explanation that fits a row.

    Attributes:
        label: a label of :data:`LABELS`.
        slot, source_row: the slot t and the row of grad_expanded_x of a summand fault (else None).
        profile: the schedule whose replay reproduces the row bit for bit (a profile name,
            ``"pairwise"`` or ``"reversed"``), or None when the fit is only within the bound.
        exact: whether a replay reproduces the row bit for bit.
        residual_ratio: the largest ``|candidate - golden - fingerprint| / bound`` over the row's
            columns (1 or less: within the bound); NaN where no bound was tested.
    """

    label: Str
    slot: Int | None
    source_row: Int | None
    profile: Str | None
    exact: Bool
    residual_ratio: WireFloat


@dataclass(frozen=True, slots=True)
class Evidence(_Serializable):
    """Why a row got its label.

    Attributes:
        summary: one sentence.
        exact: whether a replay of the label reproduces the row bit for bit.
        schedules: the schedule names of that replay (every profile of the same arithmetic), empty
            when the fit is only within the bound.
        accumulator: ``precision``: the dtype the replay accumulated in; else None.
        residual_ratio: as :attr:`Hypothesis.residual_ratio`, for the label's fit.
        outside_bound_columns: the row's columns where ``|candidate - golden|`` exceeds the
            any-order bound: how many columns carry a fingerprint (a summand fault needs two).
        nonfinite_columns: ``nonfinite``: the first columns (at most 8) where NaN/Inf differs.
        candidates: ``ambiguous``: every explanation that fits (at most 16); otherwise the other
            explanations that also fit within the bound (rivals the replay set aside).
        search_complete: False when the search of grad_expanded_x's rows for a replaced or extra
            summand left a target out (every key column's window held more than 4096 rows).
    """

    summary: Str
    exact: Bool
    schedules: tuple[Str, ...]
    accumulator: Str | None
    residual_ratio: WireFloat
    outside_bound_columns: Int
    nonfinite_columns: tuple[Int, ...]
    candidates: tuple[Hypothesis, ...]
    search_complete: Bool = True


@dataclass(frozen=True, slots=True)
class RowExplanation(_Serializable):
    """One row of grad_x whose bits differ from the device's.

    Attributes:
        row: the token i.
        label: one of :data:`LABELS`.
        slot: a summand fault's slot t in [0, K); ``nonfinite``: the slot whose input carries the
            NaN/Inf, if any; else None.
        source_row: the row of grad_expanded_x that slot reads (``missing``, ``duplicated``: its
            own row; ``replaced``: the row read instead; ``extra``: the row the skipped slot read).
        profile: ``order``: the known schedule that reproduces the row (None: within the bound
            only); a fault or ``precision``: the schedule of the replay that reproduces it.
        evidence: :class:`Evidence`.
        slots: the row's provenance, :class:`SlotTable`.
        elements: its differing elements, :class:`ElementTable`.
    """

    row: Int
    label: Label
    slot: Int | None
    source_row: Int | None
    profile: Str | None
    evidence: Evidence
    slots: SlotTable
    elements: ElementTable


@dataclass(frozen=True, slots=True)
class Explanation(_Serializable):
    """What :func:`moegrad.explain` found: the rows that differ from the device's, each explained.

    Attributes:
        dtype: grad_x's dtype.
        shape: grad_x's shape [N, H].
        profile: the device profile whose result the candidate was held against.
        differing_rows: rows whose bits differ (each listed in ``rows``).
        labels: every label of :data:`LABELS` -> the number of rows with it.
        rows: one :class:`RowExplanation` per differing row, in row order.
        capacity: drop/pad mode: C, the capacity (``expert = index // C``); else None.
    """

    dtype: Str
    shape: tuple[Int, Int]
    profile: Str
    differing_rows: Int
    labels: dict[Str, Int]
    rows: tuple[RowExplanation, ...]
    capacity: Int | None

    def row(self, i: int) -> RowExplanation | None:
        """The explanation of row ``i``, or None when it agrees with the device."""
        for explained in self.rows:
            if explained.row == i:
                return explained
        return None

    def __str__(self) -> str:
        count = ", ".join(f"{label} {n}" for label, n in self.labels.items() if n)
        head = f"grad_x {self.dtype} {list(self.shape)} against {self.profile}: "
        if not self.rows:
            return head + "every row is bit-identical to the device's\n"
        lines = [head + f"{self.differing_rows} rows differ ({count})", ""]
        lines.append(f"{'row':>8}  {'label':<11}  {'slot':>4}  {'source':>8}  {'profile':<16}  evidence")
        for explained in self.rows[:20]:
            slot = "-" if explained.slot is None else str(explained.slot)
            source = "-" if explained.source_row is None else str(explained.source_row)
            lines.append(
                f"{explained.row:>8}  {explained.label:<11}  {slot:>4}  {source:>8}  "
                f"{explained.profile or '-':<16}  {explained.evidence.summary}"
            )
        if len(self.rows) > 20:
            lines.append(f"... {len(self.rows) - 20} more rows (to_dict() lists every one)")
        return "\n".join(lines) + "\n"


def labels_line(labels: Mapping[str, int] | None) -> str:
    """Label counts as one line: ``"order 12, missing 1"``; ``"no row differs"`` when every count is
    0; ``""`` for None (not explained)."""
    if labels is None:
        return ""
    return ", ".join(f"{label} {count}" for label, count in labels.items() if count) or "no row differs"
