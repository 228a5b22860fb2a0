"""``moegrad compare --html FILE``: one self-contained HTML page, for one call or a sweep
(docs/accuracy.md, "A page to look at"); the pages are :mod:`moegrad.accuracy`'s
(:func:`~moegrad.accuracy.write_html_report`, :func:`~moegrad.accuracy.write_html_sweep`).

One call: the candidate is explained for the page (as ``--explain``) and its row errors are in the
report. A sweep (``--cases DIR``, or ``--merge``): every case worst first, which factor makes cases
fail, and a section for each of the worst cases that differ from the device, each read again from
its case file and explained in this process.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

import numpy as np

from moegrad import Explanation, MoeInitRoutingV2GradCall
from moegrad.accuracy import CaseResult, ComparisonReport, write_html_report, write_html_sweep
from moegrad.cli._parser import UsageError

__all__ = ["check_html", "write_case_page", "write_sweep_page"]


def check_html(args: argparse.Namespace) -> None:
    """Refuse ``--html FILE`` whose folder does not exist, before any work is done."""
    path = getattr(args, "html", None)
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"cannot write --html {path}: the folder {folder} does not exist")


def write_case_page(
    path: str,
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    device_result: np.ndarray | None,
    explanation: Explanation | None,
) -> None:
    """One call's page.

    Raises:
        UsageError: the file cannot be written.
    """
    try:
        write_html_report(path, report, call, candidate, device_result=device_result, explanation=explanation)
    except OSError as exc:
        raise UsageError(f"cannot write --html {path}: {exc}") from None


def write_sweep_page(args: argparse.Namespace) -> Callable[[Sequence[CaseResult]], None] | None:
    """What a sweep calls with its results once every case is judged: the page written, and a line
    saying so (None without ``--html``).

    Raises:
        UsageError: the file cannot be written.
    """
    path = args.html
    if not path:
        return None

    def write(results: Sequence[CaseResult]) -> None:
        try:
            write_html_sweep(path, results)
        except OSError as exc:
            raise UsageError(f"cannot write --html {path}: {exc}") from None
        print(f"wrote {path}")

    return write
