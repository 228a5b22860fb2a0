"""What a handler reads from its request: the app's services, its admission, a size-limited body, the deadline.

Plain functions that the handlers call, not FastAPI dependencies: FastAPI re-solves a route's whole
dependency graph on every request, which costs more server CPU than a small call's compute.

The app's lifespan puts ``settings``, ``dataplane`` and ``metrics`` in every request's state
(``create_app``); the accessors below only give them their types. :func:`read_body` admits the
request (``DataPlane.admit``) and keeps its :class:`~moegrad_service.memory.Admission` in the
request's state under :data:`ADMISSION`, the one key a request adds there; the route releases it
once the answer is sent (:func:`release_admission`, api/routing.py), and the access log and the
early-answer check read it (:func:`admission_of`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from moegrad import MalformedRequest, MoegradError, PayloadTooLarge, brief
from moegrad_service.api.errors import RequestTimeout, UnsupportedMediaType
from moegrad_service.connections import BODY_INTO
from moegrad_service.dataplane import DataPlane
from moegrad_service.memory import Admission
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = [
    "ADMISSION",
    "INLINE_DECODE_BYTES",
    "MSGPACK_MEDIA_TYPES",
    "admission_of",
    "byte_count",
    "dataplane_of",
    "disconnected",
    "media_type_of",
    "metrics_of",
    "off_loop",
    "read_body",
    "release_admission",
    "request_timeout",
    "settings_of",
]

T = TypeVar("T")


async def off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` on a worker thread (Starlette's ``run_in_threadpool``): decoding,
    validating and encoding that would otherwise hold the event loop.

    A MoegradError (the client's mistake) is raised again from here without the frames it came back
    through: anyio keeps the exception in a future that its own frame holds, so its traceback makes
    a reference cycle, which would keep the request's body and tensors alive until the garbage
    collector next runs (a refused 4 MiB body stayed 4 MiB until then, measured). Any other
    exception is a bug and keeps its whole traceback for the log.
    """
    try:
        return await run_in_threadpool(function, *args, **kwargs)
    except MoegradError as exc:
        raise exc.with_traceback(None)  # noqa: B904 - the same exception, re-raised from here


MSGPACK_MEDIA_TYPES = frozenset({"application/msgpack", "application/x-msgpack"})
#: Bodies larger than this are decoded and validated on a worker thread, not on the event loop.
INLINE_DECODE_BYTES = 1 << 20


def byte_count(text: str) -> int | None:
    """A header's byte count (ASCII digits, leading zeros allowed), or None when it is not one.

    19 or more significant digits come back as 10**18, more than any body: such a count is refused as
    too large rather than handed to int(), whose 4300-digit cap would raise (an internal error).
    """
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()):
        return None
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= 18 else 10**18


def settings_of(request: Request) -> Settings:
    return request.state.settings


def dataplane_of(request: Request) -> DataPlane:
    return request.state.dataplane


async def disconnected(request: Request) -> None:
    """Return once the client has gone: for a handler whose body is already read, only
    ``http.disconnect`` is left to receive."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def metrics_of(request: Request) -> Metrics:
    return request.state.metrics


#: The request state's key of the request's Admission.
ADMISSION = "admission"


def admission_of(scope: Scope) -> Admission | None:
    """The request's admission (:func:`read_body` made it), or None: its body was not read."""
    return scope.get("state", {}).get(ADMISSION)


def release_admission(scope: Scope) -> None:
    """Give back what the request holds of the service's memory (:meth:`Admission.release`), once
    its answer is sent."""
    admission = admission_of(scope)
    if admission is not None:
        admission.release()


