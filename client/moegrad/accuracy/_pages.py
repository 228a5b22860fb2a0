"""The HTML pages of ``moegrad compare --html FILE``: what they show, computed, and the file written.

:func:`write_html_report` is one case's page; :func:`write_html_sweep` a sweep's, whose worst cases
(up to :data:`~moegrad.accuracy._html.SWEEP_SECTIONS` that differ from the device) each get a
section: the case file read again, explained in this process against the emulation of the profile
that judged it (as ``compare --explain`` does in a sweep), its row errors and page numbers computed
there. The rendering is :mod:`moegrad.accuracy._html`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moegrad._errors import InvalidArgument
from moegrad.accuracy._batches import context_call
from moegrad.accuracy._cases import CaseResult, load_case
from moegrad.accuracy._explained import explain_case
from moegrad.accuracy._explanation import Explanation
from moegrad.accuracy._html import SWEEP_SECTIONS, HtmlCase, case_page, sweep_page
from moegrad.accuracy._html_data import case_view
from moegrad.accuracy._results import ComparisonReport
from moegrad.accuracy._summary import worst_first
from moegrad.accuracy._where import with_row_errors
from moegrad.operator._call import MoeInitRoutingV2GradCall
from moegrad.operator._profiles import PROFILES

__all__ = ["write_html_report", "write_html_sweep"]


def write_html_report(
    path: str | os.PathLike[str],
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    *,
    device_result: np.ndarray | None = None,
    explanation: Explanation | None = None,
    name: str | None = None,
) -> None:
    """Write one case's page (docs/accuracy.md, "A page to look at").

    Args:
        path: the HTML file to write.
        report: the comparison of ``candidate`` for ``call``; its row errors are computed when it
            has none (:func:`~moegrad.accuracy.with_row_errors`).
        call: the validated call.
        candidate: [N, H], the candidate the report judged.
        device_result: the device's grad_x; default the emulation of ``call.order``.
        explanation: the candidate's :func:`~moegrad.explain` (label counts per slot, the worst
            rows' labels); None: the page shows none.
        name: the case's name (default the report's context's case, else ``"candidate"``).

    Raises:
        OSError: the file cannot be written.
    """
    if report.row_errors is None:
        report = with_row_errors(report, call, candidate, device_result=device_result)
    view = case_view(call, candidate, device_result=device_result, explanation=explanation)
    shown = name or (report.context.case if report.context is not None else None) or "candidate"
    Path(path).write_text(case_page(report, view, name=shown), encoding="utf-8")


def _case(result: CaseResult) -> HtmlCase:
    """One sweep case with its section's numbers (the case file read again), or without a view
    where there is nothing to show or nothing to read."""
    report = result.report
    plain = HtmlCase(result.name, result.status, report, result.error)
    if report is None or result.path is None or (report.exact is not None and report.exact.bit_exact):
        return plain
    order = report.context.order if report.context is not None else None
    if order not in PROFILES:  # a device of no profile moegrad knows: nothing to emulate
        return plain
    try:
        fields, candidate = load_case(result.path)
        call = context_call(fields, order)
        report, explanation = explain_case(report, fields, candidate)
        report = with_row_errors(report, call, candidate)
        view = case_view(call, candidate, explanation=explanation)
    except (OSError, ValueError, TypeError, InvalidArgument):  # the file changed or went since it was judged
        return plain
    return HtmlCase(result.name, result.status, report, result.error, view)


def write_html_sweep(
    path: str | os.PathLike[str],
    results: Iterable[CaseResult],
    *,
    sections: int = SWEEP_SECTIONS,
    title: str = "moegrad sweep",
) -> list[CaseResult]:
    """Write a sweep's page: which factor makes cases fail, every case worst first, and a section
    for each of the ``sections`` worst cases that differ from the device (docs/accuracy.md, "A page
    to look at").

    Returns:
        The results in the page's order (:func:`~moegrad.accuracy.worst_first`).

    Raises:
        OSError: the file cannot be written.
    """
    ordered = worst_first(results)
    cases: list[HtmlCase] = []
    shown = 0
    for result in ordered:
        case = _case(result) if shown < sections else HtmlCase(result.name, result.status, result.report, result.error)
        shown += case.view is not None
        cases.append(case)
    Path(path).write_text(sweep_page(cases, title=title), encoding="utf-8")
    return ordered
