"""Accuracy of a candidate gradX, judged against the device's result and a float64 golden.

An accuracy team sends the inputs of one call and its own gradX (the *candidate*, from a GPU or CPU
port); :func:`compare` measures three pairs and judges the candidate by named standards; the
report writers render the result for people and files. docs/accuracy.md defines every number and
standard, with the thresholds per dtype and their sources.

- tables: :data:`STANDARDS`, :data:`THRESHOLDS` (standard, dtype) -> criteria, :data:`DTYPE_LIMITS`;
- judging: :func:`compare` (one operator call), :func:`compare_arrays` (given arrays),
  :func:`metrics` (one pair), :func:`check_compare_arguments`, :func:`skipped_rows`,
  :func:`summand_magnitude`;
- results: :class:`ComparisonReport` and its parts, each with ``to_dict`` / ``from_dict``;
- reports: :func:`format_report` (terminal), :func:`markdown_report`, :func:`write_markdown_report`,
  :func:`relative_errors`, :func:`write_histogram`.
"""

from moegrad.accuracy._compare import check_compare_arguments, compare, compare_arrays, skipped_rows, summand_magnitude
from moegrad.accuracy._metrics import metrics
from moegrad.accuracy._report import (
    format_report,
    markdown_report,
    relative_errors,
    write_histogram,
    write_markdown_report,
)
from moegrad.accuracy._results import (
    ComparisonReport,
    CriterionResult,
    Metrics,
    StandardVerdict,
    WorstElement,
    ZeroRowCheck,
)
from moegrad.accuracy._standards import DTYPE_LIMITS, STANDARDS, THRESHOLDS, Criterion, DtypeLimits

__all__ = [
    "DTYPE_LIMITS",
    "STANDARDS",
    "THRESHOLDS",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DtypeLimits",
    "Metrics",
    "StandardVerdict",
    "WorstElement",
    "ZeroRowCheck",
    "check_compare_arguments",
    "compare",
    "compare_arrays",
    "format_report",
    "markdown_report",
    "metrics",
    "relative_errors",
    "skipped_rows",
    "summand_magnitude",
    "write_histogram",
    "write_markdown_report",
]
