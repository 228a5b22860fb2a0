"""The clients' transport details: httpx's transports over a faster network backend; the frames readers.

httpcore reads a response 64 KiB at a time, and each read goes through h11's buffer and a Python
generator on its way to the caller: a 16 MiB grad_x is 256 reads. Its sync stream also sends a
partially sent chunk's rest as a fresh ``bytes`` (``buffer[n:]``), so a 1 MiB chunk that the socket
takes in four sends is copied three more times. The backend here wraps httpcore's own (socket
handling, timeouts, TLS and their exceptions stay httpcore's): reads ask for up to READ_BYTES, and
writes step through a ``memoryview`` of the chunk. Each connect, read and write waits at most what
is left of the call's deadline (:mod:`moegrad.http._deadline`), so a server that drips its reply cannot
hold a call past it.

:func:`http_transport` and :func:`async_http_transport` build ``httpx.HTTPTransport`` /
``httpx.AsyncHTTPTransport`` as httpx's clients build their default one (the same TLS context,
limits and HTTP/1.1), with the connection pool over this backend. httpx takes no network backend,
so the pool is put in place through the transport's private ``_pool``: the one private member of
httpx or httpcore the client touches, set in one function (:func:`_install_pool`) and listed in
:data:`PRIVATE_MEMBERS`.

**A name with several addresses.** A plain ``http(s)://`` URL is one replica: httpx connects to the
first address its name resolves to. At each backend's first connection to a host name (once per
client and origin: :class:`PerReplica` makes a backend each), the name is resolved (the connection
resolves it again, as it always did) and, when it has several addresses of one family (a dual-stack
host's one IPv4 and one IPv6 are one machine), :class:`~moegrad.ReplicaWarning` says so once and
how to use them all (``dns+``). An address, or a ``dns+`` URL's replica (an address), is never looked up.

:func:`read_frames` and :func:`aread_frames` stream a frames reply into its
:class:`~moegrad.wire._frames.FramesReader`; the sync one receives the rest of a large reply (1 MiB or
more left) from the plain TCP socket straight into the result's arrays, past h11's copies.
"""

from __future__ import annotations

import socket
import ssl
import threading
import typing
import warnings

import anyio
import httpcore
import httpx

from moegrad._errors import MalformedRequest, ReplicaWarning
from moegrad.http._deadline import time_left
from moegrad.http._replicas import is_address
from moegrad.wire._frames import FramesReader

__all__ = [
    "DIRECT_READ_MIN_BYTES",
    "PRIVATE_MEMBERS",
    "READ_BYTES",
    "PerReplica",
    "aread_frames",
    "async_http_transport",
    "http_transport",
    "raw_socket",
    "read_frames",
    "receive_into",
]

#: The most bytes one read of a response asks for.
READ_BYTES = 1 << 20
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)  # httpx's defaults

#: The sync client receives the rest of a frames reply straight from the socket once this much is left.
DIRECT_READ_MIN_BYTES = 1 << 20
#: Every private member of httpx or httpcore that moegrad's client reads or sets: (class, attribute).
PRIVATE_MEMBERS: tuple[tuple[str, str], ...] = (
    ("httpx.HTTPTransport", "_pool"),
    ("httpx.AsyncHTTPTransport", "_pool"),
)

Verify = ssl.SSLContext | str | bool
H = typing.TypeVar("H", httpx.Client, httpx.AsyncClient)


class PerReplica(typing.Generic[H]):
    """One httpx client per replica, so that each has its own connection pool and keep-alive never
    pins a client to one server (the complaint about clients behind a load balancer): a request
    goes through the client of its URL's origin (scheme, host, port), made on first use; or, when
    the caller passed a transport (a test's ``MockTransport``), through one client over it.

    Args:
        make: a new httpx client over a default transport.
        shared: the one client over the caller's transport, or None.
        urls: replicas whose clients are made now.
    """

    def __init__(
        self, make: typing.Callable[[], H], shared: H | None = None, urls: typing.Iterable[httpx.URL] = ()
    ) -> None:
        self._make: typing.Callable[[], H] = make
        self._shared: H | None = shared
        self._clients: dict[tuple[str, str, int | None], H] = {}
        self._lock = threading.Lock()
        for url in urls:
            self(url)

    def __call__(self, url: httpx.URL) -> H:
        """The client for a request to ``url``."""
        if self._shared is not None:
            return self._shared
        key = (url.scheme, url.host, url.port)
        client = self._clients.get(key)
        if client is None:
            with self._lock:
                client = self._clients.get(key)
                if client is None:
                    client = self._clients[key] = self._make()
        return client

    def clients(self) -> list[H]:
        """Every client made so far (to close them)."""
        with self._lock:
            return [self._shared] if self._shared is not None else list(self._clients.values())


