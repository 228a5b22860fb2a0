"""Raw HTTP/1.1 for the attacks, one socket at a time: no client library, so resets and early answers show.

:func:`exchange` sends a head and a body (in chunks, at a rate, or stopping part way) and reads the
answer as soon as it comes, even while still sending; :func:`example_call` sends the
documentation's example (support.docexample) and counts its answer as 200 only with the right grad_x.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np

from ..docexample import DOC_BODY, DOC_RESULT
from ..launch import LOOPBACK

__all__ = ["GRAD_PATH", "INFER_PATH", "MIB", "Answer", "example_call", "exchange", "read_answer", "read_answer_by",
           "request_head", "valid_call_body"]

MIB = 1 << 20
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
INFER_PATH = "/v2/models/moe_init_routing_v2_grad/infer"


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
    data = sock.recv(1 << 20)
    if not data:
        return _finish(received, started, "closed")
    received += data
    if not _whole(received):  # not parsed (copied) again for every piece of a large answer
        return None
    parsed = _parse(bytes(received))
    return Answer(*parsed, elapsed_s=time.monotonic() - started) if parsed else None


def _whole(received: bytearray) -> bool:
    """Whether ``received`` holds a whole answer: its head, and as many bytes after it as it declares."""
    end = received.find(b"\r\n\r\n")
    if end < 0:
        return False
    length = 0
    for line in bytes(received[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = int(value)
    return len(received) >= end + 4 + length


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
    answer = exchange(port, request_head("POST", GRAD_PATH, headers, len(DOC_BODY)), DOC_BODY, timeout_s=timeout_s,
                      sock=sock)
    if answer.status == 200:
        tensor = msgpack.unpackb(answer.body)["grad_x"]
        got = np.frombuffer(tensor["data"], np.float32).reshape(tensor["shape"])
        if not np.array_equal(got, DOC_RESULT):
            answer.status, answer.error = None, "wrong result"
    return answer


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


def read_answer(sock: socket.socket) -> Answer:
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


def read_answer_by(sock: socket.socket, deadline: float) -> Answer:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        return Answer(None, error="still open")
    except ConnectionResetError:
        return Answer(None, error="reset")
    parsed = _parse(data) if data else None
    return Answer(*parsed) if parsed else Answer(None, error="closed")
