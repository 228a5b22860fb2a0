"""The attacks, each against a running server watched by probes, each returning its :class:`Outcome`.

Each server attack takes the server, its probes, ``quick`` (the tests' size instead of the original
finding's) and the in-flight budget in bytes. :data:`ATTACK_SETTINGS` are the settings every
attacked server runs with; :func:`auth_server` starts one with authentication on.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np

from ..launch import LOOPBACK, REFERENCE_FLAGS, SERVE_COMMAND, ServerProcess, moegrad_server
from .outcome import RSS_MARGIN_BYTES, Outcome, parallel, summary, tally, watched
from .probes import Probes, rss_bytes, settled_rss
from .wire import (
    GRAD_PATH,
    INFER_PATH,
    MIB,
    Answer,
    example_call,
    exchange,
    read_answer,
    read_answer_by,
    request_head,
    valid_call_body,
)

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
AUTH_TOKEN = "attack-token"


def auth_server(log_dir: Path, settings: dict) -> ServerProcess:
    """A started server with ``settings`` and authentication on (bearer :data:`AUTH_TOKEN`)."""
    # /health/ready needs no token, so the launcher's readiness poll works with authentication on.
    return moegrad_server(log_dir, settings={**settings, "auth_tokens": AUTH_TOKEN}, name="attack-auth")


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
        answers = parallel(count, lambda _: exchange(server.port, head, body, timeout_s=30))
    tally(outcome, answers)
    outcome.now = (f"{count} x {size // MIB} MiB at once: {summary(outcome.statuses)} in "
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
        answers = parallel(count, lambda _: exchange(server.port, head, document, timeout_s=30))
    tally(outcome, answers)
    outcome.now = (f"{count} x {len(document) / MIB:.2f} MiB at once: {summary(outcome.statuses)} in "
                   f"{max(a.elapsed_s for a in answers):.2f} s")
    return outcome


def uploads_past_the_queue(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    size, count = (16 * MIB, 16) if quick else (16 * MIB, 64)
    outcome = Outcome("uploads past the queue (max_queue 2)", 3,
                      "64 x 16 MiB: 1,654 MiB peak, every 503 after its full body")
    body = valid_call_body(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(body))
    with watched(server, probes, outcome, budget):
        answers = parallel(count, lambda _: exchange(server.port, head, body, chunk=256 << 10, timeout_s=30))
    tally(outcome, answers)
    early = sum(1 for a in answers if a.status == 503 and a.elapsed_s < 1.0)
    outcome.figures["early_503"] = early
    outcome.now = f"{count} x {size // MIB} MiB at once: {summary(outcome.statuses)}; {early} 503s within 1 s"
    return outcome


def slow_senders(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count, size, rate = (6, 4 * MIB, 2 * MIB) if quick else (16, 16 * MIB, MIB)
    outcome = Outcome("slow senders (1 MiB/s)", 3, "like the uploads: held whole before 503")
    body = valid_call_body(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, len(body))
    with watched(server, probes, outcome, budget):
        answers = parallel(count, lambda _: exchange(server.port, head, body, chunk=256 << 10, rate_bps=rate,
                                                      timeout_s=30))
    tally(outcome, answers)
    outcome.now = f"{count} x {size // MIB} MiB at {rate // MIB} MiB/s: {summary(outcome.statuses)}"
    return outcome


def stalled_uploads(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count, size = (4, 16 * MIB) if quick else (8, 16 * MIB)
    outcome = Outcome("uploads that stop sending", 3, "8 x 16 MiB: 1.79 GiB held forever")
    body = bytes(size)
    head = request_head("POST", GRAD_PATH, {"Content-Type": "application/msgpack"}, size)
    with watched(server, probes, outcome, budget):
        answers = parallel(count, lambda _: exchange(server.port, head, body, chunk=MIB, stop_after=2 * MIB,
                                                      timeout_s=15))
    tally(outcome, answers)
    outcome.figures["elapsed_s"] = max(a.elapsed_s for a in answers)
    outcome.now = (f"{count} stop after 2 of {size // MIB} MiB: {summary(outcome.statuses)} after "
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
                    answers.append(read_answer(sock))
            for sock in list(still):
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    answers.append(read_answer(sock))
                    still.remove(sock)
            open_socks, position = still, min(position + 1, len(head) - 5)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    for sock in socks:
        sock.close()
    tally(outcome, answers)
    outcome.resets += len(open_socks)
    outcome.figures["elapsed_s"] = elapsed
    outcome.now = f"{count} connections: {summary(outcome.statuses)} within {elapsed:.1f} s (header_timeout_s)"
    return outcome


def idle_sockets(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    count = 100 if quick else 250  # below max_connections: the cap has its own attack
    outcome = Outcome("idle sockets (connect, send nothing)", 4, "4,000 sockets never closed")
    socks = [socket.create_connection((LOOPBACK, server.port)) for _ in range(count)]
    with watched(server, probes, outcome, budget):
        started = time.monotonic()
        answers = []
        for sock in socks:
            answers.append(read_answer_by(sock, started + 15))
        elapsed = time.monotonic() - started
    for sock in socks:
        sock.close()
    tally(outcome, answers, closed_is_fine=True)
    outcome.figures["elapsed_s"] = elapsed
    outcome.now = f"{count} sockets: {summary(outcome.statuses)} within {elapsed:.1f} s (header_timeout_s)"
    return outcome


def huge_header(server: ServerProcess, probes: Probes, quick: bool, budget: int) -> Outcome:
    size = 16 * MIB if quick else 128 * MIB
    outcome = Outcome("huge header", 4, "128-217 MiB: 18 s of a core, no 431, valid calls 7-8.5 s")
    head = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: "
    filler = b"a" * size
    with watched(server, probes, outcome, budget):
        answers = parallel(2, lambda _: exchange(server.port, head, filler, chunk=MIB, timeout_s=30))
    tally(outcome, answers)
    outcome.figures["elapsed_s"] = max(a.elapsed_s for a in answers)
    outcome.now = (f"2 x {size // MIB} MiB header: {summary(outcome.statuses)} in "
                   f"{max(a.elapsed_s for a in answers):.2f} s")
    return outcome


def connection_cap(server: ServerProcess, probes: Probes, quick: bool, budget: int, max_connections: int) -> Outcome:
    extra = 20
    outcome = Outcome(f"connections past the cap (max_connections {max_connections})", 4,
                      "at the fd limit: closed with no answer, no log", probe_may_get_503=True)
    socks = [socket.create_connection((LOOPBACK, server.port)) for _ in range(max_connections)]
    with watched(server, probes, outcome, budget):
        answers = parallel(extra, lambda _: exchange(server.port, request_head("GET", "/health/ready"), timeout_s=10))
        for sock in socks:
            sock.close()
    tally(outcome, answers)
    closes = sum(1 for a in answers if a.headers.get("connection") == "close")
    outcome.figures["connection_close"] = closes
    outcome.now = (f"{extra} requests past {max_connections} open sockets: {summary(outcome.statuses)}, "
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
        answers = parallel(count, one)
    tally(outcome, answers)
    outcome.now = f"{count} x {size // MIB} MiB bodies: {summary(outcome.statuses)}"
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
    outcome.now = f"{summary(outcome.statuses)}: {str(detail)[:70]}"
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
    outcome.now = f"{summary(outcome.statuses)}, aclnn_status {codes}"
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
    settled = settled_rss(server.pid)
    outcome.figures.update(start_mib=baseline / MIB, idle_mib=settled / MIB)
    outcome.now = (f"{len(answers)} calls ({big // MIB} MiB among them), {summary(outcome.statuses)}: "
                   f"{baseline / MIB:.0f} -> {outcome.peak_rss_bytes / MIB:.0f} MiB peak -> "
                   f"{settled / MIB:.0f} MiB idle")
    return outcome


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
    outcome.now = f"{len(requests)} probes: {summary(outcome.statuses)}"
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
    outcome.now = f"{len(answers)} calls: {summary(outcome.statuses)}, {refused} connections refused, exit {code}"
    return outcome


SERVER_ATTACKS = (msgpack_empty_maps, v2_json_ragged, uploads_past_the_queue, slow_senders, stalled_uploads, slowloris,
                  idle_sockets, huge_header, early_answers, unsupported_dtypes, duplicate_keys, rss_after_load)
