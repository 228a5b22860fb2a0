"""Rendering a :class:`~moegrad.accuracy.ComparisonReport`: terminal tables, markdown, JSON, CSV, a plot.

The one place a report is rendered; ``moegrad compare`` uses it for a service's report and for an
in-process one alike. The terminal and markdown renderings share their sections (:func:`_sections`):

- the call and its provenance (:class:`~moegrad.accuracy.ReportContext`), when recorded;
- bit-exactness to the device, stated apart from the verdict (count and share of differing elements);
- the standards: each one's status, the device's own status under it, and the numbers that decided
  it, each beside the device's own figure;
- the key metrics of the three comparisons side by side (docs/accuracy.md, "Metrics");
- the worst element of each comparison, and the rows that must be +0.0.

JSON and CSV files are :mod:`moegrad.accuracy._export`'s. The plot (the
candidate's and the device's error distributions on the same axes, and the error balance) needs
matplotlib (the optional extra ``plot``); without it :func:`write_markdown_report` writes the report
and says the histogram was skipped.
"""

from __future__ import annotations

import functools
import math
import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moegrad.accuracy._compare import summand_magnitude
from moegrad.accuracy._escape import console_text, markdown_text
from moegrad.accuracy._results import ComparisonReport, CriterionResult, Metrics, ReportContext
from moegrad.accuracy._standards import DTYPE_LIMITS, THRESHOLDS
from moegrad.accuracy._where import row_error_lines, row_error_table
from moegrad.numerics._reference import moe_init_routing_v2_grad_golden
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = [
    "PLOT_MISSING",
    "exactness_line",
    "format_report",
    "markdown_report",
    "relative_errors",
    "write_histogram",
    "write_markdown_report",
]

_COMPARISONS = ("candidate_vs_golden", "device_vs_golden", "candidate_vs_device")
#: Why a report has no plot, and what to install (the optional extra ``plot`` of pyproject.toml).
PLOT_MISSING = "matplotlib is not installed: pip install 'moegrad[plot]'"
# Criteria every tolerance standard repeats; shown for a standard only when they did not pass (the
# special values and the zero rows have their own lines below the tables).
_SHARED = frozenset({"special_value_mismatches", "special_value_mismatch_excess", "zero_row_mismatches"})
_KEY_METRICS = (
    "max_abs_error",
    "mean_abs_error",
    "rmse",
    "max_relative_error",
    "mean_relative_error",
    "max_ulp_error",
    "bitwise_equal_share",
    "thousandth_share",
    "cosine_similarity",
    "error_imbalance",
)
_VERDICT_MEANS = {"pass": "every standard passed", "warning": "passed; a standard warned", "fail": "a standard failed"}
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


def _shown(status: str) -> str:
    return status if status == "pass" else status.upper()


def _metric_row(name: str, comparisons: Sequence[Metrics]) -> list[str]:
    return [name, *(_number(getattr(m, name)) for m in comparisons)]


def _sections(report: ComparisonReport) -> list[_Table]:
    comparisons = [getattr(report, name) for name in _COMPARISONS]
    standards = [
        (v.standard, _shown(v.status), _shown(v.device_status), "\n".join(_deciding(v.criteria, v.status)))
        for v in report.verdicts
    ]
    metrics = [_metric_row(name, comparisons) for name in _KEY_METRICS]
    metrics.append(["nan / inf mismatches", *(f"{m.nan_mismatch_count} / {m.inf_mismatch_count}" for m in comparisons)])
    worst = []
    for name, m in zip(_COMPARISONS, comparisons, strict=True):
        w = m.worst
        if w is None:
            worst.append([name, "-", "-", "-", "-", "-", "none: every element equal"])
        else:
            worst.append(
                [
                    name,
                    str(w.row),
                    str(w.column),
                    _value(w.actual),
                    _value(w.expected),
                    _value(w.golden),
                    _number(w.abs_error),
                ]
            )
    tables: list[_Table] = []
    if report.context is not None:
        tables.append(("call", ("field", "value"), _context_rows(report.context)))
    spread = row_error_table(report)
    return [
        *tables,
        ("standards", ("standard", "status", "device", "deciding numbers (device's own figure beside)"), standards),
        ("metrics", ("metric", *_COMPARISONS), metrics),
        ("worst elements", ("comparison", "row", "column", "actual", "expected", "golden", "abs error"), worst),
        *([] if spread is None else [spread]),
    ]


