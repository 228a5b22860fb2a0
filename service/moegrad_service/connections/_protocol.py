"""The HTTP protocol: uvicorn's httptools protocol with a bounded request head and a lingering close.

uvicorn's httptools protocol puts no bound on a request's head (request line plus headers): a client
can send hundreds of MiB of header, or one byte a second forever, and each such connection holds a
socket, memory and CPU without ever reaching the application. :func:`guarded_protocol` makes a
subclass of that protocol that bounds both, per request:

- a head longer than ``max_header_bytes`` is answered ``431 Request Header Fields Too Large``;
- a head that is not complete ``header_timeout_s`` seconds after its first byte (or, on a new
  connection, after the connection opened) is answered ``408 Request Timeout``, or closed without an
  answer when not one byte of it came (a socket that never speaks has asked nothing).

Both answers carry ``Connection: close`` and a problem+json body naming the setting. Each refusal
is logged at warning level with the client's address.

Every close of a connection whose request is not all in -- these two answers, and any answer the
application gives before reading the whole body (413, 415, 503 ...), which it sends with
``Connection: close`` -- is *lingering*: the write side is shut, what the client still sends is read
and discarded for up to LINGER_S seconds or LINGER_BYTES bytes, then the socket is closed. Closing
with unread bytes would make the kernel send a reset, which can destroy the answer before the
client reads it.

The protocol also offers a request's body to its handler through :data:`~._body.BODY_INTO` (the
body sink, :mod:`._body`), and answers ``Connection: close`` from the moment the server drains
(:mod:`._server`). It reaches uvicorn's private members only through :mod:`._uvicorn_private`.

The guard is a subclass rather than uvicorn's ``http="h11"`` (whose ``h11_max_incomplete_event_size``
bounds the head, answered 400, with no head timeout): h11 parses in Python and costs more server
CPU per small call than httptools (see docs/operations.md, "Limits")."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import struct
import termios
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Scope

import moegrad_service.connections._uvicorn_private as uv
from moegrad_service.connections._body import BODY_INTO, BodySink, Received

__all__ = ["LINGER_BYTES", "LINGER_S", "SHUTDOWN_IDLE_S", "GuardedProtocol", "guarded_protocol"]

log = logging.getLogger("moegrad_service.connections")

#: After an early answer: how long, and how many bytes, the client's further sending is read and discarded.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20
#: A lingering connection reads one chunk, then waits this long (seconds) before the next.
LINGER_PACE_S = 0.05
#: At shutdown, how long a connection with no request in progress stays open for one that may be
#: on its way (answered 503 + Connection: close) before it is closed, in seconds.
SHUTDOWN_IDLE_S = 0.5
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _answer(status: int, detail: str) -> bytes:
    body = json.dumps({"type": "about:blank", "title": _REASONS[status], "status": status, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close()`` lingers while the request is not all in."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        if self._protocol._body_unread() or self._protocol._unparsed:
            self._protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedProtocol(uv.HttpToolsProtocol):
    """HttpToolsProtocol with a bounded request head and a lingering close (see the module docstring).

    Made per server by :func:`guarded_protocol`, which sets the two limits. The state it adds to
    uvicorn's instance: ``_raw_transport``, ``_guarded_transport``, ``_peer``, ``_lost``, ``_head_bytes``,
    ``_lingering``, ``_message_done``, ``_deferred``, ``_unparsed``, ``_cycles``, ``_head_timer``,
    ``_shutting_down``
    (names uvicorn's protocol does not use).
    """

    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    #: Set when the server drains (SIGTERM): every answer from then on carries Connection: close.
    draining: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw_transport = transport
        self._guarded_transport = _LingeringTransport(transport, self)  # what uvicorn and this class write to
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, (list, tuple)) and len(peer) >= 2 else "a client"
        self._lost = False
        self._shutting_down = False
        super().connection_made(self._guarded_transport)  # type: ignore[arg-type]
        self._head_bytes: int | None = 0  # bytes of the current request head so far; None: head complete
        self._lingering = 0  # > 0: answered early, discarding what the client still sends
        self._message_done = True  # the parser has seen the whole of the current request (body too)
        self._deferred: bytes | str | None = None  # a refusal waiting for the answer before it to be sent
        self._unparsed = False  # answered 400: the bytes after the bad ones are never parsed
        # the requests of this connection not yet answered: uvicorn's ``cycle`` is only the newest
        # (a pipelined one once parsed), so its connection_lost tells no earlier one it is gone
        self._cycles: list[uv.RequestResponseCycle] = []
        self._head_timer: asyncio.TimerHandle | None = uv.event_loop(self).call_later(
            self.header_timeout_s, self._head_late
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_head_timer()
        super().connection_lost(exc)
        for cycle in self._cycles:  # a reply being sent when the client went: it stops, as uvicorn's own does
            if not uv.answered(cycle):
                uv.client_gone(cycle)
        self._cycles.clear()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discarded(len(data))
            return
        if self._deferred is not None:  # refused, once the answers before it are sent: read no further
            self._raw_transport.pause_reading()
            return
        if self._head_bytes is not None:
            if self._head_bytes == 0 and self._head_timer is None:  # the first byte of a keep-alive request
                self._head_timer = uv.event_loop(self).call_later(self.header_timeout_s, self._head_late)
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes and not self._head_fits(data):
                return
        super().data_received(data)

    def _head_fits(self, data: bytes) -> bool:
        """The head passed max_header_bytes with this chunk: True when the head ends within the limit
        (the rest of the chunk is body), else answer 431 and return False."""
        end = data.find(b"\r\n\r\n")
        head = self._head_bytes
        assert head is not None  # called only while a head is being read
        if end >= 0 and head - len(data) + end + 4 <= self.max_header_bytes:
            return True
        self._refuse(
            431,
            f"the request's header is over the limit of {self.max_header_bytes} bytes "
            "(max_header_bytes); send a shorter header",
        )
        return False

    def _discarded(self, nbytes: int) -> None:
        """``nbytes`` more arrived on a lingering connection and were thrown away."""
        self._lingering += nbytes
        if self._lingering > LINGER_BYTES:
            self._raw_transport.close()
        else:  # paced: what is only being thrown away must not crowd out the requests being served
            self._raw_transport.pause_reading()
            uv.event_loop(self).call_later(LINGER_PACE_S, self._resume_lingering)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._cancel_head_timer()
        super().on_headers_complete()
        cycle, scope = uv.current_cycle(self), uv.parsing_scope(self)
        if cycle is None or uv.cycle_scope(cycle) is not scope:
            return  # an upgrade: no cycle of this request
        self._cycles = [each for each in self._cycles if not uv.answered(each)] + [cycle]
        if self.draining:
            uv.close_after_answer(cycle)
        if scope["scheme"] == "http":  # under TLS the bytes are decrypted into a buffer anyway
            extensions: dict[str, Any] = scope.setdefault("extensions", {})
            extensions[BODY_INTO] = self._body_into

    async def _body_into(self, scope: Scope, view: memoryview, received: Received | None = None) -> bool:
        """See :data:`BODY_INTO`."""
        cycle = uv.current_cycle(self)
        if (
            cycle is None
            or uv.cycle_scope(cycle) is not scope
            or self._message_done
            or self._lingering
            or self._lost
            or uv.is_client_gone(cycle)
            or uv.parsed_body_bytes(cycle) >= len(view)  # all in already (or more than declared: refused later)
        ):
            return False
        if uv.continue_awaited(cycle) and not self._guarded_transport.is_closing():
            self._guarded_transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            uv.continue_sent(cycle)
        parsed = uv.take_parsed_body(cycle)  # what the parser has already passed on of the body
        filled = len(parsed)
        view[:filled] = parsed
        del parsed
        sink = BodySink(
            view,
            filled,
            delegate=self,
            loop=uv.event_loop(self),
            on_complete=self._body_read,
            on_discarded=self._sink_discarded,
            received=received,
        )
        self._raw_transport.set_protocol(sink)
        uv.resume_reading(self)
        try:
            complete = await sink.done
        finally:
            sink.abandon()  # the handler stopped waiting (a timeout): the rest is read and thrown away
        if not complete:
            # raised here, not kept in the future: a stored exception's traceback would hold this
            # frame, whose sink holds the future (a cycle keeping the body's buffer until a collection)
            raise ClientDisconnect()
        return True

    def _body_read(self) -> None:
        """The sink has read the whole body: the socket is the parser's again, for the next request."""
        self._raw_transport.set_protocol(self)
        uv.renew_parser(self)  # the old one still counts the body's bytes
        self.on_message_complete()

    def _sink_discarded(self, nbytes: int) -> None:
        """The sink threw ``nbytes`` of an abandoned body away: counted when the connection lingers."""
        if self._lingering:
            self._discarded(nbytes)

    def drain(self) -> None:
        """The server is draining: the request in progress, if its answer has not begun, is answered
        with Connection: close. An answer already begun said keep-alive: its connection stays open,
        and the client's next request there is answered 503 with Connection: close (closing after
        it would meet that request with a closed socket). An idle keep-alive connection stays open
        until its next request or its idle timeout, for the same reason."""
        cycle = uv.current_cycle(self)
        if cycle is not None and not uv.answered(cycle) and not uv.reply_started(cycle):
            uv.close_after_answer(cycle)

    def shutdown(self) -> None:
        """uvicorn's shutdown: a request whose answer has not begun ends the connection once
        answered; a connection with no request in progress (now, or once the answer being sent is
        all sent) gets SHUTDOWN_IDLE_S more for a request already on its way (closing at once would
        reset it), then is closed unless one has begun."""
        self._shutting_down = True
        self.drain()
        if self._idle():
            uv.event_loop(self).call_later(SHUTDOWN_IDLE_S, self._close_if_idle)

    def _idle(self) -> bool:
        """No request is being answered (none came yet, or the newest one's answer is all sent)."""
        cycle = uv.current_cycle(self)
        return cycle is None or uv.answered(cycle)

    def _close_if_idle(self) -> None:
        if self._head_bytes == 0 and self._idle() and not self._unread_bytes():
            self._guarded_transport.close()

    def _unread_bytes(self) -> int:
        """Bytes the kernel holds for this connection that the event loop has not read yet (a
        request that came as the idle wait ended: read and answered, not reset by the close)."""
        sock = self._raw_transport.get_extra_info("socket")
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):
            return 0

    def on_message_begin(self) -> None:
        self._message_done = False
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._message_done = True
        super().on_message_complete()
        self._next_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if one is waiting
        if self._deferred is None:
            self._next_head()
            if self._shutting_down and self._idle() and not self._guarded_transport.is_closing():
                uv.event_loop(self).call_later(SHUTDOWN_IDLE_S, self._close_if_idle)
            return
        if uv.pipelined(self) or self._answering():
            return  # the refusal waits for every answer before it
        deferred, self._deferred = self._deferred, None
        if isinstance(deferred, bytes):  # a pipelined head refused while the requests before it were answered
            self._guarded_transport.write(deferred)
            self._linger()
        else:  # bytes that are no request, after requests being answered
            self.send_400_response(deferred)

    def _next_head(self) -> None:
        # Once a request's body is all in (an early answer's unread body is parsed and dropped by
        # uvicorn), what follows is the next request's head, pipelined or after the answer: its size
        # is counted, and its time from its first byte.
        if self._message_done and self._head_bytes is None and not self._guarded_transport.is_closing():
            self._head_bytes = 0

    def _answering(self) -> bool:
        """A request before the bytes being parsed is still being answered: its body is all in, or
        the parser has begun another message (whose head is not complete: it has no cycle yet)."""
        cycle = uv.current_cycle(self)
        if cycle is None or uv.answered(cycle):
            return False
        return self._message_done or uv.cycle_scope(cycle) is not uv.parsing_scope(self)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are no HTTP request; after the answer of a request still
        being answered, not instead of it (reading stops until then)."""
        if self._answering():
            if self._deferred is None:
                self._deferred = msg
            self._raw_transport.pause_reading()
            return
        self._unparsed = True  # what the client still sends is unread: the close lingers
        super().send_400_response(msg)

    def _head_late(self) -> None:
        self._head_timer = None
        if self._head_bytes is None or self._guarded_transport.is_closing():
            return
        if self._head_bytes == 0 and uv.current_cycle(self) is None:
            log.warning(
                "%s: closed a connection that sent nothing within %g s (header_timeout_s)",
                self._peer,
                self.header_timeout_s,
            )
            self._guarded_transport.close()
            return
        if self._head_bytes == 0:  # an idle keep-alive connection: uvicorn's idle timeout closes it
            return
        self._refuse(
            408,
            f"the request's header did not arrive within {self.header_timeout_s:g} s "
            "(header_timeout_s); send it at once",
        )

    def _refuse(self, status: int, detail: str) -> None:
        log.warning("%s: %d %s", self._peer, status, detail)
        self._cancel_head_timer()
        self._head_bytes = None
        if self._answering():  # a pipelined head: refused once the request before it is answered
            self._deferred = _answer(status, detail)
            self._raw_transport.pause_reading()
            return
        self._guarded_transport.write(_answer(status, detail))
        self._linger()

    def _body_unread(self) -> bool:
        """The request's head is in, its body is not, and the connection is still up."""
        return not (self._lost or self._lingering or self._message_done)

    def _linger(self) -> None:
        """Shut the write side (what was written is still delivered), discard what the client still
        sends, and close after LINGER_S seconds or LINGER_BYTES bytes, whichever comes first."""
        if self._lingering or self._lost:
            return
        self._lingering = 1
        self._cancel_head_timer()
        transport = self._raw_transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()  # uvicorn may have paused it while its buffer was full
        uv.event_loop(self).call_later(LINGER_S, transport.close)

    def _resume_lingering(self) -> None:
        if not self._raw_transport.is_closing():
            self._raw_transport.resume_reading()

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None


def guarded_protocol(*, max_header_bytes: int, header_timeout_s: float) -> type[GuardedProtocol]:
    """The protocol class to pass as uvicorn's ``http``.

    Args:
        max_header_bytes: longest request head (request line and headers, with their line ends),
            in bytes; a longer one is answered 431.
        header_timeout_s: longest a request head may take to arrive, in seconds; then 408.
    """
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedProtocol,),
        {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s},
    )
