"""The accuracy comparison's time against the grad call it judges, on W1-W4, side by side.

For each workload of :data:`bench.kernel.WORKLOADS` (W1-W4 by default) it builds the call as the
kernel bench does, computes the device result once, then alternates ``repeats`` times: one
``moegrad.moe_init_routing_v2_grad`` call and one ``moegrad.compare(call, candidate,
device_result=device)`` (the candidate = the device result with one element in every 97 nudged by
one ULP, so every statistic has work to do), both warm, in this process. Prints a markdown table of
the medians and the ratio compare / grad (target: at most 10x), with each one's CPU time.

    python -m bench.compare_speed [--workload W1 ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import numpy as np

import moegrad
from bench.kernel import WORKLOADS, build

__all__ = ["main"]

TARGET_RATIO = 10.0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(function) -> tuple[float, float]:
    """Wall and CPU seconds of one call of ``function``."""
    cpu, wall = _cpu_s(), time.perf_counter()
    function()
    return time.perf_counter() - wall, _cpu_s() - cpu


def _candidate(device: np.ndarray) -> np.ndarray:
    """The device result with every 97th element moved one step up in its own format."""
    candidate = device.copy()
    flat = candidate.reshape(-1)
    words = flat.view(np.uint16 if flat.dtype.itemsize == 2 else np.uint32)
    words[::97] += 1
    return candidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS],
                        help="a workload to run (repeatable; default W1-W4)")
    parser.add_argument("--repeats", type=int, default=5, help="grad/compare pairs per workload (default 5)")
    args = parser.parse_args(argv)
    names = args.workload or ["W1", "W2", "W3", "W4"]
    moegrad.warm_up()
    moegrad.accuracy.warm_up_compare()
    print("| workload | grad call ms (CPU) | compare ms (CPU) | compare / grad | target <= 10x |")
    print("|---|---:|---:|---:|---|")
    met = True
    for workload in (w for w in WORKLOADS if w.name in names):
        call = build(workload)
        device = moegrad.moe_init_routing_v2_grad(call)
        candidate = _candidate(device)
        moegrad.compare(call, candidate, device_result=device)  # warm: the first call of a dtype pair
        grads, compares = [], []
        for _ in range(args.repeats):
            grads.append(_timed(lambda: moegrad.moe_init_routing_v2_grad(call)))
            compares.append(_timed(lambda: moegrad.compare(call, candidate, device_result=device)))
        grad_ms = statistics.median(w for w, _ in grads) * 1e3
        grad_cpu = statistics.median(c for _, c in grads) * 1e3
        compare_ms = statistics.median(w for w, _ in compares) * 1e3
        compare_cpu = statistics.median(c for _, c in compares) * 1e3
        ratio = compare_ms / grad_ms
        met &= ratio <= TARGET_RATIO
        print(f"| {workload.name} ({workload.describe()}) | {grad_ms:.1f} ({grad_cpu:.0f}) | "
              f"{compare_ms:.0f} ({compare_cpu:.0f}) | {ratio:.1f}x | {'met' if ratio <= TARGET_RATIO else 'NOT met'} |")
    print(f"\nMedians of {args.repeats} alternating pairs in one process; CPU time is both threads'.")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
