"""Accuracy of a candidate gradX, judged against the device's result and a float64 golden.

An accuracy team sends the inputs of one call and its own gradX (the *candidate*, from a GPU or CPU
port); :func:`compare` measures three pairs and judges the candidate by named standards; the
report writers render the result for people and files. docs/accuracy.md defines every number and
standard, with the thresholds per dtype and their sources.

- tables: :data:`STANDARDS`, :data:`THRESHOLDS` (standard, dtype) -> criteria, :data:`DTYPE_LIMITS`;
- judging: :func:`compare` (one operator call), :func:`compare_arrays` (given arrays),
  :func:`metrics` (one pair), :func:`check_compare_arguments`, :func:`skipped_rows`,
  :func:`summand_magnitude`; :func:`warm_up_compare` (compile the comparison and the row errors'
  kernels now, or load them from numba's cache: :func:`compare_cache` says which);
- results: :class:`ComparisonReport` and its parts, each with ``to_dict`` / ``from_dict``;
- reports: :func:`format_report` (terminal), :func:`markdown_report` / :func:`write_markdown_report`
  (with the plot, :func:`write_histogram`), :func:`write_json_report` / :func:`read_json_report`,
  :func:`write_csv_report` (msprobe's column names, then the call's: :data:`CSV_CONTEXT_COLUMNS`),
  :func:`report_context` / :func:`with_context`
  (what makes a saved report reproducible), :func:`with_profiles` (the device profiles whose
  emulation is bit-identical to the candidate), :func:`rejudge` (verdicts again from stored metrics);
- explaining: :func:`explain` (why each differing row differs: order of adds, a wrong summand,
  precision, NaN/Inf; :class:`Explanation`), :func:`check_explain_arguments`,
  :func:`explain_peak_bytes`, :func:`any_order_bound` (the largest error any schedule of float32
  adds can give); a comparison explained (``moegrad compare --explain``): :func:`explain_case`,
  :func:`with_explanation` (the label counts in the report), :func:`explaining_one`,
  :func:`explaining_batch`, :func:`aexplaining_batch` (a sweep's), :func:`explanation_markdown`,
  :func:`labels_line`;
- where the error lives: :func:`row_errors`, :func:`with_row_errors` (:class:`RowErrors`,
  :class:`RowPercentiles`, :class:`NonfiniteRow`; the CSV's :data:`ROW_ERROR_COLUMNS`); which
  factor makes a sweep's cases fail: :func:`analyse_factors` (:class:`FactorAnalysis`,
  :class:`Factor`, :func:`fisher_tail`, :data:`FAMILY_ALPHA`) over the :class:`CallTraits` each
  report context records (:func:`call_traits`); one HTML page: :func:`write_html_report`,
  :func:`write_html_sweep`;
- bulk: :func:`load_case` / :func:`save_case` (one ``.npz`` per case), :func:`compare_cases`,
  :func:`write_summary` (a sweep's summary to triage: :class:`SummaryNotes`, :func:`triage`,
  :class:`Finding`); sweeps: :class:`SweepFile` (the results file a run writes as it goes and
  resumes from), :func:`shard_of`, :func:`merge_sweeps` (shard files -> one run's results),
  :class:`ProfilesDiffer` (cases that name no profile over replicas of different profiles) and
  :func:`refuse_mixed_profiles`, :func:`worst_first`, :func:`statuses`; a sweep's pieces as the
  ``moegrad`` command uses them: :func:`fields_with_order`, :func:`context_call`,
  :data:`SWEEP_THREAD`, :data:`PLOT_MISSING`, :func:`console_text` (a name or message shown inert);
- the candidate on the bench: :class:`Candidate` (:func:`as_candidate`, :class:`CandidateError`),
  :func:`probe_order` (its tree of adds, FPRev; :class:`OrderProbe`, :class:`InconsistentOrder`,
  :class:`MultiTermOrder`, :data:`PROBE_LIMITS`, :func:`probe_scale`), :func:`order_free_inputs`
  (:data:`ORDER_FREE_LIMITS`), :func:`check_determinism` (:class:`DeterminismCheck`,
  :func:`any_order_bound`), :func:`shrink` (the smallest call that keeps a fault, and its
  reproducer: :class:`ShrinkResult`, :class:`NothingToShrink`, :class:`ShrinkError`).
"""

