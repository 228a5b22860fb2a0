"""The connection protocol's body sink (connections.BODY_INTO), driven by hand.

A fake transport stands in for the event loop's: the test plays the loop, feeding the HTTP protocol
with ``data_received`` and, once the handler has asked for its body, the sink with
``get_buffer``/``buffer_updated`` as a loop reading with ``recv_into`` does. What is checked: the
handler's buffer gets exactly the body (what the parser had already passed on, then the rest); the
sink never offers room past the body's end (a pipelined next request stays for the parser); the
socket goes back to the HTTP protocol with a parser that reads the next request; a client that goes
mid-body is ClientDisconnect; a handler that stops waiting gets nothing more written into its
buffer and the rest of the body is read and discarded; ``Expect: 100-continue`` is answered.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.server import ServerState

from moegrad_service.connections import BODY_INTO, guarded_protocol


class FakeTransport:
    """What the protocol calls on its transport, recorded."""

    def __init__(self) -> None:
        self.protocol = None
        self.written = bytearray()
        self.closed = False
        self.reading = True
        self.switches: list[object] = []

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol
        self.switches.append(protocol)

    def get_protocol(self):
        return self.protocol

    def write(self, data) -> None:
        self.written += data

    def writelines(self, parts) -> None:
        for part in parts:
            self.written += part

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)


class Handler:
    """An ASGI app that reads its body into a buffer of Content-Length bytes through BODY_INTO (or
    receive() when the extension declines) and answers the body's SHA-256 and which way it came."""

    def __init__(self, *, wait_s: float | None = None) -> None:
        self.wait_s = wait_s
        self.views: list[memoryview] = []
        self.outcomes: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        length = int(dict(scope["headers"])[b"content-length"])
        view = memoryview(bytearray(length))
        self.views.append(view)
        body_into = scope["extensions"][BODY_INTO]
        try:
            async with asyncio.timeout(self.wait_s):
                direct = await body_into(scope, view)
        except TimeoutError:
            self.outcomes.append("timed out")
            await self._answer(send, 408, b"late", close=True)
            return
        except ClientDisconnect:
            self.outcomes.append("disconnected")
            return
        if not direct:
            filled = 0
            while True:
                message = await receive()
                chunk = message.get("body", b"")
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
                if not message.get("more_body"):
                    break
        self.outcomes.append("direct" if direct else "receive")
        await self._answer(send, 200, hashlib.sha256(view).hexdigest().encode())

    @staticmethod
    async def _answer(send, status: int, body: bytes, close: bool = False) -> None:
        headers = [(b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def request(body: bytes, *, extra: str = "") -> tuple[bytes, bytes]:
    head = f"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
    return head, body


def body_of(size: int, seed: int) -> bytes:
    return bytes((seed * 7 + i * 13) % 251 for i in range(size))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def connect(app, *, header_timeout_s: float = 10.0) -> tuple[object, FakeTransport]:
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    protocol_class = guarded_protocol(max_header_bytes=64 << 10, header_timeout_s=header_timeout_s)
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = FakeTransport()
    transport.protocol = protocol
    protocol.connection_made(transport)
    return protocol, transport


def feed_sink(transport: FakeTransport, data: bytes, step: int) -> list[int]:
    """Play the loop: the sink's offered room each time, then ``step`` bytes read into it."""
    sink, offered, at = transport.protocol, [], 0
    while at < len(data):
        room = sink.get_buffer(-1)
        offered.append(len(room))
        n = min(step, len(room), len(data) - at)
        room[:n] = data[at : at + n]
        sink.buffer_updated(n)
        at += n
    return offered


def answers(transport: FakeTransport) -> list[bytes]:
    """The bodies of the answers written so far (each a head then a Content-Length body)."""
    out, data = [], bytes(transport.written)
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        out.append(head.split(b"\r\n")[0] + b" " + rest[:length])
        data = rest[length:]
    return out


def test_a_body_in_pieces_lands_whole_in_the_handlers_buffer_and_the_next_request_is_parsed():
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        first, second = body_of(300_000, 1), body_of(5, 2)
        head, body = request(first)
        protocol.data_received(head + body[:1000])  # the parser passes on the first 1000 bytes
        await settle()
        sink = transport.protocol
        assert sink is not protocol and isinstance(sink, asyncio.BufferedProtocol)
        offered = feed_sink(transport, body[1000:], step=70_000)
        # the room offered is always exactly what is left of the body, never more
        assert offered == [len(first) - 1000 - k * 70_000 for k in range(len(offered))]
        assert transport.protocol is protocol  # the socket is the parser's again
        await settle()
        protocol.data_received(b"".join(request(second)))
        await settle()
        assert app.outcomes == ["direct", "receive"]  # the second body came with its head
        assert answers(transport) == [b"HTTP/1.1 200 OK " + hashlib.sha256(first).hexdigest().encode(),
                                      b"HTTP/1.1 200 OK " + hashlib.sha256(second).hexdigest().encode()]

    asyncio.run(main())


def test_a_body_that_came_with_its_head_is_left_to_receive():
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        body = body_of(4000, 3)
        protocol.data_received(b"".join(request(body)))
        await settle()
        assert transport.switches == [] and app.outcomes == ["receive"]
        assert answers(transport) == [b"HTTP/1.1 200 OK " + hashlib.sha256(body).hexdigest().encode()]

    asyncio.run(main())


def test_expect_100_continue_is_answered_before_the_body_is_read():
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        head, body = request(body_of(100_000, 4), extra="Expect: 100-continue\r\n")
        protocol.data_received(head)
        await settle()
        assert bytes(transport.written) == b"HTTP/1.1 100 Continue\r\n\r\n"
        transport.written.clear()
        feed_sink(transport, body, step=1 << 20)
        await settle()
        assert app.outcomes == ["direct"]
        assert answers(transport) == [b"HTTP/1.1 200 OK " + hashlib.sha256(body).hexdigest().encode()]

    asyncio.run(main())


def test_a_client_gone_mid_body_is_client_disconnect():
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        head, body = request(body_of(100_000, 5))
        protocol.data_received(head + body[:10])
        await settle()
        sink = transport.protocol
        feed_sink(transport, body[10:5000], step=1000)
        sink.connection_lost(None)
        await settle()
        assert app.outcomes == ["disconnected"]
        assert protocol.cycle.disconnected and transport.written == b""

    asyncio.run(main())


def test_a_handler_that_stops_waiting_gets_nothing_more_and_the_rest_is_discarded():
    async def main():
        app = Handler(wait_s=0.05)
        protocol, transport = connect(app)
        head, body = request(body_of(200_000, 6))
        protocol.data_received(head + body[:100])
        await settle()
        feed_sink(transport, body[100:50_000], step=10_000)
        await asyncio.sleep(0.1)  # the handler's timeout: it answers 408 with Connection: close
        assert app.outcomes == ["timed out"]
        view = app.views[0]
        assert bytes(view[:50_000]) == body[:50_000] and not any(view[50_000:])
        feed_sink(transport, body[50_000:], step=64 << 10)  # read and thrown away
        assert not any(view[50_000:])
        assert transport.protocol is protocol
        assert answers(transport)[0].startswith(b"HTTP/1.1 408 ")

    asyncio.run(main())


@pytest.mark.parametrize("offset", [0, 1, 64 << 10])
def test_the_body_is_exact_wherever_the_heads_packet_ends(offset):
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        body = body_of(150_000, 7 + offset)
        head, _ = request(body)
        protocol.data_received(head + body[:offset])
        await settle()
        feed_sink(transport, body[offset:], step=4093)
        await settle()
        assert app.outcomes == ["direct"]
        assert answers(transport) == [b"HTTP/1.1 200 OK " + hashlib.sha256(body).hexdigest().encode()]

    asyncio.run(main())


def test_a_client_gone_mid_body_leaves_no_reference_to_the_buffer(collector_off):
    """With the garbage collector off, only reference counts free anything: the handler's buffer
    must be gone once its handler has returned (an exception kept in the sink's future would hold
    the frame that holds the buffer, in a cycle)."""
    import weakref

    import numpy as np

    refs = []

    async def app(scope, receive, send):
        buffer = np.empty(int(dict(scope["headers"])[b"content-length"]), dtype=np.uint8)
        refs.append(weakref.ref(buffer))
        try:
            await scope["extensions"][BODY_INTO](scope, buffer.data)
        except ClientDisconnect:
            return

    async def main():
        protocol, transport = connect(app)
        head, body = request(body_of(100_000, 9))
        protocol.data_received(head + body[:10])
        await settle()
        feed_sink(transport, body[10:5000], step=1000)
        transport.protocol.connection_lost(None)
        await settle()

    asyncio.run(main())
    assert refs and refs[0]() is None


class GatedHandler:
    """Answers 200 "ok" to each request once ``gate`` is set (the body, if any, left unread)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        await self.gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def statuses(transport: FakeTransport) -> list[bytes]:
    import re

    return re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(transport.written))


PIPELINED = [
    # a pipelined head past max_header_bytes, sent while the request before it is answered
    ("oversized head", b"GET /next HTTP/1.1\r\nX-Big: ", [b"a" * (16 << 10)] * 6, 0.0, b"431"),
    # a pipelined head that stops coming (header_timeout_s 0.1 s)
    ("late head", b"GET /next HTTP/1.1\r\nX-Slow: ", [b"a"], 0.3, b"408"),
    # bytes that are no request after a request
    ("garbage", b"\x00\x01 not http\r\n\r\n", [], 0.0, b"400"),
]


@pytest.mark.parametrize(("case", "start", "more", "wait_s", "refusal"), PIPELINED, ids=[c[0] for c in PIPELINED])
def test_a_bad_pipelined_request_is_refused_after_the_answer_before_it(case, start, more, wait_s, refusal):
    """The request before it gets its answer, then the refusal, then the connection lingers and
    closes; nothing more of the bad request is parsed meanwhile (reading stops)."""
    async def main():
        app = GatedHandler()
        protocol, transport = connect(app, header_timeout_s=0.1)
        protocol.data_received(b"POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
        await settle()
        protocol.data_received(start)
        for piece in more:
            protocol.data_received(piece)
        await asyncio.sleep(wait_s)
        await settle()
        assert transport.written == b"" and not transport.reading  # refused, but not before the answer
        app.gate.set()
        await settle()
        assert statuses(transport) == [b"200", refusal]
        assert bytes(transport.written).index(b"ok") < bytes(transport.written).index(b"HTTP/1.1 " + refusal)
        assert protocol._lingering  # the close lingers: what the client still sends is read and dropped

    asyncio.run(main())


def test_a_pipelined_head_after_a_sink_read_body_is_bounded():
    async def main():
        app = Handler()
        protocol, transport = connect(app)
        head, body = request(body_of(200_000, 11))
        protocol.data_received(head + body[:10])
        await settle()
        feed_sink(transport, body[10:], step=50_000)
        await settle()
        assert app.outcomes == ["direct"]
        protocol.data_received(b"GET /next HTTP/1.1\r\nX-Big: ")
        for _ in range(6):
            protocol.data_received(b"a" * (16 << 10))
        await settle()
        assert statuses(transport) == [b"200", b"431"]

    asyncio.run(main())


def test_bytes_that_are_no_request_after_two_pipelined_requests_wait_for_both_answers():
    async def main():
        app = GatedHandler()
        protocol, transport = connect(app)
        first = b"POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        second = b"POST /second HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nde"
        protocol.data_received(first + second)
        await settle()
        protocol.data_received(b"\x00\x01 not http\r\n\r\n")
        await settle()
        assert transport.written == b""
        app.gate.set()
        for _ in range(5):
            await settle()
        assert statuses(transport) == [b"200", b"200", b"400"]

    asyncio.run(main())
