"""Attacks of one tenant on the others: memory beyond a request's body, stalled uploads holding the
budget, work left behind by clients that hung up, and a flood that starves another tenant's calls.

- :func:`worst_shape`: a shape of :mod:`.worst`, sized to hold 5/8 of the budget, several at
  once: the server's RSS may grow by what one of them holds (the budget admits one at a time)
  plus :data:`ALLOWANCE_BYTES`, never by what all of them hold; :func:`oversized`: one holding
  twice the budget, refused 413.
- :func:`stalled_large_uploads`: two uploads at 16 bytes/s hold most of the budget; another
  tenant's 4 MiB call must get through once they fall behind ``body_min_bytes_per_s``.
- :func:`abandoned_compares`: compares whose clients hang up while they are judged; the server's
  CPU time after the hang-up, against the same compares answered.
- :func:`flood_latency`: a small call's latency alone and under another tenant's compare flood
  (bench/tenancy.py; no test asserts a time).
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from ..launch import LOOPBACK, ServerProcess, moegrad_server
from .outcome import Outcome, parallel, summary, tally, watched
from .probes import Probes, reset_peak, rss_bytes, settled_rss
from .wire import GRAD_PATH, MIB, Answer, _parse, _whole, example_call, exchange, request_head, valid_call_body
from .worst import SHAPES, compare_small_h

__all__ = ["ALLOWANCE_BYTES", "abandoned_compares", "cpu_seconds", "flood_latency", "oversized",
           "stalled_large_uploads", "worst_shape"]

#: What a server's RSS may grow by beyond what the requests it admitted hold: the compute's chunks,
#: thread arenas, small replies.
ALLOWANCE_BYTES = 32 * MIB


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, user and system, every thread's (/proc/<pid>/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _settled(pid: int, quiet_s: float = 1.0, within_s: float = 30.0) -> float:
    """Wait until the process has used no CPU for ``quiet_s``; its CPU time then."""
    end, last = time.monotonic() + within_s, cpu_seconds(pid)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = cpu_seconds(pid)
        if now - last < 0.02:
            return now
        last = now
    return last


def _head(path: str, media_type: str, length: int, token: str | None = None) -> bytes:
    headers = {"Content-Type": media_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return request_head("POST", path, headers, length)


def worst_shape(server: ServerProcess, probes: Probes, name: str, budget: int, count: int) -> Outcome:
    """``count`` requests of the worst shape ``name`` (:data:`.worst.SHAPES`) at once, each holding
    5/8 of ``budget``: the budget admits one at a time, so the server's RSS may grow by one's peak,
    and by :data:`ALLOWANCE_BYTES` more, never by ``count`` of them."""
    path, media_type, body, peak = SHAPES[name](budget * 5 // 8)
    outcome = Outcome(f"worst shape: {name}", 2, "reserved 2x (5x) the body: up to 66x held")
    head = _head(path, media_type, len(body))
    before = settled_rss(server.pid)  # the last attack's buffers and heap given back first
    with watched(server, probes, outcome, budget):
        answers = parallel(count, lambda _: exchange(server.port, head, body, timeout_s=60))
    growth = outcome.peak_rss_bytes - before
    tally(outcome, answers)
    outcome.figures.update(body_mib=len(body) / MIB, peak_mib=peak / MIB, growth_mib=growth / MIB)
    if growth > budget + ALLOWANCE_BYTES:
        outcome.problems.append(f"RSS grew {growth / MIB:.0f} MiB > budget {budget / MIB:.0f} MiB + "
                                f"{ALLOWANCE_BYTES / MIB:.0f} MiB")
    outcome.now = (f"{count} x {len(body) / MIB:.2f} MiB bodies holding {peak / MIB:.0f} MiB each: "
                   f"{summary(outcome.statuses)}, RSS +{growth / MIB:.0f} MiB")
    return outcome


def oversized(server: ServerProcess, name: str, budget: int) -> Outcome | None:
    """One request of the worst shape ``name`` holding twice ``budget`` (None where the shape cannot
    hold that much: a batch of 10,000 tiny calls): it must be refused 413, the RSS grown by at
    most the body and :data:`ALLOWANCE_BYTES`."""
    path, media_type, body, peak = SHAPES[name](2 * budget)
    if peak < 3 * budget // 2:
        return None
    outcome = Outcome(f"worst shape twice the budget: {name}", 2, "admitted, RSS up by what it holds")
    before = settled_rss(server.pid)
    reset_peak(server.pid)
    answer = exchange(server.port, _head(path, media_type, len(body)), body, timeout_s=60)
    growth = rss_bytes(server.pid, "VmHWM") - before
    tally(outcome, [answer])
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    outcome.figures.update(body_mib=len(body) / MIB, peak_mib=peak / MIB, growth_mib=growth / MIB)
    if answer.status != 413:
        outcome.problems.append(f"answered {answer.status or answer.error}, want 413")
    if growth > len(body) + ALLOWANCE_BYTES:
        outcome.problems.append(f"RSS grew {growth / MIB:.0f} MiB > the body + {ALLOWANCE_BYTES / MIB:.0f} MiB")
    outcome.now = (f"{len(body) / MIB:.2f} MiB body holding {peak / MIB:.0f} MiB: "
                   f"{summary(outcome.statuses)}, RSS +{growth / MIB:.0f} MiB")
    return outcome


def stalled_large_uploads(log_dir: Path, quick: bool, env: dict[str, str] | None = None) -> Outcome:
    """Row 5: two uploads at 16 bytes/s hold most of a 64 MiB budget; another tenant's 4 MiB call
    (holding 8 MiB) is tried every 0.25 s until it gets through. ``env``: the server's environment
    (bench/tenancy.py runs an older checkout's code through PYTHONPATH)."""
    settings = {"max_inflight_bytes": 64 * MIB, "body_timeout_s": 30.0, "body_grace_s": 1.0,
                "body_min_bytes_per_s": 64 << 10, "warm_up": "false", "shutdown_drain_s": 0}
    outcome = Outcome("uploads at 16 B/s holding the large-body budget", 5,
                      "every other tenant's 4 MiB call 503 for 60 s (body_timeout_s)")
    declared = 14 * MIB  # 2 x 28 MiB reserved: a 4 MiB call's 8 MiB no longer fit in the 56 a large body may use
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, declared)
    call = valid_call_body(4 * MIB)
    call_head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(call))
    limit_s = 8.0 if quick else 40.0
    with moegrad_server(log_dir, settings=settings, name="stalled", env=env) as server:
        example_call(server.port, timeout_s=120)
        stallers: list[Answer] = []
        threads = [threading.Thread(target=lambda: stallers.append(_trickle(server.port, head, 16, limit_s + 5)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # both admitted (their heads are sent at once)
        started = time.monotonic()
        through_s, answers = None, []
        while time.monotonic() - started < limit_s:
            answer = exchange(server.port, call_head, call, timeout_s=10)
            answers.append(answer)
            if answer.status == 200:
                through_s = time.monotonic() - started
                break
            time.sleep(0.25)
        for thread in threads:
            thread.join()
    tally(outcome, stallers + answers)
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    outcome.figures.update(through_s=float("inf") if through_s is None else through_s,
                           stalled_s=max((a.elapsed_s for a in stallers), default=float("nan")))
    refused = sum(1 for a in answers if a.status == 503)
    uploads = summary(Counter(a.status or a.error for a in stallers))
    call = (f"call through after {through_s:.1f} s ({refused} x 503 before)" if through_s is not None
            else f"call never got through in {limit_s:.0f} s ({refused} x 503)")
    outcome.now = f"uploads {uploads} after {outcome.figures['stalled_s']:.1f} s; the 4 MiB {call}"
    return outcome


def _trickle(port: int, head: bytes, rate_bps: int, timeout_s: float) -> Answer:
    """Send ``head``, then the body ``rate_bps`` bytes (zeros) a second, until an answer comes or
    ``timeout_s`` passes."""
    started = time.monotonic()
    received = bytearray()
    with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as sock:
        sock.sendall(head)
        while time.monotonic() - started < timeout_s:
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                try:
                    data = sock.recv(1 << 16)
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                received += data
                if _whole(received):
                    break
                continue
            try:
                sock.sendall(bytes(rate_bps))
            except OSError:
                break
    parsed = _parse(bytes(received))
    elapsed = time.monotonic() - started
    return Answer(*parsed, elapsed_s=elapsed) if parsed else Answer(None, error="timeout", elapsed_s=elapsed)


def abandoned_compares(server: ServerProcess, count: int, tokens: int) -> Outcome:
    """Row 10: ``count`` compares of H = 1 (``tokens`` tokens: a long judging for a small body) whose
    clients hang up 0.5 s after sending: the server's CPU time from the hang-up on, against the same
    compares answered (both in this run)."""
    outcome = Outcome("compares abandoned while judged", 10, "3.85 CPU-s after the hang-up of a 3 s judging")
    path, media_type, body, _ = compare_small_h(tokens * 808)
    head = _head(path, media_type, len(body))
    _settled(server.pid)
    start = cpu_seconds(server.pid)
    answered = parallel(count, lambda _: exchange(server.port, head, body, timeout_s=120))
    answered_cpu = _settled(server.pid) - start
    socks = []
    for _ in range(count):
        sock = socket.create_connection((LOOPBACK, server.port))
        sock.sendall(head + body)
        socks.append(sock)
    time.sleep(0.5)  # the calls have run; the judging has begun
    hung_up = cpu_seconds(server.pid)
    for sock in socks:
        sock.close()
    abandoned_cpu = _settled(server.pid) - hung_up
    tally(outcome, answered)
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    outcome.figures.update(answered_cpu_s=answered_cpu, abandoned_cpu_s=abandoned_cpu)
    outcome.now = (f"{count} compares ({len(body) / MIB:.1f} MiB, H = 1): {answered_cpu:.2f} CPU-s answered, "
                   f"{abandoned_cpu:.2f} CPU-s after their clients hung up")
    return outcome


# --- one tenant's flood, another's small call (bench/tenancy.py) ---------------------------------

FLOOD_TOKEN, SMALL_TOKEN = "tenant-a-token", "tenant-b-token"


def _latencies(port: int, seconds: float, token: str | None) -> tuple[list[float], list[float]]:
    """The example call sent back to back (a fresh connection each, 20 ms apart) for ``seconds``:
    each one's latency, and the time its reply says it waited for a worker (``timings_ms.queue``),
    in seconds (NaN for a failed call)."""
    import msgpack

    latencies, queued, end = [], [], time.monotonic() + seconds
    while time.monotonic() < end:
        answer = example_call(port, timeout_s=30, token=token)
        ok = answer.status == 200
        latencies.append(answer.elapsed_s if ok else float("nan"))
        queued.append(msgpack.unpackb(answer.body)["timings_ms"]["queue"] / 1e3 if ok else float("nan"))
        time.sleep(0.02)
    return latencies, queued


def flood_main(port: int, connections: int, seconds: float, token: str, tokens: int, hidden: int,
               kind: str = "compare") -> None:
    """The flood process: ``connections`` keep-alive connections sending the same prebuilt request
    back to back for ``seconds`` (``python -m support.attacks.tenancy PORT CONNECTIONS SECONDS TOKEN
    TOKENS HIDDEN KIND``); prints the count of answers by status. ``kind`` "compare": a dropless
    compare of ``tokens`` x ``hidden``, top_k 2; "grad": a call whose work is large for its body
    and its reply (active mode, top_k 64, every index one of 1024 rows, repeats allowed: N x 64 x H
    adds from a body of N x 256 bytes and 1024 rows)."""
    import msgpack
    import numpy as np

    rng = np.random.default_rng(0)
    tensor = lambda a: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}  # noqa: E731
    if kind == "grad":
        rows, top_k = 1024, 64
        document = {"grad_expanded_x": tensor(rng.standard_normal((rows, hidden), dtype=np.float32)),
                    "expanded_row_idx": tensor(rng.integers(0, rows, tokens * top_k, dtype=np.int32)),
                    "top_k": top_k, "drop_pad_mode": 0, "active_num": rows, "allow_duplicate_indices": True}
        path = GRAD_PATH
    else:
        grad = rng.standard_normal((2 * tokens, hidden), dtype=np.float32)
        document = {"grad_expanded_x": tensor(grad), "expanded_row_idx": tensor(
            rng.permutation(2 * tokens).astype(np.int32)), "top_k": 2, "drop_pad_mode": 0, "active_num": 0,
            "candidate": tensor(np.zeros((tokens, hidden), np.float32))}
        path = "/v1/moe_init_routing_v2_grad/compare"
    body = msgpack.packb(document, use_bin_type=True)
    head = _head(path, "application/msgpack", len(body), token or None)
    counts: Counter = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop() -> None:
        sock = None
        while time.monotonic() < end:
            if sock is None:
                sock = socket.create_connection((LOOPBACK, port), timeout=60)
            answer = exchange(port, head, body, timeout_s=60, sock=sock)
            with lock:
                counts[answer.status or answer.error] += 1
            if answer.status is None or answer.headers.get("connection") == "close":
                sock.close()
                sock = None
            if answer.status == 503:
                time.sleep(0.05)
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=loop) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(dict(counts), flush=True)


def flood_latency(log_dir: Path, *, seconds: float, connections: int, tokens: int, hidden: int,
                  authenticated: bool, env: dict[str, str] | None = None, kind: str = "compare"
                  ) -> dict[str, float | str]:
    """A small call's latency (the documentation's example, tenant B) alone, then under tenant A's
    flood (``connections`` keep-alive connections of :func:`flood_main`'s ``kind``), on one server
    (bearer tokens on when ``authenticated``, so A and B are two tenants; else both are the one
    tenant a server without tokens has); ``env``: the server's environment. Milliseconds."""
    settings: dict[str, object] = {"warm_up": "true", "shutdown_drain_s": 0}
    if authenticated:
        settings["auth_tokens"] = f"{FLOOD_TOKEN},{SMALL_TOKEN}"
    flood_token, small_token = (FLOOD_TOKEN, SMALL_TOKEN) if authenticated else ("", None)
    with moegrad_server(log_dir, settings=settings, name="flood", ready_within_s=300, env=env) as server:
        for _ in range(20):
            example_call(server.port, timeout_s=120, token=small_token)
        alone, alone_queued = _latencies(server.port, seconds, small_token)
        flood = subprocess.Popen([sys.executable, "-m", "support.attacks.tenancy", str(server.port), str(connections),
                                  str(seconds + 2.0), flood_token, str(tokens), str(hidden), kind],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     p for p in (str(Path(__file__).resolve().parents[2]),
                                                 os.environ.get("PYTHONPATH", "")) if p)})
        time.sleep(1.0)  # the flood fills the queue
        flooded, flooded_queued = _latencies(server.port, seconds, small_token)
        counts, _ = flood.communicate(timeout=seconds + 120)
    return {**_percentiles("alone", alone), **_percentiles("flood", flooded),
            **_percentiles("alone_queue", alone_queued), **_percentiles("flood_queue", flooded_queued),
            "flood_answers": counts.strip()}


def _percentiles(name: str, values: list[float]) -> dict[str, float]:
    good = sorted(v * 1e3 for v in values if v == v)
    failed = len(values) - len(good)
    if len(good) < 2:
        return {f"{name}_p50_ms": float("nan"), f"{name}_p99_ms": float("nan"), f"{name}_failed": failed}
    cuts = statistics.quantiles(good, n=100, method="inclusive")
    return {f"{name}_p50_ms": statistics.median(good), f"{name}_p99_ms": cuts[98], f"{name}_n": len(good),
            f"{name}_failed": failed}


if __name__ == "__main__":
    flood_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
               int(sys.argv[6]), sys.argv[7])