from moegrad.accuracy._batches import ProfilesDiffer, context_call, fields_with_order, refuse_mixed_profiles
from moegrad.accuracy._bound import any_order_bound
from moegrad.accuracy._candidate import Candidate, CandidateError, as_candidate
from moegrad.accuracy._cases import CaseResult, find_cases, load_case, save_case, shard_of
from moegrad.accuracy._compare import (
    check_compare_arguments,
    compare,
    compare_arrays,
    rejudge,
    skipped_rows,
    summand_magnitude,
)
from moegrad.accuracy._context import report_context, with_context, with_profiles
from moegrad.accuracy._determinism import DeterminismCheck, check_determinism
from moegrad.accuracy._escape import console_text
from moegrad.accuracy._explain import check_explain_arguments, explain, explain_peak_bytes
from moegrad.accuracy._explained import (
    aexplaining_batch,
    explain_case,
    explaining_batch,
    explaining_one,
    explanation_markdown,
    with_explanation,
)
from moegrad.accuracy._explanation import (
    LABELS,
    ElementTable,
    Evidence,
    Explanation,
    Hypothesis,
    RowExplanation,
    SlotTable,
    labels_line,
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
from moegrad.accuracy._factors import FAMILY_ALPHA, Factor, FactorAnalysis, analyse_factors, fisher_tail
from moegrad.accuracy._fused import compare_cache
from moegrad.accuracy._ledger import SweepFile, SweepFileBusy, SweepFileError, SweepHeader, statuses
from moegrad.accuracy._merge import MergedSweep, MergeError, merge_sweeps
from moegrad.accuracy._metrics import metrics
from moegrad.accuracy._order_free import ORDER_FREE_LIMITS, order_free_inputs
from moegrad.accuracy._pages import write_html_report, write_html_sweep
from moegrad.accuracy._probe import (
    PROBE_LIMITS,
    InconsistentOrder,
    MultiTermOrder,
    OrderProbe,
    OrderProbeError,
    probe_order,
    probe_scale,
)
from moegrad.accuracy._report import (
    PLOT_MISSING,
    exactness_line,
    format_report,
    markdown_report,
    relative_errors,
    write_histogram,
    write_markdown_report,
)
from moegrad.accuracy._results import (
    CallTraits,
    ComparisonReport,
    CriterionResult,
    ExactMatch,
    Metrics,
    NonfiniteRow,
    ReportContext,
    RowErrors,
    RowPercentiles,
    StandardVerdict,
    WorstElement,
    ZeroRowCheck,
)
from moegrad.accuracy._shrink import DEFAULT_MAX_TESTS, NothingToShrink, ShrinkError, ShrinkResult, ShrinkStep, shrink
from moegrad.accuracy._standards import DEFAULT_STANDARDS, DTYPE_LIMITS, STANDARDS, THRESHOLDS, Criterion, DtypeLimits
from moegrad.accuracy._summary import SUMMARY_COLUMNS, Finding, SummaryNotes, triage, worst_first, write_summary
from moegrad.accuracy._sweep import SWEEP_THREAD, compare_cases, compare_in_process
from moegrad.accuracy._traits import call_traits
from moegrad.accuracy._warm_up import warm_up_compare
from moegrad.accuracy._where import PERCENTILES, ROW_ERROR_COLUMNS, row_errors, with_row_errors

__all__ = [
    "CSV_CONTEXT_COLUMNS",
    "DEFAULT_MAX_TESTS",
    "DEFAULT_STANDARDS",
    "DTYPE_LIMITS",
    "FAMILY_ALPHA",
    "LABELS",
    "MSPROBE_DETAIL_COLUMNS",
    "MSPROBE_STATUS",
    "ORDER_FREE_LIMITS",
    "PERCENTILES",
    "PLOT_MISSING",
    "PROBE_LIMITS",
    "ROW_ERROR_COLUMNS",
    "STANDARDS",
    "SUMMARY_COLUMNS",
    "SWEEP_THREAD",
    "THRESHOLDS",
    "CallTraits",
    "Candidate",
    "CandidateError",
    "CaseResult",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DeterminismCheck",
    "DtypeLimits",
    "ElementTable",
    "Evidence",
    "ExactMatch",
    "Explanation",
    "Factor",
    "FactorAnalysis",
    "Finding",
    "Hypothesis",
    "InconsistentOrder",
    "MergeError",
    "MergedSweep",
    "Metrics",
    "MultiTermOrder",
    "NonfiniteRow",
    "NothingToShrink",
    "OrderProbe",
    "OrderProbeError",
    "ProfilesDiffer",
    "ReportContext",
    "RowErrors",
    "RowExplanation",
    "RowPercentiles",
    "ShrinkError",
    "ShrinkResult",
    "ShrinkStep",
    "SlotTable",
    "StandardVerdict",
    "SummaryNotes",
    "SweepFile",
    "SweepFileBusy",
    "SweepFileError",
    "SweepHeader",
    "WorstElement",
    "ZeroRowCheck",
    "aexplaining_batch",
    "analyse_factors",
    "any_order_bound",
    "as_candidate",
    "call_traits",
    "check_compare_arguments",
    "check_determinism",
    "check_explain_arguments",
    "compare",
    "compare_arrays",
    "compare_cache",
    "compare_cases",
    "compare_in_process",
    "console_text",
    "context_call",
    "csv_rows",
    "exactness_line",
    "explain",
    "explain_case",
    "explain_peak_bytes",
    "explaining_batch",
    "explaining_one",
    "explanation_markdown",
    "fields_with_order",
    "find_cases",
    "fisher_tail",
    "format_report",
    "labels_line",
    "load_case",
    "markdown_report",
    "merge_sweeps",
    "metrics",
    "order_free_inputs",
    "probe_order",
    "probe_scale",
    "read_json_report",
    "refuse_mixed_profiles",
    "rejudge",
    "relative_errors",
    "report_context",
    "row_errors",
    "save_case",
    "shard_of",
    "shrink",
    "skipped_rows",
    "statuses",
    "summand_magnitude",
    "triage",
    "warm_up_compare",
    "with_context",
    "with_explanation",
    "with_profiles",
    "with_row_errors",
    "worst_first",
    "write_csv_report",
    "write_histogram",
    "write_html_report",
    "write_html_sweep",
    "write_json_report",
    "write_markdown_report",
    "write_summary",
]
