"""``compare --cases DIR --reports OUT``: each case's report written off the sweep's path.

A case's report is its ``.json``, ``.csv`` and ``.md`` (docs/accuracy.md, "Reports that reproduce")
and, as ``--plots`` says (``none``, ``failing``: the cases that failed, ``all``), its plot
(``.png``, linked from the ``.md``). The sweep only queues each result (under its lock, at once):
one thread writes the text files, a few milliseconds a case, and worker processes draw the plots,
about 0.3 s of a core each, which in the sweep's own process would hold the sweep back (matplotlib
draws under the interpreter's lock). The workers are started (``spawn``: a fresh interpreter, never
a fork of this threaded process) at the first case to plot, at most one per CPU up to
:data:`PLOT_WORKERS`; :meth:`CaseReports.close` waits for every report once the sweep is done.
A plot's device result and golden are computed in the worker, by the emulation of the profile
that judged the case. With ``--explain``, a case that is not bit-exact is explained again here (its
report keeps only the label counts): its rows go to ``NAME.explain.json`` and at the end of its
``.md`` (docs/accuracy.md, "Explaining a mismatch").
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from moegrad import MoeInitRoutingV2GradCall, moe_init_routing_v2_grad
from moegrad.accuracy import (
    PLOT_MISSING,
    CaseResult,
    ComparisonReport,
    Explanation,
    context_call,
    explain_case,
    explanation_markdown,
    fields_with_order,
    load_case,
    markdown_report,
    write_csv_report,
    write_json_report,
    write_markdown_report,
)
from moegrad.cli._explain import explanation_json_path
from moegrad.cli._parser import UsageError

__all__ = ["PLOT_WORKERS", "CaseReports"]

#: The most worker processes that draw plots at once.
PLOT_WORKERS = 4


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def draw(markdown: str, report: ComparisonReport, path: str, order: str | None, section: str = "") -> None:
    """A worker's task: the case's markdown report with its plot (``.md`` and ``.png``), the call
    on the profile that judged it (its report's context), else on ``order``'s; ``section`` (its
    explanation's, or empty) at the end.

    Raises:
        OSError: a file cannot be read or written.
    """
    fields, candidate = load_case(path)
    judged = report.context.order if report.context is not None else None
    call = context_call(fields, judged) if judged else MoeInitRoutingV2GradCall(**fields_with_order(fields, order))
    write_markdown_report(markdown, report, call, candidate, device_result=moe_init_routing_v2_grad(call))
    if section:
        with open(markdown, "a", encoding="utf-8") as file:
            file.write(section)


class CaseReports:
    """The reports of a sweep's cases in ``folder``, written while the sweep goes on.

    Args:
        folder: where each case's files go (created now).
        plots: ``"none"``, ``"failing"`` or ``"all"`` (:data:`moegrad.cli._bulk.PLOTS`).
        order: the profile of the cases that name none (``--order``), for a plot of an in-process case.
        explain: each case that is not bit-exact explained, its rows written (``--explain``).

    Raises:
        UsageError: the folder cannot be created.
    """

    def __init__(self, folder: str, plots: str, order: str | None, *, explain: bool = False) -> None:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create --reports {folder}: {exc}") from None
        self.folder, self.plots, self.order, self.explain = folder, plots, order, explain
        self._drawable = importlib.util.find_spec("matplotlib") is not None
        self._work: queue.SimpleQueue[CaseResult | None] = queue.SimpleQueue()
        self._pool: ProcessPoolExecutor | None = None
        self._plotted: list[tuple[str, Future[None]]] = []
        self.error: str | None = None
        self._stopped = False
        self._writer = threading.Thread(target=self._write_all, name="moegrad-reports", daemon=True)
        self._writer.start()

    def add(self, result: CaseResult) -> None:
        """Queue a judged case's reports (a case without a report, invalid or not judged, has none)."""
        if result.report is not None and result.path is not None:
            self._work.put(result)

    def _plotted_case(self, result: CaseResult) -> bool:
        return self._drawable and (self.plots == "all" or (self.plots == "failing" and result.status == "fail"))

    def _write_all(self) -> None:
        while (result := self._work.get()) is not None:
            if self.error is None and not self._stopped:
                try:
                    self._write(result)
                except OSError as exc:
                    self.error = f"cannot write --reports {self.folder}: {exc}"

    def _write(self, result: CaseResult) -> None:
        report, path = result.report, result.path
        assert report is not None and path is not None  # add() queues only those
        base = os.path.join(self.folder, result.name)
        write_json_report(base + ".json", report)
        write_csv_report(base + ".csv", report)
        explanation = self._explained(report, path, base + ".json") if self.explain else None
        section = "" if explanation is None else "\n" + explanation_markdown(explanation)
        if self._plotted_case(result):
            if self._pool is None:
                workers = max(1, min(PLOT_WORKERS, _cpus()))
                self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            drawn = self._pool.submit(draw, base + ".md", report, path, self.order, section)
            self._plotted.append((base + ".md", drawn))
            return
        if not self._drawable and self.plots != "none":
            note = PLOT_MISSING
        else:
            note = f"not drawn: --plots {self.plots}" + (" draws the failed cases'" if self.plots == "failing" else "")
        with open(base + ".md", "w", encoding="utf-8") as file:
            file.write(markdown_report(report, histogram_note=note) + section)

    @staticmethod
    def _explained(report: ComparisonReport, path: str, json_path: str) -> Explanation | None:
        """The case's explanation, its rows written beside its JSON report; None when it is bit-exact
        or cannot be explained (:func:`~moegrad.accuracy.explain_case`)."""
        fields, candidate = load_case(path)
        explanation = explain_case(report, fields, candidate)[1]
        if explanation is not None:
            with open(explanation_json_path(json_path), "w", encoding="utf-8") as file:
                json.dump(explanation.to_dict(), file, indent=2, allow_nan=False)
                file.write("\n")
        return explanation

    def close(self) -> None:
        """Wait for every report (the plots included).

        Raises:
            UsageError: a report could not be written (the first that failed, named).
        """
        self._work.put(None)
        self._writer.join()
        if self._pool is not None:
            for markdown, plotted in self._plotted:
                try:
                    plotted.result()
                except OSError as exc:
                    self.error = self.error or f"cannot write --reports {markdown}: {exc}"
            self._pool.shutdown()
        if self.error is not None:
            raise UsageError(self.error)

    def abandon(self) -> None:
        """Stop at once (an interrupted sweep): what is queued is dropped, the plots not begun are cancelled."""
        self._stopped = True
        self._work.put(None)
        self._writer.join(1.0)  # the report in hand: a few milliseconds
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> CaseReports:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is not None:
            self.abandon()
