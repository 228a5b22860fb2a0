"""An explanation of a DeepSeek-size call on the service: time, and the server's memory against its reservation.

One ``moegrad-service`` (the reference backend, an in-flight budget of 4 GiB) on loopback; the call is W1 of :data:`bench.kernel.WORKLOADS` (N = 4096, K = 8,
H = 7168, bfloat16, dropless, the kernel bench's routing; values over binades as
:func:`bench.explain_speed.wide_call` makes them), sent by ``moegrad.Client.explain`` (frames). Three
candidates: ``few``, the device's result with 0.5% of its rows changed (every other one the
sequential order's row, the others a slot left out); ``float64``, the float64 sum rounded once
(every row that differs does so by order); and ``one ULP``, the device's result one ULP off in every
element (no correct float32 sum rounds so: every row is searched for a wrong summand and ends
``unexplained``, the most work and memory a row can take). For each, after a
warm-up on a small call: the wall time of ``Client.explain`` and ``Client.compare`` of the same
inputs, side by side, the server's timings, and the server's peak RSS growth (VmHWM, reset just
before the call) against what the request reserves (docs/operations.md, "Memory a request holds":
its body, the device's grad_x and ``moegrad.explain_peak_bytes(call, device_result=True,
reply=True)``). Prints Markdown; the exit
status is 1 when a peak is over its reservation. ``--write`` puts it into bench/RESULTS.md
(section ``explain-service``).

    python -m bench.explain_service [--tokens 4096] [--repeats 3] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import moegrad
from bench._results import machine, write_section
from bench.explain_speed import candidates, wide_call
from bench.kernel import WORKLOADS
from support.attacks.probes import reset_peak, rss_bytes
from support.launch import moegrad_server

__all__ = ["main"]

MIB = 2**20
BUDGET = 4 << 30


def _arguments(call: moegrad.MoeInitRoutingV2GradCall) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k}


def _body_bytes(call: moegrad.MoeInitRoutingV2GradCall, candidate: np.ndarray) -> int:
    """The frames body Client.explain sends: the call's document and the candidate."""
    document = {**call.to_wire(), "candidate": moegrad.encode_tensor(candidate)}
    document.pop("order", None)
    return moegrad.encode_frames(document)[1]


def _measure(server, client: moegrad.Client, call, candidate: np.ndarray, repeats: int) -> dict:
    explain_s, compare_s, peaks = [], [], []
    for _ in range(repeats):
        before = rss_bytes(server.pid)
        reset_peak(server.pid)
        started = time.perf_counter()
        result = client.explain(**_arguments(call), candidate=candidate)
        explain_s.append(time.perf_counter() - started)
        peaks.append(rss_bytes(server.pid, "VmHWM") - before)
        started = time.perf_counter()
        client.compare(**_arguments(call), candidate=candidate)
        compare_s.append(time.perf_counter() - started)
    return {"explain_s": statistics.median(explain_s), "compare_s": statistics.median(compare_s),
            "peak": max(peaks), "result": result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.explain_service", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="N (default 4096: DeepSeek's W1)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per candidate (default 3)")
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md's explain-service section")
    args = parser.parse_args(argv)
    workload = dataclasses.replace(WORKLOADS[0], tokens=args.tokens)
    call = wide_call(workload)
    device = moegrad.moe_init_routing_v2_grad(call)
    one_ulp = device.copy()
    one_ulp.view(np.uint16)[...] ^= 1
    made = candidates(call, device)
    made = {"few (0.5% of rows)": made["few"], "the float64 sum": made["float64"], "one ULP, every element": one_ulp}
    small = wide_call(dataclasses.replace(workload, tokens=64))
    lines = ["| candidate | rows that differ | Client.explain s | Client.compare s | explain / compare "
             "| server: compute ms, explain ms | server RSS growth MiB | reserved MiB | within |",
             "|---|---:|---:|---:|---:|---|---:|---:|---|"]
    within_all = True
    settings = {"max_inflight_bytes": BUDGET}
    with tempfile.TemporaryDirectory() as log_dir, moegrad_server(Path(log_dir), settings=settings) as server, \
            moegrad.Client(server.url, timeout_s=600) as client:
        client.explain(**_arguments(small), candidate=moegrad.moe_init_routing_v2_grad(small))  # warm
        for name, candidate in made.items():
            measured = _measure(server, client, call, candidate, args.repeats)
            grad_x = call.num_tokens * call.hidden_size * call.grad_expanded_x.dtype.itemsize
            reserved = _body_bytes(call, candidate) + grad_x + moegrad.explain_peak_bytes(
                call, device_result=True, reply=True)
            within = measured["peak"] <= reserved
            within_all &= within
            result = measured["result"]
            timings = result.timings_ms
            lines.append(
                f"| {name} | {result.explanation.differing_rows} | {measured['explain_s']:.2f} | "
                f"{measured['compare_s']:.2f} | {measured['explain_s'] / measured['compare_s']:.2f}x | "
                f"{timings['compute']:.0f}, {timings['explain']:.0f} | {measured['peak'] / MIB:.0f} | "
                f"{reserved / MIB:.0f} | {'yes' if within else 'NO'} |")
    text = "\n".join(lines) + (
        f"\n\nThe call: {workload.name} with N = {args.tokens} ({workload.describe()}); the server's in-flight budget "
        f"{BUDGET / MIB:.0f} MiB (seven eighths of it for one request); medians of {args.repeats} calls per candidate (RSS: the largest), explain and compare "
        "alternating, through Client (frames).")
    print(text)
    if args.write:
        command = f"python -m bench.explain_service --tokens {args.tokens} --repeats {args.repeats}"
        write_section("explain-service", "## moegrad.explain of a DeepSeek-size call on the service\n\n"
                      f"`{command}` on {machine()}\n\n{text}")
    return 0 if within_all else 1


if __name__ == "__main__":
    sys.exit(main())
