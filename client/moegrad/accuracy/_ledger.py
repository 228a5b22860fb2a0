"""A sweep's results file: one JSON line per judged case, written as it is judged, read back to resume.

The format ``moegrad-sweep/1`` (docs/accuracy.md, "Sweeps"): UTF-8 JSON lines, appended only. A
header line, then one line per case judged; a run that resumes the file appends its case lines
after the last header, and a header of its own only when it is over another number of cases (the
folder changed: a merge reads a shard's count from its last header)::

    {"kind": "header", "format": "moegrad-sweep/1", "shard": {"index": 2, "count": 8}, "cases": 137,
     "standards": ["dual_thousandth", ...], "require_exact": false, "moegrad": "0.4.0",
     "started": "2026-07-14T09:12:03Z", "orders": {"http://10.0.3.7:8000": "ascend950@9.1"}}
    {"kind": "case", "case": "0042", "file": "cases/0042.npz", "digest": "sha256:<64 hex>",
     "status": "fail", "verdicts": {"dual_thousandth": "pass", ...}, "bit_exact": false,
     "error": null, "report": {<ComparisonReport.to_dict()>}, "server": "http://10.0.3.7:8000",
     "order": "ascend950@9.1", "time": "2026-07-14T09:12:05Z"}

``orders`` is each replica's device profile as the run found it before it sent anything (its
``/v1/info``'s ``order``; null: no answer; ``{}`` in-process); a case's ``order`` is the profile its
answer names, the one that judged it (its report's ``context.order``). A resumed run writes a header
of its own too when its replicas' profiles are not those of the last header.

Only judged cases are written (pass, warning, fail, invalid); a case the service did not judge
(``"error"``) is not, so that a later run judges it. Each line is written whole with one
``write``, then fsync'd. :class:`SweepFile` holds an exclusive ``fcntl.lockf`` lock on the file
while a run writes it (where the platform has one), cuts a torn last line (no newline) when it
opens it, and refuses a file written for another shard, other standards or another
``require_exact``. :func:`read_sweep_file` reads one back (the merge, :mod:`moegrad.accuracy._merge`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from moegrad._version import __version__
from moegrad.accuracy._cases import CaseResult, CaseStatus
from moegrad.accuracy._compare import _check_standards
from moegrad.accuracy._results import ComparisonReport

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FORMAT",
    "CaseLine",
    "SweepFile",
    "SweepFileBusy",
    "SweepFileError",
    "SweepHeader",
    "case_json",
    "read_sweep_file",
    "statuses",
    "sweep_output",
    "utc_now",
]

FORMAT = "moegrad-sweep/1"
_JUDGED: frozenset[str] = frozenset({"pass", "warning", "fail", "invalid"})


class SweepFileError(ValueError):
    """A results file that cannot be used for this run: not a sweep's, or written for another
    shard, other standards or another ``require_exact`` (the message says which and what to do)."""


class SweepFileBusy(OSError):
    """Another run holds the results file's lock."""


