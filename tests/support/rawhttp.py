"""Raw HTTP/1.1 over sockets, below any client library: a local responder, and one answer read off a socket.

- :class:`Responder` answers every request on 127.0.0.1 with :data:`BODY` (6 MiB) in one
  ``sendall`` and records each request body's SHA-256; subclasses override ``_answer``.
- :func:`connect` and :func:`answer`: a connection to a server's URL, and the status, headers and
  body of the one answer on it (asserting the connection does not close first).
"""

from __future__ import annotations

import hashlib
import socket
import threading

__all__ = ["BODY", "Responder", "answer", "connect"]

BODY = bytes(range(256)) * (6 << 12)  # 6 MiB


class Responder:
    """Answers each request on a connection with BODY; records each request body's SHA-256."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.digests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            while len(body) < length:
                body += connection.recv(1 << 20)
            self.digests.append(hashlib.sha256(body).hexdigest())
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY)

    def close(self) -> None:
        self.listener.close()


def answer(sock: socket.socket, within_s: float) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one answer on ``sock``, read within ``within_s`` seconds."""
    sock.settimeout(within_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed with no answer after {data!r}"
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)
