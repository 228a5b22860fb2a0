"""Attacks on a real ``moegrad-service``, each watched by probes: ``python -m bench.attack [--quick]``.

Every attack runs against a reference-backend server on a free 127.0.0.1 port (bench/_procs.py),
over raw sockets (a client library would hide resets and retry). While it runs, a probe thread
asks ``GET /health/live`` every 20 ms and sends the documentation's example call every 200 ms on
fresh connections. Each attack reports its figure (what the server answered, how fast, what it
held) and is judged on the same five rules:

1. ``/health/live`` answers within 100 ms at the 99th percentile;
2. the example call succeeds within 1 s every time (the connection-cap attack excepted: at the cap
   every request, the probe's too, is answered 503 + Connection: close, which is its point);
3. the server's peak RSS (``VmHWM``, reset before each attack through ``/proc/<pid>/clear_refs``)
   stays within ``max_inflight_bytes`` + 256 MiB;
4. no answer is a 5xx other than 503 or 504;
5. no request meets a reset or a closed socket instead of an answer (where closing is the
   documented outcome -- a socket that never sent a byte -- the attack says so).

``--quick`` runs each attack at a size for the tests (tests/e2e/test_attacks_e2e.py runs them so);
without it, at the size of the original finding. Every loop is bounded in count and in time, and
all traffic stays on the loopback interface.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from bench._procs import LOOPBACK, REFERENCE_FLAGS, SERVE_COMMAND, ServerProcess, moegrad_server

MIB = 1 << 20
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
INFER_PATH = "/v2/models/moe_init_routing_v2_grad/infer"
LIVE_P99_S = 0.100
VALID_WITHIN_S = 1.0
RSS_MARGIN_BYTES = 256 * MIB
#: The settings every attacked server runs with (small timeouts so that the attacks end quickly).
ATTACK_SETTINGS = {
    "max_inflight_bytes": 64 * MIB,
    "max_body_bytes": 256 * MIB,
    "max_queue": 2,
    "streams": 2,
    "body_timeout_s": 2.0,
    "header_timeout_s": 2.0,
    "idle_timeout_s": 2,
    "max_connections": 300,
    "shutdown_drain_s": 1.0,
    "warm_up": "false",
}
_EXAMPLE = msgpack.packb({
    "grad_expanded_x": {"dtype": "float32", "shape": [4, 2],
                        "data": np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], np.float32).tobytes()},
    "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.array([2, 0, 1, 3], np.int32).tobytes()},
    "top_k": 2, "drop_pad_mode": 0, "active_num": 0}, use_bin_type=True)
#: The example's grad_x (docs/protocol.md, the worked example): row 0 = 0.2 + 0.1, row 1 = 0.3 + 0.4 in float32.
_EXAMPLE_GRAD_X = np.array([[np.float32(0.2) + np.float32(0.1)] * 2, [np.float32(0.3) + np.float32(0.4)] * 2],
                           np.float32)


# --- raw HTTP over one socket ------------------------------------------------------------------------

@dataclass
class Answer:
    """What one raw request got: a status (None: none came), its headers, its body, or the error."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None  # "reset", "closed" (EOF before a status line), "timeout"
    elapsed_s: float = 0.0


