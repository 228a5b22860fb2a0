"""Sweep rate: ``Client.compare_many`` over a folder of small cases against one, two and three servers;
and what ``--reports`` costs the command.

Usage::

    .venv/bin/python -m bench.sweep                       # 600 cases, 1/2/3 servers, best of 3
    .venv/bin/python -m bench.sweep --cases 300 --repeat 1 --servers 1 3
    .venv/bin/python -m bench.sweep --cases 300 --servers 3 --repeat 5 --reports --failing 10

It starts the largest number of reference-backend servers asked for (``moegrad-service serve
--backend reference``, each on a free 127.0.0.1 port, started together by
:func:`support.launch.moegrad_server`), writes ``--cases`` case files (float32, K=2, ``--tokens`` x
``--hidden``, the candidate the device result itself) to a temporary folder, sweeps them once
over every server to warm them up (imports, compiled kernels), then for each server count N sweeps
them ``--repeat`` times with ``Client(urls[:N]).compare_many(files, concurrency=2 N)`` (the
command's default) and prints a markdown table of the best rate (cases/s, the files read and
hashed, the batches sent, every verdict checked to be ``pass``). The servers share this machine's
cores with the client: the table says how far a sweep spreads here, not what N hosts would give.

With ``--reports``, the command itself (``moegrad compare --cases DIR --url ...``, run in this process
through :func:`moegrad.cli.main`, over every server) is timed without ``--reports``, with it (``--plots
none``, the default), with ``--plots failing`` and, with ``--plots-all``, with ``--plots all``, the
variants alternating, ``--repeat`` times each, the median kept; then the same over a second folder
where ``--failing`` cases of the ``--cases`` fail (their candidate scaled by 1 + 2^-12). Each row
says the plots drawn and its time over the sweep's without ``--reports``. Every run writes its
reports to a folder of its own, all removed only with the temporary folder: on ext4 the inode
allocator passes over (and reads) each inode deleted in the last minutes, so removing one run's
files before the next made the next one's file creation several times slower. The last row per
folder is the floor of the file work: the same files, read back from one run, written again from
memory (``os.open``, ``os.write``, ``os.close`` each) into a new folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import moegrad
from bench._results import machine
from moegrad import accuracy
from moegrad.cli import main as moegrad_command
from support.launch import moegrad_server, stop_on_sigterm

__all__ = ["main", "reports_cost", "sweep_rate", "write_cases"]


def write_cases(folder: Path, count: int, tokens: int, hidden: int, failing: int = 0) -> list[Path]:
    """``count`` case files: a float32 dropless call with K=2 and its device result as the candidate
    (the first ``failing`` of them scaled by 1 + 2^-12: they fail)."""
    rng = np.random.default_rng(0)
    for i in range(count):
        grad = rng.uniform(-1.0, 1.0, (2 * tokens, hidden)).astype(np.float32)
        idx = rng.permutation(2 * tokens).astype(np.int32)
        candidate = moegrad.moe_init_routing_v2_grad(grad, idx, 2)
        if i < failing:
            candidate = (candidate.astype(np.float64) * (1 + 2.0**-12)).astype(np.float32)
        accuracy.save_case(folder / f"case{i:05d}.npz", grad_expanded_x=grad, expanded_row_idx=idx, top_k=2,
                           candidate=candidate)
    return accuracy.find_cases(folder)


def _command_s(argv: list[str], expected: int) -> float:
    """Seconds of one ``moegrad`` command run in this process (its output dropped)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        started = time.perf_counter()
        status = moegrad_command(argv)
        elapsed = time.perf_counter() - started
    if status != expected:
        raise SystemExit(f"{' '.join(argv)}: exit {status}, not {expected}: {err.getvalue()}")
    return elapsed


def reports_cost(
    urls: list[str], folder: Path, repeat: int, plots_all: bool, failing: int
) -> list[tuple[str, int, float]]:
    """The command over ``folder``'s cases (``failing`` of them fail) without ``--reports``, with it,
    and (``plots_all``) with ``--plots all``, alternating ``repeat`` times: (variant, plots drawn,
    median seconds) each."""
    base = ["compare", "--cases", str(folder), "--no-progress", "--summary", str(folder.parent / "summary"),
            *(arg for url in urls for arg in ("--url", url))]
    expected = 1 if failing else 0
    variants = [
        ("without --reports", [], 0),
        ("--reports OUT (--plots none, the default)", ["--reports"], 0),
        ("--reports OUT --plots failing", ["--reports", "--plots", "failing"], failing),
    ]
    if plots_all:
        variants.append(("--reports OUT --plots all", ["--reports", "--plots", "all"], len(list(folder.iterdir()))))
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    outs = folder.parent / "reports"  # removed with the temporary folder, after every timing
    for run in range(repeat):
        for k, (name, flags, _) in enumerate(variants):
            # a new folder each time: on ext4, creating a file costs more for each inode deleted in
            # the last minutes (the inode allocator skips and reads each), so removing a run's reports
            # before the next would slow the next
            out = outs / f"{run}-{k}"
            argv = [*base, *flags[:1], str(out), *flags[1:]] if flags else base
            times[name].append(_command_s(argv, expected))
    floor = ("the same files written alone (os.write, no moegrad)", 0, statistics.median(
        _files_s(outs / f"{run}-1", outs / f"floor-{run}") for run in range(repeat)))
    return [*((name, plots, statistics.median(times[name])) for name, _, plots in variants), floor]


