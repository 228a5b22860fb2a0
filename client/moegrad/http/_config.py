"""The clients' configuration: keyword-only objects whose values are checked before any I/O.

- :class:`Timeouts`: a call's deadline and one connection attempt's limit, in seconds;
- :class:`Retries`: how many times a call is retried, and how long it waits before each retry;
- :class:`ClientConfig`: all the sans-I/O core (:mod:`moegrad.http._core`) needs, built from the
  clients' keyword arguments by :meth:`ClientConfig.from_arguments` (TypeError / ValueError for a
  value of the wrong type or out of range, naming the argument);
- :data:`USE_CLIENT_DEFAULT`: a call's ``timeout_s`` when not passed, as opposed to None (no deadline);
- :func:`ssl_verify`: the ``verify`` argument as httpx takes it;
- :data:`CLIENT_DOC`: the clients' docstring, which documents each argument.
"""

from __future__ import annotations

import dataclasses
import math
import os
import ssl
from collections.abc import Mapping
from typing import Any, Literal

import httpx

from moegrad._version import __version__
from moegrad.http._replicas import parse_replicas

__all__ = ["CLIENT_DOC", "USE_CLIENT_DEFAULT", "WIRES", "ClientConfig", "Retries", "Timeouts", "Wire", "ssl_verify"]

#: How a call's tensors travel (docs/protocol.md): ``"auto"``, ``"msgpack"`` or ``"frames"``.
Wire = Literal["auto", "msgpack", "frames"]
WIRES: tuple[Wire, ...] = ("auto", "msgpack", "frames")


#: The clients' docstring (``kind``: "A blocking" / "An asyncio", ``transport``: the httpx base class),
#: which documents each keyword argument that :meth:`ClientConfig.from_arguments` checks.
CLIENT_DOC = """{kind} client of a moegrad service (wire protocol v1, docs/protocol.md).

    Args:
        base_url: the service's root URL, e.g. ``"http://127.0.0.1:8000"`` (a path prefix is kept);
            or a list of them, one per replica of the service; or ``"dns+http://NAME:PORT"``, whose
            replicas are NAME's addresses (a Kubernetes headless Service), resolved again every
            30 s. Each call goes to the less busy of two replicas picked at random, and a call that
            cannot connect, is dropped or gets 503/504 is retried on another one at once; a failing
            replica is set aside for 1 s to 30 s (:mod:`moegrad.http._replicas`; ``stats`` says what
            each served).
        timeout_s: each call's deadline in seconds, covering retries, waits and every read of the
            reply (docs/protocol.md, "Reply bounds"); sent to the server as ``X-Request-Timeout``
            (which the server may cap). None: no deadline.
        connect_timeout_s: the longest one connection attempt may take, in seconds (None: no limit).
        retries: how many times a call is retried after a connection error or a 503 (Retry-After
            honoured, at most 30 s a wait, never past the deadline), or a 504 when another replica
            is left. 4xx and 500 are never retried.
        token: a bearer token sent as ``Authorization: Bearer <token>``.
        verify: TLS verification: True (system/certifi CAs), False, a CA bundle path, or an
            ``ssl.SSLContext``.
        transport: an httpx {transport} (``httpx.MockTransport``, ``httpx.ASGITransport``, ...)
            used instead of the network.
        validate: check every call locally with :class:`~moegrad.MoeInitRoutingV2GradCall` before
            sending it, so a bad call raises InvalidArgument without being sent: by the profile it
            names, else by the replicas' own (their ``/v1/info`` ``order``, asked once when a call
            needs it; ``info()["orders"]``), the same answer the server gives. False sends calls as
            given, for the server to judge.
        headers: extra headers sent with every request.
        wire: how a call's tensors travel: ``"auto"`` (frames for calls of FRAMES_MIN_BYTES or more
            when the server's ``/v1/info`` offers them, else msgpack), ``"msgpack"`` (always one
            msgpack document) or ``"frames"`` (always frames: the tensors' bytes unpacked after a
            msgpack header, docs/protocol.md).

    Raises:
        TypeError, ValueError: a configuration value of the wrong type or out of range (no I/O done).
    """


class _UseClientDefault:
    """The type of :data:`USE_CLIENT_DEFAULT`: "not passed", as opposed to ``timeout_s=None``."""

    _instance: _UseClientDefault | None = None

    def __new__(cls) -> _UseClientDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"