def request_head(method: str, path: str, headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    end = raw.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = raw[:end].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    body = raw[end + 4:]
    length = int(headers.get("content-length", "0"))
    if len(body) < length:
        return None
    return int(lines[0].split()[1]), headers, body[:length]


def exchange(port: int, head: bytes, body: bytes | memoryview = b"", *, chunk: int = 1 << 20,
             rate_bps: float | None = None,
             stop_after: int | None = None, timeout_s: float = 10.0, sock: socket.socket | None = None) -> Answer:
    """Send ``head`` then ``body`` (``chunk`` bytes at a time, at most ``rate_bps`` bytes per second,
    stopping after ``stop_after`` bytes when given) on a fresh connection, reading the answer as soon
    as it comes, even while still sending; an answer that arrives early ends the sending."""
    started = time.monotonic()
    deadline = started + timeout_s
    own = sock is None
    if own:
        sock = socket.create_connection((LOOPBACK, port), timeout=timeout_s)
    sock.setblocking(False)
    received = bytearray()
    body = memoryview(body)
    limit = len(body) if stop_after is None else min(len(body), stop_after)
    pieces = [memoryview(head), *(body[i:min(i + chunk, limit)] for i in range(0, limit, chunk))]
    try:
        for piece in pieces:
            offset = 0
            while offset < len(piece):
                if time.monotonic() > deadline:
                    return Answer(None, error="timeout", elapsed_s=time.monotonic() - started)
                readable, writable, _ = select.select([sock], [sock], [], 0.05)
                if readable and (answer := _read_some(sock, received, started)):
                    return answer
                if writable:
                    try:
                        offset += sock.send(piece[offset:])
                    except BlockingIOError:
                        pass
            if rate_bps:
                time.sleep(len(piece) / rate_bps)
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable and (answer := _read_some(sock, received, started)):
                return answer
        return Answer(None, error="timeout", elapsed_s=time.monotonic() - started)
    except (ConnectionResetError, BrokenPipeError) as exc:
        # The server may have answered and closed while we were still sending: read what came.
        with contextlib.suppress(OSError):
            sock.setblocking(True)
            sock.settimeout(0.5)
            while data := sock.recv(1 << 16):
                received += data
        parsed = _parse(bytes(received))
        if parsed:
            return Answer(*parsed, elapsed_s=time.monotonic() - started)
        return Answer(None, error="reset", elapsed_s=time.monotonic() - started, body=str(exc).encode())
    finally:
        if own:
            sock.close()


def _read_some(sock: socket.socket, received: bytearray, started: float) -> Answer | None:
    """Read what a readable socket has into ``received``: the answer once it is whole (or the close
    that ended it), else None."""
    data = sock.recv(1 << 16)
    if not data:
        return _finish(received, started, "closed")
    received += data
    parsed = _parse(bytes(received))
    return Answer(*parsed, elapsed_s=time.monotonic() - started) if parsed else None


def _finish(received: bytearray, started: float, error: str) -> Answer:
    parsed = _parse(bytes(received))
    if parsed:
        return Answer(*parsed, elapsed_s=time.monotonic() - started)
    return Answer(None, error=error, elapsed_s=time.monotonic() - started)


def example_call(port: int, timeout_s: float = 5.0, token: str | None = None,
                 sock: socket.socket | None = None) -> Answer:
    """The documentation's example call (on ``sock`` when given, else a fresh connection); its
    status is 200 only with the right grad_x."""
    headers = {"Content-Type": "application/msgpack"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    answer = exchange(port, request_head("POST", GRAD_PATH, headers, len(_EXAMPLE)), _EXAMPLE, timeout_s=timeout_s,
                      sock=sock)
    if answer.status == 200:
        tensor = msgpack.unpackb(answer.body)["grad_x"]
        got = np.frombuffer(tensor["data"], np.float32).reshape(tensor["shape"])
        if not np.array_equal(got, _EXAMPLE_GRAD_X):
            answer.status, answer.error = None, "wrong result"
    return answer


# --- the server's memory -------------------------------------------------------------------------------

def rss_bytes(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh from the current RSS (Linux's clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# --- the probes ---------------------------------------------------------------------------------------

class Probes:
    """A probe process: GET /health/live every 20 ms and the example call every 200 ms, each on a fresh
    connection, each answer a line ``<monotonic time> live|valid <seconds> <status or error>`` in a file.

    A separate process, so that the attack's own threads (and their GIL) do not slow the probes
    down; :meth:`window` reads the lines between two ``time.monotonic()`` readings (one clock for
    every process on Linux). Stops at :meth:`stop` or after ``max_s`` seconds.
    """

    def __init__(self, port: int, log_dir: Path, *, max_s: float = 900.0, token: str = "") -> None:
        self.path = Path(log_dir) / f"probes-{port}.txt"
        self.process = subprocess.Popen([sys.executable, "-m", "bench.attack", "--probe", str(port), str(self.path),
                                         str(max_s), token], cwd=Path(__file__).resolve().parents[1])
        end = time.monotonic() + 30
        while not (self.path.exists() and self.path.stat().st_size) and time.monotonic() < end:
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)

    def __enter__(self) -> Probes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def window(self, start: float, end: float) -> tuple[list[float], list[str], list[float], list[str]]:
        """(live latencies, live failures, call latencies, call failures) of the probes sent in [start, end]."""
        live_s, live_failures, valid_s, valid_failures = [], [], [], []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 4 or not start <= float(parts[0]) <= end:
                continue
            latency, status = float(parts[2]), parts[3]
            if parts[1] == "live":
                live_s.append(latency)
                if status != "200":
                    live_failures.append(status)
            else:
                valid_s.append(latency)
                if status != "200":
                    valid_failures.append(status)
        return live_s, live_failures, valid_s, valid_failures


def _probe_main(port: int, path: Path, max_s: float, token: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    end = time.monotonic() + max_s
    with open(path, "a", buffering=1) as out:
        next_valid = 0.0
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                with socket.create_connection((LOOPBACK, port), timeout=5.0) as sock:
                    connected = time.monotonic()
                    answer = exchange(port, request_head("GET", "/health/live"), timeout_s=5.0, sock=sock)
                total = time.monotonic() - sent
            except OSError as exc:
                answer, total = Answer(None, error=type(exc).__name__), 5.0
                connected = sent
            out.write(f"{sent:.4f} live {total:.4f} {answer.status or answer.error} {connected - sent:.4f}\n")
            if sent >= next_valid:
                next_valid = sent + 0.2
                sent = time.monotonic()
                answer = example_call(port, token=token or None)
                out.write(f"{sent:.4f} valid {answer.elapsed_s:.4f} {answer.status or answer.error}\n")
            time.sleep(max(0.0, sent + 0.02 - time.monotonic()))


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


# --- one attack's outcome -------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One attack's figure and its judgement against the five rules (module docstring)."""

    name: str
    item: int
    before: str
    now: str = ""
    statuses: Counter = field(default_factory=Counter)
    resets: int = 0
    live_p99_s: float = float("nan")
    valid_max_s: float = float("nan")
    valid_failures: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    rss_limit_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    probe_may_get_503: bool = False
    figures: dict[str, float] = field(default_factory=dict)  #: the figure's numbers, by name (seconds, MiB)
    probed: bool = True  #: False where the probes do not apply (no server, or one going away)

    def judge(self) -> None:
        if not self.live_p99_s <= LIVE_P99_S:
            self.problems.append(f"/health/live p99 {self.live_p99_s * 1e3:.0f} ms > {LIVE_P99_S * 1e3:.0f} ms")
        failures = [f for f in self.valid_failures if not (self.probe_may_get_503 and f in ("503", "live 503"))]
        if failures:
            self.problems.append(f"example call failed: {Counter(failures).most_common(3)}")
        if not self.valid_max_s <= VALID_WITHIN_S and not (self.probe_may_get_503 and self.valid_failures):
            self.problems.append(f"example call took {self.valid_max_s:.2f} s > {VALID_WITHIN_S} s")
        if self.peak_rss_bytes > self.rss_limit_bytes:
            self.problems.append(f"peak RSS {self.peak_rss_bytes / MIB:.0f} MiB > {self.rss_limit_bytes / MIB:.0f} MiB")
        bad = {s: n for s, n in self.statuses.items() if isinstance(s, int) and s >= 500 and s not in (503, 504)}
        if bad:
            self.problems.append(f"5xx answers: {bad}")
        if self.resets:
            self.problems.append(f"{self.resets} requests reset or closed unanswered")

    @property
    def passed(self) -> bool:
        return not self.problems

    def row(self) -> str:
        watched = (f"; live p99 {self.live_p99_s * 1e3:.0f} ms, call max {self.valid_max_s:.2f} s, peak RSS "
                   f"{self.peak_rss_bytes / MIB:.0f} MiB") if self.probed else ""
        return (f"| {self.item} | {self.name} | {self.before} | {self.now}{watched} "
                f"| {'pass' if self.passed else 'FAIL: ' + '; '.join(self.problems)} |")


def tally(outcome: Outcome, answers: list[Answer], *, closed_is_fine: bool = False) -> Counter:
    """Count the answers' statuses into ``outcome`` (resets and unanswered closes as resets)."""
    for answer in answers:
        if answer.status is not None:
            outcome.statuses[answer.status] += 1
        elif answer.error == "closed" and closed_is_fine:
            outcome.statuses["closed"] += 1
        elif answer.error in ("reset", "closed"):
            outcome.resets += 1
            outcome.statuses[answer.error] += 1
        else:
            outcome.statuses[answer.error] += 1
    return outcome.statuses


@contextlib.contextmanager
def watched(server: ServerProcess, probes: Probes, outcome: Outcome, budget_bytes: int) -> Iterator[None]:
    """Run the block as an attack: its probes' window, the peak RSS reset before and read after, then judged."""
    reset_peak(server.pid)
    outcome.rss_limit_bytes = budget_bytes + RSS_MARGIN_BYTES
    start = time.monotonic()
    time.sleep(0.1)
    yield
    time.sleep(0.2)
    live_s, live_failures, valid_s, valid_failures = probes.window(start, time.monotonic())
    outcome.live_p99_s, outcome.valid_max_s = p99(live_s), max(valid_s, default=float("nan"))
    outcome.valid_failures = valid_failures + [f"live {f}" for f in live_failures]
    outcome.peak_rss_bytes = rss_bytes(server.pid, "VmHWM")
    outcome.judge()


#: The attack's own sending threads run at this nice level: attacker, server and probes share this
#: machine's cores, and a remote attacker would not take the server's CPU to send.
ATTACKER_NICE = 10


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ATTACKER_NICE)  # this thread only (Linux)


def _parallel(count: int, job: Callable[[int], Answer]) -> list[Answer]:
    with ThreadPoolExecutor(min(count, 64), initializer=_lower_priority) as pool:
        return list(pool.map(job, range(count)))


def _summary(statuses: Counter) -> str:
    return ", ".join(f"{n}x {s}" for s, n in sorted(statuses.items(), key=lambda kv: str(kv[0])))


# --- the attacks ---------------------------------------------------------------------------------------
# Each takes the server, the size scale (1.0 full, as found; the quick form passes less) and the
# in-flight budget, and returns its Outcome.

def msgpack_empty_maps(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    size, count = (4 * MIB, 2) if quick else (16 * MIB, 4)
    outcome = Outcome("msgpack: body of empty maps", 1,
                      "16 MiB: +2.35 GiB, 14.5 s; 4 at once 9.6 GiB peak")
    n = size - 5
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # array32 of n empty maps
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(body))
    with watched(server, probes, outcome, budget):
        answers = _parallel(count, lambda _: exchange(server.port, head, body, timeout_s=30))
    tally(outcome, answers)
    outcome.now = (f"{count} x {size // MIB} MiB at once: {_summary(outcome.statuses)} in "
                   f"{max(a.elapsed_s for a in answers):.2f} s")
    return outcome


def _ragged(depth: int) -> str:
    # [1,[1,[1,...]]]: every level holds a number and a list, the ragged nesting the flattening must reject.
    return "[1," * depth + "1" + "]" * depth


def v2_json_ragged(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    depth, count = (50_000, 2) if quick else (220_000, 4)
    outcome = Outcome("v2 JSON: ragged nesting in data", 2, "0.86 MiB: /health/live 35.3 s")
    document = ('{"inputs":[{"name":"grad_expanded_x","shape":[4,2],"datatype":"FP32","data":' + _ragged(depth)
                + '},{"name":"expanded_row_idx","shape":[4],"datatype":"INT32","data":[2,0,1,3]}],'
                  '"parameters":{"top_k":2}}').encode()
    head = request_head("POST", INFER_PATH, {"Content-Type": "application/json"}, len(document))
    with watched(server, probes, outcome, budget):
        answers = _parallel(count, lambda _: exchange(server.port, head, document, timeout_s=30))
    tally(outcome, answers)
    outcome.now = (f"{count} x {len(document) / MIB:.2f} MiB at once: {_summary(outcome.statuses)} in "
                   f"{max(a.elapsed_s for a in answers):.2f} s")
    return outcome


def valid_call_body(nbytes: int, seed: int = 0) -> bytes:
    """A valid v1 call (dropless, K = 2, 4096 tokens, float32) whose grad is about ``nbytes`` bytes."""
    tokens = 4096
    hidden = max(1, nbytes // (tokens * 2 * 4))
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal((tokens * 2, hidden), dtype=np.float32)
    idx = rng.permutation(tokens * 2).astype(np.int32)
    return msgpack.packb({"grad_expanded_x": {"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
                          "expanded_row_idx": {"dtype": "int32", "shape": [tokens * 2], "data": idx.tobytes()},
                          "top_k": 2, "drop_pad_mode": 0, "active_num": 0}, use_bin_type=True)


def uploads_past_the_queue(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    size, count = (16 * MIB, 16) if quick else (16 * MIB, 64)
    outcome = Outcome("uploads past the queue (max_queue 2)", 3,
                      "64 x 16 MiB: 1,654 MiB peak, every 503 after its full body")
    body = valid_call_body(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(body))
    with watched(server, probes, outcome, budget):
        answers = _parallel(count, lambda _: exchange(server.port, head, body, chunk=256 << 10, timeout_s=30))
    tally(outcome, answers)
    early = sum(1 for a in answers if a.status == 503 and a.elapsed_s < 1.0)
    outcome.figures["early_503"] = early
    outcome.now = f"{count} x {size // MIB} MiB at once: {_summary(outcome.statuses)}; {early} 503s within 1 s"
    return outcome


def slow_senders(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count, size, rate = (6, 4 * MIB, 2 * MIB) if quick else (16, 16 * MIB, MIB)
    outcome = Outcome("slow senders (1 MiB/s)", 3, "like the uploads: held whole before 503")
    body = valid_call_body(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(body))
    with watched(server, probes, outcome, budget):
        answers = _parallel(count, lambda _: exchange(server.port, head, body, chunk=256 << 10, rate_bps=rate,
                                                      timeout_s=30))
    tally(outcome, answers)
    outcome.now = f"{count} x {size // MIB} MiB at {rate // MIB} MiB/s: {_summary(outcome.statuses)}"
    return outcome


def stalled_uploads(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count, size = (4, 16 * MIB) if quick else (8, 16 * MIB)
    outcome = Outcome("uploads that stop sending", 3, "8 x 16 MiB: 1.79 GiB held forever")
    body = bytes(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, size)
    with watched(server, probes, outcome, budget):
        answers = _parallel(count, lambda _: exchange(server.port, head, body, chunk=MIB, stop_after=2 * MIB,
                                                      timeout_s=15))
    tally(outcome, answers)
    outcome.figures["elapsed_s"] = max(a.elapsed_s for a in answers)
    outcome.now = (f"{count} stop after 2 of {size // MIB} MiB: {_summary(outcome.statuses)} after "
                   f"{max(a.elapsed_s for a in answers):.1f} s (body_timeout_s)")
    return outcome


def slowloris(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count = 100 if quick else 250
    outcome = Outcome("slowloris (a header byte every 0.2 s)", 4, "2,000 connections never closed")
    head = request_head("GET", "/health/live", {"X-Slow": "a" * 200})
    socks = [socket.create_connection((LOOPBACK, server.port)) for _ in range(count)]
    answers: list[Answer] = []
    with watched(server, probes, outcome, budget):
        started = time.monotonic()
        position, open_socks = 0, list(socks)
        while open_socks and time.monotonic() < started + 20:
            still = []
            for sock in open_socks:
                try:
                    sock.send(head[position:position + 1])
                    still.append(sock)
                except OSError:
                    answers.append(_read_answer(sock))
            for sock in list(still):
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    answers.append(_read_answer(sock))
                    still.remove(sock)
            open_socks, position = still, min(position + 1, len(head) - 5)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    for sock in socks:
        sock.close()
    tally(outcome, answers)
    outcome.resets += len(open_socks)
    outcome.figures["elapsed_s"] = elapsed
    outcome.now = f"{count} connections: {_summary(outcome.statuses)} within {elapsed:.1f} s (header_timeout_s)"
    return outcome


def _read_answer(sock: socket.socket) -> Answer:
    received = bytearray()
    sock.settimeout(2.0)
    try:
        while data := sock.recv(1 << 16):
            received += data
    except (ConnectionResetError, BrokenPipeError):
        parsed = _parse(bytes(received))
        return Answer(*parsed) if parsed else Answer(None, error="reset")
    except TimeoutError:
        pass
    parsed = _parse(bytes(received))
    return Answer(*parsed) if parsed else Answer(None, error="closed")


def idle_sockets(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count = 100 if quick else 250  # below max_connections: the cap has its own attack
    outcome = Outcome("idle sockets (connect, send nothing)", 4, "4,000 sockets never closed")
    socks = [socket.create_connection((LOOPBACK, server.port)) for _ in range(count)]
    with watched(server, probes, outcome, budget):
        started = time.monotonic()
        answers = []
        for sock in socks:
            answers.append(_read_answer_by(sock, started + 15))
        elapsed = time.monotonic() - started
    for sock in socks:
        sock.close()
    tally(outcome, answers, closed_is_fine=True)
    outcome.figures["elapsed_s"] = elapsed
    outcome.now = f"{count} sockets: {_summary(outcome.statuses)} within {elapsed:.1f} s (header_timeout_s)"
    return outcome


def _read_answer_by(sock: socket.socket, deadline: float) -> Answer:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        return Answer(None, error="still open")
    except ConnectionResetError:
        return Answer(None, error="reset")
    parsed = _parse(data) if data else None
    return Answer(*parsed) if parsed else Answer(None, error="closed")


def huge_header(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    size = 16 * MIB if quick else 128 * MIB
    outcome = Outcome("huge header", 4, "128-217 MiB: 18 s of a core, no 431, valid calls 7-8.5 s")
    head = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: "
    filler = b"a" * size
    with watched(server, probes, outcome, budget):
        answers = _parallel(2, lambda _: exchange(server.port, head, filler, chunk=MIB, timeout_s=30))
    tally(outcome, answers)
    outcome.figures["elapsed_s"] = max(a.elapsed_s for a in answers)
    outcome.now = (f"2 x {size // MIB} MiB header: {_summary(outcome.statuses)} in "
                   f"{max(a.elapsed_s for a in answers):.2f} s")
    return outcome


def connection_cap(server: ServerProcess, probes: Probes, quick: bool, budget: int, max_connections: int) -> Outcome:
    extra = 20
    outcome = Outcome(f"connections past the cap (max_connections {max_connections})", 4,
                      "at the fd limit: closed with no answer, no log", probe_may_get_503=True)
    socks = [socket.create_connection((LOOPBACK, server.port)) for _ in range(max_connections)]
    with watched(server, probes, outcome, budget):
        answers = _parallel(extra, lambda _: exchange(server.port, request_head("GET", "/health/ready"), timeout_s=10))
        for sock in socks:
            sock.close()
    tally(outcome, answers)
    closes = sum(1 for a in answers if a.headers.get("connection") == "close")
    outcome.figures["connection_close"] = closes
    outcome.now = (f"{extra} requests past {max_connections} open sockets: {_summary(outcome.statuses)}, "
                   f"{closes} with Connection: close")
    return outcome


def early_answers(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count, size = (8, 8 * MIB) if quick else (32, 32 * MIB)
    outcome = Outcome("early 413/415 while the body is still coming", 6, "sometimes lost to a reset")
    body = bytes(size)
    wrong_type = request_head("POST", GRAD_PATH, {"Content-Type": "text/plain"}, size)
    too_large = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, 300 * MIB)

    def one(i: int) -> Answer:
        return exchange(server.port, wrong_type if i % 2 else too_large, body, chunk=256 << 10, timeout_s=20)

    with watched(server, probes, outcome, budget):
        answers = _parallel(count, one)
    tally(outcome, answers)
    outcome.now = f"{count} x {size // MIB} MiB bodies: {_summary(outcome.statuses)}"
    return outcome


def duplicate_keys(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    outcome = Outcome("v2 JSON duplicate keys", 9, "resolved silently")
    document = (b'{"inputs":[{"name":"grad_expanded_x","name":"expanded_row_idx","shape":[4,2],"datatype":"FP32",'
                b'"data":[1,2,3,4,5,6,7,8]}]}')
    head = request_head("POST", INFER_PATH, {"Content-Type": "application/json"}, len(document))
    with watched(server, probes, outcome, budget):
        answers = [exchange(server.port, head, document)]
    tally(outcome, answers)
    detail = json.loads(answers[0].body or b"{}").get("error", answers[0].body[:80]) if answers[0].status else ""
    outcome.now = f"{_summary(outcome.statuses)}: {str(detail)[:70]}"
    return outcome


def unsupported_dtypes(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    outcome = Outcome("v1 int64 index / float64 grad", 8, "400 with no aclnn code")
    docs = []
    for grad_dtype, idx_dtype in (("float32", "int64"), ("float64", "int32")):
        grad = np.zeros((4, 2), grad_dtype)
        idx = np.array([2, 0, 1, 3], idx_dtype)
        docs.append(msgpack.packb({"grad_expanded_x": {"dtype": grad_dtype, "shape": [4, 2], "data": grad.tobytes()},
                                   "expanded_row_idx": {"dtype": idx_dtype, "shape": [4], "data": idx.tobytes()},
                                   "top_k": 2, "drop_pad_mode": 0, "active_num": 0}, use_bin_type=True))
    with watched(server, probes, outcome, budget):
        answers = [exchange(server.port, request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"},
                                                      len(d)), d) for d in docs]
    tally(outcome, answers)
    codes = [json.loads(a.body).get("aclnn_status") for a in answers if a.status]
    outcome.now = f"{_summary(outcome.statuses)}, aclnn_status {codes}"
    return outcome


def rss_after_load(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    seconds, big = (4.0, 8 * MIB) if quick else (60.0, 16 * MIB)
    # the large call fits the attack budget: a body holds twice its size, 32 of the 56 MiB a large call may take
    outcome = Outcome("RSS after mixed load", 9, "300 s soak: 187 -> 922 MiB peak -> 697 MiB idle")
    baseline = rss_bytes(server.pid)
    large = valid_call_body(big)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(large))
    answers: list[Answer] = []
    with watched(server, probes, outcome, budget):
        end = time.monotonic() + seconds
        # two calls at a time and the probe's: one fewer than the server admits (2 streams + max_queue
        # 2), so that the load tests memory, not the queue's 503s (uploads_past_the_queue does that)
        with ThreadPoolExecutor(2) as pool:
            while time.monotonic() < end:
                batch = [pool.submit(exchange, server.port, head, large, timeout_s=30),
                         pool.submit(example_call, server.port)]
                answers += [f.result() for f in batch]
    outcome.statuses.update(a.status for a in answers if a.status)
    outcome.resets += sum(1 for a in answers if a.error in ("reset", "closed"))
    settled = _settled_rss(server.pid)
    outcome.figures.update(start_mib=baseline / MIB, idle_mib=settled / MIB)
    outcome.now = (f"{len(answers)} calls ({big // MIB} MiB among them), {_summary(outcome.statuses)}: "
                   f"{baseline / MIB:.0f} -> {outcome.peak_rss_bytes / MIB:.0f} MiB peak -> "
                   f"{settled / MIB:.0f} MiB idle")
    return outcome


def _settled_rss(pid: int, within_s: float = 5.0) -> int:
    end, last = time.monotonic() + within_s, rss_bytes(pid)
    while time.monotonic() < end:
        time.sleep(0.5)
        now = rss_bytes(pid)
        if abs(now - last) < MIB:
            return now
        last = now
    return last


def auth_fails_closed(log_dir: Path) -> Outcome:
    """Item 5 without a running server: configured-but-empty tokens refuse to start (exit 2)."""
    outcome = Outcome("auth configured but empty", 5, "authentication silently off")
    empty = Path(log_dir) / "empty-tokens"
    empty.write_text("\n")
    codes = []
    for env in ({"MOEGRAD_AUTH_TOKENS": ","}, {"MOEGRAD_AUTH_TOKENS_FILE": str(empty)}):
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOEGRAD_")}
        done = subprocess.run([*SERVE_COMMAND, "--port", "0", *REFERENCE_FLAGS], env={**base, **env},
                              capture_output=True, text=True, timeout=60)
        codes.append(done.returncode)
        outcome.statuses[f"exit {done.returncode}"] += 1
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    if codes != [2, 2]:
        outcome.problems.append(f"exit codes {codes}, want [2, 2]")
    outcome.now = f"both refuse to start: exit codes {codes}"
    return outcome


def unauthenticated_probing(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    outcome = Outcome("unauthenticated probing of routes", 5, "redirect, 404 and 405 before the token check")
    requests = [("GET", "/nope"), ("GET", GRAD_PATH), ("POST", GRAD_PATH + "/"), ("DELETE", "/v2"), ("GET", "/metrics")]
    with watched(server, probes, outcome, budget):
        answers = [exchange(server.port, request_head(m, p, length=0 if m == "POST" else None)) for m, p in requests]
    tally(outcome, answers)
    outcome.now = f"{len(requests)} probes: {_summary(outcome.statuses)}"
    if set(outcome.statuses) != {401}:
        outcome.problems.append(f"want 401 for every probe, got {dict(outcome.statuses)}")
    return outcome


def sigterm_under_load(log_dir: Path, quick: bool, settings: dict) -> Outcome:
    """Item 6: clients keep calling (fresh and keep-alive connections) while the server gets SIGTERM."""
    clients, seconds = (6, 3.0) if quick else (16, 6.0)
    outcome = Outcome("SIGTERM under load", 6, "0-14 requests per SIGTERM reset with no answer")
    server = moegrad_server(log_dir, settings=settings, name="attack-sigterm")
    answers: list[Answer] = []
    refused = 0
    lock = threading.Lock()
    stop_at = [time.monotonic() + 60]

    def client(i: int) -> None:
        # Even clients keep one connection alive (reconnecting after Connection: close), odd ones
        # open a fresh connection per call; all of them call until the port is closed.
        nonlocal refused
        sock = None
        end = time.monotonic() + seconds + 60
        while time.monotonic() < min(end, stop_at[0]):
            if sock is None:
                try:
                    sock = socket.create_connection((LOOPBACK, server.port), timeout=5)
                except ConnectionRefusedError:
                    with lock:
                        refused += 1  # the listener is closed: a clean refusal, nothing was sent
                    return
            answer = example_call(server.port, timeout_s=20, sock=sock)
            with lock:
                answers.append(answer)
            if i % 2 or answer.status is None or answer.headers.get("connection") == "close":
                sock.close()
                sock = None
            if answer.status == 503:
                time.sleep(0.05)
        if sock is not None:
            sock.close()

    try:
        example_call(server.port, timeout_s=120)  # compile the kernel before the load
        live = rss_bytes(server.pid)
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(client, i) for i in range(clients)]
            time.sleep(seconds / 2)
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(60)
            stop_at[0] = time.monotonic()
            for future in futures:
                future.result(timeout=60)
    finally:
        server.stop()
    tally(outcome, answers)
    outcome.live_p99_s = outcome.valid_max_s = 0.0  # the probes do not apply: the server is going away
    outcome.probed = False
    outcome.peak_rss_bytes, outcome.rss_limit_bytes = live, int(settings["max_inflight_bytes"]) + RSS_MARGIN_BYTES
    if code != 0:
        outcome.problems.append(f"exit code {code}")
    if outcome.resets:
        outcome.problems.append(f"{outcome.resets} resets")
    bad = {s: n for s, n in outcome.statuses.items() if isinstance(s, int) and s >= 500 and s not in (503, 504)}
    if bad:
        outcome.problems.append(f"5xx: {bad}")
    outcome.now = f"{len(answers)} calls: {_summary(outcome.statuses)}, {refused} connections refused, exit {code}"
    return outcome


def hung_kernels() -> Outcome:
    """Item 7 runs on the CANN simulator in tests/ascend (it needs a C compiler to build)."""
    outcome = Outcome("hung kernels (ascend, on the simulator)", 7,
                      "1 stream, 4 hung: 100% of calls fail, ready 200; CANN calls after aclFinalize")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "client"), str(root / "service"),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/ascend/test_service.py", "-k", "lost_capacity or hung_kernel"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    if done.returncode != 0:
        outcome.problems.append(last)
    outcome.now = f"ready 503 and calls 503 with none left, ready again once they finish, 0 violations ({last})"
    return outcome


# --- the run ---------------------------------------------------------------------------------------------

SERVER_ATTACKS = (msgpack_empty_maps, v2_json_ragged, uploads_past_the_queue, slow_senders, stalled_uploads, slowloris,
                  idle_sockets, huge_header, early_answers, unsupported_dtypes, duplicate_keys, rss_after_load)


def run_all(quick: bool, log_dir: Path, *, include_ascend: bool = True,
            report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Every attack in turn (``report`` is called with each outcome as it comes); the outcomes."""
    settings = dict(ATTACK_SETTINGS)
    budget = int(settings["max_inflight_bytes"])
    outcomes = []

    def done(outcome: Outcome) -> None:
        outcomes.append(outcome)
        report(outcome)

    with moegrad_server(log_dir, settings=settings, name="attack") as server, Probes(server.port, log_dir) as probes:
        example_call(server.port, timeout_s=120)  # compile the kernel before anything is timed
        for attack in SERVER_ATTACKS:
            done(attack(server, probes, quick, budget))
        done(connection_cap(server, probes, quick, budget, int(settings["max_connections"])))
    done(auth_fails_closed(log_dir))
    with _auth_server(log_dir, settings) as server, Probes(server.port, log_dir, token=AUTH_TOKEN) as probes:
        example_call(server.port, timeout_s=120, token=AUTH_TOKEN)
        done(unauthenticated_probing(server, probes, quick, budget))
    done(sigterm_under_load(log_dir, quick, settings))
    if include_ascend:
        done(hung_kernels())
    return outcomes


AUTH_TOKEN = "attack-token"


def _auth_server(log_dir: Path, settings: dict) -> ServerProcess:
    # /health/ready needs no token, so the launcher's readiness poll works with authentication on.
    return moegrad_server(log_dir, settings={**settings, "auth_tokens": AUTH_TOKEN}, name="attack-auth")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' sizes instead of the original finding's")
    parser.add_argument("--no-ascend", action="store_true", help="skip the simulator's hung-kernel run")
    parser.add_argument("--probe", nargs=4, metavar=("PORT", "FILE", "MAX_S", "TOKEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        port, path, max_s, token = args.probe
        _probe_main(int(port), Path(path), float(max_s), token)
        return 0
    print("| # | attack | before | now | result |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="moegrad-attack-") as log_dir:
        outcomes = run_all(args.quick, Path(log_dir), include_ascend=not args.no_ascend,
                           report=lambda outcome: print(outcome.row(), flush=True))
    failed = [o.name for o in outcomes if not o.passed]
    verdict = f"; failed: {failed}" if failed else ""
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} attacks pass{verdict}")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
