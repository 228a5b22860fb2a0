"""A comparison as one self-contained HTML page (docs/accuracy.md, "A page to look at").

``moegrad compare --html FILE`` writes it for one case (:func:`case_page`) or a sweep
(:func:`sweep_page`: the cases worst first, each linking to its section further down the same
file); :mod:`moegrad.accuracy._pages` computes what they show and writes them. The page fetches
nothing: its style is inline, its plots are PNG images drawn by matplotlib (the optional extra
``plot``) inside ``data:`` URIs, it holds no script, and every number of a plot is in a table
beside it, written as the JSON report writes it (``repr`` of the float, ``"nan"``, ``"inf"``), so
that it reads the same with JavaScript off or with no plots at all. Every text that comes from a
case (its name, a message, a server's words) is escaped (``html.escape``).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moegrad.accuracy._explanation import LABELS
from moegrad.accuracy._factors import FactorAnalysis, analyse_factors
from moegrad.accuracy._html_data import SLOT_LABELS, CaseView, ErrorMap, SlotErrors, WorstRow
from moegrad.accuracy._report import PLOT_MISSING
from moegrad.accuracy._results import ComparisonReport, RowPercentiles, SlotTable
from moegrad.accuracy._traits import mode_of
from moegrad.accuracy._where import PERCENTILES

__all__ = ["SWEEP_SECTIONS", "HtmlCase", "case_page", "case_section", "html_page", "number", "plotting", "sweep_page"]

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 2px 6px; text-align: right; vertical-align: top; }
th { background: #eee; }
td.text, th.text { text-align: left; }
.fail { color: #b00; font-weight: bold; } .warning { color: #a60; } .pass { color: #070; }
section { border-top: 2px solid #888; margin-top: 2em; }
img { max-width: 100%; }
"""
_STATUS_CLASS = {"fail": "fail", "warning": "warning", "pass": "pass", "invalid": "fail", "error": "fail"}
#: Sections a sweep's page holds at most (the worst cases that differ from the device).
SWEEP_SECTIONS = 100


@dataclass(frozen=True)
class HtmlCase:
    """One case of a sweep's page.

    Attributes:
        name: the case's name.
        status: its status (``pass``, ``warning``, ``fail``, ``invalid``, ``error``).
        report: its report (None: invalid, or not judged).
        error: why it has no report.
        view: its page numbers, when it has a section (:func:`~moegrad.accuracy._html_data.case_view`).
    """

    name: str
    status: str
    report: ComparisonReport | None
    error: str | None = None
    view: CaseView | None = None


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)