def exactness_line(report: ComparisonReport) -> str:
    """One line on bit-exactness to the device, e.g. ``"bit-exact: no, 12 of 4096 elements differ (0.29%)"``."""
    e = report.exact
    if e is None:
        return "bit-exact: not reported"
    required = " (required: the verdict fails unless bit-exact)" if e.required else " (not required)"
    if e.bit_exact:
        return f"bit-exact: yes, all {e.count} elements equal the device's{required}"
    return f"bit-exact: no, {e.mismatched} of {e.count} elements differ ({100 * e.share:.4g}%){required}"


def _summary(report: ComparisonReport, source: str | None) -> list[str]:
    n, h = report.shape
    means = _VERDICT_MEANS[report.verdict]
    if report.exact is not None and report.exact.required and not report.exact.bit_exact:
        means = "exactness was required and the candidate is not bit-exact"
    lines = [
        f"verdict: {report.verdict.upper()} ({means})",
        f"grad_x [{n}, {h}] {report.dtype}; candidate {report.candidate_dtype}",
        exactness_line(report),
    ]
    if report.profiles_matching is not None:
        lines.append(f"profiles bit-identical to the candidate: {', '.join(report.profiles_matching) or 'none'}")
    if source:
        lines.append(f"device result: {source}")
    return lines


def _context_rows(context: ReportContext) -> list[list[str]]:
    """The call's provenance, each value's control characters made visible (a case's name is its
    file's, a server's strings its own): one line each, in either rendering."""
    rows = _context_values(context)
    return [[field, console_text(value)] for field, value in rows]


def _context_values(context: ReportContext) -> list[list[str]]:
    rows = [["operator", context.operator]]
    for name in context.shapes:
        rows.append([name, f"{context.dtypes[name]} {list(context.shapes[name])}, sha256 {context.sha256[name]}"])
    rows += [
        ["top_k, drop_pad_mode, active_num", f"{context.top_k}, {context.drop_pad_mode}, {context.active_num}"],
        ["order (product line)", f"{context.order} ({context.product_line})"],
        ["backend, device", f"{context.backend}, {context.device or '-'}"],
        ["server", context.server_url or "in-process"],
        ["moegrad", context.moegrad_version],
        ["created", context.created],
    ]
    if context.case:
        rows.insert(0, ["case", context.case])
    return rows


def _zero_rows_line(report: ComparisonReport) -> str:
    z = report.zero_rows
    if z.rows == 0:
        return "zero rows: none (no row has every slot skipped)"
    first = "" if z.first_mismatched_row is None else f", first row {z.first_mismatched_row}"
    return (
        f"zero rows: {z.rows} must be +0.0 (every slot skipped); {z.mismatched_rows} mismatched rows, "
        f"{z.mismatched_elements} mismatched elements{first}"
    )


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    split = [[[console_text(line) for line in cell.split("\n")] for cell in row] for row in rows]
    widths = [max([len(headers[i])] + [len(line) for row in split for line in row[i]]) for i in range(len(headers))]
    out = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    for row in split:
        for k in range(max(len(cell) for cell in row)):
            cells = ((cell[k] if k < len(cell) else "").ljust(w) for cell, w in zip(row, widths, strict=False))
            out.append("  ".join(cells).rstrip())
    return out


def format_report(report: ComparisonReport, *, source: str | None = None) -> str:
    """The report as plain-text tables for a terminal (standards, metrics, worst elements, zero rows).

    Args:
        report: the comparison.
        source: where the device result came from, e.g. ``"backend reference, order ascend910b@9.1"``.
    """
    lines = [console_text(line) for line in _summary(report, source)]
    for title, headers, rows in _sections(report):
        lines += ["", f"{title}:", *_text_table(headers, rows)]
    lines += ["", *(console_text(line) for line in row_error_lines(report)), _zero_rows_line(report)]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=4096)  # most cells recur from case to case (names, statuses, limits)
def _md_cell(text: str) -> str:
    """A table cell: each of its lines as markdown shows it literally, joined by ``<br>``."""
    if "\n" not in text:  # most cells: one line
        return markdown_text(text)
    return "<br>".join(markdown_text(line) for line in text.split("\n"))


