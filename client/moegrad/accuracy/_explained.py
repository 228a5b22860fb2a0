"""A comparison explained: the label counts in its report, the rows in its per-case report.

``moegrad compare --explain`` (one call or a sweep) explains each candidate that is not bit-exact
to the device's result (:func:`moegrad.explain`) and records the explanation's label counts in the
report (:attr:`~moegrad.ComparisonReport.explained`: the results file and the summary carry them);
the rows go to the case's own report files (:func:`explanation_markdown` in the markdown report,
the explanation's dict beside the JSON report). A sweep explains each case in this process,
against the emulation of the profile that judged it (the device's bits, by construction), on the
sweep's worker threads or, for asyncio, on a worker thread of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from moegrad._errors import InvalidArgument
from moegrad.accuracy._batches import context_call
from moegrad.accuracy._escape import markdown_text
from moegrad.accuracy._explain import explain
from moegrad.accuracy._explanation import LABELS, Explanation, labels_line
from moegrad.accuracy._results import ComparisonReport
from moegrad.operator._profiles import PROFILES

__all__ = [
    "aexplaining_batch",
    "explain_case",
    "explaining_batch",
    "explaining_one",
    "explanation_markdown",
    "with_explanation",
]

#: Rows a markdown report lists (the explanation's dict lists every one).
MARKDOWN_ROWS = 50

Chunk = list[tuple[str, Mapping[str, Any], np.ndarray]]


def with_explanation(report: ComparisonReport, explanation: Explanation | None) -> ComparisonReport:
    """``report`` with :attr:`~moegrad.ComparisonReport.explained` set to ``explanation``'s label
    counts (every label of :data:`LABELS`, all 0 when ``explanation`` is None: a bit-exact candidate)."""
    labels = dict.fromkeys(LABELS, 0) if explanation is None else dict(explanation.labels)
    return dataclasses.replace(report, explained=labels)


def explain_case(
    report: ComparisonReport, fields: Mapping[str, Any], candidate: np.ndarray
) -> tuple[ComparisonReport, Explanation | None]:
    """Explain one judged case in this process against the profile that judged it (its report's
    context; a bit-exact candidate is not explained, every count 0).

    Returns:
        The report with its label counts, and the explanation (None when not run). The report is
        unchanged where the profile that judged it is not one moegrad knows (nothing to replay) or
        the candidate is not of the call's dtype (a float32 candidate of a float16 or bfloat16
        call: compare judges it, explain compares bits).
    """
    if report.exact is not None and report.exact.bit_exact:
        return with_explanation(report, None), None
    order = report.context.order if report.context is not None else None
    if order not in PROFILES:
        return report, None
    try:
        explanation = explain(context_call(fields, order), candidate)
    except InvalidArgument:  # a float32 candidate of a half-precision call: compare judges it, explain compares bits
        return report, None
    return with_explanation(report, explanation), explanation


def explaining_one(
    compare_one: Callable[[str, Mapping[str, Any], np.ndarray], ComparisonReport],
) -> Callable[[str, Mapping[str, Any], np.ndarray], ComparisonReport]:
    """A sweep's ``compare_one`` whose reports carry their explanation's label counts."""

    def one(name: str, fields: Mapping[str, Any], candidate: np.ndarray) -> ComparisonReport:
        return explain_case(compare_one(name, fields, candidate), fields, candidate)[0]

    return one


def _explained(chunk: Chunk, outcomes: list[ComparisonReport | Exception]) -> list[ComparisonReport | Exception]:
    return [
        explain_case(outcome, fields, candidate)[0] if isinstance(outcome, ComparisonReport) else outcome
        for (_, fields, candidate), outcome in zip(chunk, outcomes, strict=True)
    ]


def explaining_batch(
    judged: Callable[[Chunk], list[ComparisonReport | Exception]],
) -> Callable[[Chunk], list[ComparisonReport | Exception]]:
    """A sweep's ``compare_batch`` whose reports carry their explanation's label counts."""

    def batch(chunk: Chunk) -> list[ComparisonReport | Exception]:
        return _explained(chunk, judged(chunk))

    return batch


def aexplaining_batch(
    judged: Callable[[Chunk], Awaitable[list[ComparisonReport | Exception]]],
) -> Callable[[Chunk], Awaitable[list[ComparisonReport | Exception]]]:
    """:func:`explaining_batch` for an awaited ``compare_batch``: the explanations on a worker thread."""

    async def batch(chunk: Chunk) -> list[ComparisonReport | Exception]:
        return await asyncio.to_thread(_explained, chunk, await judged(chunk))

    return batch


def explanation_markdown(explanation: Explanation) -> str:
    """The explanation as a markdown section: its label counts and its first rows (every cell escaped)."""
    lines = [
        "## Explanation",
        "",
        f"{explanation.differing_rows} rows differ from the device's ({explanation.profile}): "
        + markdown_text(labels_line(explanation.labels)),
    ]
    if explanation.rows:
        lines += ["", "| row | label | slot | source row | profile | evidence |", "|---:|---|---:|---:|---|---|"]
    for row in explanation.rows[:MARKDOWN_ROWS]:
        cells = [str(row.row), row.label, _dash(row.slot), _dash(row.source_row), row.profile or "-"]
        lines.append("| " + " | ".join([*cells, markdown_text(row.evidence.summary)]) + " |")
    left = len(explanation.rows) - MARKDOWN_ROWS
    if left > 0:
        lines += ["", f"{left} more rows: the explanation's JSON lists every one."]
    return "\n".join(lines) + "\n"


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
