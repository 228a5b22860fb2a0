"""A sweep's summary, for a team to triage: one row per case, real failures first (docs/accuracy.md, "The summary").

Each row says what the case is (its dtype, grad_x's shape [N, H], K, the mode, active_num and the
device profile that judged it, from its report's :class:`~moegrad.accuracy.ReportContext`), the
candidate's status beside the device's own under the same standards, the criterion that decided
it, a message per criterion that did not pass, naming its unit, and (a sweep with ``--explain``)
its explanation's label counts (``explained``: :func:`~moegrad.accuracy.labels_line`).

**A finding the device shares.** A criterion that the device's own result misses too (``device_value``
past the same line; every bfloat16 case's ``dual_thousandth`` warning, say) is the data's, not the
candidate's: a case is *shared* when every criterion that gives it its status does so for the
device too. Exactness (``require_exact``) is never shared: the device is exact to itself.

**The order** (:func:`worst_first`): by status (missing, error, invalid, fail, warning, pass); then
the candidate's own findings before shared ones; then by the deciding criterion, the one that puts
the case furthest past the device, in three tiers:

1. a defect, a line of 0 (NaN/Inf mismatches, rows that must be +0.0, bitwise mismatches) or
   exactness required: by the elements past the device's count;
2. a tolerance with a finite figure: by ``(value - device_value) / limit`` (for a share that must
   exceed its line, ``(device_value - value) / (1 - limit)``): how far past the device, in lines;
3. a ratio whose device figure is 0 (``inf``: the device is exact there, which says nothing of how
   far the candidate is off): after every finite one, by the share of elements that differ from
   the device. An ``inf`` never ranks a case.

Cases that tie keep their order (a sweep's is its files' names). The summary also states the policy
(the standards judged, ``require_exact``), and above the rows what the sweep is missing (a merge's
shards or cases with no line: :class:`SummaryNotes`) and the replicas that failed it.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from moegrad.accuracy._cases import CaseResult
from moegrad.accuracy._escape import csv_row, markdown_text
from moegrad.accuracy._explanation import labels_line
from moegrad.accuracy._export import MSPROBE_STATUS, number_cell
from moegrad.accuracy._factors import analyse_factors
from moegrad.accuracy._results import ComparisonReport, CriterionResult
from moegrad.accuracy._standards import DEFAULT_STANDARDS, SEVERITY

__all__ = ["SUMMARY_COLUMNS", "Finding", "SummaryNotes", "triage", "worst_first", "write_summary"]

_CASE_SEVERITY = {**SEVERITY, "invalid": 3, "error": 4}
#: How many missing cases the markdown names before it counts the rest (the CSV lists every one).
_NAMED_MISSING = 20

#: What each measure counts, said after its value in a message.
_UNITS = {
    "bitwise_mismatches": "elements differ from the device",
    "hundredth_share": "of the elements within 1e-2",
    "thousandth_share": "of the elements within 1e-3",
    "ten_thousandth_share": "of the elements within 1e-4",
    "mean_relative_error": "relative to the summands' magnitude",
    "max_relative_error": "relative to the summands' magnitude",
    "rmse_ratio": "x the device's RMSE",
    "mean_relative_error_ratio": "x the device's mean relative error",
    "max_relative_error_ratio": "x the device's max relative error",
    "small_value_error_ratio": "x the device's small-value error rate",
    "error_imbalance_excess": "above the device's error imbalance (0 to 1)",
    "max_accumulative_error": "relative to max(magnitude, 1)",
    "special_value_mismatches": "elements NaN/Inf unlike the golden",
    "special_value_mismatch_excess": "elements NaN/Inf unlike the golden, beyond the device's",
    "zero_row_mismatches": "elements not +0.0 in rows that must be +0.0",
}
_OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One case as the summary triages it (:func:`triage`).

    Attributes:
        status: the case's status.
        device_status: the worst status the device's own result gets under the case's standards;
            None without a report (an invalid case, one not judged).
        shared: the device misses the line of every criterion that gives the case its status.
        deciding: the measure that ranks the case (``"exactness"`` when only require_exact failed
            it); empty when it passed or has no report.
        tier: 1 a defect (a line of 0, exactness), 2 a finite tolerance, 3 a ratio over a device
            figure of 0 (module docstring); 0 without a deciding criterion.
        excess: how far past the device on the deciding criterion, in its tier's unit; finite.
        messages: one per criterion that did not pass (or exactness), naming its unit and the
            standards that judged it.
    """

    status: str
    device_status: str | None
    shared: bool
    deciding: str
    tier: int
    excess: float
    messages: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SummaryNotes:
    """What a summary states above its rows.

    Attributes:
        standards: the standards the sweep judged (its policy).
        require_exact: whether exactness decided the verdicts.
        missing: what the sweep has not judged, one line each, shards without a file first (a
            merge's :attr:`~moegrad.accuracy.MergedSweep.missing`); said first.
        missing_cases: each case known to be missing -> why (a row each, before every other).
        missing_count: how many cases are missing, when known (None: a shard with no file and
            no case files to count its cases by).
        replicas: a line per replica that failed the sweep (set aside, lost), said once.
    """

    standards: tuple[str, ...] = DEFAULT_STANDARDS
    require_exact: bool = False
    missing: tuple[str, ...] = ()
    missing_cases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    missing_count: int | None = None
    replicas: tuple[str, ...] = ()


