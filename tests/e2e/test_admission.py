"""Admission before reading, against a real server: what a body costs is decided before it is read.

Raw sockets send a request head and then nothing (or a trickle), so any answer that arrives proves
the server did not wait for the body. The rules (docs/operations.md, "Limits"): a Content-Length
larger than the free part of the in-flight budget is 503 + Retry-After, one larger than the whole
budget 413, both before the body is read; a body slower than body_timeout_s is 408.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from support.docexample import example_document
from support.rawhttp import answer, connect
from support.servicekit import pack

GRAD_PATH = "/v1/moe_init_routing_v2_grad"


def head(url: str, length: int) -> bytes:
    host = url.removeprefix("http://")
    return (f"POST {GRAD_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


# An 8 MiB budget: a large call may take seven eighths (7 MiB), and a body holds twice its size.
@pytest.mark.parametrize(("declared", "status"), [(12 << 20, 413), (4 << 20, 413), (3 << 20, 503)])
def test_a_body_that_does_not_fit_the_budget_is_answered_before_it_is_read(server_factory, declared, status):
    url = server_factory(max_inflight_bytes=8 << 20, max_body_bytes=64 << 20)
    with connect(url) as first, connect(url) as second:
        if status == 503:  # the first request holds 6 of the 8 MiB while its body never arrives
            first.sendall(head(url, 3 << 20) + b"\x00" * 1024)
            time.sleep(0.5)
        started = time.monotonic()
        second.sendall(head(url, declared))  # the head alone: the body is never sent
        got, headers, body = answer(second, within_s=10)
        assert got == status, body
        assert time.monotonic() - started < 5  # not after a body read timeout
        problem = json.loads(body)
        assert problem["status"] == status and "in-flight" in problem["detail"]
        if status == 503:
            assert int(headers["retry-after"]) >= 0


def test_a_body_slower_than_the_body_timeout_is_408(server_factory):
    url = server_factory(body_timeout_s=1)
    document = pack(example_document())
    with connect(url) as sock:
        sock.sendall(head(url, len(document)) + document[:10])  # then nothing more
        got, _, body = answer(sock, within_s=10)
    assert got == 408 and "body_timeout_s" in json.loads(body)["detail"]


def test_the_server_still_serves_after_the_refusals(server_factory):
    url = server_factory(max_inflight_bytes=1 << 20)
    with connect(url) as sock:
        sock.sendall(head(url, 2 << 20))
        assert answer(sock, within_s=10)[0] == 413
    document = pack(example_document())
    with connect(url) as sock:
        sock.sendall(head(url, len(document)) + document)
        assert answer(sock, within_s=10)[0] == 200


def test_stalled_chunked_uploads_leave_small_calls_their_eighth(server_factory):
    """Chunked uploads are reserved as they arrive, each piece counted with the body so far (a piece
    alone is a small call's size): three that stall after 8 MiB hold 48 of a 64 MiB budget, a fourth
    is 503 once it would pass seven eighths (56 MiB), and a small call is still answered. Counted
    piece by piece, the fourth would have taken the last eighth, and the small call been 503."""
    url = server_factory(max_inflight_bytes=64 << 20, max_body_bytes=64 << 20)
    host = url.removeprefix("http://")
    chunked = (f"POST {GRAD_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/msgpack\r\n"
               "Transfer-Encoding: chunked\r\n\r\n").encode()
    mib_chunk = b"100000\r\n" + b"\x00" * (1 << 20) + b"\r\n"
    uploads = [connect(url) for _ in range(4)]
    try:
        for sock in uploads[:3]:
            sock.sendall(chunked + mib_chunk * 8)
        time.sleep(1.0)
        fourth = uploads[3]
        fourth.sendall(chunked)
        with contextlib.suppress(OSError):  # the 503 may close the connection while it still sends
            for _ in range(8):
                fourth.sendall(mib_chunk)
        status, headers, _ = answer(fourth, 10)
        assert status == 503 and "retry-after" in headers
        with connect(url) as small:
            body = pack(example_document())
            small.sendall(head(url, len(body)) + body)
            status, _, _ = answer(small, 10)
        assert status == 200
    finally:
        for sock in uploads:
            sock.close()