#: A call's ``timeout_s`` when not passed: the client's ``timeout_s`` applies.
USE_CLIENT_DEFAULT = _UseClientDefault()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long a call may take.

    Attributes:
        call_s: each call's deadline in seconds, covering retries, waits and every read of the
            reply; sent to the server as ``X-Request-Timeout``. None: no deadline.
        connect_s: the longest one connection attempt may take, in seconds (None: no limit); never
            more than what is left of the call's deadline.
    """

    call_s: float | None
    connect_s: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Retries:
    """How a call is retried after a connection error or a 503 (a 504 only on another replica; 4xx and 500 never).

    Attributes:
        count: retries after the first attempt (>= 0).
        backoff_base_s: the wait before the first retry after a connection error, in seconds,
            doubled at each further retry ...
        backoff_max_s: ... up to this many seconds.
        max_retry_after_s: the longest a 503's Retry-After is honoured, in seconds.
    """

    count: int
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    max_retry_after_s: float = 30.0

    def delay_s(self, attempt: int, retry_after_s: float | None) -> float:
        """Seconds to wait before retry number ``attempt + 1``.

        A 503's Retry-After (``retry_after_s``; None after a connection error) is honoured, at
        least the backoff and at most ``max_retry_after_s``; a connection error backs off
        exponentially. The caller drops a retry that would end after the call's deadline.
        """
        backoff_s = min(self.backoff_base_s * 2**attempt, self.backoff_max_s)
        if retry_after_s is not None:
            return min(max(retry_after_s, backoff_s), self.max_retry_after_s)
        return backoff_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """A client's configuration, checked (see :meth:`from_arguments`).

    Attributes:
        base_url: the service's root URL (absolute http(s), no query or fragment; a path prefix is
            kept); of several replicas, the first; for a ``dns+`` URL, the name's URL without ``dns+``.
        replicas: every replica's root URL (one for a single URL or a ``dns+`` URL).
        dns: the replicas are the addresses of ``base_url``'s host (:mod:`moegrad.http._replicas`).
        timeouts: the call's deadline and the connection limit.
        retries: the retry policy.
        token: the bearer token sent as ``Authorization: Bearer <token>``, or None.
        validate: check every call locally before sending it.
        headers: sent with every request: ``User-Agent``, then the caller's own.
        wire: how a call's tensors travel.
    """

    base_url: httpx.URL
    replicas: tuple[httpx.URL, ...]
    dns: bool
    timeouts: Timeouts
    retries: Retries
    token: str | None
    validate: bool
    headers: Mapping[str, str]
    wire: Wire

    @classmethod
    def from_arguments(
        cls,
        base_url: Any,
        *,
        timeout_s: Any,
        connect_timeout_s: Any,
        retries: Any,
        token: Any,
        validate: Any,
        headers: Any,
        wire: Any,
    ) -> ClientConfig:
        """The configuration of a client's keyword arguments (their meaning: ``moegrad.Client``'s docstring).

        Raises:
            TypeError, ValueError: a value of the wrong type or out of range, the argument named.
        """
        urls, dns = parse_replicas(base_url, _base_url)
        if wire not in WIRES:
            raise ValueError(f"wire={wire!r} must be one of {list(WIRES)}")
        timeouts = Timeouts(
            call_s=_seconds("timeout_s", timeout_s, allow_none=True),
            connect_s=_seconds("connect_timeout_s", connect_timeout_s, allow_none=True),
        )
        if isinstance(retries, bool) or not isinstance(retries, int):
            raise TypeError(f"retries must be an int, got {type(retries).__name__}")
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str or None, got {type(token).__name__}")
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise ValueError("token must be a non-empty single-line string")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        if headers is not None and not isinstance(headers, Mapping):
            raise TypeError(f"headers must be a mapping of str to str, got {type(headers).__name__}")
        return cls(
            base_url=urls[0],
            replicas=urls,
            dns=dns,
            timeouts=timeouts,
            retries=Retries(count=retries),
            token=token,
            validate=validate,
            headers={"User-Agent": f"moegrad/{__version__} httpx/{httpx.__version__}", **dict(headers or {})},
            wire=wire,
        )

    def call_timeout_s(self, timeout_s: Any) -> float | None:
        """A call's deadline in seconds: the client's when not passed, None for no deadline.

        Raises:
            TypeError, ValueError: ``timeout_s`` is not a number of seconds > 0 or None.
        """
        if timeout_s is USE_CLIENT_DEFAULT:
            return self.timeouts.call_s
        return _seconds("timeout_s", timeout_s, allow_none=True)


def _seconds(name: str, value: Any, *, allow_none: bool) -> float | None:
    """``value`` as a finite number of seconds > 0 (or None when ``allow_none``).

    Raises:
        TypeError: not a number (a bool is not one).
        ValueError: not finite, or not > 0.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number of seconds or None" if allow_none else "a number of seconds"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{name}={value} must be a finite number of seconds > 0" + (" (or None)" if allow_none else "")
        )
    return value


def _base_url(value: Any) -> httpx.URL:
    """One replica's root URL, checked (:func:`moegrad.http._replicas.parse_replicas` takes lists and ``dns+``)."""
    if not isinstance(value, (str, httpx.URL)):
        raise TypeError(f"base_url must be a str or httpx.URL, got {type(value).__name__}")
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url={str(value)!r} is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"base_url={str(value)!r} must be an absolute http:// or https:// URL")
    if url.query or url.fragment:
        raise ValueError(f"base_url={str(value)!r} must not have a query or fragment")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"base_url={str(value)!r}: port {url.port} is outside 1..65535")
    return url


def ssl_verify(value: Any) -> bool | ssl.SSLContext:
    """TLS verification as httpx takes it: True (system/certifi CAs), False, or an ``ssl.SSLContext``
    (one is made for a CA bundle file or directory).

    Raises:
        TypeError: not a bool, a path or an SSLContext.
        ValueError: a path that does not exist.
    """
    if isinstance(value, (bool, ssl.SSLContext)):
        return value
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.exists(path):
            raise ValueError(f"verify={path!r}: no such CA bundle file or directory")
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        return ssl.create_default_context(cafile=path)
    raise TypeError(f"verify must be a bool, a CA bundle path or an ssl.SSLContext, got {type(value).__name__}")