def _number(value: float) -> str:
    return f"{value:.6g}"


def _misses(criterion: CriterionResult, value: float) -> bool:
    """Whether ``value`` misses the criterion's line (NaN: undefined, it does not)."""
    return not math.isnan(value) and not _OPS[criterion.op](value, criterion.limit)


def _excess(criterion: CriterionResult, report: ComparisonReport) -> tuple[int, float]:
    """(tier, excess) of a criterion that did not pass (the module docstring)."""
    value, device = criterion.value, criterion.device_value
    device = 0.0 if math.isnan(device) else device
    if criterion.limit == 0:
        tier, excess = 1, value - device
    elif math.isinf(value):
        tier, excess = 3, 0.0 if report.exact is None else report.exact.share
    elif criterion.op in (">", ">="):
        tier, excess = 2, (device - value) / (1.0 - criterion.limit) if criterion.limit < 1 else device - value
    else:
        tier, excess = 2, (value - device) / abs(criterion.limit)
    return tier, excess if math.isfinite(excess) else 0.0  # a device figure past float's range: no rank


def _message(criterion: CriterionResult, standards: Sequence[str]) -> str:
    """One criterion that did not pass, e.g. ``rmse_ratio = 2.31 x the device's RMSE (needs <= 2;
    device 1): fail [benchmark]``."""
    value = " ".join(filter(None, (_number(criterion.value), _UNITS.get(criterion.measure))))
    device = "" if math.isnan(criterion.device_value) else f"; device {_number(criterion.device_value)}"
    needs = f"needs {criterion.op} {_number(criterion.limit)}{device}"
    return f"{criterion.measure} = {value} ({needs}): {criterion.status} [{', '.join(standards)}]"


def triage(result: CaseResult) -> Finding:
    """The summary's reading of one case: its deciding criterion, its messages, whether the device shares it."""
    report = result.report
    if report is None:
        return Finding(result.status, None, False, "", 0, 0.0, ())
    device_status = max((v.device_status for v in report.verdicts), key=SEVERITY.__getitem__, default="pass")
    judged: dict[str, tuple[CriterionResult, list[str]]] = {}  # a criterion several standards share, once
    for verdict in report.verdicts:
        for criterion in verdict.criteria:
            if criterion.status != "pass":
                judged.setdefault(criterion.measure, (criterion, []))[1].append(verdict.standard)
    messages = [_message(criterion, standards) for criterion, standards in judged.values()]
    exact = report.exact
    inexact = exact is not None and exact.required and not exact.bit_exact
    if inexact:
        assert exact is not None
        messages.append(
            f"not bit-exact: {exact.mismatched} of {exact.count} elements differ from the device "
            f"(share {_number(exact.share)}; require_exact): fail"
        )
    deciding = [c for c, _ in judged.values() if c.status == report.verdict]
    ranked = [(*_excess(c, report), c.measure) for c in deciding]
    if inexact and report.verdict == "fail":
        assert exact is not None
        ranked.append((1, float(exact.mismatched), "exactness"))
    shared = bool(deciding) and not (inexact and report.verdict == "fail")
    shared = shared and all(_misses(c, c.device_value) for c in deciding)
    if not ranked:
        return Finding(result.status, device_status, False, "", 0, 0.0, tuple(messages))
    tier, excess, measure = min(ranked, key=lambda item: (item[0], -item[1]))
    return Finding(result.status, device_status, shared, measure, tier, excess, tuple(messages))


def _key(item: tuple[CaseResult, Finding]) -> tuple[int, bool, int, float]:
    result, finding = item
    return (-_CASE_SEVERITY[result.status], finding.shared, finding.tier or 4, -finding.excess)


def _ordered(results: Iterable[CaseResult]) -> list[tuple[CaseResult, Finding]]:
    return sorted(((result, triage(result)) for result in results), key=_key)


