"""A :class:`~moegrad.accuracy.ComparisonReport` for people: a terminal table, a markdown report, a histogram.

The one place a report is rendered; ``moegrad compare`` uses it for a service's report and for an
in-process one alike. Both renderings are built from the same sections (:func:`_sections`):

- the standards: each one's status and the numbers that decided it (for a standard that passed,
  its assessed criteria; for one that did not, the criteria that failed or warned);
- the key metrics of the three comparisons side by side (docs/accuracy.md, "Metrics");
- the worst element of each comparison, and the rows that must be +0.0.

The histogram of the candidate's relative errors needs matplotlib (the optional extra ``plot``);
without it :func:`write_markdown_report` writes the report and says the histogram was skipped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moegrad.accuracy._compare import summand_magnitude
from moegrad.accuracy._results import ComparisonReport, CriterionResult, Metrics
from moegrad.accuracy._standards import DTYPE_LIMITS, THRESHOLDS
from moegrad._reference import moe_init_routing_v2_grad_golden
from moegrad._spec import MoeInitRoutingV2GradCall

__all__ = ["format_report", "markdown_report", "relative_errors", "write_histogram", "write_markdown_report"]

_COMPARISONS = ("candidate_vs_golden", "device_vs_golden", "candidate_vs_device")
# Criteria every tolerance standard repeats; shown for a standard only when they did not pass (the
# special values and the zero rows have their own lines below the tables).
_SHARED = frozenset({"special_value_mismatches", "special_value_mismatch_excess", "zero_row_mismatches"})
_KEY_METRICS = (
    "max_abs_error", "mean_abs_error", "rmse", "max_relative_error", "mean_relative_error", "max_ulp_error",
    "bitwise_equal_share", "thousandth_share", "cosine_similarity", "error_imbalance",
)
_VERDICT_MEANS = {"pass": "every standard passed", "warning": "passed; a standard warned",
                  "fail": "a standard failed"}
_Table = tuple[str, Sequence[str], Sequence[Sequence[str]]]  # title, headers, rows (a cell may hold lines)


def _number(value: float | int, digits: int = 4) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def _value(value: float) -> str:
    """An element's value: 9 significant digits tell any two float32 values apart."""
    return "nan" if math.isnan(value) else _number(value, 9)


def _deciding(criteria: Sequence[CriterionResult], status: str) -> list[str]:
    if status != "pass":
        return [c.describe() for c in criteria if c.status != "pass"]
    shown = [c.describe() for c in criteria if c.assessed and c.measure not in _SHARED]
    return shown or [c.describe() for c in criteria]


def _metric_row(name: str, comparisons: Sequence[Metrics]) -> list[str]:
    return [name, *(_number(getattr(m, name)) for m in comparisons)]


def _sections(report: ComparisonReport) -> list[_Table]:
    comparisons = [getattr(report, name) for name in _COMPARISONS]
    standards = [(v.standard, v.status.upper() if v.status != "pass" else v.status, "\n".join(_deciding(v.criteria, v.status)))
                 for v in report.verdicts]
    metrics = [_metric_row(name, comparisons) for name in _KEY_METRICS]
    metrics.append(["nan / inf mismatches", *(f"{m.nan_mismatch_count} / {m.inf_mismatch_count}" for m in comparisons)])
    worst = []
    for name, m in zip(_COMPARISONS, comparisons):
        w = m.worst
        if w is None:
            worst.append([name, "-", "-", "-", "-", "-", "none: every element equal"])
        else:
            worst.append([name, str(w.row), str(w.column), _value(w.actual), _value(w.expected), _value(w.golden),
                          _number(w.abs_error)])
    return [
        ("standards", ("standard", "status", "deciding numbers"), standards),
        ("metrics", ("metric", *_COMPARISONS), metrics),
        ("worst elements", ("comparison", "row", "column", "actual", "expected", "golden", "abs error"), worst),
    ]


def _summary(report: ComparisonReport, source: str | None) -> list[str]:
    n, h = report.shape
    lines = [f"verdict: {report.verdict.upper()} ({_VERDICT_MEANS[report.verdict]})",
             f"grad_x [{n}, {h}] {report.dtype}; candidate {report.candidate_dtype}"]
    if source:
        lines.append(f"device result: {source}")
    return lines


def _zero_rows_line(report: ComparisonReport) -> str:
    z = report.zero_rows
    if z.rows == 0:
        return "zero rows: none (no row has every slot skipped)"
    first = "" if z.first_mismatched_row is None else f", first row {z.first_mismatched_row}"
    return (f"zero rows: {z.rows} must be +0.0 (every slot skipped); {z.mismatched_rows} mismatched rows, "
            f"{z.mismatched_elements} mismatched elements{first}")


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    split = [[cell.split("\n") for cell in row] for row in rows]
    widths = [max([len(headers[i])] + [len(line) for row in split for line in row[i]]) for i in range(len(headers))]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for row in split:
        for k in range(max(len(cell) for cell in row)):
            out.append("  ".join((cell[k] if k < len(cell) else "").ljust(w) for cell, w in zip(row, widths)).rstrip())
    return out