def number(value: Any) -> str:
    """A number as the JSON report writes it: an int as is, a float as ``repr`` (``"nan"``,
    ``"inf"``, ``"-inf"`` when not finite), None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _cell(value: Any, field: str | None = None, *, text: bool = False) -> str:
    attribute = f' data-field="{_text(field)}"' if field else ""
    css = ' class="text"' if text else ""
    shown = _text(value) if text else number(value)
    return f"<td{css}{attribute}>{shown}</td>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None = None) -> str:
    head = "".join(f"<th>{_text(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    title = f"<caption>{_text(caption)}</caption>" if caption else ""
    return f"<table>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image(source: str | None, alt: str) -> str:
    if source is None:
        return ""
    return f'<p><img alt="{_text(alt)}" src="{source}"></p>'


def plotting() -> bool:
    """Whether matplotlib (the extra ``plot``) is installed."""
    try:
        import matplotlib.figure  # noqa: F401  (the optional extra ``plot``)
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Plots


def _map_png(error_map: ErrorMap) -> str:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    values = error_map.values
    positive = values[np.isfinite(values) & (values > 0)]
    floor = float(positive.min()) if positive.size else 1e-12
    top = math.log10(float(positive.max())) + 1 if positive.size else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        data = np.log10(np.maximum(values, floor))
    data = np.where(np.isinf(values), top, data)
    figure = Figure(figsize=(6.5, 4.5), dpi=90, layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(
        np.ma.masked_invalid(data),
        aspect="auto",
        interpolation="nearest",
        cmap=colormaps["viridis"].with_extremes(bad="lightgrey"),
    )
    figure.colorbar(image, label="log10 scaled error")
    rows, columns = ("expert", "capacity row") if error_map.kind == "experts" else ("row", "column")
    axes.set_xlabel(f"{columns} block (first {columns})")
    axes.set_ylabel(f"{rows} block (first {rows})")
    for setter, edges in ((axes.set_xticks, error_map.column_edges), (axes.set_yticks, error_map.row_edges)):
        shown = list(range(0, len(edges) - 1, max(1, (len(edges) - 1) // 8)))
        setter(shown, [str(edges[i]) for i in shown])
    return _png(figure)


def _slots_png(slots: SlotErrors) -> str:
    from matplotlib.figure import Figure

    top_k = slots.coefficient.size
    positions = np.arange(top_k)
    figure = Figure(figsize=(6.5, 4.5), dpi=90, layout="constrained")
    counts_axes, coefficient_axes = figure.subplots(2, 1, sharex=True)
    base = np.zeros(top_k)
    for label in SLOT_LABELS:
        counts = np.array((slots.labels or {}).get(label, [0] * top_k), dtype=np.float64)
        if counts.any():
            counts_axes.bar(positions, counts, bottom=base, label=label)
            base += counts
    counts_axes.set_ylabel("rows explained at t")
    if base.any():
        counts_axes.legend(fontsize="small")
    coefficient_axes.bar(positions, np.nan_to_num(slots.coefficient), color="tab:red")
    coefficient_axes.axhline(0, color="black", linewidth=0.5)
    coefficient_axes.set_ylabel("residual on slot t")
    coefficient_axes.set_xlabel("slot position t")
    return _png(figure)


# --------------------------------------------------------------------------------------------------
# Sections


def _percentile_cells(p: RowPercentiles, field: str) -> list[str]:
    cells = [_cell(p.rows, f"{field}.rows")]
    cells += [_cell(getattr(p, f"p{q}"), f"{field}.p{q}") for q in PERCENTILES]
    return [*cells, _cell(p.max, f"{field}.max"), _cell(p.max_row, f"{field}.max_row")]


def _slots_cell(slots: SlotTable) -> str:
    lines = []
    for t, index, read, skipped, expert, place in zip(
        slots.t, slots.index, slots.row, slots.skipped, slots.expert, slots.capacity_row, strict=True
    ):
        where = f"expert {expert}, capacity row {place}, " if expert is not None else ""
        lines.append(f"t={t}: index {index}, " + ("skipped" if skipped else f"{where}row {read}"))
    return '<td class="text">' + "<br>".join(_text(line) for line in lines) + "</td>"


def _row_errors_html(report: ComparisonReport) -> str:
    r = report.row_errors
    if r is None:
        return "<p>Row errors were not computed for this report.</p>"
    counts = [
        ("rows", r.rows, "rows", r.rows, None),
        ("rows that differ from the device", r.differing, "differing", 0, None),
        ("rows past an element's limit", r.failing, "failing", r.device_failing, "device_failing"),
        ("rows outside the any-order bound", r.outside_bound, "outside_bound", None, None),
        ("rows holding NaN/Inf", r.nonfinite, "nonfinite", r.device_nonfinite, "device_nonfinite"),
    ]
    rows = [
        [
            _cell(name, text=True),
            _cell(mine, f"row_errors.{key}"),
            _cell(theirs, f"row_errors.{their_key}" if their_key else None),
        ]
        for name, mine, key, theirs, their_key in counts
    ]
    out = _table(("figure", "candidate", "device"), rows, "Rows")
    headers = ("each row's largest", "rows measured", *(f"p{q}" for q in PERCENTILES), "max", "row of max")
    spread = []
    for title, field in (
        ("relative error, candidate", "relative_error"),
        ("relative error, device", "device_relative_error"),
        ("ULP error, candidate", "ulp_error"),
        ("ULP error, device", "device_ulp_error"),
    ):
        spread.append([_cell(title, text=True), *_percentile_cells(getattr(r, field), f"row_errors.{field}")])
    out += _table(headers, spread, "Percentiles over the rows (nearest rank)")
    f = r.first_nonfinite
    if f is None:
        out += "<p>No row of the candidate holds a NaN or an Inf.</p>"
    else:
        carried = ", ".join(f"slot {t} (row {f.slots.row[t]})" for t in f.carriers) or "no slot's input"
        out += (
            f'<p>First row holding a NaN/Inf: <span data-field="row_errors.first_nonfinite.row">{f.row}</span>, '
            f"{f.count} elements (columns {_text(', '.join(map(str, f.columns)))}); the device {f.device_count}, "
            f"the golden {f.golden_count}; carried by {_text(carried)}.</p>"
        )
        out += _table(("slots",), [[_slots_cell(f.slots)]])
    return out


def _labels_html(report: ComparisonReport) -> str:
    if report.explained is None:
        return "<p>Not explained.</p>"
    rows = [[_cell(label, text=True), _cell(report.explained.get(label, 0), f"explained.{label}")] for label in LABELS]
    return _table(("label", "rows"), rows)


def _map_html(error_map: ErrorMap, plots: bool) -> str:
    rows_word, columns_word = ("experts", "capacity rows") if error_map.kind == "experts" else ("rows", "columns")
    edges = error_map.column_edges
    headers = [f"{rows_word} \\ {columns_word}"] + [f"{edges[j]}-{edges[j + 1] - 1}" for j in range(len(edges) - 1)]
    body = []
    for i in range(len(error_map.row_edges) - 1):
        label = f"{error_map.row_edges[i]}-{error_map.row_edges[i + 1] - 1}"
        cells = [_cell(error_map.values[i, j], f"map.{i}.{j}") for j in range(len(edges) - 1)]
        body.append([f"<th>{_text(label)}</th>", *cells])
    what = "per expert x capacity row" if error_map.kind == "experts" else "per row block x column block"
    image = _image(_map_png(error_map), f"the largest scaled error {what}") if plots else ""
    caption = f"Largest scaled error {what}: |candidate - golden| / max(magnitude, small value); inf: a NaN/Inf "
    caption += "unlike the golden's (the top of the plot's scale)" + (
        "; nan: no slot reads it (grey)" if error_map.kind == "experts" else ""
    )
    table = _table(headers, body, caption)
    return f"{image}<details open><summary>The map's numbers</summary>{table}</details>"


def _slots_html(slots: SlotErrors, plots: bool) -> str:
    labels = slots.labels
    headers = ("t", *((SLOT_LABELS) if labels is not None else ()), "residual on slot t")
    rows = []
    for t in range(slots.coefficient.size):
        counts = [_cell(labels[label][t], f"slots.{label}.{t}") for label in SLOT_LABELS] if labels is not None else []
        rows.append([_cell(t), *counts, _cell(slots.coefficient[t], f"slots.coefficient.{t}")])
    note = f"the residual's coefficient on each slot's summand over the {slots.rows} rows outside the any-order bound"
    image = _image(_slots_png(slots), "the error by slot position") if plots else ""
    return image + _table(headers, rows, f"By slot position: rows explained at t; {note}")


def _worst_html(worst: Sequence[WorstRow]) -> str:
    if not worst:
        return "<p>No row differs from the golden.</p>"
    headers = ["row", "column", "scaled error", "candidate", "device", "golden", "label", "slot", "source row"]
    headers += ["evidence", "slots: index, row read"]
    rows = []
    for w in worst:
        e = w.explained
        rows.append(
            [
                _cell(w.row, f"worst.{w.row}.row"),
                _cell(w.column, f"worst.{w.row}.column"),
                _cell(w.error, f"worst.{w.row}.error"),
                _cell(w.candidate, f"worst.{w.row}.candidate"),
                _cell(w.device, f"worst.{w.row}.device"),
                _cell(w.golden, f"worst.{w.row}.golden"),
                _cell("-" if e is None else e.label, f"worst.{w.row}.label", text=True),
                _cell(None if e is None else e.slot, f"worst.{w.row}.slot"),
                _cell(None if e is None else e.source_row, f"worst.{w.row}.source_row"),
                _cell("-" if e is None else e.evidence.summary, text=True),
                _slots_cell(w.slots),
            ]
        )
    return _table(headers, rows, "The rows with the largest scaled error, worst first, with their provenance")


def _summary_html(report: ComparisonReport) -> str:
    context = report.context
    exact = report.exact
    rows = [
        ("verdict", report.verdict),
        ("grad_x", f"{report.dtype} {list(report.shape)}; candidate {report.candidate_dtype}"),
        ("profile", "-" if context is None else f"{context.order} ({context.product_line})"),
        (
            "top_k, mode, active_num",
            "-"
            if context is None
            else f"{context.top_k}, {mode_of(context.drop_pad_mode, context.active_num)}, {context.active_num}",
        ),
        (
            "bit-exact",
            "-"
            if exact is None
            else f"{str(exact.bit_exact).lower()}: {exact.mismatched} of {exact.count} elements differ",
        ),
    ]
    rows += [(f"standard {v.standard}", f"{v.status} (device {v.device_status})") for v in report.verdicts]
    return _table(("field", "value"), [[_cell(k, text=True), _cell(v, text=True)] for k, v in rows])


def case_section(anchor: str, name: str, report: ComparisonReport, view: CaseView | None, plots: bool) -> str:
    """One case's section: its summary, where the error lives, its labels, the map, the slots, the worst rows."""
    parts = [
        f'<section id="{_text(anchor)}"><h2>{_text(name)}: <span class="{_STATUS_CLASS.get(report.verdict, "")}">'
        f"{_text(report.verdict)}</span></h2>",
        _summary_html(report),
    ]
    parts += ["<h3>Where the error lives</h3>", _row_errors_html(report), "<h3>Labels</h3>", _labels_html(report)]
    if view is not None:
        parts += ["<h3>Error map</h3>", _map_html(view.map, plots)]
        parts += ["<h3>Error by slot position</h3>", _slots_html(view.slots, plots)]
        parts += ["<h3>Worst rows</h3>", _worst_html(view.worst)]
    return "".join(parts) + "</section>"


