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
- reports: :func:`format_report` (terminal), :func:`markdown_report` / :func:`write_markdown_report`
  (with the plot, :func:`write_histogram`), :func:`write_json_report` / :func:`read_json_report`,
  :func:`write_csv_report` (msprobe's column names, then the call's: :data:`CSV_CONTEXT_COLUMNS`),
  :func:`report_context` / :func:`with_context`
  (what makes a saved report reproducible), :func:`with_profiles` (the device profiles whose
  emulation is bit-identical to the candidate), :func:`rejudge` (verdicts again from stored metrics);
- explaining: :func:`explain` (why each differing row differs: order of adds, a wrong summand,
  precision, NaN/Inf; :class:`Explanation`), :func:`explain_peak_bytes`, :func:`any_order_bound`;
- bulk: :func:`load_case` / :func:`save_case` (one ``.npz`` per case), :func:`compare_cases`,
  :func:`write_summary`; sweeps: :class:`SweepFile` (the results file a run writes as it goes and
  resumes from), :func:`shard_of`, :func:`merge_sweeps` (shard files -> one run's results),
  :class:`ProfilesDiffer` (cases that name no profile over replicas of different profiles).
"""

from moegrad._identify import with_profiles
from moegrad.accuracy._batches import ProfilesDiffer
from moegrad.accuracy._bound import any_order_bound
from moegrad.accuracy._cases import (
    SUMMARY_COLUMNS,
    CaseResult,
    find_cases,
    load_case,
    save_case,
    shard_of,
    write_summary,
)
from moegrad.accuracy._compare import (
    check_compare_arguments,
    compare,
    compare_arrays,
    rejudge,
    skipped_rows,
    summand_magnitude,
)
from moegrad.accuracy._context import report_context, with_context
from moegrad.accuracy._explain import explain, explain_peak_bytes
from moegrad.accuracy._explanation import (
    LABELS,
    ElementTable,
    Evidence,
    Explanation,
    Hypothesis,
    RowExplanation,
    SlotTable,
)
from moegrad.accuracy._export import (
    CSV_CONTEXT_COLUMNS,
    MSPROBE_DETAIL_COLUMNS,
    MSPROBE_STATUS,
    csv_rows,
    read_json_report,
    write_csv_report,
    write_json_report,
)
from moegrad.accuracy._fused import warm_up_compare
from moegrad.accuracy._ledger import SweepFile, SweepFileBusy, SweepFileError, SweepHeader
from moegrad.accuracy._merge import MergedSweep, MergeError, merge_sweeps
from moegrad.accuracy._metrics import metrics
from moegrad.accuracy._report import (
    exactness_line,
    format_report,
    markdown_report,
    relative_errors,
    write_histogram,
    write_markdown_report,
)
from moegrad.accuracy._results import (
    ComparisonReport,
    CriterionResult,
    ExactMatch,
    Metrics,
    ReportContext,
    StandardVerdict,
    WorstElement,
    ZeroRowCheck,
)
from moegrad.accuracy._standards import DEFAULT_STANDARDS, DTYPE_LIMITS, STANDARDS, THRESHOLDS, Criterion, DtypeLimits
from moegrad.accuracy._sweep import compare_cases, compare_in_process

__all__ = [
    "CSV_CONTEXT_COLUMNS",
    "DEFAULT_STANDARDS",
    "DTYPE_LIMITS",
    "LABELS",
    "MSPROBE_DETAIL_COLUMNS",
    "MSPROBE_STATUS",
    "STANDARDS",
    "SUMMARY_COLUMNS",
    "THRESHOLDS",
    "CaseResult",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DtypeLimits",
    "ElementTable",
    "Evidence",
    "ExactMatch",
    "Explanation",
    "Hypothesis",
    "MergeError",
    "MergedSweep",
    "Metrics",
    "ProfilesDiffer",
    "ReportContext",
    "RowExplanation",
    "SlotTable",
    "StandardVerdict",
    "SweepFile",
    "SweepFileBusy",
    "SweepFileError",
    "SweepHeader",
    "WorstElement",
    "ZeroRowCheck",
    "any_order_bound",
    "check_compare_arguments",
    "compare",
    "compare_arrays",
    "compare_cases",
    "compare_in_process",
    "csv_rows",
    "exactness_line",
    "explain",
    "explain_peak_bytes",
    "find_cases",
    "format_report",
    "load_case",
    "markdown_report",
    "merge_sweeps",
    "metrics",
    "read_json_report",
    "rejudge",
    "relative_errors",
    "report_context",
    "save_case",
    "shard_of",
    "skipped_rows",
    "summand_magnitude",
    "warm_up_compare",
    "with_context",
    "with_profiles",
    "write_csv_report",
    "write_histogram",
    "write_json_report",
    "write_markdown_report",
    "write_summary",
]
