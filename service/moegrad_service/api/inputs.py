"""What a handler reads from its request: the app's services, a size-limited body, the call, the deadline.

Plain functions that the handlers call, not FastAPI dependencies: FastAPI re-solves a route's whole
dependency graph on every request, which costs more server CPU than a small call's compute.

The app's lifespan puts ``settings``, ``dataplane`` and ``metrics`` in every request's state
(``create_app``); the accessors below only give them their types.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from moegrad import (
    FRAMES_MEDIA_TYPE,
    REQUEST_LIMITS,
    MalformedRequest,
    MoegradError,
    MoeInitRoutingV2GradCall,
    PayloadTooLarge,
    brief,
    decode_body,
    decode_frames,
)
from moegrad_service.api.errors import RequestTimeout, UnsupportedMediaType
from moegrad_service.buffers import REUSE_MIN_BYTES
from moegrad_service.connections import BODY_INTO
from moegrad_service.dataplane import DataPlane
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = [
    "INLINE_DECODE_BYTES",
    "MSGPACK_MEDIA_TYPES",
    "V1_MEDIA_TYPES",
    "byte_count",
    "dataplane_of",
    "disconnected",
    "media_type_of",
    "metrics_of",
    "off_loop",
    "read_body",
    "read_call",
    "read_document",
    "release_reserved",
    "request_timeout",
    "result_buffer",
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
#: What a v1 call's body may be: msgpack, or frames (a msgpack header, then the tensors' bytes).
V1_MEDIA_TYPES = MSGPACK_MEDIA_TYPES | {FRAMES_MEDIA_TYPE}
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
    408 when the body takes longer than ``body_timeout_s`` to arrive. The bytes reserved from the
    budget are given back by the route once the answer is sent (api/routing.py).

    ``lead`` > 0 puts that many zero bytes before the body in its buffer (whose start CPython
    aligns to 16 bytes) and returns a memoryview of the body alone: a caller that knows where
    binary data starts inside the body picks ``lead`` so that it lands 16-byte aligned, and its
    arrays can view the body instead of copying it (v2's binary tensor data).

    ``hold_per_byte``: what the request holds per byte of its body, when not a single call's
    (MemoryBudget.HOLD_PER_BODY_BYTE): a batch passes MemoryBudget.BATCH_HOLD_PER_BODY_BYTE."""
    if hold_per_byte is not None:
        request.scope["state"]["hold_per_byte"] = hold_per_byte
    if media_types is not None:
        media_type = media_type_of(request)
        if media_type not in media_types:
            raise UnsupportedMediaType(
                f"Content-Type {media_type or '(none)'!r} is not accepted; send {' or '.join(sorted(media_types))}"
            )
    dataplane = dataplane_of(request)
    declared = request.headers.get("content-length")
    expected = None
    if declared is not None:
        expected = byte_count(declared)
        if expected is None:
            raise MalformedRequest(f"Content-Length {brief(declared)} is not a byte count")
        if expected > limit:
            raise PayloadTooLarge(f"Content-Length {brief(declared)} is over the limit of {limit} bytes")
    dataplane.admit()
    if expected is not None:
        _reserve(request, dataplane, expected)
    try:
        async with asyncio.timeout(settings_of(request).body_timeout_s):
            return await _receive(request, dataplane, limit, expected, lead)
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {settings_of(request).body_timeout_s:g} s "
            "(body_timeout_s); send it at once, or in smaller calls"
        ) from None


async def _receive(
    request: Request, dataplane: DataPlane, limit: int, expected: int | None, lead: int
) -> bytearray | memoryview:
    if expected is not None:
        return await _receive_declared(request, expected, lead)
    # Without a Content-Length the body grows as bytes arrive (each chunk reserved from the budget first).
    body = bytearray(lead)
    async for chunk in request.stream():
        if len(body) - lead + len(chunk) > limit:
            raise PayloadTooLarge(f"the body grew past the limit of {limit} bytes")
        _reserve(request, dataplane, len(chunk))
        body += chunk
    request.scope["state"]["body_complete"] = True
    return memoryview(body)[lead:] if lead else body


async def _receive_declared(request: Request, expected: int, lead: int) -> memoryview:
    # The declared length is already reserved from the in-flight budget, so the buffer is taken
    # whole and each chunk is copied once, in place.
    if lead + expected >= REUSE_MIN_BYTES:
        buffer = dataplane_of(request).receive_buffers.take(lead + expected)
        request.scope["state"]["receive_buffer"] = buffer  # given back once the answer is sent
    else:
        buffer = np.empty(lead + expected, dtype=np.uint8)
    view = buffer.data[: lead + expected]
    filled = lead
    if lead:
        buffer[:lead] = 0
    body_into = request.scope.get("extensions", {}).get(BODY_INTO)
    if body_into is not None and expected and await body_into(request.scope, view[lead:]):
        request.scope["state"]["body_complete"] = True
        request.scope["state"]["bytes_in"] = expected  # not seen by receive(): for the access log
        return view[lead:]
    async for chunk in request.stream():
        end = filled + len(chunk)
        if end - lead > expected:
            raise MalformedRequest("the body is longer than its Content-Length")
        view[filled:end] = chunk
        filled = end
    request.scope["state"]["body_complete"] = True
    if filled - lead != expected:
        raise MalformedRequest(f"the body ended after {filled - lead} of {expected} bytes")
    return view[lead:]