def worst_first(results: Iterable[CaseResult]) -> list[CaseResult]:
    """The results in the summary's order (the module docstring): by status, the candidate's own
    findings before those the device shares, then the furthest past the device on its deciding
    criterion; cases that tie keep their order."""
    return [result for result, _ in _ordered(results)]


#: Columns of the summary CSV: msprobe's result-comparison names first, then moegrad's own.
SUMMARY_COLUMNS: tuple[str, ...] = (
    "API Name",
    "DEVICE Dtype",
    "Shape",
    "比对结果",
    "比对算法",
    "均方根误差比值",
    "相对误差最大值比值",
    "相对误差平均值比值",
    "小值域错误比值",
    "二进制一致错误率",
    "Message",
    "moegrad_status",
    "device_status",
    "shared_with_device",
    "deciding",
    "excess",
    "bit_exact",
    "bitwise_mismatches",
    "worst_row",
    "explained",
    "top_k",
    "mode",
    "active_num",
    "order",
    "require_exact",
    "file",
)


def _ratio(report: ComparisonReport, measure: str) -> float:
    for verdict in report.verdicts:
        for criterion in verdict.criteria:
            if criterion.measure == measure:
                return criterion.value
    return math.nan


def _mode(drop_pad_mode: int, active_num: int) -> str:
    """The operator's mode: ``drop_pad`` (drop_pad_mode 1), ``active`` (active_num > 0) or ``dropless``."""
    return "drop_pad" if drop_pad_mode == 1 else "active" if active_num > 0 else "dropless"


def _row(result: CaseResult, finding: Finding, notes: SummaryNotes) -> dict[str, str]:
    r = result.report
    row = dict.fromkeys(SUMMARY_COLUMNS, "")
    row.update(
        {
            "API Name": result.name,
            "比对结果": MSPROBE_STATUS[result.status],
            "moegrad_status": result.status,
            "require_exact": str(notes.require_exact).lower(),
            "file": result.path or "",
        }
    )
    if r is None:
        row["Message"] = result.error or ""
        return row
    exact, context, worst = r.exact, r.context, r.candidate_vs_golden.worst
    row.update(
        {
            "DEVICE Dtype": r.candidate_dtype,
            "Shape": str(tuple(r.shape)),
            "比对算法": "+".join(v.standard for v in r.verdicts),
            "均方根误差比值": number_cell(_ratio(r, "rmse_ratio")),
            "相对误差最大值比值": number_cell(_ratio(r, "max_relative_error_ratio")),
            "相对误差平均值比值": number_cell(_ratio(r, "mean_relative_error_ratio")),
            "小值域错误比值": number_cell(_ratio(r, "small_value_error_ratio")),
            "二进制一致错误率": "" if exact is None else number_cell(exact.share),
            "Message": "; ".join(finding.messages),
            "device_status": finding.device_status or "",
            "shared_with_device": str(finding.shared).lower() if finding.deciding else "",
            "deciding": finding.deciding,
            "excess": number_cell(finding.excess) if finding.deciding else "",
            "bit_exact": "" if exact is None else str(exact.bit_exact).lower(),
            "bitwise_mismatches": "" if exact is None else str(exact.mismatched),
            "worst_row": "" if worst is None else str(worst.row),
            "explained": labels_line(r.explained),
        }
    )
    if context is not None:
        row.update(
            {
                "top_k": str(context.top_k),
                "mode": _mode(context.drop_pad_mode, context.active_num),
                "active_num": str(context.active_num),
                "order": context.order,
            }
        )
    return row


def _missing_row(name: str, why: str, notes: SummaryNotes) -> dict[str, str]:
    row = dict.fromkeys(SUMMARY_COLUMNS, "")
    row.update(
        {
            "API Name": name,
            "比对结果": MSPROBE_STATUS["error"],
            "Message": why,
            "moegrad_status": "missing",
            "require_exact": str(notes.require_exact).lower(),
        }
    )
    return row


def _counts(ordered: Sequence[tuple[CaseResult, Finding]], notes: SummaryNotes) -> str:
    parts = []
    for status in ("pass", "warning", "fail", "invalid", "error"):
        of = [finding for result, finding in ordered if result.status == status]
        if of:
            shared = sum(finding.shared for finding in of)
            too = {"warning": "gets", "fail": "fails"}.get(status)
            parts.append(f"{len(of)} {status}" + (f" ({shared} the device {too} too)" if too and shared else ""))
    missing = notes.missing_count if notes.missing_count is not None else len(notes.missing_cases)
    if missing or notes.missing:
        parts.append(f"{missing} missing" if missing else "some missing")
    total = len(ordered) + missing
    return f"{total} {'case' if total == 1 else 'cases'}: " + ", ".join(parts)


