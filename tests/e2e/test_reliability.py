"""Reliability against a real server: SIGTERM, disconnecting clients, backend faults, TLS, and a quick soak.

Every server here is a real uvicorn process on a free 127.0.0.1 port, started through
tests/e2e/slow_server.py, which runs ``moegrad_service.__main__.serve`` (the same server, SIGTERM
drain and exit code as ``moegrad-service serve``) with a reference backend whose fault hook can
slow calls down, hold them at a gate, log them, raise or hang. Every loop is bounded by a deadline.

What is proved:

- SIGTERM with 8 calls admitted (2 running, held at a gate, 6 queued; once the gate opens each takes
  0.3 s): all 8 are answered, bit for bit right; a call sent after the drain began is refused (503 or the connection
  refused); the process exits 0;
- a client that disconnects while its call is queued costs no compute (the backend never sees the
  call), and one that disconnects while its call runs leaves no residue (gauges back to 0, the next
  call is right), and one that hangs up halfway through its body is a disconnect, not an internal
  error;
- a client that promises a large body (Content-Length within max_body_bytes) and sends a few bytes
  pins no server memory;
- a backend exception is a 500 carrying its text, and the next call succeeds; a hung backend is a
  504, and the pool gets its capacity back while the hung call is still stuck; X-Request-Timeout
  shortens a call's deadline but never lengthens it past request_timeout_s;
- TLS with a CA and a certificate made in the test: ``moegrad.Client(verify=<CA bundle>)`` gets the
  right result (with a bearer token, over TLS); a client that does not trust the CA gets TransportError;
- a 10 s soak (tests/support/soak.py) with 16 clients, two 32 MiB calls among them: see that module; every answer well formed, every valid
  one bitwise right, no status but 200/400/422/503, every 503 retried to success, the server's RSS
  settles, and the server exits 0 on SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import trustme

import moegrad
from support import routing, soak
from support.bits import same_bits
from support.launch import REFERENCE_FLAGS, ServerProcess, moegrad_server

LAUNCHER = Path(__file__).with_name("slow_server.py")
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
READY_WITHIN_S = 60.0
STOP_WITHIN_S = 90.0
#: How far the server's settled RSS may sit above its warmed-up start after the quick soak.
SOAK_RSS_BOUND_BYTES = 128 << 20


def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.02)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when the series is not there yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in httpx.get(server.url + "/metrics", timeout=5.0).text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def admitted(server: ServerProcess) -> float:
    """Calls queued plus calls running, from the pool's gauges."""
    return metric(server, "moegrad_inference_pending_request_count") + metric(server, "moegrad_inference_exec_count")


@pytest.fixture
def launch(tmp_path):
    """``launch(hook=[...], flags=[...], ca_path=None) -> ServerProcess``: one ``slow_server.py [hook flags]
    -- [serve flags]`` on a free loopback port, ready; every server is stopped at the end."""
    servers: list[ServerProcess] = []

    def start(hook: list[str] = (), flags: list[str] = (), ca_path: Path | None = None) -> ServerProcess:
        server = moegrad_server(tmp_path, command=[sys.executable, str(LAUNCHER), *hook, "--"],
                                flags=[*REFERENCE_FLAGS, *flags], tls_ca=ca_path, ready_within_s=READY_WITHIN_S,
                                stop_within_s=STOP_WITHIN_S)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


# --- calls and their independently computed results ----------------------------------------------

def routed_call(seed: int, *, mode: str = "dropless", hidden: int = 8, dtype=np.float32, tokens: int = 6,
                top_k: int = 3) -> tuple[dict, np.ndarray]:
    """Keyword arguments of a valid call (tests/support/routing.py) and its grad_x computed in this process."""
    rng = np.random.default_rng(seed)
    r = routing.route(rng, tokens=tokens, top_k=top_k, experts=5, mode=mode)
    grad = rng.standard_normal(r.grad_shape(hidden), dtype=np.float32).astype(dtype)
    kwargs = {"grad_expanded_x": grad, **r.kwargs()}
    return kwargs, moegrad.moe_init_routing_v2_grad(**kwargs)