def _reserve(request: Request, dataplane: DataPlane, nbytes: int) -> None:
    """Take what ``nbytes`` of body hold of the in-flight budget (MemoryBudget.reserve_body) for this
    request (given back by release_reserved)."""
    state = request.scope["state"]
    per_byte = state.get("hold_per_byte", dataplane.budget.HOLD_PER_BODY_BYTE)
    so_far = state.get("reserved_bytes", 0) // per_byte
    held = dataplane.budget.reserve_body(nbytes, so_far=so_far, per_byte=per_byte)
    state["reserved_bytes"] = state.get("reserved_bytes", 0) + held


def result_buffer(request: Request, call: MoeInitRoutingV2GradCall) -> np.ndarray | None:
    """Where the worker writes this call's grad_x ([N, H], grad_expanded_x's dtype in native byte
    order): when grad_x has REUSE_MIN_BYTES or more, an array lent by the receive buffers
    (:meth:`ReceiveBuffers.lend`: a buffer an answered call left behind, pages resident, so the
    kernel's writes fault none in; it goes back once the reply is sent and the worker is done);
    None (the backend allocates) for a smaller grad_x. The request's reservation already counts
    grad_x (MemoryBudget.HOLD_PER_BODY_BYTE)."""
    dtype = call.grad_expanded_x.dtype.newbyteorder("=")
    shape = (call.num_tokens, call.hidden_size)
    if shape[0] * shape[1] * dtype.itemsize < REUSE_MIN_BYTES:
        return None
    return dataplane_of(request).receive_buffers.lend(shape, dtype)


def release_reserved(scope: Scope) -> None:
    """Give back what this request reserved of the in-flight budget, and its receive buffer for
    reuse when nothing views it any more (once its answer is sent)."""
    state = scope.get("state", {})
    reserved = state.pop("reserved_bytes", 0)
    if reserved:
        state["dataplane"].budget.release(reserved)
    buffer = state.pop("receive_buffer", None)
    if buffer is not None:
        state["dataplane"].receive_buffers.give(buffer, references=1)
        del buffer


async def read_document(request: Request) -> dict[str, Any]:
    """The v1 body as a map (415/413/400 per :func:`read_body` and :func:`moegrad.decode_body`), its
    bytes counted: msgpack, or frames (:func:`moegrad.decode_frames`: the tensors' data views the
    body, no copy); bodies over INLINE_DECODE_BYTES are decoded on a worker thread."""
    body = await read_body(request, settings_of(request).max_body_bytes, V1_MEDIA_TYPES)
    metrics_of(request).bytes_in.inc(len(body))
    if media_type_of(request) == FRAMES_MEDIA_TYPE:  # the call's arrays will view the body
        if len(body) > INLINE_DECODE_BYTES:
            return await off_loop(decode_frames, body, REQUEST_LIMITS)
        return decode_frames(body, REQUEST_LIMITS)
    if len(body) > INLINE_DECODE_BYTES:
        document = await off_loop(decode_body, body, REQUEST_LIMITS)
    else:
        document = decode_body(body, REQUEST_LIMITS)
    # msgpack copied every bin out of the body: let the body go now, not after the reply
    del body
    buffer = request.scope["state"].pop("receive_buffer", None)
    if buffer is not None:
        dataplane_of(request).receive_buffers.give(buffer, references=1)
        del buffer
    return document


def media_type_of(request: Request) -> str:
    """The request's Content-Type without parameters, lower-cased ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_call(request: Request) -> MoeInitRoutingV2GradCall:
    """The v1 body as a call validated with the app's limits and default order (InvalidArgument,
    422, names the field and the aclnn code); large tensors are validated on a worker thread."""
    document = await read_document(request)
    dataplane = dataplane_of(request)
    dataplane.check_order(document.get("order"))
    max_elements, default_order = settings_of(request).max_elements, dataplane.default_order

    def build() -> MoeInitRoutingV2GradCall:
        return MoeInitRoutingV2GradCall.from_wire(document, max_elements=max_elements, default_order=default_order)

    if _tensor_bytes(document) > INLINE_DECODE_BYTES:
        return await off_loop(build)
    return build()


def _tensor_bytes(document: dict[str, Any]) -> int:
    total = 0
    for value in document.values():
        data = value.get("data") if isinstance(value, dict) else None
        if data is not None and not isinstance(data, (str, list, dict)) and hasattr(data, "__len__"):
            total += len(data)  # a msgpack bin, or a frames body's segment
    return total


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
