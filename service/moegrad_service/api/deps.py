"""Request dependencies: the settings, the pool, a size-limited body, the decoded call, the deadline.

Every dependency is a coroutine function, even those that only read request state: FastAPI runs a
plain ``def`` dependency on its thread pool, one thread hop (and a GIL hand-off) each per request.
The body, call and deadline dependencies read the settings and metrics from ``request.state``
themselves rather than through SettingsDep/MetricsDep: FastAPI re-solves every sub-dependency of
every node on each request (cached or not), and those nodes were a large share of a small call's
server time.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from moegrad import MalformedRequest, MoeInitRoutingV2GradCall, PayloadTooLarge, decode_body
from moegrad_service.api.problems import UnsupportedMediaType
from moegrad_service.engine import StreamPool
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = [
    "MSGPACK_MEDIA_TYPES",
    "BodyDep",
    "CallDep",
    "DocumentDep",
    "MetricsDep",
    "PoolDep",
    "SettingsDep",
    "TimeoutDep",
    "read_body",
]

MSGPACK_MEDIA_TYPES = frozenset({"application/msgpack", "application/x-msgpack"})
#: Bodies larger than this are decoded and validated on a worker thread, not on the event loop.
INLINE_DECODE_BYTES = 1 << 20


async def get_settings(request: Request) -> Settings:
    return request.state.settings


async def get_pool(request: Request) -> StreamPool:
    return request.state.pool


async def get_metrics(request: Request) -> Metrics:
    return request.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
PoolDep = Annotated[StreamPool, Depends(get_pool)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def read_body(request: Request, limit: int, media_types: frozenset[str] | None = MSGPACK_MEDIA_TYPES, *,
                    lead: int = 0) -> bytearray | memoryview:
    """The request body, refused with 413 before reading when Content-Length is over ``limit`` and
    as soon as a body without one grows past it; 415 when the media type is not in ``media_types``.

    ``lead`` > 0 puts that many zero bytes before the body in its buffer (whose start CPython
    aligns to 16 bytes) and returns a memoryview of the body alone: a caller that knows where
    binary data starts inside the body picks ``lead`` so that it lands 16-byte aligned, and its
    arrays can view the body instead of copying it (v2's binary tensor data)."""
    if media_types is not None:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type not in media_types:
            raise UnsupportedMediaType(
                f"Content-Type {media_type or '(none)'!r} is not accepted; send {' or '.join(sorted(media_types))}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise MalformedRequest(f"Content-Length {declared!r} is not a byte count")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the body of {int(declared)} bytes is over the limit of {limit} bytes")
        # Grown as bytes arrive, never allocated from the declared length: a zero-filled buffer of
        # Content-Length bytes is resident at once, so a client declaring max_body_bytes and sending
        # nothing would pin that much memory per connection. (Large buffers grow by remapping pages.)
        expected, body = int(declared), bytearray(lead)
        async for chunk in request.stream():
            if len(body) - lead + len(chunk) > expected:
                raise MalformedRequest("the body is longer than its Content-Length")
            body += chunk
        if len(body) - lead != expected:
            raise MalformedRequest(f"the body ended after {len(body) - lead} of {expected} bytes")
        return memoryview(body)[lead:] if lead else body
    body = bytearray(lead)
    async for chunk in request.stream():
        body += chunk
        if len(body) - lead > limit:
            raise PayloadTooLarge(f"the body grew past the limit of {limit} bytes")
    return memoryview(body)[lead:] if lead else body


async def get_body(request: Request) -> bytearray:
    body = await read_body(request, request.state.settings.max_body_bytes)
    request.state.metrics.bytes_in.inc(len(body))
    return body


BodyDep = Annotated[bytearray, Depends(get_body)]


async def get_document(body: BodyDep) -> dict[str, Any]:
    if len(body) > INLINE_DECODE_BYTES:
        return await run_in_threadpool(decode_body, body)
    return decode_body(body)


DocumentDep = Annotated[dict, Depends(get_document)]


async def get_call(request: Request, document: DocumentDep) -> MoeInitRoutingV2GradCall:
    settings: Settings = request.state.settings

    def build() -> MoeInitRoutingV2GradCall:
        return MoeInitRoutingV2GradCall.from_wire(document, max_elements=settings.max_elements,
                                                  default_order=settings.order)

    if _tensor_bytes(document) > INLINE_DECODE_BYTES:
        return await run_in_threadpool(build)
    return build()


def _tensor_bytes(document: dict[str, Any]) -> int:
    total = 0
    for value in document.values():
        if isinstance(value, dict) and isinstance(value.get("data"), bytes):
            total += len(value["data"])
    return total


CallDep = Annotated[MoeInitRoutingV2GradCall, Depends(get_call)]


async def get_timeout(request: Request) -> float:
    """Seconds the call may take: ``X-Request-Timeout`` (seconds) capped by ``request_timeout_s``."""
    settings: Settings = request.state.settings
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return settings.request_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise MalformedRequest(f"X-Request-Timeout {raw!r} must be a positive number of seconds", field="X-Request-Timeout")
    return min(value, settings.request_timeout_s)


TimeoutDep = Annotated[float, Depends(get_timeout)]