def _within(timeout: float | None, error: type[httpcore.TimeoutException]) -> float | None:
    """One network operation's timeout cut to what is left of the call's deadline (:mod:`moegrad.http._deadline`).

    Raises:
        httpcore.ConnectTimeout, ReadTimeout or WriteTimeout (``error``): the deadline has passed.
    """
    left = time_left(timeout)
    if left == 0.0:
        raise error("the call's deadline passed")
    return left


class _NameCheck:
    """Which host names a backend has looked up (each once), and the warning for one with several addresses."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def due(self, host: str, port: int) -> bool:
        """Whether ``host`` is a name this backend has not looked up yet (it is marked looked up now)."""
        if is_address(host):
            return False
        with self._lock:
            if (host, port) in self._seen:
                return False
            self._seen.add((host, port))
            return True

    @staticmethod
    def note(host: str, port: int, answer: typing.Iterable[typing.Any]) -> None:
        """Warn when ``getaddrinfo``'s ``answer`` for ``host`` holds several addresses of one family."""
        families: dict[int, set[str]] = {}
        for family, *_, sockaddr in answer:
            families.setdefault(int(family), set()).add(str(sockaddr[0]))
        if all(len(addresses) < 2 for addresses in families.values()):
            return
        addresses = sorted(set().union(*families.values()))
        shown = ", ".join(addresses[:4]) + (", ..." if len(addresses) > 4 else "")
        warnings.warn(
            f"{host}:{port} resolves to {len(addresses)} addresses ({shown}), and a plain http(s):// URL is one "
            f"replica: every call goes to the address the resolver gives first, with no spreading and no "
            f"failover. To make each address a replica, put dns+ before the URL's scheme (dns+http://{host}:{port})",
            ReplicaWarning,
            stacklevel=2,
        )


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream
        sock = stream.get_extra_info("socket")
        # plain TCP only: under TLS the socket is the TLS object's, written through it
        self._sock = sock if isinstance(sock, socket.socket) and stream.get_extra_info("ssl_object") is None else None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max(max_bytes, READ_BYTES), _within(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._sock is None:
            self._stream.write(buffer, _within(timeout, httpcore.WriteTimeout))
            return
        view = memoryview(buffer)
        try:
            while view:
                self._sock.settimeout(_within(timeout, httpcore.WriteTimeout))
                view = view[self._sock.send(view) :]
        except TimeoutError as exc:  # socket.timeout: as httpcore's stream maps it
            raise httpcore.WriteTimeout(exc) from exc
        except OSError as exc:
            raise httpcore.WriteError(exc) from exc

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, _within(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()
        self._names = _NameCheck()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _within(timeout, httpcore.ConnectTimeout)
        if self._names.due(host, port):
            try:
                self._names.note(host, port, socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except OSError:  # the connection says why
                pass
        return _Stream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: typing.Iterable[typing.Any] | None = None
    ) -> httpcore.NetworkStream:
        return _Stream(
            self._backend.connect_unix_socket(path, _within(timeout, httpcore.ConnectTimeout), socket_options)
        )

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max(max_bytes, READ_BYTES), _within(timeout, httpcore.ReadTimeout))

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, _within(timeout, httpcore.WriteTimeout))

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        timeout = _within(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()
        self._names = _NameCheck()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        timeout = _within(timeout, httpcore.ConnectTimeout)
        if self._names.due(host, port):
            try:
                self._names.note(host, port, await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except OSError:  # the connection says why
                pass
        return _AsyncStream(await self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: typing.Iterable[typing.Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        timeout = _within(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def http_transport(verify: Verify) -> httpx.HTTPTransport:
    """httpx's default transport for ``verify`` (True, a CA bundle path, False or an SSLContext),
    its connection pool over the large-read backend."""
    context = httpx.create_ssl_context(verify=verify)  # honours SSL_CERT_FILE / SSL_CERT_DIR, as httpx's clients do
    transport = httpx.HTTPTransport(verify=context)
    _install_pool(transport, httpcore.ConnectionPool(network_backend=_Backend(), **_pool_options(context)))
    return transport


def async_http_transport(verify: Verify) -> httpx.AsyncHTTPTransport:
    """:func:`http_transport` for ``httpx.AsyncClient`` (asyncio or trio, through AnyIO)."""
    context = httpx.create_ssl_context(verify=verify)
    transport = httpx.AsyncHTTPTransport(verify=context)
    _install_pool(transport, httpcore.AsyncConnectionPool(network_backend=_AsyncBackend(), **_pool_options(context)))
    return transport


def _install_pool(
    transport: httpx.HTTPTransport | httpx.AsyncHTTPTransport,
    pool: httpcore.ConnectionPool | httpcore.AsyncConnectionPool,
) -> None:
    """Put ``pool`` in place of the one ``transport`` built for itself.

    PRIVATE: this sets httpx's private ``HTTPTransport._pool`` / ``AsyncHTTPTransport._pool`` (the
    transport sends every request through it, and its constructor takes no network backend). It is
    the only private member of httpx or httpcore the client touches (:data:`PRIVATE_MEMBERS`, which
    the contract test names). An httpx that keeps its pool elsewhere keeps its own pool here:
    correct, without the large reads.
    """
    if hasattr(transport, "_pool"):
        transport._pool = pool


def _pool_options(context: ssl.SSLContext) -> dict[str, typing.Any]:
    """The connection pool's settings as httpx's default transport sets them."""
    return {
        "ssl_context": context,
        "max_connections": _LIMITS.max_connections,
        "max_keepalive_connections": _LIMITS.max_keepalive_connections,
        "keepalive_expiry": _LIMITS.keepalive_expiry,
    }


def raw_socket(response: httpx.Response) -> socket.socket | None:
    """The plain TCP socket ``response`` arrives on, when it came through :func:`http_transport`'s
    pool; None under TLS, over another transport, or for a response that was not read off a socket.

    Bytes read from it bypass h11: whoever does must close the response before its body is done
    in h11's eyes, and httpcore then closes the connection instead of reusing it."""
    stream = response.extensions.get("network_stream")
    return stream._sock if isinstance(stream, _Stream) else None


def receive_into(sock: socket.socket, room: memoryview, timeout: float | None, request: httpx.Request) -> int:
    """``sock.recv_into(room)`` with the read timeout (seconds, None: none) and httpx's exceptions:
    the bytes received, 0 when the peer has closed.

    Raises:
        httpx.ReadTimeout: nothing arrived within ``timeout`` (0.0: the call's deadline has passed).
        httpx.ReadError: the socket failed.
    """
    if timeout == 0.0:
        raise httpx.ReadTimeout("the call's deadline passed while its reply was arriving", request=request)
    try:
        sock.settimeout(timeout)
        return sock.recv_into(room)
    except TimeoutError as exc:  # socket.timeout
        raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc


def read_frames(response: httpx.Response, reader: FramesReader) -> None:
    """Stream a frames reply's body into ``reader``; a malformed body is kept as ``reader.error``.

    Through httpx, or, once the rest of a large body (DIRECT_READ_MIN_BYTES or more) is left to
    come on a plain TCP socket of the client's own transport, straight from the socket into the
    reply's arrays: on its way through h11 each byte is copied three more times. h11 then has not
    seen the body's end, so the connection is closed when the response is, not reused (a new
    connection costs far less than those copies of a large body).

    Raises:
        httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: as httpx raises them.
    """
    if response.is_stream_consumed:  # a response built with its content (a mock transport) is not a stream
        chunks: typing.Iterable[bytes] = [response.content]
    else:
        chunks = response.iter_raw()
    sock = raw_socket(response)
    length = reader.length
    try:
        for chunk in chunks:
            reader.feed(chunk)
            if sock is not None and length is not None and length - reader.received >= DIRECT_READ_MIN_BYTES:
                break
        else:
            return
        assert sock is not None and length is not None  # only they break out of the loop
        timeout = response.request.extensions.get("timeout", {}).get("read")
        while reader.received < length:
            left = length - reader.received
            room = reader.room()
            if room is None:  # padding between tensors, or bytes past the last one: fed as they come
                piece = bytearray(min(left, 1 << 16))
                got = receive_into(sock, memoryview(piece), time_left(timeout), response.request)
                if got:
                    reader.feed(memoryview(piece)[:got])
            else:
                got = receive_into(sock, room[:left], time_left(timeout), response.request)
                reader.advance(got)
            if not got:
                raise httpx.RemoteProtocolError(
                    f"peer closed connection without sending complete message body (received "
                    f"{reader.received} bytes, expected {length})",
                    request=response.request,
                )
    except MalformedRequest as exc:
        reader.error = exc


async def aread_frames(response: httpx.Response, reader: FramesReader) -> None:
    """:func:`read_frames` for ``httpx.AsyncClient``: every byte through httpx (no direct socket reads).

    Raises:
        httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: as httpx raises them.
    """
    try:
        if response.is_stream_consumed:  # a response built with its content (a mock transport)
            reader.feed(response.content)
        else:
            async for chunk in response.aiter_raw():
                reader.feed(chunk)
    except MalformedRequest as exc:
        reader.error = exc
