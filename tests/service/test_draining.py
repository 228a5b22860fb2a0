"""The draining server's stop (connections.DrainingServer): no connection closed without an answer.

Two ways a client met a closed connection instead of an answer while the server stopped:

- A connection is complete in the kernel (the client's ``connect()`` has returned, its request is on
  its way) before the server's ``accept()`` sees it, and closing a listening socket resets every
  such connection still queued. The stop must first make the kernel start no new connection (the
  client's connect then fails cleanly: nothing was sent), then answer every one that completed,
  and only then close the port.
- The drain began (SIGTERM) while an answer was being written whose head already said keep-alive;
  closing the connection after it met the client's next request with a closed socket. An answer
  already begun keeps its connection; the next request there is answered ``Connection: close``.

Each server here is a real :class:`~moegrad_service.connections.DrainingServer` (uvicorn, the
guarded protocol, uvloop where installed) in a thread, with a trivial app; the clients are raw
sockets. Not timed: the rounds only repeat the race.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from moegrad_service.connections import DrainingServer, guarded_protocol
from moegrad_service.connections._server import _refuse_new_connections
from support.attacks.wire import read_answer_by
from support.launch import LOOPBACK, free_port

ROUNDS = 5
#: How long each request holds the event loop, in seconds: a loaded server does work between accepts.
BUSY_S = 0.001
#: The client process: CONCURRENCY tasks, each opening a fresh connection per request until the port
#: refuses (or does not answer its SYN); prints its counts as JSON.
CLIENT = r"""
import asyncio, json, sys
port, concurrency = int(sys.argv[1]), int(sys.argv[2])
counts = {"answered": 0, "refused": 0, "unanswered": 0}
async def one():
    while True:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 0.25)
        except (OSError, asyncio.TimeoutError):
            counts["refused"] += 1  # nothing was sent: a clean refusal
            return
        try:
            writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            counts["answered" if head.startswith(b"HTTP/1.1 ") else "unanswered"] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            counts["unanswered"] += 1
        finally:
            writer.close()
async def main():
    await asyncio.gather(*(one() for _ in range(concurrency)))
asyncio.run(main())
print(json.dumps(counts))
"""


class App:
    """Answers ``ok``, holding the event loop BUSY_S first; on ``/slow`` the body's last byte waits for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        time.sleep(BUSY_S)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        if scope["path"] == "/slow":
            await send({"type": "http.response.body", "body": b"o", "more_body": True})
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"k"})
        else:
            await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def draining_server(app: App, *, drain_s: float = 0) -> Iterator[tuple[DrainingServer, int]]:
    """A DrainingServer on a free loopback port in a thread, started; stopped (should_exit) at the end."""
    port = free_port()
    protocol = guarded_protocol(max_header_bytes=1 << 16, header_timeout_s=5.0)
    config = uvicorn.Config(app, host=LOOPBACK, port=port, http=protocol, log_level="warning", lifespan="off",
                            log_config=None)
    server = DrainingServer(config, protocol=protocol, drain_s=drain_s, on_drain=lambda: None)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.has_started():
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield server, port
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the socket filter is Linux's")
def test_a_listener_refusing_new_connections_completes_none_and_keeps_those_completed():
    with socket.create_server((LOOPBACK, 0), backlog=16) as listener:
        port = listener.getsockname()[1]
        before = socket.create_connection((LOOPBACK, port), timeout=1)
        assert _refuse_new_connections(listener)
        with pytest.raises(TimeoutError):  # its SYN goes unanswered: connect() never returns a socket
            socket.create_connection((LOOPBACK, port), timeout=0.3)
        listener.settimeout(1)
        accepted, _ = listener.accept()
        with before, accepted:
            before.sendall(b"ping")
            assert accepted.recv(4) == b"ping"
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()
    with pytest.raises(ConnectionRefusedError):  # once closed, a connect is refused at once
        socket.create_connection((LOOPBACK, port), timeout=1)


def test_no_connection_is_reset_when_the_port_closes_under_fresh_connections():
    totals = {"answered": 0, "refused": 0, "unanswered": 0}
    for _ in range(ROUNDS):
        client = None
        with draining_server(App()) as (_, port):
            client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), "200"], stdout=subprocess.PIPE,
                                      text=True)
            time.sleep(0.3)  # the client is connecting as fast as it can; the server stops while it does
        out, _ = client.communicate(timeout=30)
        for key, n in json.loads(out).items():
            totals[key] += n
    assert totals["answered"] > 0
    assert totals["unanswered"] == 0, totals


def test_an_answer_begun_before_the_drain_keeps_its_connection_for_the_next_request():
    app = App()
    with draining_server(app, drain_s=30) as (server, port), socket.create_connection((LOOPBACK, port)) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        first = sock.recv(1 << 16)
        assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower()  # head sent: keep-alive
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler does: the drain begins
        time.sleep(0.2)
        app.release.set()
        while not first.endswith(b"ok"):  # the answer's last byte
            first += sock.recv(1 << 16)
        sock.sendall(b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
        answer = read_answer_by(sock, time.monotonic() + 5)
        assert answer.status == 200, answer.error  # answered, not a closed socket
        assert answer.headers.get("connection") == "close"
