"""The body sink: a request body of known length read from the socket straight into the handler's buffer.

A handler asks for it through :data:`BODY_INTO`, an ASGI scope extension of plain-TCP requests. The
HTTP protocol then hands the socket to a :class:`BodySink`, an :class:`asyncio.BufferedProtocol`
that the event loop fills with ``recv_into`` until the body is all in, and takes the socket back
with a fresh parser for the next request. Through uvicorn's own path every body byte is copied
five times after the kernel's copy (the loop's read buffer into a ``bytes``, the parser's
``on_body`` slice, the cycle's bytearray, ``receive()``'s ``bytes``, the handler's buffer), 256 KiB
at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["BODY_INTO", "BodySink", "Received"]

#: The scope extension (``scope["extensions"][BODY_INTO]``) of a plain-TCP request with a body:
#: ``await body_into(scope, view, received)`` reads the whole body, whose Content-Length is
#: ``len(view)``, into ``view``, counting the bytes in ``received`` (a :class:`Received`, or None)
#: as they arrive. It returns False, having read nothing, when the body is not this connection's
#: to give (the handler already received part of it, or it is not the request being parsed):
#: read it with ``receive()`` then. Raises starlette's ClientDisconnect when the client goes.
BODY_INTO = "moegrad.body_into"
#: Bytes discarded at a time by a body sink whose handler stopped waiting.
_SCRATCH_BYTES = 256 << 10


class Received:
    """A body's bytes received so far, counted by whoever reads it (the body sink, or the handler
    from ``receive()``): what a watcher of the body's pace reads.

    Attributes:
        nbytes: the bytes received so far.
    """

    __slots__ = ("nbytes",)

    def __init__(self) -> None:
        self.nbytes = 0


class BodySink(asyncio.BufferedProtocol):
    """The connection's protocol while one request body is read into ``view`` from ``filled`` on.

    The event loop reads the socket straight into the view (``recv_into``), never past the body's
    end, so a pipelined next request stays in the socket for the parser. Once abandoned (the
    handler stopped waiting), the rest of the body is read into a scratch buffer and discarded.
    Everything else the transport reports goes to ``delegate``, the HTTP protocol.

    Args:
        view: the handler's buffer, ``len(view)`` the body's Content-Length in bytes.
        filled: bytes of the body already in ``view`` (what the parser had passed on).
        delegate: the HTTP protocol the sink stands in for.
        loop: the connection's event loop.
        on_complete: called once the body is all in (read or discarded): the socket goes back to
            the HTTP protocol.
        on_discarded: called with the bytes read and thrown away after :meth:`abandon` (the HTTP
            protocol counts them when the connection lingers).
        received: counts the body's bytes in ``view`` as they arrive (``filled`` among them), or None.
    """

    def __init__(
        self,
        view: memoryview,
        filled: int,
        *,
        delegate: asyncio.Protocol,
        loop: asyncio.AbstractEventLoop,
        on_complete: Callable[[], None],
        on_discarded: Callable[[int], None],
        received: Received | None = None,
    ) -> None:
        self._delegate = delegate
        self._received = received
        if received is not None:
            received.nbytes = filled
        self._on_complete = on_complete
        self._on_discarded = on_discarded
        self._view: memoryview | None = view
        self._filled = filled
        self._left = len(view) - filled
        self._scratch: memoryview | None = None
        #: True once the body is all in, False when the connection was lost first.
        self.done: asyncio.Future[bool] = loop.create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._view is not None:
            return self._view[self._filled :]
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch[: self._left]

    def buffer_updated(self, nbytes: int) -> None:
        self._left -= nbytes
        if self._view is not None:
            self._filled += nbytes
            if self._received is not None:
                self._received.nbytes = self._filled
        else:
            self._on_discarded(nbytes)
        if self._left == 0:
            self._view = None
            self._on_complete()
            if not self.done.done():
                self.done.set_result(True)

    def abandon(self) -> None:
        self._view = None  # the handler's buffer is the handler's again

    def eof_received(self) -> bool | None:
        return self._delegate.eof_received()  # uvicorn's: None, so the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._view = None
        if not self.done.done():
            self.done.set_result(False)
        self._delegate.connection_lost(exc)

    def pause_writing(self) -> None:
        self._delegate.pause_writing()

    def resume_writing(self) -> None:
        self._delegate.resume_writing()
