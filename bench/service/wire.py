"""The wire section: large calls (S2, SL) over every path against the loopback floor, the server's
memory per call and idle, and 1,000 S1 calls one by one against one ``Client.batch``."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .clients import LoopbackFloor, PlainMsgpack, RawWire
from .common import log, ms
from .payloads import Payload, check, s1, s2, same_bits, sl
from .procs import cpu_s, descendants, idle_rss_mib, moegrad_server, reset_peak_rss, status_kib

__all__ = ["COLD_PATHS", "CPU_BATCHES", "MIXED_CALLS", "TARGETS", "WIRE_PATHS", "batch_measure", "mixed_batches",
           "wire_measure", "wire_speed"]


WIRE_PATHS = ("raw -> v1 msgpack", "raw -> v1 frames", "raw -> v2 binary", "msgpack + http.client -> v1",
              "Client -> v1 (msgpack)", "Client -> v1 (auto: frames)")
#: Issue 31's targets for the documented msgpack protocol: raw socket -> v1 msgpack within 1.5x the floor,
#: the server's peak RSS growth within 1.15x of request + reply, a plain msgpack client within 2x the floor.
TARGETS = {"raw": 1.5, "growth": 1.15, "plain": 2.0}
#: The paths whose peak RSS growth is also measured from an idle server (no receive buffer kept).
COLD_PATHS = ("raw -> v1 msgpack", "msgpack + http.client -> v1")


def wire_measure(url: str, pid: int, payload: Payload, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of the floor and then each path once, each reply checked bitwise once.

    First ``rounds`` back to back (each call right after the one before, as a caller's loop makes
    them), then ``rounds`` with 0.3 s of idle before each call (the floor's too), which also take
    the server's peak RSS growth per call (VmHWM after a reset, minus VmRSS before) and its RSS one
    second after the call. An idle 2-core VM wakes slower: both the floor and the paths take longer
    after the pause, the paths more (they wake more threads).
    """
    from moegrad import Client

    floor = LoopbackFloor(payload.request_bytes, payload.reply_bytes)
    raws = {"raw -> v1 msgpack": RawWire(url, payload, "v1"), "raw -> v1 frames": RawWire(url, payload, "frames"),
            "raw -> v2 binary": RawWire(url, payload, "v2")}
    plain = PlainMsgpack(url, payload)
    clients = {"Client -> v1 (msgpack)": Client(url, retries=0, timeout_s=300.0, wire="msgpack"),
               "Client -> v1 (auto: frames)": Client(url, retries=0, timeout_s=300.0)}
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    times: dict[str, list[float]] = {name: [] for name in ("floor", *WIRE_PATHS)}
    idle_times: dict[str, list[float]] = {name: [] for name in ("floor", *WIRE_PATHS)}
    growth: dict[str, list[float]] = {name: [] for name in WIRE_PATHS}
    after: dict[str, list[float]] = {name: [] for name in WIRE_PATHS}
    calls: dict[str, Callable[[], Any]] = {**raws, "msgpack + http.client -> v1": plain,
                                           **{name: (lambda c=c: c.moe_init_routing_v2_grad(*args))
                                              for name, c in clients.items()}}
    cold: dict[str, float] = {}

    def timed(name: str, call: Callable[[], Any]) -> float:
        if name in raws:
            raws[name].connect()
        elif call is plain:
            plain.connect()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    try:
        floor.round_trip_s()
        for name, raw in raws.items():  # warm-up and the bitwise check, outside the timing
            raw()
            same_bits(raw.result(), payload, name)
        same_bits(plain(), payload, "msgpack + http.client -> v1")
        for name, client in clients.items():
            same_bits(client.moe_init_routing_v2_grad(*args), payload, name)
        for _ in range(rounds):
            times["floor"].append(floor.round_trip_s())
            for name, call in calls.items():
                times[name].append(timed(name, call))
        for _ in range(rounds):
            time.sleep(0.3)
            idle_times["floor"].append(floor.round_trip_s())
            for name, call in calls.items():
                time.sleep(0.3)
                before = status_kib(pid, "VmRSS")
                reset_peak_rss(pid)
                idle_times[name].append(timed(name, call))
                growth[name].append((status_kib(pid, "VmHWM") - before) * 1024 / (payload.request_bytes
                                                                                  + payload.reply_bytes))
                time.sleep(1.0)
                after[name].append(status_kib(pid, "VmRSS") / 1024)
        for name in COLD_PATHS:  # from an idle server: every buffer of the call fresh
            idle = _without_kept_buffers(url, pid)
            reset_peak_rss(pid)
            timed(name, calls[name])
            cold[name] = (status_kib(pid, "VmHWM") - idle) * 1024 / (payload.request_bytes + payload.reply_bytes)
    finally:
        floor.close()
        plain.close()
        for raw in raws.values():
            raw.close()
        for client in clients.values():
            client.close()
    return {"times": times, "idle_times": idle_times, "growth": growth, "after_mib": after, "cold": cold}


