"""Sweeps: judge a folder (or a list) of cases one after another, and never stop on a bad one.

:func:`compare_cases` loads each case (:func:`~moegrad.accuracy.load_case`), judges it in this
process (:func:`compare_in_process`) or, in batches, on a service (:func:`compare_batch_on`, which
``Client.compare_many`` passes its batch endpoint to), and classifies each outcome as a
:class:`~moegrad.accuracy.CaseResult`; docs/accuracy.md, "Bulk checking".
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from moegrad._errors import InvalidArgument, MalformedRequest, MoegradError
from moegrad._spec import MoeInitRoutingV2GradCall
from moegrad.accuracy._cases import CaseResult, load_case
from moegrad.accuracy._compare import compare, rejudge, report_context, with_context
from moegrad.accuracy._results import ComparisonReport

if TYPE_CHECKING:  # moegrad._results imports moegrad.accuracy: a type only, to keep the import one way
    from moegrad._results import CompareResult

__all__ = [
    "BATCH_BYTES",
    "BATCH_CASES",
    "CompareBatch",
    "CompareOne",
    "SendCompares",
    "compare_batch_on",
    "compare_cases",
    "compare_in_process",
]


class _Progress:
    """A one-line progress bar on a terminal (``[=====>    ] 12/40 name``); silent elsewhere."""

    def __init__(self, total: int, stream: TextIO | None, enabled: bool | None) -> None:
        self.total, self.stream = total, stream if stream is not None else sys.stderr
        self.enabled = (self.stream.isatty() and total > 1) if enabled is None else enabled
        self.started = time.monotonic()

    def show(self, done: int, name: str) -> None:
        if not self.enabled or not self.total:
            return
        width = 30
        filled = width * done // self.total
        elapsed = time.monotonic() - self.started
        eta = f", {elapsed / done * (self.total - done):.0f} s left" if done else ""
        self.stream.write(f"\r[{'=' * filled}{' ' * (width - filled)}] {done}/{self.total} {name[:40]:<40}{eta}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.total:
            self.stream.write("\n")
            self.stream.flush()


#: compare_one(name, fields, candidate) -> the report of one case (raise for a bad one).
CompareOne = Callable[[str, Mapping[str, Any], np.ndarray], ComparisonReport]


#: compare_batch([(name, fields, candidate), ...]) -> per case, its report or the exception it raised.
CompareBatch = Callable[[list[tuple[str, Mapping[str, Any], np.ndarray]]], list["ComparisonReport | Exception"]]
#: compare_cases sends a batch once it holds this many cases or this many input bytes.
BATCH_CASES = 64
BATCH_BYTES = 32 << 20


def compare_cases(
    cases: Iterable[str | os.PathLike[str] | tuple[str, Mapping[str, Any], np.ndarray]],
    compare_one: CompareOne | None = None,
    *,
    compare_batch: CompareBatch | None = None,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Judge every case, and never stop on a bad one.

    Args:
        cases: case files (:func:`load_case`) or ``(name, fields, candidate)`` tuples.
        compare_one: judges one case (``moegrad compare --cases`` passes the in-process comparison).
        compare_batch: judges many cases at once (``Client.compare_many`` passes the service's batch
            endpoint); cases are loaded and sent in batches of at most BATCH_CASES cases and about
            BATCH_BYTES bytes of inputs. Give this or ``compare_one``.
        progress: draw a progress bar on ``progress_stream``; None: when it is a terminal.
        progress_stream: default ``sys.stderr``.
        on_result: called with each case's result as it is known (e.g. to write its report).

    Returns:
        One :class:`CaseResult` per case, in the order given. A file that cannot be read or a call
        the operator rejects is ``"invalid"``; a service failure is ``"error"``.
    """
    if (compare_one is None) == (compare_batch is None):
        raise TypeError("give exactly one of compare_one and compare_batch")
    items = list(cases)
    bar = _Progress(len(items), progress_stream, progress)
    results: list[CaseResult] = []

    def done(result: CaseResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    pending: list[tuple[str, str | None, Mapping[str, Any], np.ndarray]] = []

    def flush() -> None:
        if not pending:
            return
        assert compare_batch is not None
        try:
            outcomes = compare_batch([(name, fields, candidate) for name, _, fields, candidate in pending])
        except MoegradError as exc:  # the whole batch failed (transport): each case is an error
            outcomes = [exc] * len(pending)
        for (name, path, _, _), outcome in zip(pending, outcomes, strict=True):
            done(_classified(name, path, outcome))
        pending.clear()

    try:
        for index, item in enumerate(items):
            name, path = (item[0], None) if isinstance(item, tuple) else (Path(item).stem, os.fspath(item))
            bar.show(index, name)
            loaded = _load(name, path, item)
            if isinstance(loaded, CaseResult):
                flush()  # keep the order of the results
                done(loaded)
                continue
            fields, candidate = loaded
            if compare_one is not None:
                try:
                    outcome: ComparisonReport | Exception = compare_one(name, fields, candidate)
                except MoegradError as exc:
                    outcome = exc
                except (TypeError, ValueError) as exc:
                    outcome = exc
                done(_classified(name, path, outcome))
                continue
            pending.append((name, path, fields, candidate))
            if len(pending) >= BATCH_CASES or sum(_nbytes(case) for case in pending) >= BATCH_BYTES:
                flush()
        flush()
        bar.show(len(items), "done")
    finally:
        bar.close()
    return results


def _nbytes(case: tuple[str, str | None, Mapping[str, Any], np.ndarray]) -> int:
    _, _, fields, candidate = case
    return int(candidate.nbytes) + sum(int(np.asarray(v).nbytes) for v in fields.values() if isinstance(v, np.ndarray))


def _load(name: str, path: str | None, item: Any) -> tuple[Mapping[str, Any], np.ndarray] | CaseResult:
    """The case's call fields and candidate, or its ``"invalid"`` result when it cannot be read."""
    try:
        return (item[1], item[2]) if path is None else load_case(path)
    except (OSError, ValueError) as exc:
        return CaseResult(name, "invalid", None, f"{type(exc).__name__}: {exc}", path)


def _classified(name: str, path: str | None, outcome: ComparisonReport | Exception) -> CaseResult:
    """A case's result: its report's verdict; ``"invalid"`` for a call the operator or moegrad
    refused; ``"error"`` for a failure of the service or the transport."""
    if isinstance(outcome, (InvalidArgument, MalformedRequest, TypeError, ValueError)):
        return CaseResult(name, "invalid", None, f"{type(outcome).__name__}: {outcome}", path)
    if isinstance(outcome, Exception):
        return CaseResult(name, "error", None, f"{type(outcome).__name__}: {outcome}", path)
    return CaseResult(name, outcome.verdict, outcome, None, path)


def compare_in_process(standards: Iterable[str] | str | None = None, require_exact: bool = False) -> CompareOne:
    """A ``compare_one`` for :func:`compare_cases` that judges each case in this process (:func:`compare`),
    against the bit-exact emulation, and records its :class:`ReportContext`."""

    def one(name: str, fields: Mapping[str, Any], candidate: np.ndarray) -> ComparisonReport:
        call = MoeInitRoutingV2GradCall(**fields)
        report = compare(call, candidate, standards=standards, require_exact=require_exact)
        return with_context(report, report_context(call, candidate, case=name))

    return one


#: send([(call, candidate), ...]) -> per pair, in order, the service's answer or the exception that case earned.
SendCompares = Callable[[list[tuple[MoeInitRoutingV2GradCall, np.ndarray]]], Sequence["CompareResult | MoegradError"]]


def compare_batch_on(send: SendCompares, *, require_exact: bool, server_url: str) -> CompareBatch:
    """A ``compare_batch`` for :func:`compare_cases` that judges each batch of cases with one call of ``send``.

    ``Client.compare_many`` passes a ``send`` that asks its service's batch endpoint
    (``Client.batch`` with a ``BatchCompare`` per case). Each case's call is validated here first:
    one the operator refuses (InvalidArgument, MalformedRequest, TypeError, ValueError) is that
    case's outcome and is not sent.

    Args:
        send: judges calls with their candidates on the service, one answer per pair, in order.
        require_exact: each verdict fails unless the candidate is bit-exact (:func:`rejudge`).
        server_url: the service's root URL, recorded in each report's context.

    Returns:
        ``compare_batch(chunk)``: per case, its report (with its :class:`ReportContext`: the inputs'
        SHA-256, the server, the time) or the exception it earned.
    """

    def judged(chunk: list[tuple[str, Mapping[str, Any], np.ndarray]]) -> list[ComparisonReport | Exception]:
        outcomes: list[ComparisonReport | Exception | None] = [None] * len(chunk)
        pairs: list[tuple[MoeInitRoutingV2GradCall, np.ndarray]] = []
        sent: list[int] = []
        for index, (_, fields, candidate) in enumerate(chunk):
            try:
                call = MoeInitRoutingV2GradCall(**fields)
            except (InvalidArgument, MalformedRequest, TypeError, ValueError) as exc:
                outcomes[index] = exc.with_traceback(None)  # a cycle through ``outcomes`` otherwise
                continue
            pairs.append((call, candidate))
            sent.append(index)
        for index, (call, _), answer in zip(sent, pairs, send(pairs), strict=True):
            if isinstance(answer, Exception):
                outcomes[index] = answer
                continue
            name, _, candidate = chunk[index]
            report = rejudge(answer.report, require_exact=True) if require_exact else answer.report
            context = report_context(
                call,
                candidate,
                backend=answer.backend,
                device=answer.device,
                server_url=server_url,
                order=answer.order,
                case=name,
            )
            outcomes[index] = with_context(report, context)
        assert all(outcome is not None for outcome in outcomes)
        return outcomes  # type: ignore[return-value]  # every slot filled above

    return judged