def html_page(title: str, body: str, *, plots: bool) -> str:
    """A whole page around ``body`` (no script, no external reference)."""
    note = "" if plots else f"<p>Plots skipped: {_text(PLOT_MISSING)}; the tables hold every number.</p>"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_text(title)}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{_text(title)}</h1>{note}{body}<p>Definitions: docs/accuracy.md of moegrad.</p></body></html>\n"
    )


def case_page(report: ComparisonReport, view: CaseView | None, *, name: str = "candidate") -> str:
    """One case's page."""
    plots = plotting()
    section = case_section("case-0", name, report, view, plots)
    return html_page(f"moegrad accuracy report: {report.verdict}", section, plots=plots)


def _factors_html(analysis: FactorAnalysis) -> str:
    head, *rest = analysis.lines()
    out = f"<p>{_text(head)}</p>"
    if analysis.factors:
        headers = ("condition", "same cases", "failing with", "failing without", "passing with", "passing without", "p")
        rows = [
            [
                _cell(f.condition, text=True),
                _cell(", ".join(f.same) or "-", text=True),
                _cell(f.failing_with),
                _cell(f.failing_without),
                _cell(f.passing_with),
                _cell(f.passing_without),
                _cell(f.p_value),
            ]
            for f in analysis.factors
        ]
        out += _table(headers, rows)
    notes = [line.strip() for line in rest if line.strip().startswith("(")]
    return out + "".join(f"<p>{_text(note)}</p>" for note in notes)


