"""The draining server: uvicorn's server with a graceful stop that a load balancer can follow."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

import moegrad_service.connections._uvicorn_private as uv
from moegrad_service.connections._protocol import GuardedProtocol

__all__ = ["SETTLE_S", "DrainingServer"]

#: At shutdown, once the kernel starts no new connection: how long no connection may complete
#: before the listening socket closes (a handshake begun before needs one round trip), in seconds.
SETTLE_S = 0.1

#: A classic BPF socket filter (Linux): drop a TCP segment with SYN set and ACK clear -- a new
#: connection's first segment -- and pass every other. A TCP socket's filter sees a segment from its
#: TCP header, whose flags are byte 13 (RFC 9293). On a listening socket the kernel then starts no
#: new connection (the client's SYN goes unanswered; its retry meets the closed port and is refused,
#: nothing sent), while every handshake already begun completes into the accept queue.
_DROP_SYN = (
    (0x30, 0, 0, 13),  # ldb [13]
    (0x54, 0, 0, 0x12),  # and #(SYN | ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN, drop, keep
    (0x06, 0, 0, 0),  # drop: ret #0
    (0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #-1 (the whole segment)
)
_SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; the socket module does not name it


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop admitting at once (every new call 503 + Connection: close,
    readiness 503) while the port stays open for ``drain_s``; then uvicorn's own shutdown closes
    the port and lets every admitted call finish before the lifespan closes the backend. A second
    signal stops at once.

    Args:
        config: uvicorn's configuration; its ``http`` is ``protocol``.
        protocol: the connections' protocol class (:func:`~._protocol.guarded_protocol`): from the
            drain on, each of its connections answers with ``Connection: close``.
        drain_s: seconds between the first signal and uvicorn's shutdown (``shutdown_drain_s``);
            0 shuts down at once.
        on_drain: called once, when the drain begins: the app stops admitting calls.

    The signal handler only records the signal: the drain itself runs on the event loop (a handler
    set with ``signal.signal`` runs between any two bytecodes of the main thread, even inside an
    answer being written). Once started, everything made while starting is frozen out of the
    garbage collector's passes (``gc.freeze``). At shutdown the kernel stops completing new
    connections, and every one it has completed but uvicorn has not yet accepted is answered,
    before the listening socket closes.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        protocol: type[GuardedProtocol],
        drain_s: float,
        on_drain: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self.protocol = protocol
        self.drain_s = drain_s
        self.on_drain = on_drain
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def has_started(self) -> bool:
        """Whether the server finished starting (its lifespan ran and it listened); stays True once it stops."""
        return uv.has_started(self)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first, self.draining = not self.draining, True
        if first:
            self._in_loop(self._begin_drain)
        if not first or not self.has_started() or self.drain_s == 0:
            super().handle_exit(sig, frame)
            return
        timer = threading.Timer(self.drain_s, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        # Everything made while starting (the imported modules, numba's compiled kernels) lives
        # as long as the process: keep it out of the collector's full passes, which otherwise
        # stall the event loop under load (bench/RESULTS.md, "Notes kept from earlier runs").
        gc.collect()
        gc.freeze()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._answer_backlog()
        await super().shutdown(sockets)

    async def _answer_backlog(self) -> None:
        """Serve the connections the kernel has completed but uvicorn has not accepted: closing a
        listening socket resets every connection still in its queue, and a client that has
        already sent its request would read that reset instead of an answer. The kernel first
        stops starting connections (:data:`_DROP_SYN`), then every one completed is accepted until
        none has come for :data:`SETTLE_S`; where no filter can be attached, the queue is cut to
        one and taken until empty (a connection completing in between is reset)."""
        servers = uv.listening_servers(self)
        listeners = []
        for listener in [sock for server in servers for sock in server.sockets]:
            own = socket.socket(fileno=os.dup(listener.fileno()))  # stays listening once asyncio closes its fd
            own.setblocking(False)
            listeners.append((own, _refuse_new_connections(own)))
        for server in servers:
            server.close()  # asyncio stops accepting: every pending connection is ours
        for own, refusing in listeners:
            with own:
                await self._accept_remaining(own, settle_s=SETTLE_S if refusing else 0.0)

    async def _accept_remaining(self, listener: socket.socket, *, settle_s: float) -> None:
        """Accept and serve connections on ``listener`` until none has come for ``settle_s`` seconds."""
        loop = asyncio.get_running_loop()
        quiet_since: float | None = None
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                now = loop.time()
                quiet_since = now if quiet_since is None else quiet_since
                if now - quiet_since >= settle_s:
                    return
                await asyncio.sleep(min(0.01, settle_s))
                continue
            except OSError:
                return
            quiet_since = None
            made = uv.make_connection(self.protocol, self)
            with contextlib.suppress(OSError):
                await loop.connect_accepted_socket(functools.partial(_same, made), sock=connection)

    def _in_loop(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the server's event loop, soon (at once when it has none yet)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            function()
        else:
            loop.call_soon_threadsafe(function)

    def _begin_drain(self) -> None:
        self.protocol.draining = True
        self.on_drain()
        for connection in uv.open_connections(self):
            if isinstance(connection, GuardedProtocol):
                connection.drain()


def _refuse_new_connections(listener: socket.socket) -> bool:
    """Make the kernel start no new connection on ``listener`` (:data:`_DROP_SYN`); False where
    it cannot (not Linux, or not TCP): then its accept queue is cut to one instead."""
    if sys.platform.startswith("linux") and listener.type == socket.SOCK_STREAM:
        code = b"".join(struct.pack("HBBI", *instruction) for instruction in _DROP_SYN)
        program = ctypes.create_string_buffer(code)
        try:  # struct sock_fprog: the length, then a pointer to the instructions (copied by the kernel)
            listener.setsockopt(
                socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("HP", len(_DROP_SYN), ctypes.addressof(program))
            )
            return True
        except OSError:
            pass
    with contextlib.suppress(OSError):
        listener.listen(0)  # the backlog holds at most one from now on
    return False


def _same(protocol: asyncio.BaseProtocol) -> asyncio.BaseProtocol:
    """A protocol factory that hands out one protocol already made (for connect_accepted_socket)."""
    return protocol