def wire_body(kwargs: dict) -> bytes:
    """The msgpack body of a call, tensors encoded by hand (docs/protocol.md)."""
    def tensor(array: np.ndarray) -> dict:
        name = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32"}[array.dtype]
        return {"dtype": name, "shape": list(array.shape), "data": np.ascontiguousarray(array).tobytes()}

    return msgpack.packb({"grad_expanded_x": tensor(kwargs["grad_expanded_x"]),
                          "expanded_row_idx": tensor(kwargs["expanded_row_idx"]), "top_k": kwargs["top_k"],
                          "drop_pad_mode": kwargs["drop_pad_mode"], "active_num": kwargs["active_num"]},
                         use_bin_type=True)


def send_and_hold(server: ServerProcess, body: bytes) -> socket.socket:
    """POST a call over a raw socket and return the socket unread (closing it disconnects the client)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = (f"POST {GRAD_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def calls_log(calls_file: Path) -> list[dict[str, str]]:
    """The launcher's calls file: one ``{"H": ..., "timeout_s": ...}`` per call that reached the backend."""
    lines = calls_file.read_text().splitlines() if calls_file.exists() else []
    return [dict(field.split("=", 1) for field in line.split()) for line in lines]


def calls_seen(calls_file: Path) -> list[str]:
    """The hidden sizes of the calls that reached the backend, in order (``["H=2", ...]``)."""
    return [f"H={call['H']}" for call in calls_log(calls_file)]


# --- SIGTERM --------------------------------------------------------------------------------------

def test_ctrl_c_stops_the_server_cleanly_with_status_0_and_no_traceback(launch):
    """SIGINT (Ctrl-C in a terminal, as after ``make serve``) drains like SIGTERM: status 0, and no
    KeyboardInterrupt traceback once uvicorn has shut down."""
    server = launch()
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(STOP_WITHIN_S) == 0, server.log()
    assert "Traceback" not in server.log() and "KeyboardInterrupt" not in server.log(), server.log()


def test_sigterm_answers_all_8_admitted_calls_refuses_new_ones_and_exits_0(launch, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()  # open for the warm-up
    server = launch(hook=["--gate-file", str(gate), "--delay-s", "0.3"],
                    flags=["--streams", "2", "--shutdown-grace-s", "60", "--shutdown-drain-s", "1"])
    modes = ["dropless", "active", "drop_pad", "dropless"] * 2
    calls = [routed_call(i, mode=modes[i], hidden=4 + i, dtype=[np.float32, np.float16][i % 2]) for i in range(8)]

    def run(kwargs: dict) -> np.ndarray:
        with moegrad.Client(server.url, retries=0, timeout_s=120.0) as client:
            return client.moe_init_routing_v2_grad(**kwargs)

    for kwargs, want in calls:  # warm up first: a cold server may compile kernels on its first calls
        assert same_bits(run(kwargs), want)
    gate.unlink()  # from now on the two workers hold their calls until the gate opens again

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, kwargs) for kwargs, _ in calls]
        wait_until(lambda: admitted(server) == 8, what="8 calls admitted")  # 2 running, 6 queued
        server.process.send_signal(signal.SIGTERM)

        def draining() -> bool:  # readiness turns 503 at once, or the listener is already closed
            try:
                return httpx.get(server.url + "/health/ready", timeout=2.0).status_code == 503
            except httpx.TransportError:
                return True

        wait_until(draining, what="drain")
        with moegrad.Client(server.url, retries=0, timeout_s=10.0) as late:
            with pytest.raises((moegrad.DeviceBusy, moegrad.TransportError)):
                late.moe_init_routing_v2_grad(**calls[0][0])
        gate.touch()  # the 8 admitted calls now run, 0.3 s each, two at a time, while the server stops
        for future, (_, want) in zip(futures, calls):
            assert same_bits(future.result(timeout=120), want)
    assert server.process.wait(STOP_WITHIN_S) == 0, server.log()