def _without_kept_buffers(url: str, pid: int, within_s: float = 30.0) -> int:
    """Wait until the server keeps no receive buffer (``receive_keep_s`` after its last call), then
    a second more for its heap trim; its RSS then, in KiB."""
    import httpx

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        kept = next(line for line in text.splitlines() if line.startswith("moegrad_receive_buffer_kept_bytes "))
        if float(kept.split()[1]) == 0:
            break
        time.sleep(0.5)
    time.sleep(1.0)
    return status_kib(pid, "VmRSS")


#: Batches of each size a round's server CPU is read over.
CPU_BATCHES = 10


def batch_measure(url: str, pid: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """``calls`` S1 calls: one after another with the sync Client, and in one ``Client.batch``; interleaved.

    Also the server's CPU seconds (all its threads, /proc) per batch of ``calls`` and per batch of one
    (each the mean over CPU_BATCHES batches).
    """
    from moegrad import Client, GradResult, MoeInitRoutingV2GradCall

    payload = s1()
    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    out: dict[str, list[float]] = {"sequential": [], "batch": [], "batch_cpu": [], "one_cpu": []}
    pids = descendants(pid)
    with Client(url, retries=0, timeout_s=300.0) as client:
        client.run(call)
        client.batch([call] * 10)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                client.run(call)
            out["sequential"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            answers = client.batch([call] * calls)
            out["batch"].append(time.perf_counter() - t0)
            for answer in answers:
                if not isinstance(answer, GradResult):
                    raise AssertionError(f"a batch item failed: {answer!r}")
                check(answer.grad_x, payload, "Client.batch")
            # the server's CPU per batch, over CPU_BATCHES of each size (its clock ticks are 10 ms)
            cpu0 = cpu_s(pids)
            for _ in range(CPU_BATCHES):
                client.batch([call])
            out["one_cpu"].append((cpu_s(pids) - cpu0) / CPU_BATCHES)
            cpu0 = cpu_s(pids)
            for _ in range(CPU_BATCHES):
                client.batch([call] * calls)
            out["batch_cpu"].append((cpu_s(pids) - cpu0) / CPU_BATCHES)
    return out


MIXED_CALLS = 10_000  #: calls of a mixed batch: H = 1 .. MIXED_CALLS (N = K = 1, float32): 200 MB a body


def mixed_batches(url: str, rounds: int) -> float:
    """Send ``rounds`` batches of MIXED_CALLS calls of distinct shapes (each tensor under glibc's mmap
    threshold, so it comes from the heap); returns the seconds of the slowest."""
    from moegrad import Client, GradResult, MoeInitRoutingV2GradCall

    rng = np.random.default_rng(3)
    calls = [MoeInitRoutingV2GradCall(grad_expanded_x=rng.standard_normal((1, hidden), dtype=np.float32),
                                      expanded_row_idx=np.zeros(1, dtype=np.int32), top_k=1)
             for hidden in range(1, MIXED_CALLS + 1)]
    slowest = 0.0
    with Client(url, retries=0, timeout_s=600.0) as client:
        for _ in range(rounds):
            t0 = time.perf_counter()
            answers = client.batch(calls)
            slowest = max(slowest, time.perf_counter() - t0)
            for call, answer in zip(calls, answers, strict=True):  # K = 1, index 0: grad_x is the row itself
                if not isinstance(answer, GradResult) or not np.array_equal(
                        answer.grad_x.view(np.uint32), call.grad_expanded_x.view(np.uint32)):
                    raise AssertionError(f"a mixed batch item is wrong: {answer!r}")
            del answers
    return slowest


def wire_speed(*, s2_rounds: int = 5, sl_rounds: int = 2, batch_calls: int = 1000, batch_rounds: int = 3,
               mixed_rounds: int = 3, server_pythonpath: str | None = None) -> str:
    """Measure large calls against the loopback floor (S2 and SL), the server's memory per call and
    idle (after S2, SL and ``mixed_rounds`` batches of calls of distinct shapes), and the batch
    speedup; return the markdown tables."""
    results: dict[str, Any] = {}
    with moegrad_server(pythonpath=server_pythonpath) as server:
        log(f"moegrad at {server.url} (pid {server.pid})")
        from moegrad import Client

        with Client(server.url, retries=0) as client:
            small = s1()
            for _ in range(20):
                client.moe_init_routing_v2_grad(small.grad_expanded_x, small.expanded_row_idx, small.top_k)
        time.sleep(1.0)
        results["start_mib"] = status_kib(server.pid, "VmRSS") / 1024
        log("batches: S1 sequential vs one batch")
        results["batch"] = batch_measure(server.url, server.pid, batch_calls, batch_rounds)
        results["batch_calls"] = batch_calls
        log("S2: every path against the floor")
        results["S2"] = wire_measure(server.url, server.pid, s2(), s2_rounds)
        results["settled_mib"] = idle_rss_mib(server.pid)
        if sl_rounds:
            log("SL: building the payload (448 MiB, and its expected result)")
            large = sl()
            log("SL: every path against the floor")
            results["SL"] = wire_measure(server.url, server.pid, large, sl_rounds)
            del large
        time.sleep(1.0)
        results["kept_mib"] = status_kib(server.pid, "VmRSS") / 1024
        results["end_mib"] = idle_rss_mib(server.pid)
        if mixed_rounds:
            log(f"mixed: {mixed_rounds} batches of {MIXED_CALLS:,} calls of distinct shapes")
            results["mixed_s"] = mixed_batches(server.url, mixed_rounds)
            results["mixed_rounds"] = mixed_rounds
            results["mixed_mib"] = idle_rss_mib(server.pid)
    return _wire_tables(results)


def _targets(r: dict[str, Any], payloads: list[str]) -> list[str]:
    """Issue 31's targets against this run, back-to-back medians (a noisy shared machine: one run)."""
    lines = ["| issue 31 target | " + " | ".join(payloads) + " |", "|---|" + "---:|" * len(payloads)]
    rows = [("raw socket -> v1 msgpack, x the floor", "raw", lambda name: _ratio(r[name], "raw -> v1 msgpack")),
            ("msgpack + http.client -> v1 (end to end), x the floor", "plain",
             lambda name: _ratio(r[name], "msgpack + http.client -> v1")),
            ("server peak RSS growth from idle, x (request + reply)", "growth",
             lambda name: r[name]["cold"]["raw -> v1 msgpack"])]
    for label, key, value in rows:
        cells = []
        for name in payloads:
            got = value(name)
            cells.append(f"{got:.2f}x ({'met' if got <= TARGETS[key] else 'NOT met'}: <= {TARGETS[key]}x)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _ratio(run: dict[str, Any], path: str) -> float:
    return statistics.median(run["times"][path]) / statistics.median(run["times"]["floor"])


def _wire_tables(r: dict[str, Any]) -> str:
    load = os.getloadavg()
    lines = [f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min; 2 cores, shared).", ""]
    payloads = [name for name in ("S2", "SL") if name in r]
    runs = [(name, kind) for name in payloads for kind in ("times", "idle_times")]
    heading = {"times": "back to back", "idle_times": "after 0.3 s idle"}
    lines += ["Medians in ms (x the floor measured in the same rounds):", "",
              "| path | " + " | ".join(f"{name} {heading[kind]}" for name, kind in runs) + " |",
              "|---|" + "---:|" * len(runs)]
    floors = {run: statistics.median(r[run[0]][run[1]]["floor"]) for run in runs}
    lines.append("| loopback floor | " + " | ".join(ms(floors[run]) for run in runs) + " |")
    for path in WIRE_PATHS:
        cells = []
        for run in runs:
            median = statistics.median(r[run[0]][run[1]][path])
            cells.append(f"{ms(median)} ({median / floors[run]:.2f}x)")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", "Server peak RSS growth per call, as a multiple of request + reply bytes (median), and its RSS "
              "1 s after the call (MiB, median; the call's receive buffer is still kept then, for the next "
              "body of its size):", "",
              "| path | " + " | ".join(f"{name} growth | {name} RSS after" for name in payloads) + " |",
              "|---|" + "---:|---:|" * len(payloads)]
    for path in WIRE_PATHS:
        cells = []
        for name in payloads:
            cells.append(f"{statistics.median(r[name]['growth'][path]):.2f}x")
            cells.append(f"{statistics.median(r[name]['after_mib'][path]):.0f}")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", "Peak RSS growth of one call from an idle server (no receive buffer kept: every buffer of the "
              "call fresh), as a multiple of request + reply bytes: " + "; ".join(
                  f"{name} {path} {r[name]['cold'][path]:.2f}x" for name in payloads for path in COLD_PATHS) + "."]
    lines += ["", *_targets(r, payloads)]
    lines += ["", f"Server RSS: {r['start_mib']:.0f} MiB after warm-up, {r['settled_mib']:.0f} MiB idle after the S2 "
              f"rounds, {r['kept_mib']:.0f} MiB 1 s after the last round (its receive buffers kept), "
              f"{r['end_mib']:.0f} MiB idle after every round (SL included; receive_keep_s passed) "
              f"({(r['end_mib'] / r['settled_mib'] - 1) * 100:+.0f}% of the settled value)."]
    if "mixed_mib" in r:
        lines[-1] += (f" After {r['mixed_rounds']} batches of {MIXED_CALLS:,} calls of distinct shapes (N = K = 1, "
                      f"float32, H = 1 .. {MIXED_CALLS:,}: 200 MB a body; the slowest {r['mixed_s']:.1f} s; every "
                      f"answer checked bitwise): {r['mixed_mib']:.0f} MiB idle "
                      f"({(r['mixed_mib'] / r['settled_mib'] - 1) * 100:+.0f}% of the settled value).")
    lines.append("")
    batch = r["batch"]
    if not batch["batch"]:  # --batch-rounds 0
        return "\n".join(lines) + "\n"
    seq, one = statistics.median(batch["sequential"]), statistics.median(batch["batch"])
    calls = r["batch_calls"]
    per_call_cpu_s = (statistics.median(batch["batch_cpu"]) - statistics.median(batch["one_cpu"])) / (calls - 1)
    lines += [f"| {calls:,} S1 calls | median (ms) | per call (us) |", "|---|---:|---:|",
              f"| sequential `Client.run` | {ms(seq)} | {seq / calls * 1e6:.0f} |",
              f"| one `Client.batch` | {ms(one)} | {one / calls * 1e6:.0f} |",
              f"| speedup | {seq / one:.1f}x | |", "",
              f"Server CPU (all threads, /proc) per call inside the batch: "
              f"{per_call_cpu_s * 1e6:.0f} us "
              f"(a {calls:,}-call batch less a 1-call batch, each over {CPU_BATCHES} batches; clock ticks of 10 ms, "
              f"so about +-{2e4 / calls / CPU_BATCHES:.0f} us)."]
    return "\n".join(lines) + "\n"
