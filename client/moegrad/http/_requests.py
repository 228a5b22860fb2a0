"""The httpx request factory: each attempt's ``httpx.Request`` for a client's configuration, with no I/O.

One factory for the sync and the async client (:class:`RequestBuilder`): the URL of the replica
that takes the attempt, the headers (Accept, the request id, the token, X-Request-Timeout), the
body in slices of the buffer it views, and the attempt's timeouts. What goes in a body is
:mod:`moegrad.http._documents`'; which profile checks a call that names none, :mod:`moegrad.http._unnamed`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from moegrad.http._config import ClientConfig
from moegrad.http._replicas import Replica
from moegrad.wire._v1 import JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE

__all__ = ["BODY_SLICE_BYTES", "JSON", "MSGPACK", "Body", "RequestBuilder"]

MSGPACK = MSGPACK_MEDIA_TYPE
JSON = JSON_MEDIA_TYPE
#: Size of the slices a request body is sent in (see :func:`_body_slices`).
BODY_SLICE_BYTES = 1 << 20

#: A request body: one buffer, or a frames body's parts (:func:`moegrad.encode_frames`).
Body = memoryview | list[memoryview | bytes]


def _body_slices(body: Body) -> Iterator[memoryview | bytes]:
    """A request body as slices of the buffer it views.

    Given ``bytes``, httpx copies the body into one more buffer of its size on its way to the
    socket; slices keep that copy to one slice at a time (bench/RESULTS.md, "Notes kept from earlier
    runs"). The Content-Length is set by the caller, so
    httpx does not fall back to chunked encoding. One generator per attempt: a retry sends it all.
    A list is a frames body's parts (:func:`moegrad.encode_frames`), each sliced in turn.
    """
    for part in body if isinstance(body, list) else [body]:
        for start in range(0, len(part), BODY_SLICE_BYTES):
            yield part[start : start + BODY_SLICE_BYTES]


async def _abody_slices(body: Body) -> AsyncIterator[memoryview | bytes]:
    """:func:`_body_slices` for httpx.AsyncClient, which takes only async iterables."""
    for part in _body_slices(body):
        yield part


class RequestBuilder:
    """Each attempt's ``httpx.Request`` for a client's configuration.

    Args:
        config: the client's configuration (URL, token, headers, connection timeout).
        async_body: request bodies as async iterables (httpx.AsyncClient takes no others).
    """

    def __init__(self, config: ClientConfig, *, async_body: bool) -> None:
        self._config = config
        self._async_body = async_body
        # (root, path) -> absolute URL: parsing one costs more than a small call's codec
        self._urls: dict[tuple[httpx.URL, str], httpx.URL] = {}

    def build(
        self,
        method: str,
        path: str,
        *,
        accept: str,
        request_id: str,
        remaining_s: float | None,
        body: Body | None = None,
        content_type: str = MSGPACK,
        replica: Replica | None = None,
    ) -> httpx.Request:
        """One attempt's request; ``remaining_s`` (None: no deadline) sets X-Request-Timeout and httpx's timeouts.

        ``body`` is sent from the buffer it views, in slices (:func:`_body_slices`): no copy of it
        is made for the request, and a fresh generator per attempt lets a retry send it again.
        ``replica`` is the server it goes to (default: the configuration's ``base_url``); an address
        of a ``dns+`` name gets the name as its ``Host`` and TLS server name."""
        config = self._config
        headers = dict(config.headers)
        extensions: dict[str, Any] = {}
        base = config.base_url if replica is None else replica.url
        if replica is not None and replica.host_header is not None:
            headers["Host"] = replica.host_header
            if base.scheme == "https" and replica.sni is not None:
                extensions["sni_hostname"] = replica.sni
        headers["Accept"] = accept
        headers["Accept-Encoding"] = "identity"  # no content coding: a compressed reply could inflate past its bound
        headers["X-Request-Id"] = request_id
        if config.token is not None:
            headers["Authorization"] = f"Bearer {config.token}"
        if body is not None:
            headers["Content-Type"] = content_type
            headers["Content-Length"] = str(sum(map(len, body)) if isinstance(body, list) else len(body))
        if remaining_s is not None:
            headers["X-Request-Timeout"] = f"{remaining_s:.3f}"
        connect = config.timeouts.connect_s
        if remaining_s is not None:
            connect = remaining_s if connect is None else min(connect, remaining_s)
        extensions["timeout"] = httpx.Timeout(remaining_s, connect=connect).as_dict()
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[base, path] = httpx.URL(str(base).rstrip("/") + path)
        content = None if body is None else (_abody_slices(body) if self._async_body else _body_slices(body))
        # httpx annotates content chunks as bytes; it sends any bytes-like chunk, and these are memoryviews
        return httpx.Request(
            method,
            url,
            headers=headers,
            content=content,  # type: ignore[arg-type]
            extensions=extensions,
        )
