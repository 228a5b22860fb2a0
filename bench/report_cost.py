"""What a compare report's extras cost beside the compare itself, on W1-W4, side by side.

For each workload of :data:`bench.kernel.WORKLOADS` it builds the call as the kernel bench does,
takes the device result once and a candidate that adds in Huawei's sequential order (every row
differs a little: the slow case of the row errors), then alternates ``repeats`` times, warm, in
this process: ``moegrad.compare``, ``accuracy.row_errors`` (where the error lives; ``moegrad
compare`` computes it for every report) and ``accuracy.write_html_report`` of the report with its
row errors (the page's numbers, its plots, the file: what ``--html`` adds beside the explanation).
It also traces row_errors' peak allocation. Prints a markdown table of the medians and the ratios to compare.

    python -m bench.report_cost [--workload W1 ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import moegrad
from bench.kernel import WORKLOADS, build
from moegrad import accuracy

__all__ = ["main"]


def _seconds(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS],
                        help="a workload to run (repeatable; default W1-W4)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per workload (default 3)")
    args = parser.parse_args(argv)
    names = args.workload or ["W1", "W2", "W3", "W4"]
    moegrad.warm_up()
    accuracy.warm_up_compare()
    print("| workload | compare ms | row_errors ms | / compare | row_errors peak MiB | --html page ms | / compare |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for workload in (w for w in WORKLOADS if w.name in names):
        call = build(workload)
        device = moegrad.moe_init_routing_v2_grad(call)
        candidate = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
        compare = functools.partial(moegrad.compare, call, candidate, device_result=device)
        rows = functools.partial(accuracy.row_errors, call, candidate, device_result=device)
        report = accuracy.with_row_errors(compare(), call, candidate, device_result=device)
        folder = tempfile.TemporaryDirectory()
        page = functools.partial(accuracy.write_html_report, Path(folder.name) / "page.html", report, call, candidate,
                                 device_result=device)
        for warm in (compare, rows, page):
            warm()
        times: dict[str, list[float]] = {"compare": [], "rows": [], "page": []}
        for _ in range(args.repeats):
            for name, function in (("compare", compare), ("rows", rows), ("page", page)):
                times[name].append(_seconds(function))
        tracemalloc.start()
        rows()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        folder.cleanup()
        c, r, p = (statistics.median(times[k]) * 1e3 for k in ("compare", "rows", "page"))
        print(f"| {workload.name} ({workload.describe()}) | {c:.0f} | {r:.0f} | {r / c:.1f}x | {peak:.0f} | "
              f"{p:.0f} | {p / c:.1f}x |")
    print(f"\nMedians of {args.repeats} rounds in one process, the three alternating; the candidate is the "
          "sequential order (every row differs). Peak: traced allocations of one row_errors beyond its inputs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
