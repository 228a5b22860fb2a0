"""What a sweep (or a merge) says when it ends: its summary files, the console's lines, the replicas' notes.

The console lists the cases that did not pass, in the summary's order (real failures first;
``--verbose``: every case), and says in one line that no replica was reachable rather than once per
case; a case's name and message are shown with their control characters made visible
(:func:`~moegrad.accuracy.console_text`). A replica that failed the sweep is named once, at the end,
on stderr and in the summary (:func:`replica_notes`): set aside and back, or lost (its last attempt
failed, or its address left a ``dns+`` name's), with the failed attempts and the calls moved to
other replicas; ``--verbose`` then prints every replica's counters (``client.stats``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from moegrad import ReplicaStats
from moegrad.accuracy import (
    CaseResult,
    SummaryNotes,
    analyse_factors,
    console_text,
    statuses,
    worst_first,
    write_summary,
)
from moegrad.cli._parser import UsageError

__all__ = ["counted", "make_folder", "print_replicas", "print_results", "replica_notes"]

#: How a case that no replica answered reads (:func:`moegrad.http._status.error_from_transport`'s message).
_UNREACHABLE = "TransportError: cannot reach "


def counted(count: int, noun: str = "case") -> str:
    """``"1 case"``, ``"2 cases"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def make_folder(path: str, flag: str) -> None:
    """Create the folder ``path`` is written in (``flag`` names it in the message).

    Raises:
        UsageError: the folder cannot be created (a file of that name, no permission).
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write {flag} {path}: cannot create its folder {folder}: {exc}") from None


def replica_notes(stats: Sequence[ReplicaStats]) -> tuple[str, ...]:
    """A line per replica that failed an attempt (none when no replica answered at all: the
    sweep says that no replica was reachable instead)."""
    if not any(s.served for s in stats):
        return ()
    notes = []
    for s in stats:
        if not s.failures:
            continue
        if s.gone:
            what = "lost (its address left the name's)"
        elif s.failures_in_a_row:
            what = "lost (no answer since it failed)"
        else:
            what = "set aside, then answered again"
        moved = counted(s.moved, "call")
        notes.append(
            f"replica {s.url} {what}: {counted(s.failures, 'failed attempt')}, {moved} moved to other replicas"
        )
    return tuple(notes)


def print_replicas(stats: Sequence[ReplicaStats]) -> None:
    """``--verbose``: each replica's counters, after the cases."""
    print("replicas:")
    for s in stats:
        state = " (gone)" if s.gone else " (set aside)" if s.set_aside_until is not None else ""
        print(f"  {s.url}{state}  served {s.served}, failures {s.failures}, moved {s.moved}")


def _write_summary(results: Sequence[CaseResult], prefix: str, notes: SummaryNotes) -> list[CaseResult]:
    """PREFIX.csv and PREFIX.md, each written beside its place and then moved there: a run stopped
    while writing them leaves each file whole, the old one or the new."""
    paths = (prefix + ".csv", prefix + ".md")
    partial = [f"{path}.{os.getpid()}.partial" for path in paths]
    try:
        ordered = write_summary(results, partial[0], partial[1], notes)
        for written, path in zip(partial, paths, strict=True):
            os.replace(written, path)
    finally:
        for written in partial:
            with contextlib.suppress(OSError):
                os.unlink(written)
    return ordered


def print_results(
    results: Sequence[CaseResult],
    where: str,
    prefix: str | None,
    notes: SummaryNotes,
    *,
    verbose: bool,
    urls: Sequence[str] = (),
) -> list[CaseResult]:
    """The console lines of a sweep (and its summary files): the counts, then each case that did not
    pass in the summary's order (every case with ``verbose``), one line for the cases no replica
    answered, and the replicas' notes on stderr.

    Raises:
        UsageError: a summary file cannot be written.
    """
    try:
        ordered = worst_first(results) if prefix is None else _write_summary(results, prefix, notes)
    except OSError as exc:
        raise UsageError(f"cannot write --summary {prefix}: {exc}") from None
    counts = statuses(ordered)
    missing = notes.missing_count if notes.missing_count is not None else len(notes.missing_cases)
    parts = [f"{n} {s}" for s, n in counts.items() if n] + ([f"{missing} missing"] if missing else [])
    print(f"{counted(len(ordered) + missing)} against {where}: " + ", ".join(parts))
    factors = analyse_factors(ordered)  # which conditions separate the failing cases from the passing ones
    if factors.failing and factors.passing:
        print("\n".join(console_text(line) for line in factors.lines()))
    unreachable = {id(r) for r in ordered if r.status == "error" and (r.error or "").startswith(_UNREACHABLE)}
    for result in ordered:
        if (result.status in ("pass", "warning") or id(result) in unreachable) and not verbose:
            continue
        worst = None if result.report is None else result.report.candidate_vs_golden.worst  # None: error says why
        detail = result.error or (worst and f"worst row {worst.row}") or ""
        print(f"  {result.status:<8} {console_text(result.name)}  {console_text(detail)}")
    if unreachable and not verbose:
        print(f"  error    {counted(len(unreachable))} not judged: no replica reachable")
    passing = counts["pass"] + counts["warning"]
    if passing and not verbose:
        print(f"  ({counted(passing, 'passing case')} not listed; --verbose lists every case)")
    for result in ordered:
        if result.status == "error" and id(result) not in unreachable:
            error = console_text(result.error or "")
            print(f"moegrad: not judged: {console_text(result.name)}: {error}", file=sys.stderr)
    if unreachable:
        print(
            f"moegrad: no replica reachable: {', '.join(urls) or where}; start a server or check --url",
            file=sys.stderr,
        )
    for note in notes.replicas:
        print(f"moegrad: {console_text(note)}", file=sys.stderr)
    return ordered
