"""A :class:`~moegrad.accuracy.ComparisonReport` as files: JSON, and CSV in msprobe's column names.

JSON is ``report.to_dict()`` (read back with :func:`read_json_report`). CSV uses the column names of
msprobe's accuracy-checking details table (docs/accuracy.md, "CSV columns"), then moegrad's own,
then the call and its inputs' SHA-256 (:data:`CSV_CONTEXT_COLUMNS`, from the report's
:class:`~moegrad.accuracy.ReportContext`), then where the error lives and the label counts
(:data:`~moegrad.accuracy.ROW_ERROR_COLUMNS`, :mod:`moegrad.accuracy._where`). The terminal,
markdown and plot renderings are :mod:`moegrad.accuracy._report`'s.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from moegrad.accuracy._escape import csv_row
from moegrad.accuracy._results import ComparisonReport
from moegrad.accuracy._standards import SEVERITY
from moegrad.accuracy._where import ROW_ERROR_COLUMNS, row_error_cells

__all__ = [
    "CSV_CONTEXT_COLUMNS",
    "MSPROBE_DETAIL_COLUMNS",
    "MSPROBE_STATUS",
    "csv_rows",
    "read_json_report",
    "write_csv_report",
    "write_json_report",
]


def write_json_report(path: str | os.PathLike[str], report: ComparisonReport, *, indent: int | None = 2) -> None:
    """Write ``report.to_dict()`` as JSON (``allow_nan=False``: non-finite floats are strings).

    Args:
        path: the file to write.
        report: the comparison.
        indent: spaces per level; None: one compact line (:meth:`ComparisonReport.to_json`, several
            times faster: a sweep's per-case reports).

    Raises:
        OSError: the file cannot be written.
    """
    if indent is None:
        Path(path).write_bytes(report.to_json() + b"\n")
        return
    text = json.dumps(report.to_dict(), indent=indent, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def read_json_report(path: str | os.PathLike[str]) -> ComparisonReport:
    """Read a report written by :func:`write_json_report` (or ``moegrad compare --json``).

    :func:`moegrad.accuracy.rejudge` of the result reproduces its verdicts from its stored metrics.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or not a report (the message names the field).
    """
    return ComparisonReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


#: The columns of msprobe's accuracy-checking details table (``accuracy_checking_details_*.csv``), in
#: its order, followed by moegrad's own (docs/accuracy.md, "CSV columns").
MSPROBE_DETAIL_COLUMNS: tuple[str, ...] = (
    "API Name",
    "Bench Dtype",
    "DEVICE Dtype",
    "Shape",
    "余弦相似度",
    "最大绝对误差",
    "双百指标",
    "双千指标",
    "双万指标",
    "二进制一致错误率",
    "误差均衡性",
    "均方根误差",
    "小值域错误占比",
    "相对误差最大值",
    "相对误差平均值",
    "inf/nan错误率",
    "相对误差错误率",
    "绝对误差错误率",
    "ULP误差最大值",
    "ULP误差平均值",
    "ULP误差大于阈值占比",
    "Status",
    "Message",
)
_MOEGRAD_COLUMNS = ("moegrad_status", "bit_exact", "bitwise_mismatches", "worst_row", "worst_column", "standards")
_INPUTS = ("grad_expanded_x", "expanded_row_idx", "candidate")
#: The call and its inputs' SHA-256 (the report's :class:`ReportContext`; empty cells without one), last.
CSV_CONTEXT_COLUMNS = (
    "order",
    "product_line",
    "top_k",
    "drop_pad_mode",
    "active_num",
    *(f"sha256_{n}" for n in _INPUTS),
)
#: moegrad's status -> the word msprobe writes in its Status column.
MSPROBE_STATUS = {"pass": "pass", "warning": "warning", "fail": "error", "invalid": "error", "error": "error"}


def number_cell(value: float | int | None) -> str:
    """A figure as a CSV cell: a float in full precision (``repr``, NaN as ``nan``), an int as
    written, None as empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def csv_rows(report: ComparisonReport) -> list[dict[str, str]]:
    """The report as two rows of msprobe's details table: the candidate's, then the device's (both
    against the golden), each with moegrad's columns and the call's (:data:`CSV_CONTEXT_COLUMNS`).

    Values are written in full precision (``repr`` of the float); a figure moegrad does not compute
    (msprobe's absolute-threshold error rates) is left empty, as is ``ULP误差大于阈值占比`` for
    float32 (msprobe counts errors above 32 ULP there, moegrad above 1).

    Returns:
        Two dicts keyed by :data:`MSPROBE_DETAIL_COLUMNS`, moegrad's columns, the call's and, last,
        the row errors' and label counts' (:data:`~moegrad.accuracy.ROW_ERROR_COLUMNS`: empty without them).
    """
    context = report.context
    name = context.case if context is not None and context.case else "aclnnMoeInitRoutingV2Grad"
    profiles = "" if report.profiles_matching is None else "+".join(report.profiles_matching) or "none"
    call = dict.fromkeys(CSV_CONTEXT_COLUMNS, "")
    if context is not None:
        attributes = (context.order, context.product_line, context.top_k, context.drop_pad_mode, context.active_num)
        call.update(zip(CSV_CONTEXT_COLUMNS, map(str, attributes), strict=False))
        call.update({f"sha256_{n}": context.sha256.get(n, "") for n in _INPUTS})
    device_status = "pass"
    for v in report.verdicts:
        if SEVERITY[v.device_status] > SEVERITY[device_status]:
            device_status = v.device_status
    rows = []
    for role, metric, status in (
        ("candidate", report.candidate_vs_golden, report.verdict),
        ("device", report.device_vs_golden, device_status),
    ):
        is_candidate = role == "candidate"
        mismatched = report.exact.mismatched if report.exact is not None and is_candidate else 0
        share = report.exact.share if report.exact is not None and is_candidate else 0.0
        messages = (
            [c.describe() for v in report.verdicts for c in v.criteria if c.status != "pass"] if is_candidate else []
        )
        worst = metric.worst
        rows.append(
            {
                "API Name": f"{name}.{role}",
                "Bench Dtype": "float64",
                "DEVICE Dtype": metric.actual_dtype,
                "Shape": str(tuple(report.shape)),
                "余弦相似度": number_cell(metric.cosine_similarity),
                "最大绝对误差": number_cell(metric.max_abs_error),
                "双百指标": number_cell(metric.hundredth_share),
                "双千指标": number_cell(metric.thousandth_share),
                "双万指标": number_cell(metric.ten_thousandth_share),
                "二进制一致错误率": number_cell(share),
                "误差均衡性": number_cell(metric.error_imbalance),
                "均方根误差": number_cell(metric.rmse),
                "小值域错误占比": number_cell(metric.small_value_error_rate),
                "相对误差最大值": number_cell(metric.max_relative_error),
                "相对误差平均值": number_cell(metric.mean_relative_error),
                "inf/nan错误率": number_cell(
                    (metric.nan_mismatch_count + metric.inf_mismatch_count) / metric.count if metric.count else math.nan
                ),
                "相对误差错误率": "",
                "绝对误差错误率": "",
                "ULP误差最大值": number_cell(metric.max_ulp_error),
                "ULP误差平均值": number_cell(metric.mean_ulp_error),
                "ULP误差大于阈值占比": ""
                if metric.actual_dtype == "float32"
                else number_cell(metric.ulp_error_above_1_share),
                "Status": MSPROBE_STATUS[status],
                "Message": "; ".join(messages),
                "moegrad_status": status,
                "bit_exact": "" if report.exact is None else str(mismatched == 0).lower(),
                "bitwise_mismatches": str(mismatched),
                "worst_row": "" if worst is None else str(worst.row),
                "worst_column": "" if worst is None else str(worst.column),
                "standards": "+".join(v.standard for v in report.verdicts),
                "profiles_matching": profiles if is_candidate else "",
                **call,
                **row_error_cells(report, role),
            }
        )
    return rows


def write_csv_report(path: str | os.PathLike[str], report: ComparisonReport) -> None:
    """Write :func:`csv_rows` to ``path`` (UTF-8 with a byte-order mark, as spreadsheet tools expect;
    a text cell they would read as a formula gets a leading ``'``: :func:`~moegrad.accuracy._escape.csv_cell`).

    Raises:
        OSError: the file cannot be written.
    """
    with open(os.fspath(path), "w", encoding="utf-8-sig", newline="") as file:
        columns = [
            *MSPROBE_DETAIL_COLUMNS,
            *_MOEGRAD_COLUMNS,
            "profiles_matching",
            *CSV_CONTEXT_COLUMNS,
            *ROW_ERROR_COLUMNS,
        ]
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(map(csv_row, csv_rows(report)))