def format_report(report: ComparisonReport, *, source: str | None = None) -> str:
    """The report as plain-text tables for a terminal (standards, metrics, worst elements, zero rows).

    Args:
        report: the comparison.
        source: where the device result came from, e.g. ``"backend reference, order ascend910b"``.
    """
    lines = _summary(report, source)
    for title, headers, rows in _sections(report):
        lines += ["", f"{title}:", *_text_table(headers, rows)]
    lines += ["", _zero_rows_line(report)]
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown_report(report: ComparisonReport, *, source: str | None = None, histogram: str | None = None,
                    histogram_note: str | None = None) -> str:
    """The report as a markdown document: the tables of :func:`format_report` and the histogram.

    Args:
        report: the comparison.
        source: where the device result came from.
        histogram: the PNG's path relative to the markdown file, linked as an image; or None.
        histogram_note: said instead of the image when there is none (why it was skipped).
    """
    lines = [f"# moegrad accuracy report: {report.verdict}", ""]
    lines += [f"- {line}" for line in _summary(report, source)]
    lines.append("- definitions and thresholds: docs/accuracy.md of moegrad")
    for title, headers, rows in _sections(report):
        lines += ["", f"## {title.capitalize()}", "",
                  "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(_md_cell(cell) for cell in row) + " |" for row in rows]
    lines += ["", "## Zero rows", "", _zero_rows_line(report), "", "## Relative errors of the candidate", ""]
    if histogram is not None:
        lines.append(f"![relative errors of the candidate against the float64 golden]({histogram})")
    else:
        lines.append(f"Histogram skipped: {histogram_note or 'not drawn'}.")
    return "\n".join(lines) + "\n"


def relative_errors(call: MoeInitRoutingV2GradCall, candidate: np.ndarray) -> np.ndarray:
    """The candidate's relative errors against the float64 golden, as ``compare`` defines them.

    ``|candidate - golden| / scale`` with scale the summands' magnitude (:func:`moegrad.summand_magnitude`),
    over the finite elements whose scale is at least the dtype's ``small_value`` (docs/accuracy.md,
    "Relative to what" and "Small values").

    Returns:
        1-D float64, one value per such element (0 where the candidate is exact).
    """
    golden = moe_init_routing_v2_grad_golden(call)
    scale = summand_magnitude(call)
    values = np.asarray(candidate).astype(np.float64)
    keep = np.isfinite(values) & np.isfinite(golden) & np.isfinite(scale) & (scale >= DTYPE_LIMITS[call.dtype_name].small_value)
    return np.abs(values[keep] - golden[keep]) / scale[keep]


def write_histogram(path: str | os.PathLike[str], errors: np.ndarray, *, dtype: str) -> None:
    """Draw a log-scale histogram of relative errors to a PNG, with the ``threshold`` standard's limits.

    Args:
        path: the PNG to write.
        errors: 1-D relative errors (:func:`relative_errors`).
        dtype: the operator's dtype, whose ``threshold`` limits are drawn.

    Raises:
        ImportError: matplotlib is not installed (``pip install "moegrad[plot]"``).
    """
    from matplotlib.figure import Figure  # optional: the ``plot`` extra; no pyplot, no global backend

    errors = np.asarray(errors, dtype=np.float64)
    positive = errors[errors > 0]
    exact = errors.size - positive.size
    figure = Figure(figsize=(7.5, 4.0), dpi=100, layout="constrained")
    axes = figure.subplots()
    if positive.size:
        low, high = math.floor(math.log10(positive.min())), math.ceil(math.log10(positive.max()))
        bins = np.logspace(low, max(high, low + 1), 10 * max(high - low, 1) + 1)
        axes.hist(positive, bins=bins, color="tab:blue")
        axes.set_xscale("log")
        for criterion, style in zip(THRESHOLDS[("threshold", dtype)][:2], ("--", ":")):
            axes.axvline(criterion.limit, color="tab:red", linestyle=style,
                         label=f"threshold: {criterion.measure} {criterion.op} {criterion.limit:.3g}")
        axes.legend(loc="upper left", fontsize="small")
    else:
        axes.text(0.5, 0.5, "no element differs from the golden" if errors.size else "no element judged relatively",
                  ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("relative error |candidate - golden| / sum |summands|")
    axes.set_ylabel("elements")
    axes.set_title(f"{dtype}: {errors.size} elements judged relatively, {exact} exact")
    figure.savefig(os.fspath(path), format="png")


def write_markdown_report(path: str | os.PathLike[str], report: ComparisonReport, call: MoeInitRoutingV2GradCall,
                          candidate: np.ndarray, *, source: str | None = None) -> Path | None:
    """Write :func:`markdown_report` to ``path`` and the histogram beside it (``out.md`` -> ``out.png``).

    Args:
        path: the markdown file to write.
        report: the comparison of ``candidate`` for ``call``.
        call: the validated call (the golden and the scale of the histogram are computed from it).
        candidate: [N, H], the candidate the report judged.
        source: where the device result came from.

    Returns:
        The PNG written, or None when matplotlib is not installed (the report says so).

    Raises:
        OSError: a file cannot be written.
    """
    markdown = Path(path)
    png = markdown.with_suffix(".png")
    if png == markdown:
        png = markdown.with_name(markdown.name + ".png")
    try:
        write_histogram(png, relative_errors(call, candidate), dtype=call.dtype_name)
    except ImportError:
        written, note = None, 'matplotlib is not installed (pip install "moegrad[plot]")'
    else:
        written, note = png, None
    markdown.write_text(markdown_report(report, source=source, histogram=None if written is None else png.name,
                                        histogram_note=note), encoding="utf-8")
    return written
