"""The clients' default transports (moegrad.http._transport): httpx's, with reads of up to READ_BYTES.

A local HTTP/1.1 responder sends a 6 MiB body in one ``sendall``; through httpx's own transport
(httpcore reads 64 KiB at a time) that body is at least 96 chunks, through ours far fewer, and the
bytes are the same. Requests' bodies arrive whole; a peer that reads nothing makes a write time out
as httpx's ``WriteTimeout``. A plain name that resolves (``socket.getaddrinfo``, replaced for the
test's own names) to several addresses of one family gets one ReplicaWarning per client, naming the
``dns+`` URL; one address, or one per family, gets none; an address is never looked up for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import warnings

import httpx
import pytest

from moegrad import ReplicaWarning
from moegrad.cli._main import main
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


# ---- a plain http:// name with several addresses (issue 38) --------------------------------------


class Resolver:
    """``socket.getaddrinfo`` with a few names of its own (their addresses, in this order); every other
    name and address resolved as before. Counts the lookups of each name."""

    def __init__(self, monkeypatch, names: dict[str, list[str]]) -> None:
        self.names, self.asked, self.real = names, [], socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self)

    def __call__(self, host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host  # anyio asks with the IDNA-encoded bytes
        self.asked.append(name)
        if name in self.names:
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                     (a, int(port), 0, 0) if ":" in a else (a, int(port))) for a in self.names[name]]
        return self.real(host, port, *args, **kwargs)


def test_a_plain_name_with_several_addresses_is_said_once_per_client_with_dns_plus(responder, monkeypatch):
    port = responder.url.split(":")[2].rstrip("/")
    resolver = Resolver(monkeypatch, {"replicas.test": ["127.0.0.1", "127.0.0.2", "127.0.0.3"]})
    with pytest.warns(ReplicaWarning) as caught, httpx.Client(transport=http_transport(True)) as client:
        for _ in range(3):  # the responder closes each connection: three connections, one warning
            assert client.get(f"http://replicas.test:{port}/").content == BODY
    [warning] = caught.list
    assert str(warning.message).startswith(f"replicas.test:{port} resolves to 3 addresses (127.0.0.1, 127.0.0.2, "
                                           "127.0.0.3)")
    assert str(warning.message).endswith(f"(dns+http://replicas.test:{port})")
    assert resolver.asked.count("replicas.test") == 3 + 1  # each connection's own lookup, and one more, once


def test_the_async_transport_says_it_too(responder, monkeypatch):
    port = responder.url.split(":")[2].rstrip("/")
    Resolver(monkeypatch, {"replicas.test": ["127.0.0.1", "127.0.0.2"]})

    async def twice() -> None:
        async with httpx.AsyncClient(transport=async_http_transport(True)) as client:
            for _ in range(2):
                assert (await client.get(f"http://replicas.test:{port}/")).content == BODY

    with pytest.warns(ReplicaWarning, match=r"resolves to 2 addresses") as caught:
        asyncio.run(twice())
    assert len(caught.list) == 1


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["127.0.0.1", "::1"], ["127.0.0.1", "127.0.0.1"]])
def test_one_address_or_one_per_family_is_one_host_and_no_warning(responder, monkeypatch, addresses):
    port = responder.url.split(":")[2].rstrip("/")
    Resolver(monkeypatch, {"one.test": addresses})
    with httpx.Client(transport=http_transport(True)) as client:  # a warning would be an error here
        assert client.get(f"http://one.test:{port}/").content == BODY


def test_an_address_is_never_looked_up_for_the_warning(responder, monkeypatch):
    resolver = Resolver(monkeypatch, {})
    with httpx.Client(transport=http_transport(True)) as client:
        for _ in range(2):
            client.get(responder.url)
    assert resolver.asked == ["127.0.0.1"] * 2  # the connections' own lookups only


def test_the_command_shows_the_warning_as_one_line(monkeypatch, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket is closed
    Resolver(monkeypatch, {"replicas.test": ["127.0.0.1", "127.0.0.2", "127.0.0.3"]})
    with warnings.catch_warnings():
        warnings.simplefilter("default", ReplicaWarning)  # as outside pytest, where warnings do not raise
        assert main(["info", "--url", f"http://replicas.test:{port}", "--retries", "0"]) == 4  # refused
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"moegrad: warning: replicas.test:{port} resolves to 3 addresses (127.0.0.1, 127.0.0.2, "
                      "127.0.0.3), and a plain http(s):// URL is one replica: every call goes to the address the "
                      "resolver gives first, with no spreading and no failover. To make each address a replica, "
                      f"put dns+ before the URL's scheme (dns+http://replicas.test:{port})")