def _missing_lines(notes: SummaryNotes) -> list[str]:
    """The markdown's first section: what the sweep is missing (how many, which shards, which cases)."""
    if not notes.missing and not notes.missing_cases:
        return []
    count = notes.missing_count if notes.missing_count is not None else len(notes.missing_cases)
    how_many = f"{count} {'case was' if count == 1 else 'cases were'}" if count else "some cases were"
    lines = [f"**Not complete: {how_many} not judged** (the exit status is 4).", ""]
    lines += [f"- {markdown_text(line)}" for line in notes.missing]
    names = list(notes.missing_cases)
    if names:
        shown = ", ".join(markdown_text(name) for name in names[:_NAMED_MISSING])
        hidden = len(names) - _NAMED_MISSING
        more = f", and {hidden} more (the CSV lists every one)" if hidden > 0 else ""
        lines.append(f"- the cases not judged: {shown}{more}")
    return [*lines, ""]


_TABLE = ("case", "status", "device", "dtype", "shape", "K", "mode", "active_num", "profile", "deciding")
_TABLE_END = ("bit-exact", "worst row", "explained", "message")


def _markdown(
    rows: Sequence[dict[str, str]], ordered: Sequence[tuple[CaseResult, Finding]], notes: SummaryNotes
) -> str:
    exact = "required: a candidate that is not bit-exact fails" if notes.require_exact else "reported, not required"
    lines = ["# moegrad accuracy summary", "", *_missing_lines(notes), _counts(ordered, notes), ""]
    lines += [f"Policy: standards {', '.join(notes.standards)}; exactness {exact} (require_exact).", ""]
    if notes.replicas:
        lines += ["Replicas:", "", *(f"- {markdown_text(line)}" for line in notes.replicas), ""]
    columns = (*_TABLE, *_TABLE_END)
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        shape = row["Shape"].strip("()").replace(", ", "x")
        status = row["moegrad_status"] + (" (device too)" if row["shared_with_device"] == "true" else "")
        cells = (
            row["API Name"],
            status,
            row["device_status"],
            row["DEVICE Dtype"],
            shape,
            row["top_k"],
            row["mode"],
            row["active_num"],
            row["order"],
            row["deciding"],
            row["bit_exact"],
            row["worst_row"],
            row["explained"],
        )
        shown = [markdown_text(cell) or "-" for cell in cells] + [markdown_text(row["Message"])]
        lines.append("| " + " | ".join(shown) + " |")
    lines += ["", *analyse_factors([result for result, _ in ordered]).markdown()]  # which factor makes cases fail
    return "\n".join(lines) + "\n"


def write_summary(
    results: Iterable[CaseResult],
    csv_path: str | os.PathLike[str],
    markdown_path: str | os.PathLike[str] | None = None,
    notes: SummaryNotes | None = None,
) -> list[CaseResult]:
    """Write one row per case, in the order of :func:`worst_first`, the cases ``notes`` names missing first.

    Args:
        results: :func:`compare_cases`'s (or a merge's).
        csv_path: the summary CSV (:data:`SUMMARY_COLUMNS`; UTF-8 with a byte-order mark), a
            text cell that a spreadsheet would read as a formula written with a leading ``'``
            (:func:`~moegrad.accuracy._escape.csv_cell`).
        markdown_path: the same rows as markdown, after what is missing, the counts per status,
            the policy and the replicas' notes, then which conditions separate the failing cases
            from the passing ones (:func:`~moegrad.accuracy.analyse_factors`); None: not written. Every cell is escaped
            (:func:`~moegrad.accuracy._escape.markdown_text`): a case's name or message never
            ends its cell or row.
        notes: the policy and what the sweep is missing (default: the default standards, exactness
            not required, nothing missing).

    Returns:
        The results in the order written.

    Raises:
        OSError: a file cannot be written.
    """
    notes = notes or SummaryNotes()
    ordered = _ordered(results)
    rows = [_missing_row(name, why, notes) for name, why in notes.missing_cases.items()]
    rows += [_row(result, finding, notes) for result, finding in ordered]
    with open(os.fspath(csv_path), "w", encoding="utf-8-sig", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(SUMMARY_COLUMNS))
        writer.writeheader()
        writer.writerows(map(csv_row, rows))
    if markdown_path is not None:
        Path(markdown_path).write_text(_markdown(rows, ordered, notes), encoding="utf-8")
    return [result for result, _ in ordered]
