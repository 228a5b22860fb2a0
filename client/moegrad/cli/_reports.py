"""``compare --cases DIR --reports OUT``: each case's report written off the sweep's path.

A case's report is its ``.json``, ``.csv`` and ``.md`` (docs/accuracy.md, "Reports that reproduce")
and, as ``--plots`` says (``none``, the default; ``failing``: the cases that failed; ``all``), its
plot (``.png``, linked from the ``.md``). The sweep only hands each result over: one thread writes
the cases without a plot, and worker processes draw the others
(``spawn``: a fresh interpreter, never a fork of this threaded process), since matplotlib draws
under the interpreter's lock and would hold the sweep back. The first plot worker is started at the
first case to plot (``--plots all``: with the reports, so that its imports overlap the sweep),
another each time :data:`PLOTS_PER_WORKER` plots wait per worker, at most one per CPU up to
:data:`PLOT_WORKERS`: a worker's start (an interpreter importing moegrad and matplotlib) costs as
much as several plots. :meth:`CaseReports.close` waits for every report once the sweep is done.
Where a case's report is written, its case file is read again (unless the sweep's reading is still
held) and its device result computed by the emulation of the profile that judged it, for the
report's row errors (docs/accuracy.md, "Where the error lives") and its plot. With
``--explain``, a case that is not bit-exact is explained again there (its report keeps only the
label counts): its rows go to ``NAME.explain.json`` and at the end of its ``.md``
(docs/accuracy.md, "Explaining a mismatch").
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import queue
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from moegrad import MoeInitRoutingV2GradCall, moe_init_routing_v2_grad
from moegrad.accuracy import (
    PLOT_MISSING,
    CaseResult,
    ComparisonReport,
    context_call,
    explain_case,
    explanation_markdown,
    fields_with_order,
    load_case,
    markdown_report,
    with_row_errors,
    write_csv_report,
    write_json_report,
    write_markdown_report,
)
from moegrad.cli._explain import explanation_json_path
from moegrad.cli._parser import UsageError

__all__ = ["PLOTS_PER_WORKER", "PLOT_WORKERS", "CaseReports", "write_case"]

#: The most worker processes that draw plots at once.
PLOT_WORKERS = 4
#: Plots waiting per worker before another worker is started.
PLOTS_PER_WORKER = 16
#: Bytes of the cases' inputs the reports hold while they wait to be written; past it, a case's file
#: is read again when its report is written.
HELD_BYTES = 256 << 20

Worker = tuple[ProcessPoolExecutor, list[Future[None]]]
Inputs = tuple[Mapping[str, Any], np.ndarray]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_case(
    folder: str,
    result: CaseResult,
    order: str | None,
    explain: bool,
    note: str | None,
    inputs: tuple[Mapping[str, Any], np.ndarray] | None = None,
) -> None:
    """One case's ``.json``, ``.csv`` and ``.md`` in ``folder``, its report with where the error lives
    (:func:`~moegrad.accuracy.with_row_errors`), with ``--explain`` its explanation, and its plot
    unless ``note`` says why there is none.

    Args:
        folder: the reports' folder.
        result: the judged case (its report and its case file's path).
        order: the profile of the cases that name none (``--order``), for an in-process case.
        explain: explain the case when it is not bit-exact (``--explain``).
        note: why the case has no plot (said in its ``.md``); None: draw it.
        inputs: the case's fields and candidate as the sweep read them; None: read from its file.

    Raises:
        OSError: a file cannot be read or written (the message names it).
    """
    report, path = result.report, result.path
    assert report is not None and path is not None  # CaseReports.add hands over only those
    fields, candidate = load_case(path) if inputs is None else inputs
    judged = report.context.order if report.context is not None else None  # the profile that judged it
    call = context_call(fields, judged) if judged else MoeInitRoutingV2GradCall(**fields_with_order(fields, order))
    device_result = moe_init_routing_v2_grad(call)  # the row errors' golden loads numba's kernels anyway
    report = with_row_errors(report, call, candidate, device_result=device_result)
    base = os.path.join(folder, result.name)
    write_json_report(base + ".json", report, indent=None)  # one compact line: several times faster
    write_csv_report(base + ".csv", report)
    section = _explained(report, fields, candidate, base + ".json") if explain else ""
    if note is None:
        write_markdown_report(base + ".md", report, call, candidate, device_result=device_result)
    else:
        with open(base + ".md", "w", encoding="utf-8") as file:
            file.write(markdown_report(report, histogram_note=note))
    if section:
        with open(base + ".md", "a", encoding="utf-8") as file:
            file.write(section)


def _explained(report: ComparisonReport, fields: Mapping[str, Any], candidate: np.ndarray, json_path: str) -> str:
    """The case's explanation as a markdown section, its rows written beside its JSON report; empty
    when it is bit-exact or cannot be explained (:func:`~moegrad.accuracy.explain_case`)."""
    explanation = explain_case(report, fields, candidate)[1]
    if explanation is None:
        return ""
    with open(explanation_json_path(json_path), "w", encoding="utf-8") as file:
        json.dump(explanation.to_dict(), file, indent=2, allow_nan=False)
        file.write("\n")
    return "\n" + explanation_markdown(explanation)


def _nbytes(inputs: Inputs) -> int:
    fields, candidate = inputs
    return candidate.nbytes + sum(value.nbytes for value in fields.values() if isinstance(value, np.ndarray))


def _prepare() -> None:
    """A plot worker's first task, run as it starts: its imports, before the first case arrives."""
    import matplotlib.figure  # noqa: F401  (the ``plot`` extra: present, or no case is plotted)


def _worker() -> Worker:
    """A started plot worker (its imports begin at once) and the list of its tasks."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    return pool, [pool.submit(_prepare)]


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
        if not self._drawable and plots != "none":
            self._note = PLOT_MISSING
        else:
            self._note = f"not drawn: --plots {plots}" + (
                " draws the failed cases'" if plots == "failing" else "; --plots failing draws the failed cases'"
            )
        self._plotters: list[Worker] = []
        if self._drawable and plots == "all":
            self._plotters.append(_worker())
        self._plotted: list[tuple[str, Future[None]]] = []
        self._work: queue.SimpleQueue[tuple[CaseResult, Inputs | None] | None] = queue.SimpleQueue()
        self._held = 0  # bytes of the inputs waiting in self._work (under self._lock)
        self._lock = threading.Lock()
        self._error: str | None = None
        self._stopped = False
        self._writer = threading.Thread(target=self._write_all, name="moegrad-reports", daemon=True)
        self._writer.start()

    def add(
        self, result: CaseResult, fields: Mapping[str, Any] | None = None, candidate: np.ndarray | None = None
    ) -> None:
        """Hand over a judged case's reports (a case without a report, invalid or not judged, has
        none), with its inputs as the sweep read them (kept while at most :data:`HELD_BYTES` wait;
        else its file is read again)."""
        if result.report is None or result.path is None:
            return
        if self._drawable and (self.plots == "all" or (self.plots == "failing" and result.status == "fail")):
            self._plot(result)  # read again in the worker: a plot worker is sent no arrays
            return
        inputs = None
        if fields is not None and candidate is not None:
            with self._lock:
                if self._held + _nbytes((fields, candidate)) <= HELD_BYTES:
                    inputs, self._held = (fields, candidate), self._held + _nbytes((fields, candidate))
        self._work.put((result, inputs))

    def _write_all(self) -> None:
        while (work := self._work.get()) is not None:
            result, inputs = work
            if self._error is None and not self._stopped:
                try:
                    write_case(self.folder, result, self.order, self.explain, self._note, inputs)
                except OSError as exc:
                    self._error = f"cannot write --reports {self.folder}: {exc}"
            if inputs is not None:
                with self._lock:
                    self._held -= _nbytes(inputs)

    def _plot(self, result: CaseResult) -> None:
        """Hand a case with a plot to the plot worker with the fewest waiting, first starting
        another when each has :data:`PLOTS_PER_WORKER` waiting (or none is started)."""
        for _, tasks in self._plotters:
            tasks[:] = [task for task in tasks if not task.done()]
        waiting = sum(len(tasks) for _, tasks in self._plotters)
        most = max(1, min(PLOT_WORKERS, _cpus()))
        if len(self._plotters) < most and waiting >= PLOTS_PER_WORKER * len(self._plotters):
            self._plotters.append(_worker())
        pool, tasks = min(self._plotters, key=lambda worker: len(worker[1]))
        task = pool.submit(write_case, self.folder, result, self.order, self.explain, None)
        tasks.append(task)
        self._plotted.append((os.path.join(self.folder, result.name + ".md"), task))

    def close(self) -> None:
        """Wait for every report (the plots included).

        Raises:
            UsageError: a report could not be written (the first that failed, named).
        """
        self._work.put(None)
        self._writer.join()
        for markdown, plotted in self._plotted:
            try:
                plotted.result()
            except OSError as exc:
                self._error = self._error or f"cannot write --reports {markdown}: {exc}"
        for pool, _ in self._plotters:
            pool.shutdown()
        if self._error is not None:
            raise UsageError(self._error)

    def abandon(self) -> None:
        """Stop at once (an interrupted sweep): what is queued is dropped, the plots not begun are cancelled."""
        self._stopped = True
        self._work.put(None)
        self._writer.join(1.0)  # the report in hand: a millisecond
        for pool, _ in self._plotters:
            pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> CaseReports:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is not None:
            self.abandon()