# --- disconnecting clients ------------------------------------------------------------------------

def test_a_batch_whose_client_disconnects_skips_the_parts_not_started(launch, tmp_path):
    """A batch of two groups (H=2 and H=5) on one worker, the first held at the gate: the client
    goes, the batch is counted as a disconnect, and once the gate opens only the part already
    running finishes; the other group never reaches the backend."""
    gate, calls_file = tmp_path / "gate", tmp_path / "calls"
    server = launch(hook=["--gate-file", str(gate), "--calls-file", str(calls_file)],
                    flags=["--streams", "1", "--express-max-adds", "0"])
    small, _ = routed_call(1, hidden=2)
    large, _ = routed_call(2, hidden=5)
    items = [msgpack.unpackb(wire_body(kwargs), raw=False) for kwargs in (small, small, large, large)]
    body = msgpack.packb(items, use_bin_type=True)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall((f"POST {GRAD_PATH}/batch HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                  f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    wait_until(lambda: calls_seen(calls_file) == ["H=2"], what="the first member at the gate")
    sock.close()
    disconnected = {"endpoint": f"{GRAD_PATH}/batch", "reason": "client_disconnected"}
    wait_until(lambda: metric(server, "moegrad_inference_request_failure_total", **disconnected) == 1,
               what="the batch's disconnect counted")
    gate.touch()
    wait_until(lambda: admitted(server) == 0, what="the pool idle again")
    after, after_want = routed_call(4, hidden=3)
    with moegrad.Client(server.url, retries=0, timeout_s=30.0) as client:
        assert same_bits(client.moe_init_routing_v2_grad(**after), after_want)
    assert calls_seen(calls_file) == ["H=2", "H=2", "H=3"]  # the H=5 group was skipped


def test_disconnected_clients_cost_no_compute_and_leave_no_residue(launch, tmp_path):
    gate, calls_file = tmp_path / "gate", tmp_path / "calls"
    server = launch(hook=["--gate-file", str(gate), "--calls-file", str(calls_file)],
                    flags=["--streams", "1", "--express-max-adds", "0"])
    holder_kwargs, holder_want = routed_call(1, hidden=2)
    queued_kwargs, _ = routed_call(2, hidden=5)
    running_kwargs, _ = routed_call(3, hidden=7)
    after_kwargs, after_want = routed_call(4, hidden=3)

    # 1. disconnect while queued behind a call held at the gate: the backend never sees it
    with ThreadPoolExecutor(1) as pool, moegrad.Client(server.url, retries=0, timeout_s=60.0) as client:
        holder = pool.submit(client.moe_init_routing_v2_grad, **holder_kwargs)
        wait_until(lambda: calls_seen(calls_file) == ["H=2"], what="the first call at the gate")
        queued = send_and_hold(server, wire_body(queued_kwargs))
        wait_until(lambda: metric(server, "moegrad_inference_pending_request_count") == 1, what="a queued call")
        queued.close()
        wait_until(lambda: metric(server, "moegrad_inference_pending_request_count") == 0, what="the queued call dropped")
        gate.touch()
        assert same_bits(holder.result(timeout=30), holder_want)
        assert same_bits(client.moe_init_routing_v2_grad(**after_kwargs), after_want)
    assert calls_seen(calls_file) == ["H=2", "H=3"]  # H=5, the dropped call, never reached the backend
    assert metric(server, "moegrad_inference_request_failure_total", endpoint=GRAD_PATH,
                         reason="client_disconnected") == 1

    # 2. disconnect while the call runs (held at the gate): once it ends, nothing is left behind
    gate.unlink()
    running = send_and_hold(server, wire_body(running_kwargs))
    wait_until(lambda: calls_seen(calls_file)[-1:] == ["H=7"], what="the call running")
    assert metric(server, "moegrad_inference_exec_count") == 1
    running.close()
    disconnected = {"endpoint": GRAD_PATH, "reason": "client_disconnected"}
    # the gate opens only once the server has seen the close: opened first, the call may finish
    # before the close is read, and a result that is ready is sent (to nobody), not counted as 499
    wait_until(lambda: metric(server, "moegrad_inference_request_failure_total", **disconnected) == 2,
               what="the running call's disconnect counted")
    gate.touch()
    wait_until(lambda: admitted(server) == 0, what="the pool idle again")
    with moegrad.Client(server.url, retries=0, timeout_s=30.0) as client:
        assert same_bits(client.moe_init_routing_v2_grad(**after_kwargs), after_want)
    assert admitted(server) == 0
    assert calls_seen(calls_file) == ["H=2", "H=3", "H=7", "H=3"]

    # 3. disconnect halfway through sending the body: nothing reaches the backend, nothing is an error
    body = wire_body(routed_call(10, hidden=9)[0])
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall((f"POST {GRAD_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body[: len(body) // 2])
    sock.close()
    wait_until(lambda: metric(server, "moegrad_inference_request_failure_total", **disconnected) == 3,
               what="three disconnects counted")  # queued, running, mid-upload
    with moegrad.Client(server.url, retries=0, timeout_s=30.0) as client:
        assert same_bits(client.moe_init_routing_v2_grad(**after_kwargs), after_want)
    assert calls_seen(calls_file) == ["H=2", "H=3", "H=7", "H=3", "H=3"]
    assert metric(server, "moegrad_inference_request_failure_total", endpoint=GRAD_PATH, reason="internal") == 0
    assert "Traceback" not in server.log(lines=None)


def test_declared_length_without_the_bytes_pins_no_memory(launch):
    """Content-Length up to max_body_bytes is admitted before the body is read (413 is decided from
    it); the buffer must grow with the bytes that actually come, not be allocated from the promise."""
    server = launch(flags=["--max-body-bytes", str(1 << 30)])
    start = soak.rss_bytes(server.process.pid)
    held = []
    for _ in range(4):  # 4 x 256 MiB promised, 3 bytes sent each
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall((f"POST {GRAD_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
                      f"Content-Length: {256 << 20}\r\n\r\nabc").encode())
        held.append(sock)
    try:
        for _ in range(3):  # round trips through the same event loop: the held requests are being read by now
            assert httpx.get(server.url + "/health/live", timeout=10.0).status_code == 200
        peak = start
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            peak = max(peak, soak.rss_bytes(server.process.pid))
            time.sleep(0.05)
        assert peak - start < 64 << 20, f"RSS grew {(peak - start) >> 20} MiB for 12 bytes received"
    finally:
        for sock in held:
            sock.close()
    kwargs, want = routed_call(9, hidden=3)
    with moegrad.Client(server.url, retries=0, timeout_s=30.0) as client:
        assert same_bits(client.moe_init_routing_v2_grad(**kwargs), want)


# --- faults through the reference backend's hook --------------------------------------------------

def test_backend_exception_is_500_with_its_text_and_a_hang_is_504_then_capacity_returns(launch, tmp_path):
    text = "injected launch failure: HBM ECC error at 0x7f00"
    calls_file = tmp_path / "calls"
    server = launch(hook=["--raise-on-hidden", "7", "--raise-text", text, "--hang-on-hidden", "11",
                          "--hang-s", "20", "--abandon-grace-s", "0.3", "--calls-file", str(calls_file)],
                    flags=["--streams", "1", "--express-max-adds", "0", "--shutdown-grace-s", "1",
                           "--request-timeout-s", "30"])
    failing, _ = routed_call(5, hidden=7)
    hanging, _ = routed_call(6, hidden=11)
    fine, fine_want = routed_call(7, hidden=4)
    headers = {"content-type": "application/msgpack"}

    response = httpx.post(server.url + GRAD_PATH, content=wire_body(failing), headers=headers, timeout=30.0)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert text in response.json()["detail"]
    with moegrad.Client(server.url, retries=0, timeout_s=30.0) as client:
        with pytest.raises(moegrad.DeviceFault, match="HBM ECC error"):
            client.moe_init_routing_v2_grad(**failing)
        assert same_bits(client.moe_init_routing_v2_grad(**fine), fine_want)  # the next call succeeds

    response = httpx.post(server.url + GRAD_PATH, content=wire_body(hanging),
                          headers={**headers, "x-request-timeout": "1"}, timeout=30.0)
    assert response.status_code == 504
    assert response.json()["status"] == 504
    # the one worker is stuck for 20 s; within far less, a replacement serves calls again
    with moegrad.Client(server.url, retries=0, timeout_s=10.0) as client:
        for _ in range(3):
            assert same_bits(client.moe_init_routing_v2_grad(**fine), fine_want)
    assert admitted(server) == 0

    # X-Request-Timeout may shorten the deadline, never lengthen it past request_timeout_s (30 s here):
    # the backend is handed the seconds left (docs/protocol.md, "The call")
    for asked in ("3600", "10"):
        response = httpx.post(server.url + GRAD_PATH, content=wire_body(fine),
                              headers={**headers, "x-request-timeout": asked}, timeout=30.0)
        assert response.status_code == 200
    handed = [float(call["timeout_s"]) for call in calls_log(calls_file)[-2:]]
    assert 0 < handed[0] <= 30.0 and 0 < handed[1] <= 10.0


# --- TLS ------------------------------------------------------------------------------------------

def test_tls_with_a_test_ca_trusted_client_succeeds_untrusting_clients_fail(launch, tmp_path):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_path))
    cert_path.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key_path))
    other_ca_path = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca_path))
    token = "tls-test-token"
    server = launch(flags=["--tls-certfile", str(cert_path), "--tls-keyfile", str(key_path), "--auth-tokens", token],
                    ca_path=ca_path)
    assert server.url.startswith("https://")
    kwargs, want = routed_call(8, hidden=6)

    with moegrad.Client(server.url, verify=str(ca_path), token=token, retries=0, timeout_s=30.0) as client:
        assert same_bits(client.moe_init_routing_v2_grad(**kwargs), want)
        assert client.info()["backend"] == "reference"
    with moegrad.Client(server.url, verify=str(ca_path), retries=0, timeout_s=30.0) as no_token:
        with pytest.raises(moegrad.Unauthorized):
            no_token.moe_init_routing_v2_grad(**kwargs)
    for verify in (True, str(other_ca_path)):  # the system's CAs, another CA: neither issued this certificate
        with moegrad.Client(server.url, verify=verify, token=token, retries=0, timeout_s=30.0) as untrusting:
            with pytest.raises(moegrad.TransportError):
                untrusting.moe_init_routing_v2_grad(**kwargs)
    with moegrad.Client(server.url.replace("https://", "http://"), retries=0, timeout_s=10.0) as plain:
        with pytest.raises(moegrad.MoegradError):  # plain HTTP to a TLS port gets no result
            plain.moe_init_routing_v2_grad(**kwargs)


# --- soak (quick) ---------------------------------------------------------------------------------

def test_quick_soak_16_clients_10_s(launch):
    server = launch(flags=["--streams", "2", "--max-queue", "8"])  # as bench/soak.py starts its server
    workload = soak.Workload.build(big_calls=2, big_mib=32.0)  # bench/soak.py sends 64 MiB ones; time here is short
    report = soak.run_soak(server.url, workload, duration_s=10.0, clients=16, server_pid=server.process.pid)
    assert report.failures == []
    assert report.calls, "no calls were made"
    assert set(report.statuses) <= {200, 400, 422, 503}
    assert report.bitwise_checked == sum(n for (kind, outcome), n in report.calls.items() if outcome == "bitwise equal")
    assert sum(n for (kind, _), n in report.calls.items() if kind.startswith("big")) == 2
    assert not any(outcome == "FAILED" for _, outcome in report.calls)
    assert report.rss_settled - report.rss_start <= SOAK_RSS_BOUND_BYTES, (report.rss_start, report.rss_settled)
    assert server.stop() == 0, server.log()
