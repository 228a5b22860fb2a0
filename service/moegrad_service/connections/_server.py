"""The draining server: uvicorn's server with a graceful stop that a load balancer can follow."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

import moegrad_service.connections._uvicorn_private as uv
from moegrad_service.connections._protocol import GuardedProtocol

__all__ = ["DrainingServer"]


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

    Once started, everything made while starting is frozen out of the garbage collector's passes
    (``gc.freeze``). At shutdown the connections the kernel has accepted but uvicorn has not yet
    are answered before the listening socket closes.
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

    def has_started(self) -> bool:
        """Whether the server finished starting (its lifespan ran and it listened); stays True once it stops."""
        return uv.has_started(self)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining or not self.has_started() or self.drain_s == 0:
            self._begin_drain()
            super().handle_exit(sig, frame)
            return
        self._begin_drain()
        timer = threading.Timer(self.drain_s, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Everything made while starting (the imported modules, numba's compiled kernels) lives
        # as long as the process: keep it out of the collector's full passes, which otherwise
        # stall the event loop for 100-200 ms at a time under load.
        gc.collect()
        gc.freeze()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._answer_backlog()
        await super().shutdown(sockets)

    async def _answer_backlog(self) -> None:
        """Serve the connections the kernel has accepted but uvicorn has not yet: closing a
        listening socket resets every connection still in its backlog, and a client that has
        already sent its request would read that reset instead of an answer."""
        loop = asyncio.get_running_loop()
        servers = uv.listening_servers(self)
        for listener in [sock for server in servers for sock in server.sockets]:
            own = socket.socket(fileno=os.dup(listener.fileno()))  # stays listening once asyncio closes its fd
            own.setblocking(False)
            with contextlib.suppress(OSError):
                own.listen(0)  # from now on the backlog holds at most one
            for server in servers:
                server.close()  # asyncio stops accepting: every pending connection is ours
            with own:
                while True:
                    try:
                        connection, _ = own.accept()
                    except (BlockingIOError, InterruptedError, OSError):
                        break
                    made = uv.make_connection(self.protocol, self)
                    with contextlib.suppress(OSError):
                        await loop.connect_accepted_socket(functools.partial(_same, made), sock=connection)

    def _begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.protocol.draining = True
        self.on_drain()
        for connection in uv.open_connections(self):
            if isinstance(connection, GuardedProtocol):
                connection.drain()


def _same(protocol: asyncio.BaseProtocol) -> asyncio.BaseProtocol:
    """A protocol factory that hands out one protocol already made (for connect_accepted_socket)."""
    return protocol
