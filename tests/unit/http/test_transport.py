"""The clients' default transports (moegrad.http._transport): httpx's, with reads of up to READ_BYTES.

A local HTTP/1.1 responder sends a 6 MiB body in one ``sendall``; through httpx's own transport
(httpcore reads 64 KiB at a time) that body is at least 96 chunks, through ours far fewer, and the
bytes are the same. Requests' bodies arrive whole; a peer that reads nothing makes a write time out
as httpx's ``WriteTimeout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket

import httpx
import pytest

from moegrad.http._transport import READ_BYTES, async_http_transport, http_transport
from support.rawhttp import BODY, Responder


@pytest.fixture
def responder():
    server = Responder()
    yield server
    server.close()


def chunks(client: httpx.Client, url: str, content: bytes | None = None) -> tuple[int, bytes]:
    with client.stream("POST", url, content=content) as response:
        parts = list(response.iter_raw())
    return len(parts), b"".join(parts)


def test_reads_are_large_and_the_bytes_the_same(responder):
    with httpx.Client() as stock, httpx.Client(transport=http_transport(True)) as ours:
        stock_count, stock_body = chunks(stock, responder.url)
        count, body = chunks(ours, responder.url)
    assert stock_body == body == BODY
    assert stock_count >= len(BODY) // (64 << 10)
    assert count <= len(BODY) // (256 << 10) < stock_count
    assert READ_BYTES >= 1 << 20


def test_a_request_body_arrives_whole(responder):
    sent = bytes(reversed(BODY)) + b"tail"
    with httpx.Client(transport=http_transport(True)) as ours:
        _, body = chunks(ours, responder.url, content=sent)
    assert body == BODY and responder.digests == [hashlib.sha256(sent).hexdigest()]


def test_a_write_to_a_peer_that_reads_nothing_times_out_as_httpx_does():
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    try:
        with httpx.Client(transport=http_transport(True), timeout=httpx.Timeout(5.0, write=0.3)) as ours:
            with pytest.raises(httpx.WriteTimeout):
                ours.post(url, content=b"\0" * (256 << 20))
    finally:
        listener.close()


def test_the_async_transport_reads_larger_too(responder):
    """Under asyncio a read takes what the event loop has buffered (its reads are 256 KiB), so the
    chunks are fewer than httpx's 64 KiB ones, not READ_BYTES each."""
    async def chunks_of(transport: httpx.AsyncBaseTransport | None) -> list[bytes]:
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("POST", responder.url, content=b"abc") as response:
                return [part async for part in response.aiter_raw()]

    stock, ours = asyncio.run(chunks_of(None)), asyncio.run(chunks_of(async_http_transport(True)))
    assert b"".join(stock) == b"".join(ours) == BODY
    assert len(ours) < len(stock) and len(stock) >= len(BODY) // (64 << 10)
    assert responder.digests == [hashlib.sha256(b"abc").hexdigest()] * 2