def markdown_report(
    report: ComparisonReport,
    *,
    source: str | None = None,
    histogram: str | None = None,
    histogram_note: str | None = None,
) -> str:
    """The report as a markdown document: the tables of :func:`format_report` and the histogram.

    Args:
        report: the comparison.
        source: where the device result came from.
        histogram: the PNG's path relative to the markdown file, linked as an image; or None.
        histogram_note: said instead of the image when there is none (why it was skipped).
    """
    lines = [f"# moegrad accuracy report: {report.verdict}", ""]
    lines += [f"- {markdown_text(line)}" for line in _summary(report, source)]
    lines.append("- definitions and thresholds: docs/accuracy.md of moegrad")
    for title, headers, rows in _sections(report):
        lines += ["", f"## {title.capitalize()}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(_md_cell(cell) for cell in row) + " |" for row in rows]
    lines += ["", *(f"- {markdown_text(line)}" for line in row_error_lines(report))]
    lines += ["", "## Zero rows", "", _zero_rows_line(report), "", "## Relative errors of the candidate", ""]
    if histogram is not None:
        lines.append(f"![relative errors of the candidate against the float64 golden]({urllib.parse.quote(histogram)})")
    else:
        lines.append(f"Histogram skipped: {histogram_note or 'not drawn'}.")
    return "\n".join(lines) + "\n"


def relative_errors(call: MoeInitRoutingV2GradCall, values: np.ndarray, *, signed: bool = False) -> np.ndarray:
    """Relative errors of ``values`` (a candidate or the device's result) against the float64 golden.

    ``(values - golden) / scale`` with scale the summands' magnitude (:func:`moegrad.summand_magnitude`),
    over the finite elements whose scale is at least the dtype's ``small_value`` (docs/accuracy.md,
    "Relative to what" and "Small values").

    Args:
        call: the validated call.
        values: [N, H] in the call's dtype or float32.
        signed: keep the sign of the error, oriented so that a negative value shrinks the magnitude
            (``(|values| - |golden|) / scale``, where truncation shows as a one-sided distribution);
            default the absolute error.

    Returns:
        1-D float64, one value per such element (0 where ``values`` is exact).
    """
    golden = moe_init_routing_v2_grad_golden(call)
    scale = summand_magnitude(call)
    return _relative(
        np.asarray(values).astype(np.float64), golden, scale, DTYPE_LIMITS[call.dtype_name].small_value, signed
    )


def _relative(
    values: np.ndarray, golden: np.ndarray, scale: np.ndarray, small_value: float, signed: bool
) -> np.ndarray:
    keep = np.isfinite(values) & np.isfinite(golden) & np.isfinite(scale) & (scale >= small_value)
    if signed:
        return (np.abs(values[keep]) - np.abs(golden[keep])) / scale[keep]
    return np.abs(values[keep] - golden[keep]) / scale[keep]


def write_histogram(
    path: str | os.PathLike[str],
    errors: np.ndarray,
    *,
    dtype: str,
    device_errors: np.ndarray | None = None,
    report: ComparisonReport | None = None,
) -> None:
    """Draw the error distributions to a PNG: the candidate's and the device's, on the same axes, and the balance.

    Left: log-scale histograms of relative errors (:func:`relative_errors`), the candidate's filled,
    the device's outlined, with the ``threshold`` standard's limits. Right (with ``report``): the
    error balance, the shares of errors that shrink / grow the magnitude and fall below / above the
    golden, candidate beside device (docs/accuracy.md, "Metrics", its error balance).

    Args:
        path: the PNG to write.
        errors: 1-D relative errors of the candidate.
        dtype: the operator's dtype, whose ``threshold`` limits are drawn.
        device_errors: 1-D relative errors of the device's result; None: not drawn.
        report: the comparison, for the balance panel; None: no balance panel.

    Raises:
        ImportError: matplotlib is not installed (:data:`PLOT_MISSING`).
    """
    from matplotlib.figure import Figure  # optional: the ``plot`` extra; no pyplot, no global backend

    errors = np.asarray(errors, dtype=np.float64)
    series = [("candidate", errors, "tab:blue")]
    if device_errors is not None:
        series.append(("device", np.asarray(device_errors, dtype=np.float64), "tab:gray"))
    # Fixed margins, plain-text decade labels and no minor ticks: a constrained layout, mathtext
    # labels and the minor ticks of a log axis each cost more than the drawing itself.
    figure = Figure(figsize=(11.0 if report is not None else 7.5, 4.0), dpi=100)
    figure.subplots_adjust(left=0.07 if report is not None else 0.1, right=0.98, bottom=0.13, top=0.92, wspace=0.2)
    panels = figure.subplots(1, 2 if report is not None else 1, squeeze=False)[0]
    axes = panels[0]
    positive = np.concatenate([e[e > 0] for _, e, _ in series])
    if positive.size:
        _histograms(axes, series, positive, dtype)
    else:
        axes.text(
            0.5,
            0.5,
            "no element differs from the golden" if errors.size else "no element judged relatively",
            ha="center",
            va="center",
            transform=axes.transAxes,
        )
    axes.set_xlabel("relative error |x - golden| / sum |summands|")
    axes.set_ylabel("elements")
    axes.set_title(f"{dtype}: error distributions against the float64 golden", fontsize="medium")
    if report is not None:
        _balance_panel(panels[1], report)
    figure.savefig(os.fspath(path), format="png")


def _histograms(axes: Any, series: list[tuple[str, np.ndarray, str]], positive: np.ndarray, dtype: str) -> None:
    """The log-scale histograms of the nonzero errors (ten bins a decade) and the ``threshold`` limits."""
    from matplotlib.ticker import NullLocator

    limits = [criterion.limit for criterion in THRESHOLDS[("threshold", dtype)][:2]]
    low = math.floor(math.log10(min(positive.min(), *limits)))
    high = max(math.ceil(math.log10(max(positive.max(), *limits))), low + 1)
    bins = np.logspace(low, high, 10 * (high - low) + 1)
    for (label, values, color), filled in zip(series, (True, False), strict=False):  # 1 or 2 series
        nonzero = values[values > 0]
        axes.stairs(
            np.histogram(nonzero, bins=bins)[0],
            bins,
            fill=filled,
            color=color,
            alpha=0.6 if filled else 1.0,
            linewidth=1.5,
            label=f"{label}: {values.size - nonzero.size} exact of {values.size}",
        )
    axes.set_xscale("log")
    step = max(1, math.ceil((high - low) / 8))  # at most 9 decade labels
    decades = range(low, high + 1, step)
    axes.set_xticks([10.0**k for k in decades], [f"1e{k}" for k in decades])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlim(10.0**low, 10.0**high)
    for criterion, style in zip(THRESHOLDS[("threshold", dtype)][:2], ("--", ":"), strict=False):
        axes.axvline(
            criterion.limit,
            color="tab:red",
            linestyle=style,
            label=f"threshold: {criterion.measure} {criterion.op} {criterion.limit:.3g}",
        )
    axes.legend(loc="upper left", fontsize="small")


def _balance_panel(axes: Any, report: ComparisonReport) -> None:
    labels = ("shrinks |x|", "grows |x|", "below golden", "above golden")
    width = 0.38
    for offset, (name, metric, color) in enumerate(
        (("candidate", report.candidate_vs_golden, "tab:blue"), ("device", report.device_vs_golden, "tab:gray"))
    ):
        shares = [
            metric.toward_zero_share,
            metric.away_from_zero_share,
            metric.negative_error_share,
            metric.positive_error_share,
        ]
        xs = [i + (offset - 0.5) * width for i in range(len(labels))]
        axes.bar(
            xs,
            [0.0 if math.isnan(v) else v for v in shares],
            width=width,
            color=color,
            label=f"{name}: imbalance {_number(metric.error_imbalance, 3)}",
        )
    axes.set_xticks(range(len(labels)), labels)
    axes.set_ylabel("share of finite elements")
    axes.set_title("error balance (unbiased rounding: the pairs are equal)", fontsize="medium")
    axes.legend(loc="upper right", fontsize="small")


def write_markdown_report(
    path: str | os.PathLike[str],
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    source: str | None = None,
    device_result: np.ndarray | None = None,
) -> Path | None:
    """Write :func:`markdown_report` to ``path`` and the plot beside it (``out.md`` -> ``out.png``).

    Args:
        path: the markdown file to write.
        report: the comparison of ``candidate`` for ``call``.
        call: the validated call (the golden and the scale of the plot are computed from it).
        candidate: [N, H], the candidate the report judged.
        source: where the device result came from.
        device_result: [N, H], the device's result, whose errors the plot overlays; None: the plot
            shows the candidate's alone.

    Returns:
        The PNG written, or None when matplotlib is not installed (the report says so).

    Raises:
        OSError: a file cannot be written.
    """
    markdown = Path(path)
    png = markdown.with_suffix(".png")
    if png == markdown:
        png = markdown.with_name(markdown.name + ".png")
    written: Path | None
    note: str | None
    try:
        import matplotlib.figure  # noqa: F401  (probe before the float64 work)
    except ImportError:
        written, note = None, PLOT_MISSING
    else:
        golden, scale = moe_init_routing_v2_grad_golden(call), summand_magnitude(call)
        small = DTYPE_LIMITS[call.dtype_name].small_value
        device_errors = (
            None
            if device_result is None
            else _relative(np.asarray(device_result).astype(np.float64), golden, scale, small, False)
        )
        write_histogram(
            png,
            _relative(np.asarray(candidate).astype(np.float64), golden, scale, small, False),
            dtype=call.dtype_name,
            device_errors=device_errors,
            report=report,
        )
        written, note = png, None
    markdown.write_text(
        markdown_report(report, source=source, histogram=None if written is None else png.name, histogram_note=note),
        encoding="utf-8",
    )
    return written