def utc_now() -> str:
    """Now, ISO 8601 in UTC to the second (``2026-07-14T09:12:03Z``)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class SweepHeader:
    """What a run over cases judged them for (a results file's header line).

    Attributes:
        shard: ``(index, count)``: the run judged the cases of shard ``index`` of ``count``
            (:func:`~moegrad.accuracy._cases.shard_of`); ``(0, 1)``: every case.
        cases: the cases of the run (its shard's) when it started.
        standards: the standards judged (the default list resolved when none was named).
        require_exact: verdicts fail unless the candidate is bit-exact.
        moegrad: the version that wrote it.
        started: when the run started (ISO 8601, UTC).
        orders: each replica's root URL -> its device profile (``/v1/info``'s ``order``; None: it
            did not answer), asked before the run sent anything; empty in-process. Not part of
            what makes two runs one sweep (:meth:`difference`).
    """

    shard: tuple[int, int]
    cases: int
    standards: tuple[str, ...]
    require_exact: bool
    moegrad: str = __version__
    started: str = dataclasses.field(default_factory=utc_now)
    orders: Mapping[str, str | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        *,
        cases: int,
        standards: Iterable[str] | str | None,
        require_exact: bool,
        shard: tuple[int, int] = (0, 1),
        orders: Mapping[str, str | None] | None = None,
    ) -> SweepHeader:
        """The header of a run starting now (``standards`` as :func:`moegrad.compare` takes them).

        Raises:
            InvalidArgument: an unknown standard (161002).
            TypeError: ``require_exact`` is not a bool.
        """
        if not isinstance(require_exact, bool):
            raise TypeError(f"require_exact must be a bool, got {type(require_exact).__name__}")
        return cls(
            shard=shard,
            cases=cases,
            standards=_check_standards(standards),
            require_exact=require_exact,
            orders=dict(orders or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "header",
            "format": FORMAT,
            "shard": {"index": self.shard[0], "count": self.shard[1]},
            "cases": self.cases,
            "standards": list(self.standards),
            "require_exact": self.require_exact,
            "moegrad": self.moegrad,
            "started": self.started,
            "orders": dict(self.orders),
        }

    @classmethod
    def from_json(cls, line: Mapping[str, Any]) -> SweepHeader:
        """Raises: ValueError (KeyError, TypeError, OverflowError) for a header that is not one."""
        if line.get("format") != FORMAT:
            raise ValueError(f"format {line.get('format')!r}, not {FORMAT!r}")
        shard, orders = line["shard"], line.get("orders") or {}
        if not isinstance(orders, dict):
            raise ValueError(f"orders {orders!r} is not a map")
        return cls(
            shard=(int(shard["index"]), int(shard["count"])),
            cases=int(line["cases"]),
            standards=tuple(str(name) for name in line["standards"]),
            require_exact=_boolean(line["require_exact"]),
            moegrad=str(line.get("moegrad", "")),
            started=str(line.get("started", "")),
            orders={str(url): None if order is None else str(order) for url, order in orders.items()},
        )

    def difference(self, other: SweepHeader) -> str | None:
        """How ``other``'s sweep differs from this one's (shard, standards, require_exact), or None."""
        if self.shard != other.shard:
            return f"shard {other.shard[0]}/{other.shard[1]}"
        if self.standards != other.standards:
            return f"standards {', '.join(other.standards)}"
        if self.require_exact != other.require_exact:
            return f"require_exact={other.require_exact}"
        return None


def _boolean(value: Any) -> bool:
    """A header's ``require_exact``: a JSON boolean, or the string ``"true"`` / ``"false"`` that
    an earlier writer may have put there (``bool("false")`` would read it as true).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"require_exact {value!r} is not a boolean")


@dataclasses.dataclass(frozen=True)
class CaseLine:
    """One case line read back: the case's result, its file's digest, who judged it and when."""

    result: CaseResult
    digest: str | None
    server: str | None
    time: str


def case_json(result: CaseResult, digest: str | None, time: str | None = None) -> dict[str, Any]:
    """A judged case's line (``result.status`` not ``"error"``)."""
    report = result.report
    return {
        "kind": "case",
        "case": result.name,
        "file": result.path,
        "digest": digest,
        "status": result.status,
        "verdicts": {} if report is None else {v.standard: v.status for v in report.verdicts},
        "bit_exact": None if report is None or report.exact is None else report.exact.bit_exact,
        "error": result.error,
        "report": None if report is None else report.to_dict(),
        "server": None if report is None or report.context is None else report.context.server_url,
        "order": None if report is None or report.context is None else report.context.order,
        "time": time or utc_now(),
    }


def _case_line(line: Mapping[str, Any]) -> CaseLine:
    """Raises: ValueError (KeyError, TypeError) for a line that is not a case's."""
    status = line["status"]
    if status not in _JUDGED:
        raise ValueError(f"status {status!r}")
    report = None if line.get("report") is None else ComparisonReport.from_dict(line["report"])
    path, error, digest = line.get("file"), line.get("error"), line.get("digest")
    result = CaseResult(
        str(line["case"]),
        status,
        report,
        None if error is None else str(error),
        None if path is None else str(path),
    )
    return CaseLine(result, None if digest is None else str(digest), line.get("server"), str(line.get("time", "")))