async def read_body(
    request: Request,
    limit: int,
    media_types: frozenset[str] | None = MSGPACK_MEDIA_TYPES,
    *,
    lead: int = 0,
    hold_per_byte: int | None = None,
) -> bytearray | memoryview:
    """The request body, admitted before it is read.

    Refused before reading: 415 when the media type is not in ``media_types``; 413 when
    Content-Length is over ``limit``; 503 + Retry-After when the pool could not take the call (not
    ready, queue full) or what the body holds (twice its bytes: MemoryBudget.reserve_body) does not
    fit the in-flight budget now (``max_inflight_bytes``). A body without Content-Length is counted
    against both as it arrives.
    408 when the body takes longer than ``body_timeout_s`` to arrive. The request's admission
    (``DataPlane.admit``: the bytes reserved, the buffer the body is read into) is released by the
    route once the answer is sent (api/routing.py).

    ``lead`` > 0 puts that many zero bytes before the body in its buffer (whose start CPython
    aligns to 16 bytes) and returns a memoryview of the body alone: a caller that knows where
    binary data starts inside the body picks ``lead`` so that it lands 16-byte aligned, and its
    arrays can view the body instead of copying it (v2's binary tensor data).

    ``hold_per_byte``: what the request holds per byte of its body, when not a single call's
    (MemoryBudget.HOLD_PER_BODY_BYTE): a batch passes MemoryBudget.BATCH_HOLD_PER_BODY_BYTE."""
    if media_types is not None:
        media_type = media_type_of(request)
        if media_type not in media_types:
            raise UnsupportedMediaType(
                f"Content-Type {media_type or '(none)'!r} is not accepted; send {' or '.join(sorted(media_types))}"
            )
    declared = request.headers.get("content-length")
    expected = None
    if declared is not None:
        expected = byte_count(declared)
        if expected is None:
            raise MalformedRequest(f"Content-Length {brief(declared)} is not a byte count")
        if expected > limit:
            raise PayloadTooLarge(f"Content-Length {brief(declared)} is over the limit of {limit} bytes")
    admission = dataplane_of(request).admit(expected, per_byte=hold_per_byte)
    request.scope["state"][ADMISSION] = admission  # released by the route (release_admission)
    try:
        async with asyncio.timeout(settings_of(request).body_timeout_s):
            return await _receive(request, admission, limit, expected, lead)
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {settings_of(request).body_timeout_s:g} s "
            "(body_timeout_s); send it at once, or in smaller calls"
        ) from None


async def _receive(
    request: Request, admission: Admission, limit: int, expected: int | None, lead: int
) -> bytearray | memoryview:
    if expected is not None:
        return await _receive_declared(request, admission, expected, lead)
    # Without a Content-Length the body grows as bytes arrive (each chunk reserved from the budget first).
    body = bytearray(lead)
    async for chunk in request.stream():
        if len(body) - lead + len(chunk) > limit:
            raise PayloadTooLarge(f"the body grew past the limit of {limit} bytes")
        admission.reserve(len(chunk))
        body += chunk
    admission.body_complete = True
    return memoryview(body)[lead:] if lead else body


async def _receive_declared(request: Request, admission: Admission, expected: int, lead: int) -> memoryview:
    # The declared length is already reserved from the in-flight budget, so the buffer is taken
    # whole and each chunk is copied once, in place.
    buffer = admission.body_buffer(lead + expected)  # a large one is given back once the answer is sent
    view = buffer.data[: lead + expected]
    filled = lead
    if lead:
        buffer[:lead] = 0
    body_into = request.scope.get("extensions", {}).get(BODY_INTO)
    if body_into is not None and expected and await body_into(request.scope, view[lead:]):
        admission.body_complete = True
        admission.read_in_place = expected  # not seen by receive(): for the access log
        return view[lead:]
    async for chunk in request.stream():
        end = filled + len(chunk)
        if end - lead > expected:
            raise MalformedRequest("the body is longer than its Content-Length")
        view[filled:end] = chunk
        filled = end
    admission.body_complete = True
    if filled - lead != expected:
        raise MalformedRequest(f"the body ended after {filled - lead} of {expected} bytes")
    return view[lead:]


def media_type_of(request: Request) -> str:
    """The request's Content-Type without parameters, lower-cased ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def request_timeout(request: Request) -> float:
    """Seconds the call may take: ``X-Request-Timeout`` (seconds) capped by ``request_timeout_s``.

    Raises:
        MalformedRequest: (400) the header is not a positive, finite number.
    """
    settings = settings_of(request)
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return settings.request_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise MalformedRequest(
            f"X-Request-Timeout {raw!r} must be a positive number of seconds", field="X-Request-Timeout"
        )
    return min(value, settings.request_timeout_s)
