"""Sweeps: judge a folder (or a list) of cases, several at a time, and never stop on a bad one.

:func:`compare_cases` (and :func:`acompare_cases`, for asyncio) loads each case
(:func:`~moegrad.accuracy.load_case`), judges it in this process (:func:`compare_in_process`) or,
in batches, on a service (:func:`moegrad.accuracy._batches.compare_batch_on`, which
``Client.compare_many`` passes its batch endpoint to), and classifies each outcome as a
:class:`~moegrad.accuracy.CaseResult`; docs/accuracy.md, "Bulk checking" and "Sweeps".

The batches are judged by ``concurrency`` worker threads (daemon threads: an interrupted sweep never
waits for a request in flight) or asyncio tasks; the loading stays one case ahead of them at most
``concurrency`` batches, so memory is bounded. Each result is recorded under one lock: its line in
the results file (:class:`~moegrad.accuracy.SweepFile`) written whole, the progress line,
``on_result`` (and ``on_judged``, with the inputs as read: for work that needs them again without
reading the case file twice, such as each case's report). Once the sweep is stopped (Ctrl-C:
KeyboardInterrupt in the main thread, or a cancelled task), nothing more is recorded, so a case is
written whole or not at all.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from moegrad._errors import InvalidArgument, MalformedRequest, MoegradError
from moegrad.accuracy._batches import AsyncCompareBatch, Case, CompareBatch, fields_with_order
from moegrad.accuracy._cases import CaseResult, case_digest, case_from_bytes, fields_digest, read_case_bytes
from moegrad.accuracy._compare import compare
from moegrad.accuracy._context import report_context, with_context
from moegrad.accuracy._ledger import SweepFile
from moegrad.accuracy._results import ComparisonReport
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = [
    "BATCH_BYTES",
    "BATCH_CASES",
    "BATCH_MIN_CASES",
    "STOP_GRACE_S",
    "SWEEP_THREAD",
    "CompareOne",
    "acompare_cases",
    "compare_cases",
    "compare_in_process",
]

#: compare_one(name, fields, candidate) -> the report of one case (raise for a bad one).
CompareOne = Callable[[str, Mapping[str, Any], np.ndarray], ComparisonReport]
#: A batch holds at most this many cases and about this many input bytes ...
BATCH_CASES = 64
BATCH_BYTES = 32 << 20
#: ... and, so that a sweep spreads over its workers, about total / (2 x concurrency) cases, at least this many.
BATCH_MIN_CASES = 8
_DRAW_EVERY_S = 0.1
_POLL_S = 0.1
#: The names of the sweep's worker threads start with this.
SWEEP_THREAD = "moegrad-sweep"
#: Seconds an interrupted sweep waits for its workers to finish the batch in hand.
STOP_GRACE_S = 2.0


class _Progress:
    """One progress line on a terminal: ``[=====     ] 12/40 cases, 35.2 cases/s, 1 failed, 0 invalid, 0 errors``."""

    def __init__(self, total: int, stream: TextIO | None, enabled: bool | None) -> None:
        self.total, self.stream = total, stream if stream is not None else sys.stderr
        self.enabled = (self.stream.isatty() and total > 1) if enabled is None else enabled
        self.started = self.drawn = time.monotonic()

    def show(self, done: int, judged: int, failed: int, invalid: int, errors: int, *, final: bool = False) -> None:
        """``done`` of total, ``judged`` by this run (the rate), ``failed`` (a standard failed),
        ``invalid`` (unreadable or refused), ``errors`` (not judged), each counting the cases a
        resumed run skips as their recorded status (as the summary does); drawn at most every
        0.1 s, and at the end."""
        now = time.monotonic()
        if not self.enabled or not self.total or (not final and now - self.drawn < _DRAW_EVERY_S):
            return
        self.drawn = now
        width = 30
        filled = width * done // self.total
        elapsed = max(now - self.started, 1e-9)
        rate = judged / elapsed
        eta = f", {(self.total - done) / rate:.0f} s left" if rate and done < self.total else ""
        self.stream.write(
            f"\r[{'=' * filled}{' ' * (width - filled)}] {done}/{self.total} cases, {rate:.1f} cases/s, "
            f"{failed} failed, {invalid} invalid, {errors} errors{eta}  "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.total:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class _Pending:
    """A loaded case waiting to be judged."""

    position: int
    name: str
    path: str | None
    digest: str | None
    fields: Mapping[str, Any]
    candidate: np.ndarray

    @property
    def nbytes(self) -> int:
        arrays = [self.candidate, *(v for v in self.fields.values() if isinstance(v, np.ndarray))]
        return sum(int(np.asarray(a).nbytes) for a in arrays)


#: ``on_judged(result, fields, candidate)``: a judged case's result with its inputs as read.
OnJudged = Callable[[CaseResult, Mapping[str, Any], np.ndarray], None]


class _Sweep:
    """What both drivers share: loading the cases into batches, and recording each result once."""

    def __init__(
        self,
        cases: Iterable[Case],
        *,
        batch_cases: int | None,
        concurrency: int,
        progress: bool | None,
        progress_stream: TextIO | None,
        on_result: Callable[[CaseResult], None] | None,
        output: SweepFile | None,
        on_judged: OnJudged | None = None,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency={concurrency!r} must be an int >= 1")
        self.items = list(cases)
        self.concurrency, self.output, self.on_result, self.on_judged = concurrency, output, on_result, on_judged
        wanted = math.ceil(len(self.items) / (2 * concurrency))
        self.batch_cases = batch_cases or min(BATCH_CASES, max(BATCH_MIN_CASES, wanted))
        self.results: list[CaseResult | None] = [None] * len(self.items)
        self.bar = _Progress(len(self.items), progress_stream, progress)
        self._lock = threading.Lock()
        self._stopped = False
        self.done = self.judged = self.failed = self.invalid = self.errors = 0

    def batches(self) -> Iterator[list[_Pending]]:
        """Load the cases in turn: record the skipped (already in the output) and unreadable ones,
        and yield the others in batches to judge."""
        pending: list[_Pending] = []
        size = 0
        for position, item in enumerate(self.items):
            if self._stopped:
                return
            if isinstance(item, tuple):
                name, path, fields, candidate = item[0], None, item[1], item[2]
                digest: str | None = fields_digest(fields, candidate)
            else:
                name, path = Path(item).stem, os.fspath(item)
                try:
                    data = read_case_bytes(path)  # refused by its length before it is read
                except (OSError, ValueError) as exc:
                    self.record(position, _invalid(name, exc, path), None)
                    continue
                digest = case_digest(data)
            recorded = None if self.output is None else self.output.recorded(name, digest)
            if recorded is not None:
                self.record(position, recorded, digest, skipped=True)
                continue
            if path is not None:
                try:
                    fields, candidate = case_from_bytes(data, path)
                except ValueError as exc:
                    self.record(position, _invalid(name, exc, path), digest)
                    continue
            pending.append(_Pending(position, name, path, digest, fields, candidate))
            size += pending[-1].nbytes
            if len(pending) >= self.batch_cases or size >= BATCH_BYTES:
                yield pending
                pending, size = [], 0
        if pending:
            yield pending

    def record(
        self,
        position: int,
        result: CaseResult,
        digest: str | None,
        *,
        skipped: bool = False,
        inputs: tuple[Mapping[str, Any], np.ndarray] | None = None,
    ) -> None:
        """Record one case's result, once: the results file's line, the progress line, ``on_result``
        (and ``on_judged`` with ``inputs``, the case as read)."""
        with self._lock:
            if self._stopped:
                return
            self.results[position] = result
            self.done += 1
            self.failed += result.status == "fail"  # a skipped case's recorded status too: as the summary counts
            self.invalid += result.status == "invalid"
            self.errors += result.status == "error"
            if skipped:
                assert self.output is not None
                self.output.skipped += 1
            else:
                self.judged += 1
                if self.output is not None:
                    self.output.append(result, digest)
                if self.on_result is not None:
                    self.on_result(result)
                if self.on_judged is not None and inputs is not None:
                    self.on_judged(result, *inputs)
            self.bar.show(self.done, self.judged, self.failed, self.invalid, self.errors)

    def record_batch(self, batch: list[_Pending], outcomes: Sequence[ComparisonReport | Exception]) -> None:
        for case, outcome in zip(batch, outcomes, strict=True):
            result = _classified(case.name, case.path, outcome)
            self.record(case.position, result, case.digest, inputs=(case.fields, case.candidate))

    def stop(self) -> None:
        """Record nothing more (a result being recorded now is finished first)."""
        with self._lock:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def finish(self) -> list[CaseResult]:
        self.bar.show(self.done, self.judged, self.failed, self.invalid, self.errors, final=True)
        self.bar.close()
        assert all(result is not None for result in self.results)
        return self.results  # type: ignore[return-value]  # every slot recorded


def _judge_one(compare_one: CompareOne, batch: list[_Pending]) -> list[ComparisonReport | Exception]:
    outcomes: list[ComparisonReport | Exception] = []
    for case in batch:
        try:
            outcomes.append(compare_one(case.name, case.fields, case.candidate))
        except (MoegradError, TypeError, ValueError) as exc:
            outcomes.append(exc)
    return outcomes


def _run_threads(sweep: _Sweep, judge: Callable[[list[_Pending]], list[ComparisonReport | Exception]]) -> None:
    """Judge the sweep's batches on ``sweep.concurrency`` daemon threads; the caller's thread loads them.

    Stopped (an exception in the caller's thread, KeyboardInterrupt say), the workers end after
    their batch in hand, and the caller waits for them up to STOP_GRACE_S seconds: a worker still
    waiting on a request then is abandoned (a daemon thread; its result is not recorded)."""
    work: queue.Queue[list[_Pending] | None] = queue.Queue(maxsize=sweep.concurrency)
    failures: list[BaseException] = []

    def worker() -> None:
        while not sweep.stopped:
            try:
                batch = work.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                try:
                    outcomes = judge(batch)
                except MoegradError as exc:  # the whole batch failed (transport): each case is an error
                    outcomes = [exc] * len(batch)
                sweep.record_batch(batch, outcomes)
            except BaseException as exc:  # a bug: stop the sweep and raise it in the caller's thread
                failures.append(exc)
                sweep.stop()

    threads = [
        threading.Thread(target=worker, name=f"{SWEEP_THREAD}-{i}", daemon=True) for i in range(sweep.concurrency)
    ]
    for thread in threads:
        thread.start()
    try:
        for item in _then_stop(sweep.batches(), len(threads)):
            while not sweep.stopped:
                try:
                    work.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
        for thread in threads:
            while thread.is_alive():
                thread.join(_POLL_S)
    except BaseException:
        sweep.stop()
        grace_ends = time.monotonic() + STOP_GRACE_S
        for thread in threads:
            thread.join(max(0.0, grace_ends - time.monotonic()))
        raise
    if failures:
        raise failures[0]


def _then_stop(batches: Iterator[list[_Pending]], workers: int) -> Iterator[list[_Pending] | None]:
    yield from batches
    yield from [None] * workers


async def _run_tasks(sweep: _Sweep, judge: AsyncCompareBatch) -> None:
    """Judge the sweep's batches in ``sweep.concurrency`` tasks; the cases are loaded in a thread."""
    work: asyncio.Queue[list[_Pending] | None] = asyncio.Queue(maxsize=sweep.concurrency)

    async def worker() -> None:
        while (batch := await work.get()) is not None:
            try:
                outcomes = await judge([(case.name, case.fields, case.candidate) for case in batch])
            except MoegradError as exc:
                outcomes = [exc] * len(batch)
            sweep.record_batch(batch, outcomes)

    tasks = [asyncio.create_task(worker()) for _ in range(sweep.concurrency)]
    batches = sweep.batches()
    try:
        while (batch := await asyncio.to_thread(next, batches, None)) is not None:
            await _put_or_raise(work, batch, tasks)
        for _ in tasks:
            await _put_or_raise(work, None, tasks)
        await asyncio.gather(*tasks)
    except BaseException:
        sweep.stop()
        for task in tasks:
            task.cancel()
        raise


async def _put_or_raise(work: asyncio.Queue[Any], item: Any, tasks: list[asyncio.Task[None]]) -> None:
    """``work.put(item)``, raising a worker's exception instead of waiting for a worker that died."""
    put = asyncio.ensure_future(work.put(item))
    while not put.done():
        await asyncio.wait([put, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done() and task.exception() is not None:
                put.cancel()
                raise task.exception()  # type: ignore[misc]


def compare_cases(
    cases: Iterable[Case],
    compare_one: CompareOne | None = None,
    *,
    compare_batch: CompareBatch | None = None,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
    concurrency: int = 1,
    output: SweepFile | None = None,
    on_judged: OnJudged | None = None,
) -> list[CaseResult]:
    """Judge every case, and never stop on a bad one.

    Args:
        cases: case files (:func:`load_case`) or ``(name, fields, candidate)`` tuples.
        compare_one: judges one case (``moegrad compare --cases`` passes the in-process comparison).
        compare_batch: judges many cases at once (``Client.compare_many`` passes the service's batch
            endpoint); cases are loaded and sent in batches of at most BATCH_CASES cases and about
            BATCH_BYTES bytes of inputs (fewer, down to BATCH_MIN_CASES, when a sweep has few cases
            per worker). Give this or ``compare_one``.
        progress: draw a progress line (done/total, cases/s, failed, invalid, errors) on ``progress_stream``;
            None: when it is a terminal.
        progress_stream: default ``sys.stderr``.
        on_result: called with each case's result as it is known, one at a time (from a worker
            thread, in the order the cases are judged; not for the cases ``output`` skips).
        concurrency: batches (or cases, with ``compare_one``) judged at once, each on a thread.
        output: the results file: each judged case's line is written as it is known, and a case
            that it records with its file's digest is skipped (its recorded result returned).
        on_judged: called as ``on_judged(result, fields, candidate)`` right after ``on_result``, for
            each case judged (not an unreadable one), with its inputs as read: work that needs them
            again (each case's report) then reads no file twice. It must not keep them longer than
            it needs them: a sweep's memory is bounded by what it holds.

    Returns:
        One :class:`CaseResult` per case, in the order given. A file that cannot be read or a call
        the operator rejects is ``"invalid"``; a service failure is ``"error"``.

    Raises:
        KeyboardInterrupt: the sweep was interrupted; every case recorded by then is in ``output``,
            whole, and nothing more is recorded.
        ValueError: ``concurrency`` is not an int >= 1.
    """
    if (compare_one is None) == (compare_batch is None):
        raise TypeError("give exactly one of compare_one and compare_batch")
    sweep = _Sweep(
        cases,
        batch_cases=1 if compare_one is not None else None,
        concurrency=concurrency,
        progress=progress,
        progress_stream=progress_stream,
        on_result=on_result,
        output=output,
        on_judged=on_judged,
    )
    if compare_one is not None:
        _run_threads(sweep, lambda batch: _judge_one(compare_one, batch))
    else:
        assert compare_batch is not None
        _run_threads(sweep, lambda batch: compare_batch([(c.name, c.fields, c.candidate) for c in batch]))
    return sweep.finish()


async def acompare_cases(
    cases: Iterable[Case],
    *,
    compare_batch: AsyncCompareBatch,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
    concurrency: int = 1,
    output: SweepFile | None = None,
    on_judged: OnJudged | None = None,
) -> list[CaseResult]:
    """:func:`compare_cases` with an awaited ``compare_batch``, its batches judged by ``concurrency``
    tasks (``AsyncClient.compare_many``). Raises CancelledError when cancelled, with every case
    recorded by then in ``output``, whole."""
    sweep = _Sweep(
        cases,
        batch_cases=None,
        concurrency=concurrency,
        progress=progress,
        progress_stream=progress_stream,
        on_result=on_result,
        output=output,
        on_judged=on_judged,
    )
    await _run_tasks(sweep, compare_batch)
    return sweep.finish()


def _invalid(name: str, exc: Exception, path: str | None) -> CaseResult:
    """The result of a case whose file cannot be read or is not a valid case."""
    return CaseResult(name, "invalid", None, f"{type(exc).__name__}: {exc}", path)


def _classified(name: str, path: str | None, outcome: ComparisonReport | Exception) -> CaseResult:
    """A case's result: its report's verdict; ``"invalid"`` for a call the operator or moegrad
    refused; ``"error"`` for a failure of the service or the transport."""
    if isinstance(outcome, (InvalidArgument, MalformedRequest, TypeError, ValueError)):
        return _invalid(name, outcome, path)
    if isinstance(outcome, Exception):
        return CaseResult(name, "error", None, f"{type(outcome).__name__}: {outcome}", path)
    return CaseResult(name, outcome.verdict, outcome, None, path)


def compare_in_process(
    standards: Iterable[str] | str | None = None, require_exact: bool = False, order: str | None = None
) -> CompareOne:
    """A ``compare_one`` for :func:`compare_cases` that judges each case in this process (:func:`compare`),
    against the bit-exact emulation, and records its :class:`ReportContext`. ``order``: the profile
    of the cases that name none (None: the default profile)."""

    def one(name: str, fields: Mapping[str, Any], candidate: np.ndarray) -> ComparisonReport:
        call = MoeInitRoutingV2GradCall(**fields_with_order(fields, order))
        report = compare(call, candidate, standards=standards, require_exact=require_exact)
        return with_context(report, report_context(call, candidate, case=name))

    return one
