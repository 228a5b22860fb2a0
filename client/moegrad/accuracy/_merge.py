"""The merge of a sweep's shard files into the results of one run (``moegrad compare --merge``).

Each shard of a sweep (``--shard I/N``) writes its own results file
(:mod:`moegrad.accuracy._ledger`); :func:`merge_sweeps` joins them into one list of
:class:`~moegrad.accuracy.CaseResult`, in the order a single run over the same folder gives (its
cases sorted by file name), so that :func:`~moegrad.accuracy.write_summary` writes the same rows.

- every header must agree on N, the standards and ``require_exact``, and each shard index must come
  from one file only; two files that record one case name with different digests conflict
  (:class:`MergeError`, the command's exit 2);
- within a file the last line for a case wins; a case recorded twice with one digest counts once;
- with the case files (``--cases DIR``), the expected cases are theirs with their current digests:
  one without a line is *missing*, a line for a case no longer there or of another digest is
  *stale* (left out, counted); without them, a shard is complete when it records as many cases as
  its last header says;
- either way, a shard index without a file is missing (the command's exit 4), named first with
  the file expected (``shard-I.jsonl`` in the folder given) and, with the case files, the count of
  its cases, which are not listed one by one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from moegrad.accuracy._cases import CaseResult, case_digest, read_case_bytes, shard_of
from moegrad.accuracy._ledger import CaseLine, SweepFileError, SweepHeader, read_sweep_file

__all__ = ["MergeError", "MergedSweep", "merge_sweeps", "shard_files"]


class MergeError(ValueError):
    """Files that do not make one sweep (the message names them and why)."""


@dataclasses.dataclass(frozen=True)
class MergedSweep:
    """A sweep's results joined from its shard files.

    Attributes:
        results: one per case, sorted by file name (the case name when there is no file).
        header: the sweep's N (``shard[1]``), standards and ``require_exact`` (the first header read).
        missing: what is not judged yet, the shards without a file first
            (``"shard I (no file): expected DIR/shard-I.jsonl; its K cases are not judged"``),
            then case names or, without the case files, ``"shard I (K of M cases)"``.
        stale: lines left out (their case is gone or has other bytes now).
        files: the shard files read.
        missing_cases: with the case files, each case not judged -> why (its shard has no file,
            or its shard's file has no line for it as its file is now); empty without them.
        missing_count: how many cases are not judged; None when a shard has no file and there
            are no case files to count its cases by.
    """

    results: list[CaseResult]
    header: SweepHeader
    missing: list[str]
    stale: int
    files: list[Path]
    missing_cases: dict[str, str] = dataclasses.field(default_factory=dict)
    missing_count: int | None = 0


def shard_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files named, a folder standing for its ``shard-*.jsonl`` (sorted); each file once.

    Raises:
        MergeError: a path that does not exist, or a folder without shard files.
    """
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(path.glob("shard-*.jsonl"))
            if not found:
                raise MergeError(f"{path} holds no shard-*.jsonl file")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise MergeError(f"{path}: no such file or folder")
    unique: dict[str, Path] = {}
    for file in files:
        unique.setdefault(os.path.realpath(file), file)
    return list(unique.values())


def _no_file(index: int, paths: Sequence[str | os.PathLike[str]], cases: int | None) -> str:
    """What a shard index without a file is missing: the file a folder given would hold, and its cases."""
    folders = [Path(path) for path in paths if Path(path).is_dir()]
    where = (
        f"expected {folders[0] / f'shard-{index}.jsonl'}" if folders else f"none of the files given is shard {index}'s"
    )
    judged = "" if cases is None else f"; its {cases} {'case is' if cases == 1 else 'cases are'} not judged"
    return f"shard {index} (no file): {where}{judged}"


def _order(result: CaseResult) -> str:
    """A single run's order: its case files sorted by name (a case without a file by its name)."""
    return os.path.basename(result.path) if result.path else result.name


def _digest(path: str | os.PathLike[str]) -> str | None:
    """A case file's digest as a sweep records it; None for a file longer than any case can be,
    which a sweep records invalid, unread, with no digest.

    Raises:
        OSError: the file cannot be read.
    """
    try:
        return case_digest(read_case_bytes(path))
    except ValueError:
        return None


def merge_sweeps(
    paths: Sequence[str | os.PathLike[str]], cases: Sequence[str | os.PathLike[str]] | None = None
) -> MergedSweep:
    """Join a sweep's shard files (see the module's docstring).

    Args:
        paths: shard files, or folders of ``shard-*.jsonl`` files.
        cases: the sweep's case files (``find_cases(DIR)``), to check coverage against; None: the
            headers' counts.

    Raises:
        MergeError: files that do not make one sweep (headers that disagree, a shard index in two
            files, one case with two digests), or a file that is not a results file.
        OSError: a file cannot be read.
    """
    files = shard_files(paths)
    header: SweepHeader | None = None
    by_index: dict[int, tuple[Path, SweepHeader, dict[str, CaseLine]]] = {}
    for file in files:
        try:
            runs = read_sweep_file(file)
        except SweepFileError as exc:
            raise MergeError(str(exc)) from None
        if not runs:
            raise MergeError(f"{file} is empty: no run wrote it")
        index = runs[-1][0].shard[0]
        for run_header, _ in runs:
            header = header or run_header
            if run_header.shard[1] != header.shard[1]:
                different: str | None = f"{run_header.shard[1]} shards"
            else:
                different = header.difference(dataclasses.replace(run_header, shard=header.shard))
            if different is not None:
                raise MergeError(f"{file} was written for {different}, unlike {files[0]}: not one sweep")
            if run_header.shard[0] != index:
                raise MergeError(f"{file} holds runs of shards {run_header.shard[0]} and {index}")
        if index in by_index:
            raise MergeError(f"shard {index} is in two files: {by_index[index][0]} and {file}")
        by_index[index] = (file, runs[-1][0], {line.result.name: line for _, lines in runs for line in lines})
    assert header is not None  # shard_files gives at least one file, and each holds a header
    chosen: dict[str, tuple[Path, CaseLine]] = {}
    for file, _, lines in by_index.values():
        for name, line in lines.items():
            if name in chosen and chosen[name][1].digest != line.digest:
                raise MergeError(
                    f"digest conflict: case {name} is {chosen[name][1].digest} in {chosen[name][0]} "
                    f"and {line.digest} in {file}"
                )
            chosen.setdefault(name, (file, line))
    count = header.shard[1]
    absent = [index for index in range(count) if index not in by_index]
    if cases is not None:
        return _against_cases(chosen, cases, paths, absent, count, header, files)
    results = [line.result for _, line in chosen.values()]
    missing = [_no_file(index, paths, None) for index in absent]
    short = 0
    for index in sorted(by_index):
        _, last, lines = by_index[index]
        if len(lines) < last.cases:
            missing.append(f"shard {index} ({len(lines)} of {last.cases} cases)")
            short += last.cases - len(lines)
    return MergedSweep(sorted(results, key=_order), header, missing, 0, files, {}, None if absent else short)


def _against_cases(
    chosen: dict[str, tuple[Path, CaseLine]],
    cases: Sequence[str | os.PathLike[str]],
    paths: Sequence[str | os.PathLike[str]],
    absent: list[int],
    count: int,
    header: SweepHeader,
    files: list[Path],
) -> MergedSweep:
    """The merge checked against the sweep's case files: each with a line of its current digest
    is judged; the others are missing, a shard without a file counted as one line."""
    expected = {Path(path).stem: _digest(path) for path in cases}
    unfiled = {index: 0 for index in absent}
    results = []
    late: list[str] = []
    why: dict[str, str] = {}
    for name, digest in expected.items():
        found = chosen.get(name)
        if found is not None and found[1].digest == digest:
            results.append(found[1].result)
        elif (index := shard_of(name, count)) in unfiled:
            unfiled[index] += 1
            why[name] = f"not judged: shard {index} has no file"
        else:
            late.append(name)
            why[name] = f"not judged: shard {index}'s file has no line for it as it is now"
    missing = [_no_file(index, paths, number) for index, number in unfiled.items()] + late
    stale = sum(1 for name, (_, line) in chosen.items() if expected.get(name) != line.digest)
    return MergedSweep(sorted(results, key=_order), header, missing, stale, files, why, len(why))
