"""The service section's and the memory section's measurements: S1 sequential (against its floors),
tritonclient sequential, S2 in process and end to end (against the loopback floor), one-call RSS
peaks and RSS under repeated S2."""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .clients import LoopbackFloor, RawCaller, TritonCaller, grad_request, grad_x_of_reply
from .payloads import Payload, check
from .procs import cpu_s, reset_peak_rss, status_kib

__all__ = ["RssRun", "one_call_peaks", "rss_run", "s1_sequential", "s2_in_process", "s2_measure", "triton_sequential"]


def s1_sequential(url: str, payload: Payload, calls: int, pid: int, max_s: float) -> dict:
    """S1 with the sync Client, interleaved in blocks of 100 with its floors: GET /health/live with the
    same Client, the same request bytes POSTed by bare httpx (the client library alone, no moegrad code),
    and by a plain socket (no client library: the server's and the kernel's time)."""
    import httpx

    from moegrad import Client

    block = 100
    kinds = ("grad", "live", "httpx", "raw")
    wall: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu = dict.fromkeys(kinds, 0.0)
    client_cpu = dict.fromkeys(kinds, 0.0)
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    head, _, body = grad_request(url, payload).partition(b"\r\n\r\n")
    with Client(url, retries=0) as client, httpx.Client(timeout=60) as bare, \
            contextlib.closing(RawCaller(url, payload)) as raw:
        def bare_post() -> np.ndarray:
            response = bare.post(url + "/v1/moe_init_routing_v2_grad", content=body,
                                 headers={"content-type": "application/msgpack"})
            return grad_x_of_reply(f"HTTP/1.1 {response.status_code} ".encode(), response.content)

        def live() -> None:
            if not client.live():
                raise RuntimeError("GET /health/live failed")

        steps: dict[str, Callable[[], Any]] = {"grad": lambda: client.moe_init_routing_v2_grad(*args), "live": live,
                                               "httpx": bare_post, "raw": raw}
        for kind in ("grad", "httpx", "raw"):
            check(steps[kind](), payload, f"S1 sequential ({kind})")
        for _ in range(block):  # warm-up: connections, caches, the server's first-call paths
            for step in steps.values():
                step()
        deadline = time.monotonic() + max_s
        while len(wall["grad"]) < calls and time.monotonic() < deadline:
            for kind, step in steps.items():
                before, own_before = cpu_s([pid]), time.process_time()
                for _ in range(block):
                    t0 = time.perf_counter()
                    out = step()
                    wall[kind].append(time.perf_counter() - t0)
                    if kind != "live":
                        check(out, payload, f"S1 sequential ({kind})")  # every reply, outside the timing
                cpu[kind] += cpu_s([pid]) - before
                client_cpu[kind] += time.process_time() - own_before
    result: dict[str, Any] = dict(wall)
    for kind in kinds:
        result[f"server_cpu_per_{kind}_s"] = cpu[kind] / len(wall[kind])
        result[f"client_cpu_per_{kind}_s"] = client_cpu[kind] / len(wall[kind])
    return result


def triton_sequential(callers: dict[str, TritonCaller], payload: Payload, calls: int, block: int,
                      max_s: float = math.inf) -> dict[str, dict[str, list[float]]]:
    """Sequential calls with sync tritonclient, servers taking turns in blocks of ``block`` calls.

    Returns, per server, ``wall`` (each call's latency) and ``client_cpu`` (this process's CPU
    seconds per call: the client's own share, the same for any server).
    """
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "client_cpu": []} for name in callers}
    for name, caller in callers.items():
        check(caller(payload), payload, f"{name} (tritonclient)")
    deadline = time.monotonic() + max_s
    while min(len(t["wall"]) for t in times.values()) < calls and time.monotonic() < deadline:
        for name, caller in callers.items():
            for _ in range(min(block, calls - len(times[name]["wall"]))):
                c0, t0 = time.process_time(), time.perf_counter()
                caller(payload)
                times[name]["wall"].append(time.perf_counter() - t0)
                times[name]["client_cpu"].append(time.process_time() - c0)
    return times


