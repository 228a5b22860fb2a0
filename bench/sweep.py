"""Sweep rate: ``Client.compare_many`` over a folder of small cases against one, two and three servers.

Usage::

    .venv/bin/python -m bench.sweep                       # 600 cases, 1/2/3 servers, best of 3
    .venv/bin/python -m bench.sweep --cases 300 --repeat 1 --servers 1 3

It starts the largest number of reference-backend servers asked for (``moegrad-service serve
--backend reference``, each on a free 127.0.0.1 port, started together by
:func:`support.launch.moegrad_server`), writes ``--cases`` case files (float32, K=2, ``--tokens`` x
``--hidden``, the candidate the device result itself) to a temporary folder, sweeps them once
over every server to warm them up (imports, compiled kernels), then for each server count N sweeps
them ``--repeat`` times with ``Client(urls[:N]).compare_many(files, concurrency=2 N)`` (the
command's default) and prints a markdown table of the best rate (cases/s, the files read and
hashed, the batches sent, every verdict checked to be ``pass``). The servers share this machine's
cores with the client: the table says how far a sweep spreads here, not what N hosts would give.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import moegrad
from bench._results import machine
from moegrad import accuracy
from support.launch import moegrad_server, stop_on_sigterm

__all__ = ["main", "sweep_rate", "write_cases"]


def write_cases(folder: Path, count: int, tokens: int, hidden: int) -> list[Path]:
    """``count`` case files: a float32 dropless call with K=2 and its device result as the candidate."""
    rng = np.random.default_rng(0)
    for i in range(count):
        grad = rng.uniform(-1.0, 1.0, (2 * tokens, hidden)).astype(np.float32)
        idx = rng.permutation(2 * tokens).astype(np.int32)
        candidate = moegrad.moe_init_routing_v2_grad(grad, idx, 2)
        accuracy.save_case(folder / f"case{i:05d}.npz", grad_expanded_x=grad, expanded_row_idx=idx, top_k=2,
                           candidate=candidate)
    return accuracy.find_cases(folder)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