def _parse(data: bytes, where: str) -> list[tuple[SweepHeader, list[CaseLine]]]:
    """A results file's complete lines as runs: each header with the case lines after it.

    Raises:
        SweepFileError: a line that is not JSON (or nested too deep to read), a header or case line
            whose fields are not theirs, a case line before any header, an unknown kind.
    """
    runs: list[tuple[SweepHeader, list[CaseLine]]] = []
    # "\n" alone ends a line: str.splitlines would also split at U+2028, U+0085 ..., which JSON
    # leaves unescaped in a string (a case's name, a message) and a line of ours may hold
    for number, text in enumerate(data.decode("utf-8", errors="replace").split("\n"), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            kind = line.get("kind") if isinstance(line, dict) else None
            if kind == "header":
                runs.append((SweepHeader.from_json(line), []))
            elif kind == "case" and runs:
                runs[-1][1].append(_case_line(line))
            else:
                raise ValueError("a case line before any header" if kind == "case" else f"kind {kind!r}")
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            # OverflowError: a number no integer is (1e400 as a shard index); RecursionError: JSON
            # nested past the interpreter's limit
            raise SweepFileError(f"{where}:{number} is not a line of a {FORMAT} results file ({exc})") from None
    return runs


def read_sweep_file(path: str | os.PathLike[str]) -> list[tuple[SweepHeader, list[CaseLine]]]:
    """A results file's runs, each header with its case lines, in the order written (a torn last
    line, from a run that was stopped while writing it, is left out).

    Raises:
        OSError: the file cannot be read.
        SweepFileError: it is not a results file.
    """
    data = Path(path).read_bytes()
    return _parse(data[: data.rfind(b"\n") + 1], os.fspath(path))


class SweepFile:
    """A results file opened by one run: read back (resume), then appended to, under a lock.

    Args:
        path: the file (created, with its folder, when missing).
        header: this run's header, written once the file is checked when the file has none yet,
            or when its last one is over another number of cases; a run that resumes the file
            otherwise appends case lines only.

    Attributes:
        judged: per case name, its last case line in the file (before this run's).
        torn_bytes: bytes of a torn last line that were cut off (0: none).
        skipped: cases the run skipped because a line records them (the sweep counts them).
        written: case lines this run wrote.

    Raises:
        SweepFileBusy: another process holds the lock (a run still writing it).
        SweepFileError: not a results file, or one written for another shard, other standards or
            another ``require_exact``.
        OSError: the file cannot be opened, read or written.
    """

    def __init__(self, path: str | os.PathLike[str], header: SweepHeader) -> None:
        self.path, self.header = Path(path), header
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lock()
            data = self._read_all()
            end = data.rfind(b"\n") + 1
            self.torn_bytes = len(data) - end
            runs = _parse(data[:end], os.fspath(self.path))
            for earlier, _ in runs:
                different = header.difference(earlier)
                if different is not None:
                    raise SweepFileError(
                        f"{self.path} was written for {different}; this run is for shard "
                        f"{header.shard[0]}/{header.shard[1]}, standards {', '.join(header.standards)}, "
                        f"require_exact={header.require_exact}; choose another --output"
                    )
            if self.torn_bytes:
                os.ftruncate(self._fd, end)
                warning = f"moegrad: warning: cut a torn last line ({self.torn_bytes} bytes) off {self.path}"
                print(warning, file=sys.stderr)
            self.judged: dict[str, CaseLine] = {line.result.name: line for _, lines in runs for line in lines}
            self.skipped = self.written = 0
            last = runs[-1][0] if runs else None
            # a new file, a folder that changed, or replicas of other profiles
            if last is None or last.cases != header.cases or (header.orders and last.orders != header.orders):
                self._write(header.to_json())
        except BaseException:
            os.close(self._fd)
            raise

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover - Windows
            return
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise SweepFileBusy(f"{self.path} is being written by another run (its lock is held: {exc})") from None

    def _read_all(self) -> bytes:
        chunks, offset = [], 0
        while chunk := os.pread(self._fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def _write(self, line: Mapping[str, Any]) -> None:
        data = (json.dumps(line, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:  # one write for a regular file; the loop only covers a short write
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def recorded(self, name: str, digest: str | None) -> CaseResult | None:
        """The recorded result of the case ``name`` whose file's digest is ``digest``, or None
        (not judged yet, judged with other bytes, or no digest: a file that could not be read)."""
        line = self.judged.get(name)
        return line.result if line is not None and digest is not None and line.digest == digest else None

    def append(self, result: CaseResult, digest: str | None) -> None:
        """Write a judged case's line (whole, fsync'd); a case not judged (``"error"``) is not written."""
        if result.status == "error":
            return
        self._write(case_json(result, digest))
        self.written += 1

    def close(self) -> None:
        """Release the lock and close the file."""
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the lockf lock
            self._fd = -1

    def __enter__(self) -> SweepFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def sweep_output(
    output: str | os.PathLike[str] | SweepFile | None,
    *,
    cases: int,
    standards: Iterable[str] | str | None,
    require_exact: bool,
    orders: Mapping[str, str | None] | None = None,
) -> Iterator[SweepFile | None]:
    """``output`` as a :class:`SweepFile` for a run over ``cases`` cases (a path is opened for every
    case, shard 0/1, with the replicas' ``orders`` in its header, and closed after; a SweepFile is
    used as it is; None stays None).

    Raises:
        as :class:`SweepFile`; InvalidArgument for an unknown standard.
    """
    if output is None or isinstance(output, SweepFile):
        yield output
        return
    header = SweepHeader.of(cases=cases, standards=standards, require_exact=require_exact, orders=orders)
    with SweepFile(output, header) as opened:
        yield opened


def statuses(results: Iterable[CaseResult]) -> dict[CaseStatus, int]:
    """How many results have each status, worst last (pass, warning, fail, invalid, error)."""
    counts: dict[CaseStatus, int] = {"pass": 0, "warning": 0, "fail": 0, "invalid": 0, "error": 0}
    for result in results:
        counts[result.status] += 1
    return counts