def s2_in_process(payload: Payload) -> dict[str, float]:
    """The same call without HTTP: the client's and the server's encode/validate/compute/decode steps.

    Mirrors what ``Client.moe_init_routing_v2_grad`` and the v1 handler do: build and validate the
    call, pack it; unpack and validate it again; compute with the reference (the server's backend);
    pack the reply; unpack it and copy grad_x out (GradResult owns its array).
    """
    from moegrad import MoeInitRoutingV2GradCall, decode_body, decode_tensor, encode_tensor, moe_init_routing_v2_grad
    from moegrad.wire import encode_body_view

    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    document = call.to_wire()
    del document["order"]  # as the Client sends it: the server's default applies
    body = encode_body_view(document)  # as the Client packs it (and streams it from msgpack's buffer)
    t1 = time.perf_counter()
    received = MoeInitRoutingV2GradCall.from_wire(decode_body(body), default_order="ascend910b")
    t2 = time.perf_counter()
    grad_x = moe_init_routing_v2_grad(received)
    t3 = time.perf_counter()
    reply = encode_body_view({"grad_x": encode_tensor(grad_x), "backend": "reference", "order": received.order,
                              "device": None, "timings_ms": {"queue": 0.0, "compute": 0.0, "total": 0.0}})
    t4 = time.perf_counter()
    result = decode_tensor(decode_body(reply)["grad_x"], "grad_x").copy()
    t5 = time.perf_counter()
    check(result, payload, "in-process")
    steps.update({"encode": t1 - t0, "validate": t2 - t1, "compute": t3 - t2, "reply_encode": t4 - t3,
                  "decode": t5 - t4, "total": t5 - t0})
    return steps


def s2_measure(url: str, payload: Payload, calls: int) -> dict[str, Any]:
    """In-process, end to end (v1 Client) and raw loopback, taking turns call by call."""
    from moegrad import Client

    in_process: list[dict[str, float]] = []
    e2e: list[float] = []
    floor_s: list[float] = []
    floor = LoopbackFloor(payload.request_bytes, payload.reply_bytes)
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    try:
        with Client(url, retries=0, timeout_s=120.0) as client:
            check(client.moe_init_routing_v2_grad(*args), payload, "moegrad v1 (Client)")  # warm-up
            s2_in_process(payload)
            floor.round_trip_s()
            for _ in range(calls):
                in_process.append(s2_in_process(payload))
                t0 = time.perf_counter()
                client.moe_init_routing_v2_grad(*args)
                e2e.append(time.perf_counter() - t0)
                floor_s.append(floor.round_trip_s())
    finally:
        floor.close()
    return {"in_process": in_process, "e2e": e2e, "floor": floor_s}


def one_call_peaks(pid: int, calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Peak RSS growth (MiB) of the server over single calls: VmHWM after the call minus VmRSS before."""
    peaks: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            time.sleep(0.2)  # let the previous reply's buffers go
            before = status_kib(pid, "VmRSS")
            reset_peak_rss(pid)
            call()
            peaks[name].append((status_kib(pid, "VmHWM") - before) / 1024)
    return peaks


@dataclass
class RssRun:
    duration_s: float
    calls: int = 0
    after_call: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB) as each reply arrived
    sampled: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB) every 50 ms
    final_mib: float = math.nan

    def _quarter(self, series: list[tuple[float, float]], q: int) -> list[float]:
        lo, hi = self.duration_s * q / 4, self.duration_s * (q + 1) / 4
        return [mib for t, mib in series if lo <= t < hi] or [math.nan]

    @property
    def settled_mib(self) -> float:
        """The median of the after-call samples in the run's second quarter."""
        return statistics.median(self._quarter(self.after_call, 1))

    @property
    def last_quarter_mib(self) -> float:
        return statistics.median(self._quarter(self.after_call, 3))

    def peak_mib(self, q: int) -> float:
        return max(self._quarter(self.sampled, q))

    @property
    def deviation(self) -> float:
        """The larger relative distance of the last-quarter median and the final value from settled."""
        settled = self.settled_mib
        return max(abs(self.last_quarter_mib - settled), abs(self.final_mib - settled)) / settled


def rss_run(pid: int, calls: list[Callable[[], Any]], duration_s: float) -> RssRun:
    """Serve S2 again and again for ``duration_s`` (the ``calls`` in turn), watching the server's RSS."""
    run = RssRun(duration_s)
    stop = threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not stop.wait(0.05):
            with contextlib.suppress(OSError, KeyError):
                run.sampled.append((time.monotonic() - started, status_kib(pid, "VmRSS") / 1024))

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        while time.monotonic() - started < duration_s:
            calls[run.calls % len(calls)]()
            run.calls += 1
            run.after_call.append((time.monotonic() - started, status_kib(pid, "VmRSS") / 1024))
    finally:
        stop.set()
        sampler.join(5)
    time.sleep(1.0)
    run.final_mib = status_kib(pid, "VmRSS") / 1024
    return run
