"""A hostile HTTP/1.1 server on raw sockets: the client's attacks (a reply dripped, huge, a bomb).

- :class:`HostileServer` answers every request on 127.0.0.1 with the answer it is given (a
  function of the connection), on its own thread per connection, and counts the bytes it managed
  to send (``sent``): a client that stops reading closes the connection, and the count stops.
- :func:`head` builds a response head; :func:`drip`, :func:`flood` and :func:`whole` the answers:
  bytes one at a time with a pause, a body of zeros as fast as the client takes it, one body.
- :func:`msgpack_bomb`, :func:`frames_claiming`: bodies that cost little to send and a lot to
  decode or allocate, built by hand from the msgpack specification and docs/protocol.md
  ("Frames"), not with moegrad's encoders.

Used by ``unit/http/test_client_bounds.py`` and ``bench/client_attacks.py``.
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["Answer", "HostileServer", "drip", "flood", "frames_claiming", "head", "msgpack_bomb", "whole"]

Answer = Callable[[socket.socket, "HostileServer"], None]


def head(status: int = 200, content_type: str = "application/msgpack", length: int | None = None, **extra: str) -> bytes:
    """A response head; ``length`` None: ``Transfer-Encoding: chunked`` is left to the answer."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", "Connection: close"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HostileServer:
    """Answers each request (its head and Content-Length body read whole) with ``answer``.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        sent: the bytes the answers sent so far, all connections together.
        requests: the heads of the requests received (request line and headers).
    """

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = 0
        self.requests: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(connection,), daemon=True).start()

    def _connection(self, connection: socket.socket) -> None:
        with connection:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = connection.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                top, _, body = data.partition(b"\r\n\r\n")
                lines = top.decode("latin-1").split("\r\n")
                length = next((int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")), 0)
                while len(body) < length:
                    chunk = connection.recv(1 << 20)
                    if not chunk:
                        return
                    body += chunk
                with self._lock:
                    self.requests.append(top.decode("latin-1"))
                self.answer(connection, self)
            except OSError:  # the client went away: that is what an attack waits for
                return

    def send(self, connection: socket.socket, data: bytes) -> None:
        """Send ``data`` whole, counting what went out (raises OSError when the client has gone)."""
        view = memoryview(data)
        while view:
            n = connection.send(view)
            with self._lock:
                self.sent += n
            view = view[n:]

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def whole(data: bytes) -> Answer:
    """Send ``data`` (a head and its body) at once."""
    return lambda connection, server: server.send(connection, data)


def drip(data: bytes, every_s: float, *, start: int = 0) -> Answer:
    """Send ``data[:start]`` at once, then the rest one byte at a time, ``every_s`` seconds apart."""

    def answer(connection: socket.socket, server: HostileServer) -> None:
        server.send(connection, data[:start])
        for index in range(start, len(data)):
            server.send(connection, data[index : index + 1])
            time.sleep(every_s)

    return answer


def flood(response_head: bytes, total: int, *, chunked: bool = False) -> Answer:
    """Send ``response_head``, then ``total`` bytes of zeros (in chunked encoding with ``chunked``)."""
    block = bytes(1 << 20)
    piece = b"%x\r\n" % len(block) + block + b"\r\n" if chunked else block

    def answer(connection: socket.socket, server: HostileServer) -> None:
        server.send(connection, response_head)
        for _ in range(total // len(block)):
            server.send(connection, piece)
        if chunked:
            server.send(connection, b"0\r\n\r\n")

    return answer


def _str(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw  # fixstr


def msgpack_bomb(width: int = 256, height: int = 256, depth: int = 16) -> bytes:
    """A msgpack map ``{"grad_x": L}``, L a list of ``depth`` lists of ``height`` lists of ``width``
    empty lists: one byte per empty list (0x90, fixarray of 0) that decodes to a Python list of
    56 bytes or more; no list is longer than 256 items (msgpack spec: array 16 is 0xdc, uint16 length)."""

    def array16(count: int) -> bytes:
        return b"\xdc" + struct.pack(">H", count)

    inner = array16(width) + b"\x90" * width
    middle = array16(height) + inner * height
    return b"\x81" + _str("grad_x") + array16(depth) + middle * depth


def frames_claiming(shape: list[int], dtype: str = "float32", itemsize: int = 4) -> bytes:
    """A frames body (docs/protocol.md, "Frames") whose header claims grad_x of ``shape``, with no
    tensor bytes after it: ``MGF1``, the header's length (uint32 little-endian), the header (a
    msgpack map, packed here by hand), zero padding to the 16-byte aligned offset it names."""
    nbytes = itemsize * math.prod(shape)

    def uint(value: int) -> bytes:
        return b"\xcf" + struct.pack(">Q", value)  # msgpack uint 64: the header's length is the same for any offset

    def header_with(offset: int) -> bytes:
        tensor = b"\x84" + _str("dtype") + _str(dtype) + _str("shape") + bytes([0x90 | len(shape)])
        tensor += b"".join(uint(dim) for dim in shape) + _str("offset") + uint(offset) + _str("nbytes") + uint(nbytes)
        return b"\x82" + _str("grad_x") + tensor + _str("backend") + _str("hostile")

    start = -(-(8 + len(header_with(0))) // 16) * 16
    header = header_with(start)
    body = b"MGF1" + struct.pack("<I", len(header)) + header
    return body + bytes(start - len(body))
