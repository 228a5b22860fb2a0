"""``moegrad compare --cases DIR`` and ``moegrad compare --merge``: sweeps (docs/accuracy.md, "Sweeps").

A sweep judges the ``.npz`` cases of a folder (its shard of them with ``--shard I/N``) through
``Client.compare_many`` (over every ``--url``) or in-process (``--local``); with ``--output FILE``
each judged case is written as it is known and a rerun skips what FILE records
(:mod:`moegrad.accuracy._ledger`). ``--merge`` joins shard files (:mod:`moegrad.accuracy._merge`).
The exit statuses (docs/accuracy.md, "Sweeps"), which deploy/sweep's Indexed Job is written against:

======  ==================================================================================
status  over all the cases of the run (its shard; for ``--merge``, the sweep), the first that applies
======  ==================================================================================
4       a case is not judged (no answer, 5xx, 401/403/404/408 ...), FILE is locked by another
        run, or (``--merge``) a shard file or a case is missing: Kubernetes retries the index
3       a case is invalid (unreadable, or the server answered 400/413/415/422): a retry answers the same
1       a case failed a standard
0       every case passed (warnings pass); with ``--exit-zero-on-findings`` (not for ``--merge``),
        every case was judged, whatever the verdicts (deploy/sweep's Job: its pods complete)
2       usage (bad flags, FILE written for another shard, files that are not one sweep)
70      an internal error (a bug in moegrad; :func:`moegrad.cli._main.main` says how to report it)
130/143 interrupted by SIGINT / SIGTERM: the lines written are whole; the workers finish the
        batch in hand for up to 2 s, then requests still in flight are abandoned (the process
        ends at once), so the command ends within seconds; interrupted once every case is
        judged, while the summary is written, each summary file is the old one or the new, whole
======  ==================================================================================

Every sweep writes a summary (:mod:`moegrad.accuracy._summary`): ``--summary PREFIX``, else
``DIR/summary``, else with ``--output FILE`` FILE without its extension + ``.summary`` (beside the
results file: the cases' folder may be read-only, or shared by the shards); a merge's, the first
PATH's folder's ``summary``. Every file a sweep writes has its folder created. What the console
says is :mod:`moegrad.cli._console`'s; each case's reports (``--reports``), :mod:`moegrad.cli._reports`'s.

Before it sends anything, a sweep asks every ``--url`` its device profile (``/v1/info``'s
``order``): the results file's header records them, and a sweep whose replicas differ is refused
(exit 2) while a case names no profile and ``--order`` gives it none.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from moegrad import Client, InvalidArgument, MoegradError, ReplicaStats
from moegrad.accuracy import (
    SWEEP_THREAD,
    CaseResult,
    MergeError,
    ProfilesDiffer,
    SummaryNotes,
    SweepFile,
    SweepFileBusy,
    SweepFileError,
    SweepHeader,
    compare_cases,
    compare_in_process,
    explaining_one,
    find_cases,
    merge_sweeps,
    refuse_mixed_profiles,
    shard_of,
    statuses,
)
from moegrad.cli._console import counted, make_folder, print_replicas, print_results, replica_notes
from moegrad.cli._parser import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TERMINATED,
    UsageError,
)
from moegrad.cli._reports import CaseReports

__all__ = ["run_cases", "run_merge", "sweep_status"]


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` in the main thread while the sweep runs."""

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread: leave SIGTERM as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_now_if_a_worker_is_left(status: int) -> None:
    """End the process with ``status`` at once when a sweep worker still waits on a request after
    the sweep's grace period: a daemon thread that wakes while the interpreter finalizes is ended
    by pthread_exit, which a C++ frame under it (a compiled kernel) may turn into an abort."""
    if any(t.name.startswith(SWEEP_THREAD) and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def sweep_status(results: Sequence[CaseResult], *, missing: bool = False) -> int:
    """The exit status of a sweep's results (the module's table): 4, 3, 1 or 0."""
    counts = statuses(results)
    if missing or counts["error"]:
        return EXIT_FAILURE
    if counts["invalid"]:
        return EXIT_REJECTED
    return EXIT_MISMATCH if counts["fail"] else EXIT_OK


def summary_prefix(args: argparse.Namespace) -> str:
    """Where a sweep's summary goes (the module's docstring): ``--summary``, else beside ``--output``
    FILE (its extension replaced by ``.summary``), else ``DIR/summary``."""
    if args.summary:
        return str(args.summary)
    if args.output:
        output = Path(args.output)
        return str(output.with_name(output.stem + ".summary"))
    return os.path.join(args.cases, "summary")


def run_cases(
    args: argparse.Namespace,
    *,
    open_client: Callable[[], Client],
    where: str,
    on_results: Callable[[Sequence[CaseResult]], None] | None = None,
) -> int:
    """``compare --cases DIR`` (with ``--shard``, ``--output``, ``--max-concurrency``, ``--reports``):
    judge, write, report; ``on_results`` is called with every case's result (``--html``) once the
    summary is written.

    Raises:
        UsageError: a folder or file that cannot be read or written, FILE written for another sweep.
    """
    try:
        files = find_cases(args.cases)
    except OSError as exc:
        raise UsageError(f"cannot read --cases {args.cases}: {exc}") from None
    index, count = args.shard or (0, 1)
    files = [file for file in files if shard_of(file.stem, count) == index]
    prefix = summary_prefix(args)
    make_folder(prefix, "--summary")
    reports = None
    if args.reports:
        reports = CaseReports(args.reports, args.plots or "none", args.order, explain=args.explain)
    client = None if args.local else open_client()
    try:
        header, ledger = _open_output(args, files, (index, count), client)
    except BaseException as exc:  # nothing judged: the client is closed
        if client is not None:
            client.close()
        if reports is not None:
            reports.abandon()
        if not isinstance(exc, SweepFileBusy):
            raise
        print(f"moegrad: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    with _sigterm_raises():
        try:
            results, stats = _judge(args, files, ledger, client, reports)
        except BaseException as exc:
            if reports is not None:
                reports.abandon()
            if not isinstance(exc, (KeyboardInterrupt, _Terminated)):
                raise
            written = f"; {counted(ledger.written)} written to {args.output}, run again to resume" if ledger else ""
            print(f"\nmoegrad: interrupted{written}", file=sys.stderr)
            status = EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_TERMINATED
            if ledger is not None:
                ledger.close()
            _exit_now_if_a_worker_is_left(status)
            return status
        finally:
            if ledger is not None:
                ledger.close()
        notes = SummaryNotes(header.standards, header.require_exact, replicas=replica_notes(stats))
        try:
            if reports is not None:
                reports.close()
            status = _report(args, results, ledger, len(files), prefix, notes, where, stats)
            if on_results is not None:
                on_results(results)
            return status
        except (KeyboardInterrupt, _Terminated) as exc:  # every case is judged (and written): only the summary is left
            if reports is not None:
                reports.abandon()
            kept = f"; every case is written to {args.output}" if ledger else ""
            print(f"\nmoegrad: interrupted while reporting{kept}; run again to report", file=sys.stderr)
            return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_TERMINATED


def _report(
    args: argparse.Namespace,
    results: list[CaseResult],
    ledger: SweepFile | None,
    cases: int,
    prefix: str,
    notes: SummaryNotes,
    where: str,
    stats: Sequence[ReplicaStats],
) -> int:
    """What a sweep that ran to its end prints and writes; its exit status."""
    if ledger is not None and ledger.skipped:
        print(f"skipped {ledger.skipped} of {counted(cases)} already judged in {args.output}")
    print_results(results, where, prefix, notes, verbose=args.verbose, urls=() if args.local else args.url)
    print(f"wrote {prefix}.csv and {prefix}.md" + (f"; reports in {args.reports}" if args.reports else ""))
    if ledger is not None:
        print(f"{counted(ledger.written)} written to {args.output}")
    if args.verbose and stats:
        print_replicas(stats)
    status = sweep_status(results)
    if args.exit_zero_on_findings and status in (EXIT_MISMATCH, EXIT_REJECTED):
        print(f"moegrad: every case judged: exit 0, not {status} (--exit-zero-on-findings)", file=sys.stderr)
        return EXIT_OK
    return status


def _open_output(
    args: argparse.Namespace, files: list[Path], shard: tuple[int, int], client: Client | None
) -> tuple[SweepHeader, SweepFile | None]:
    """The run's header (its policy, each replica's profile) and its results file (None without ``--output``).

    Raises:
        UsageError: replicas of different profiles for cases that name none (without ``--order``),
            an unknown standard, FILE written for another sweep or not openable.
        SweepFileBusy: another run holds FILE.
    """
    orders = {} if client is None else _replica_orders(client)
    try:
        refuse_mixed_profiles(orders, files, args.order)
        header = SweepHeader.of(
            cases=len(files), standards=args.standards, require_exact=args.require_exact, shard=shard, orders=orders
        )
    except (InvalidArgument, ProfilesDiffer) as exc:
        raise UsageError(str(exc)) from None
    if not args.output:
        return header, None
    try:
        return header, SweepFile(args.output, header)
    except SweepFileError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        if isinstance(exc, SweepFileBusy):
            raise
        raise UsageError(f"cannot open --output {args.output}: {exc}") from None


def _replica_orders(client: Client) -> dict[str, str | None]:
    """Each replica's profile (``Client.info()``'s ``orders``); none when no replica answers (the
    sweep then reports its cases not judged)."""
    try:
        return dict(client.info()["orders"])
    except MoegradError:
        return {}


def _judge(
    args: argparse.Namespace,
    files: list[Path],
    ledger: SweepFile | None,
    client: Client | None,
    reports: CaseReports | None,
) -> tuple[list[CaseResult], tuple[ReplicaStats, ...]]:
    """Every case's result, and each replica's counters (none in-process)."""
    on_judged = None if reports is None else reports.add
    if client is None:
        judge_one = compare_in_process(args.standards, args.require_exact, args.order)
        judge_one = explaining_one(judge_one) if args.explain else judge_one
        return compare_cases(files, judge_one, progress=args.progress, on_judged=on_judged, output=ledger), ()
    try:
        results = client.compare_many(  # interrupted, the client is left open: closing it could wait on a request
            files,
            standards=args.standards,
            require_exact=args.require_exact,
            order=args.order,
            progress=args.progress,
            on_judged=on_judged,
            concurrency=args.max_concurrency,
            output=ledger,
            explain=args.explain,
        )
    except ProfilesDiffer as exc:  # a replica changed its profile since it was asked: nothing was sent
        client.close()
        raise UsageError(str(exc)) from None
    client.close()
    return results, client.stats


def run_merge(args: argparse.Namespace, on_results: Callable[[Sequence[CaseResult]], None] | None = None) -> int:
    """``compare --merge PATH...`` (with ``--cases DIR`` to check coverage): one summary of a sweep's
    shards, what is missing said first; ``on_results`` is called with the merged results (``--html``)
    once it is written.

    Raises:
        UsageError: files that do not make one sweep, or that cannot be read; a summary that cannot be written.
    """
    first = Path(args.merge[0])
    prefix = args.summary or os.path.join(first if first.is_dir() else first.parent, "summary")
    make_folder(prefix, "--summary")
    try:
        cases = find_cases(args.cases) if args.cases else None
        merged = merge_sweeps(args.merge, cases)
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read the shard files or cases: {exc}") from None
    count = merged.header.shard[1]
    notes = SummaryNotes(
        merged.header.standards,
        merged.header.require_exact,
        missing=tuple(merged.missing),
        missing_cases=merged.missing_cases,
        missing_count=merged.missing_count,
    )
    where = f"{counted(len(merged.files), 'shard file')} of {count}"
    print_results(merged.results, where, prefix, notes, verbose=args.verbose)
    if merged.stale:
        print(f"left out {counted(merged.stale, 'line')} of cases that are gone or changed since")
    for what in merged.missing:
        print(f"moegrad: missing: {what}", file=sys.stderr)
    print(f"wrote {prefix}.csv and {prefix}.md")
    if on_results is not None:
        on_results(merged.results)
    return sweep_status(merged.results, missing=bool(merged.missing))