def _files_s(written: Path, out: Path) -> float:
    """Seconds to write ``written``'s files again into the new folder ``out``, from memory, one
    ``os.open``/``os.write``/``os.close`` each: the floor of a reports run's file work here."""
    files = [(path.name, path.read_bytes()) for path in sorted(written.iterdir())]
    started = time.perf_counter()
    out.mkdir()
    for name, data in files:
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    return time.perf_counter() - started


def sweep_rate(urls: list[str], files: list[Path], repeat: int) -> tuple[float, list[int]]:
    """The best of ``repeat`` sweeps in cases/s, and the calls each server served in the last one."""
    best = 0.0
    served: list[int] = []
    for _ in range(repeat):
        with moegrad.Client(urls) as client:
            started = time.perf_counter()
            results = client.compare_many(files, progress=False)
            elapsed = time.perf_counter() - started
            served = [stats.served for stats in client.stats]
        bad = [r for r in results if r.status != "pass"]
        if bad:
            raise SystemExit(f"{len(bad)} cases did not pass, e.g. {bad[0].name}: {bad[0].status} {bad[0].error}")
        best = max(best, len(files) / elapsed)
    return best, served


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=600, help="case files in the sweep (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=64, help="N of each case (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="H of each case (default: %(default)s)")
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 3], help="server counts (default: 1 2 3)")
    parser.add_argument("--repeat", type=int, default=3, help="sweeps per server count, best kept (default: 3)")
    parser.add_argument("--reports", action="store_true", help="also time the command with and without --reports")
    parser.add_argument("--plots-all", action="store_true", help="with --reports: also time --plots all (slow)")
    parser.add_argument("--failing", type=int, default=30,
                        help="with --reports: a second folder where this many cases fail (default: %(default)s)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="moegrad-bench-sweep-") as tmp:
        folder = Path(tmp)
        most = max(args.servers)
        with ThreadPoolExecutor(most) as pool:
            started = list(pool.map(lambda i: moegrad_server(folder / "logs", name=f"sweep{i}"), range(most)))
        try:
            (folder / "cases").mkdir()
            files = write_cases(folder / "cases", args.cases, args.tokens, args.hidden)
            urls = [server.url for server in started]
            sweep_rate(urls, files, 1)  # warm-up: every server's imports and kernels
            rows = []
            for count in args.servers:
                rate, served = sweep_rate(urls[:count], files, args.repeat)
                rows.append((count, rate, served))
            costs = []
            if args.reports:
                (folder / "failing" / "cases").mkdir(parents=True)
                write_cases(folder / "failing" / "cases", args.cases, args.tokens, args.hidden, args.failing)
                for cases, failing in ((folder / "cases", 0), (folder / "failing" / "cases", args.failing)):
                    costs.append((failing, reports_cost(urls, cases, args.repeat, args.plots_all, failing)))
        finally:
            for server in started:
                server.stop()
    one = rows[0][1] if rows[0][0] == 1 else None
    print(f"Sweep rate, {args.cases} cases of [{2 * args.tokens}, {args.hidden}] float32, K=2; "
          f"best of {args.repeat}; {machine()}")
    print()
    print("| servers | requests in flight | cases/s | vs one server | batches served per server |")
    print("|---|---|---|---|---|")
    for count, rate, served in rows:
        ratio = f"{rate / one:.2f}x" if one else "-"
        print(f"| {count} | {max(4, 2 * count)} | {rate:.0f} | {ratio} | {' / '.join(map(str, served))} |")
    if costs:
        print()
        print(f"`moegrad compare --cases DIR` over {len(urls)} servers, {args.cases} cases; median of {args.repeat}, "
              "the variants alternating")
        print()
        print("| cases failing | command | plots drawn | seconds | vs without --reports |")
        print("|---|---|---|---|---|")
        for failing, measured in costs:
            plain = measured[0][2]
            for name, plots, seconds in measured:
                print(f"| {failing} | {name} | {plots} | {seconds:.2f} | {seconds / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