def _case_row(position: int, case: HtmlCase, linked: bool) -> list[str]:
    r, anchor = case.report, f"case-{position}"
    name = f'<a href="#{anchor}">{_text(case.name)}</a>' if linked else _text(case.name)
    status = f'<td class="text {_STATUS_CLASS.get(case.status, "")}">{_text(case.status)}</td>'
    if r is None:
        return [
            f'<td class="text">{name}</td>',
            status,
            *([_cell("-", text=True)] * 7),
            _cell(case.error or "", text=True),
        ]
    context, errors = r.context, r.row_errors
    mode = "-" if context is None else mode_of(context.drop_pad_mode, context.active_num)
    return [
        f'<td class="text">{name}</td>',
        status,
        _cell(r.dtype, text=True),
        _cell("x".join(map(str, r.shape)), text=True),
        _cell(None if context is None else context.top_k),
        _cell(mode, text=True),
        _cell("-" if context is None else context.order, text=True),
        _cell("-" if r.exact is None else str(r.exact.bit_exact).lower(), text=True),
        _cell(None if errors is None else errors.differing),
        _cell(", ".join(f"{k} {v}" for k, v in (r.explained or {}).items() if v) or "-", text=True),
    ]


def sweep_page(cases: Sequence[HtmlCase], *, title: str = "moegrad sweep") -> str:
    """A sweep's page: the factor analysis, the cases in the order given (worst first), each with a
    section further down when it has a view (its name links to it)."""
    plots = plotting()
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.status] = counts.get(case.status, 0) + 1
    body = [f"<p>{len(cases)} cases: {_text(', '.join(f'{n} {s}' for s, n in counts.items()))}</p>"]
    body += ["<h2>Which factor makes cases fail</h2>", _factors_html(analyse_factors(cases))]
    headers = ("case", "status", "dtype", "shape", "K", "mode", "profile", "bit-exact", "rows differing", "explained")
    rows = [_case_row(i, case, case.view is not None and case.report is not None) for i, case in enumerate(cases)]
    body += ["<h2>Cases, worst first</h2>", _table(headers, rows)]
    body += [
        case_section(f"case-{i}", case.name, case.report, case.view, plots)
        for i, case in enumerate(cases)
        if case.view is not None and case.report is not None
    ]
    return html_page(title, "".join(body), plots=plots)
