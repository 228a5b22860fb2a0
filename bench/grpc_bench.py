"""Protocol v2 over gRPC beside HTTP: S1 and S2 with stock tritonclient, one server, one run.

One ``moegrad-service serve`` process (reference backend, 2 streams) serves HTTP and gRPC
(``--grpc-port``); the same payloads go to it through ``tritonclient.grpc`` (raw tensor contents)
and ``tritonclient.http`` (binary tensor data), in alternating blocks so both protocols see the same
machine state. Every reply is checked bitwise against the result computed here (bench/service/payloads.py's
payloads: S1 is the documentation's example, S2 is N=1024, K=2, H=4096 float32 dropless, 32 MiB in
and 16 MiB out).

Measured per protocol: S1 sequential latency (p50, p99, mean) and the server's CPU per call (user +
system of the server process over the block, divided by its calls); S2 sequential latency and the
throughput of request + reply bytes at the median. Prints a markdown table.

Usage::

    .venv/bin/python -m bench.grpc_bench [--quick] [--s1-calls 600] [--s2-calls 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.service.common import MIB, MODEL, OUT_DIR, percentile
from bench.service.payloads import Payload, s1, s2
from bench.service.procs import cpu_s, descendants
from support.launch import REFERENCE_FLAGS, ServerProcess, free_port, moegrad_server, stop_on_sigterm

__all__ = ["main"]

BLOCK = 50
#: (S1, S2) calls per protocol: the default run and ``--quick`` (under 30 s on the 2-core machine).
FULL_CALLS = (600, 5)
QUICK_CALLS = (200, 3)


def server() -> tuple[ServerProcess, int]:
    """A started moegrad server (reference backend, 2 streams) with gRPC on, and its gRPC port."""
    grpc_port = free_port()
    flags = [*REFERENCE_FLAGS, "--streams", "2", "--grpc-port", str(grpc_port)]
    return moegrad_server(OUT_DIR / "logs", flags=flags, ready_within_s=90.0, name="moegrad-grpc"), grpc_port


def callers(http_target: str, grpc_target: str) -> dict[str, tuple[Callable[[Payload], np.ndarray], Any]]:
    """protocol -> (call(payload) -> grad_x, client), each with its own long-lived connection."""
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    http_client = triton_http.InferenceServerClient(http_target, connection_timeout=120.0, network_timeout=120.0)
    grpc_client = triton_grpc.InferenceServerClient(grpc_target)

    def over_http(payload: Payload) -> np.ndarray:
        grad = triton_http.InferInput("grad_expanded_x", list(payload.grad_expanded_x.shape), "FP32")
        grad.set_data_from_numpy(payload.grad_expanded_x, binary_data=True)
        idx = triton_http.InferInput("expanded_row_idx", list(payload.expanded_row_idx.shape), "INT32")
        idx.set_data_from_numpy(payload.expanded_row_idx, binary_data=True)
        outputs = [triton_http.InferRequestedOutput("grad_x", binary_data=True)]
        return http_client.infer(MODEL, [grad, idx], outputs=outputs, parameters={"top_k": payload.top_k}).as_numpy(
            "grad_x")

    def over_grpc(payload: Payload) -> np.ndarray:
        grad = triton_grpc.InferInput("grad_expanded_x", list(payload.grad_expanded_x.shape), "FP32")
        grad.set_data_from_numpy(payload.grad_expanded_x)
        idx = triton_grpc.InferInput("expanded_row_idx", list(payload.expanded_row_idx.shape), "INT32")
        idx.set_data_from_numpy(payload.expanded_row_idx)
        return grpc_client.infer(MODEL, [grad, idx], parameters={"top_k": payload.top_k},
                                 client_timeout=120).as_numpy("grad_x")

    return {"gRPC (tritonclient.grpc)": (over_grpc, grpc_client), "HTTP (tritonclient.http)": (over_http, http_client)}


def check(result: np.ndarray, payload: Payload, where: str) -> None:
    if not (result.dtype == payload.expected.dtype and result.shape == payload.expected.shape
            and np.array_equal(result.view(np.uint32), payload.expected.view(np.uint32))):
        raise AssertionError(f"{payload.name} over {where}: the reply differs from the expected bits")


def measure(calls: dict[str, tuple[Callable, Any]], payload: Payload, count: int, block: int,
            pids: list[int]) -> dict[str, dict[str, list[float]]]:
    """``count`` calls per protocol, in alternating blocks of ``block``: latencies and server CPU."""
    seen: dict[str, dict[str, list[float]]] = {name: {"latency": [], "cpu": []} for name in calls}
    done = 0
    while done < count:
        size = min(block, count - done)
        for name, (call, _) in calls.items():
            check(call(payload), payload, name)  # one untimed call first: the connection is warm
            cpu_before = cpu_s(pids)
            for _ in range(size):
                started = time.perf_counter()
                result = call(payload)
                seen[name]["latency"].append(time.perf_counter() - started)
                check(result, payload, name)
            seen[name]["cpu"].append((cpu_s(pids) - cpu_before) / size)
        done += size
    return seen


def table(s1_seen: dict, s2_seen: dict, s1_payload: Payload, s2_payload: Payload) -> str:
    rows = ["| workload | protocol (client) | calls | p50 ms | p99 ms | mean ms | server CPU ms/call | MiB/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for payload, seen in ((s1_payload, s1_seen), (s2_payload, s2_seen)):
        moved = (payload.request_bytes + payload.reply_bytes) / MIB
        for name, values in seen.items():
            latency = values["latency"]
            p50 = statistics.median(latency)
            rate = f"{moved / p50:.0f}" if payload.name == "S2" else "-"
            rows.append(f"| {payload.name} | {name} | {len(latency)} | {p50 * 1e3:.2f} | "
                        f"{percentile(latency, 99) * 1e3:.2f} | {statistics.fmean(latency) * 1e3:.2f} | "
                        f"{statistics.fmean(values['cpu']) * 1e3:.2f} | {rate} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"fewer calls: S1 {QUICK_CALLS[0]} and S2 "
                        f"{QUICK_CALLS[1]} per protocol (bench.run's quick mode)")
    parser.add_argument("--s1-calls", type=int, help=f"S1 calls per protocol (default {FULL_CALLS[0]})")
    parser.add_argument("--s2-calls", type=int, help=f"S2 calls per protocol (default {FULL_CALLS[1]})")
    args = parser.parse_args(argv)
    default_s1, default_s2 = QUICK_CALLS if args.quick else FULL_CALLS
    args.s1_calls = default_s1 if args.s1_calls is None else args.s1_calls
    args.s2_calls = default_s2 if args.s2_calls is None else args.s2_calls
    stop_on_sigterm()
    s1_payload, s2_payload = s1(), s2()
    process, grpc_port = server()
    with process:
        pids = descendants(process.pid)
        calls = callers(process.url.removeprefix("http://"), f"127.0.0.1:{grpc_port}")
        try:
            s1_seen = measure(calls, s1_payload, args.s1_calls, BLOCK, pids)
            s2_seen = measure(calls, s2_payload, args.s2_calls, 1, pids)
        finally:
            for _, client in calls.values():
                client.close()
    print(f"moegrad-service serve, reference backend, 2 streams, loopback; {os.cpu_count()} CPUs; "
          f"S1 {args.s1_calls} calls and S2 {args.s2_calls} calls per protocol, alternating blocks; "
          f"every reply checked bitwise")
    print()
    print(table(s1_seen, s2_seen, s1_payload, s2_payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
