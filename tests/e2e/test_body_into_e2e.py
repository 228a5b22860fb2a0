"""Bodies read straight into the handler's buffer (connections.BODY_INTO), over real sockets.

A request's body sent in pieces, with the next request pipelined behind it in the same send, a body
behind ``Expect: 100-continue``, and v2's binary body: each answer is bitwise the in-process
result, the next request on the connection is answered too, and the access log counts every body
byte (the direct path does not pass them through ``receive()``, where the log counts them).
"""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest

import moegrad
from support.launch import moegrad_server
from support.rawhttp import answer, connect

GRAD_PATH = "/v1/moe_init_routing_v2_grad"


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory):
    """A reference-backend server that writes its access log (log level info)."""
    flags = ("--backend", "reference", "--log-level", "info")
    with moegrad_server(tmp_path_factory.mktemp("body-into"), flags=flags, ready_within_s=60.0,
                        stop_within_s=15.0) as server:
        yield server


def call(seed: int, tokens: int, hidden: int):
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal((tokens * 2, hidden)).astype(np.float32)
    idx = rng.permutation(tokens * 2).astype(np.int32)
    return grad, idx, moegrad.moe_init_routing_v2_grad(grad, idx, 2)


def v1_request(url: str, grad, idx, *, extra: str = "") -> bytes:
    body = moegrad.encode_body({"grad_expanded_x": moegrad.encode_tensor(grad),
                                "expanded_row_idx": moegrad.encode_tensor(idx), "top_k": 2})
    host = url.removeprefix("http://")
    return (f"POST {GRAD_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def grad_x_of(body: bytes) -> np.ndarray:
    return moegrad.decode_tensor(moegrad.decode_body(body)["grad_x"], "grad_x")


class Answers:
    """The answers on one connection, one after another (bytes past an answer are kept for the next)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def _more(self) -> None:
        chunk = self.sock.recv(1 << 20)
        assert chunk, f"the connection closed after {self.data[:200]!r}"
        self.data += chunk

    def next(self) -> tuple[int, bytes]:
        while b"\r\n\r\n" not in self.data:
            self._more()
        top, _, rest = self.data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?im)^content-length:\s*(\d+)", top).group(1))
        while len(rest) < length:
            self._more()
            top, _, rest = self.data.partition(b"\r\n\r\n")
        self.data = rest[length:]
        return int(top.split()[1]), rest[:length]


def same_bits(actual: np.ndarray, expected: np.ndarray) -> bool:
    return actual.shape == expected.shape and np.array_equal(actual.view(np.uint32), expected.view(np.uint32))


def logged_bytes_in(server, request_id: str) -> int:
    for _ in range(50):
        found = re.search(rf"request_id={request_id} .* bytes_in=(\d+)", server.log(None))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no access-log line for {request_id}:\n{server.log()}")


def test_a_body_in_pieces_then_a_pipelined_request(logged_server):
    url = logged_server.url
    big_grad, big_idx, big_expected = call(1, 2048, 1024)  # a 16 MiB body
    small_grad, small_idx, small_expected = call(2, 8, 16)
    first = v1_request(url, big_grad, big_idx, extra="X-Request-Id: pieces-1\r\n")
    second = v1_request(url, small_grad, small_idx, extra="X-Request-Id: pieces-2\r\n")
    with connect(url) as sock:
        sock.sendall(first[:5000])  # the head and the body's start: the handler asks for the rest
        time.sleep(0.3)
        sock.sendall(first[5000:3_000_000])
        time.sleep(0.1)
        sock.sendall(first[3_000_000:] + second)  # the body's tail and the next request, in one send
        sock.settimeout(60)
        replies = Answers(sock)
        status_1, body_1 = replies.next()
        status_2, body_2 = replies.next()
    assert (status_1, status_2) == (200, 200)
    assert same_bits(grad_x_of(body_1), big_expected)
    assert same_bits(grad_x_of(body_2), small_expected)
    head_1 = first.index(b"\r\n\r\n") + 4
    assert logged_bytes_in(logged_server, "pieces-1") == len(first) - head_1
    assert logged_bytes_in(logged_server, "pieces-2") == len(second) - (second.index(b"\r\n\r\n") + 4)


def test_a_body_behind_expect_100_continue(logged_server):
    url = logged_server.url
    grad, idx, expected = call(3, 1024, 512)
    whole = v1_request(url, grad, idx, extra="Expect: 100-continue\r\n")
    head_end = whole.index(b"\r\n\r\n") + 4
    with connect(url) as sock:
        sock.sendall(whole[:head_end])
        sock.settimeout(10)
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(whole[head_end:])
        status, _, body = answer(sock, 60)
    assert status == 200 and same_bits(grad_x_of(body), expected)


def test_v2_binary_body_in_pieces(logged_server):
    import json

    url = logged_server.url
    grad, idx, expected = call(4, 2048, 512)
    header = json.dumps({"inputs": [
        {"name": "grad_expanded_x", "datatype": "FP32", "shape": list(grad.shape),
         "parameters": {"binary_data_size": grad.nbytes}},
        {"name": "expanded_row_idx", "datatype": "INT32", "shape": list(idx.shape),
         "parameters": {"binary_data_size": idx.nbytes}}],
        "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}],
        "parameters": {"top_k": 2}}).encode()
    body = header + grad.tobytes() + idx.tobytes()
    host = url.removeprefix("http://")
    head = (f"POST /v2/models/moe_init_routing_v2_grad/infer HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with connect(url) as sock:
        sock.sendall(head + body[:100])
        time.sleep(0.2)
        sock.sendall(body[100:])
        status, headers, reply = answer(sock, 60)
    assert status == 200, reply[:500]
    data = reply[int(headers["inference-header-content-length"]):]
    assert same_bits(np.frombuffer(data, dtype=np.float32).reshape(expected.shape), expected)


def test_a_client_gone_mid_body_leaves_the_server_serving(logged_server):
    url = logged_server.url
    grad, idx, expected = call(5, 2048, 1024)
    whole = v1_request(url, grad, idx)
    with connect(url) as sock:
        sock.sendall(whole[:1_000_000])
        time.sleep(0.2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    with connect(url) as sock:
        sock.sendall(whole)
        status, _, body = answer(sock, 60)
    assert status == 200 and same_bits(grad_x_of(body), expected)


def frames_request(url: str, grad, idx) -> bytes:
    parts, _ = moegrad.encode_frames({"grad_expanded_x": moegrad.encode_tensor(grad),
                                      "expanded_row_idx": moegrad.encode_tensor(idx), "top_k": 2})
    body = b"".join(bytes(part) for part in parts)
    host = url.removeprefix("http://")
    return (f"POST {GRAD_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {moegrad.FRAMES_MEDIA_TYPE}\r\n"
            f"Accept: {moegrad.FRAMES_MEDIA_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_client_gone_while_a_reply_is_sent_and_the_next_request_waits_costs_the_server_nothing(logged_server):
    """Two pipelined frames calls, nothing read, then the client goes: the reply being sent stops
    (uvicorn marked only the newest, pipelined request as disconnected, so the first one's reply
    wrote to a closed transport: an 'unexpected error' and a failure counted as internal)."""
    url = logged_server.url
    grad, idx, expected = call(6, 4096, 1024)  # 32 MiB in, 16 MiB out
    request = frames_request(url, grad, idx)
    logged_before = len(logged_server.log(None))
    sock = connect(url)

    def send_both() -> None:
        try:
            sock.sendall(request + request)  # never finishes: nothing is read
        except OSError:
            pass

    sender = threading.Thread(target=send_both)
    sender.start()
    time.sleep(5)  # the first reply fills the socket's buffers; the second request is parsed and waits
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    sender.join(10)
    with connect(url) as fresh:
        fresh.sendall(request)
        status, _, body = answer(fresh, 60)
    assert status == 200 and same_bits(moegrad.decode_tensor(moegrad.decode_frames(body)["grad_x"], "grad_x"), expected)
    log = logged_server.log(None)[logged_before:]
    assert "unexpected error" not in log and "Exception in ASGI application" not in log, log[-3000:]
