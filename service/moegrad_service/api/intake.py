"""A request's body taken in: admitted before it is read, read within its limit at its pace.

:func:`read_body` admits the request (``DataPlane.admit``) and keeps its
:class:`~moegrad_service.memory.Admission` in the request's state under :data:`ADMISSION`, the one
key a request adds there; the route releases it once the answer is sent (:func:`release_admission`,
api/routing.py), and the access log and the early-answer check read it (:func:`admission_of`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.types import Scope

from moegrad import MalformedRequest, PayloadTooLarge, brief
from moegrad_service.api.auth import tenant_of
from moegrad_service.api.errors import RequestTimeout, UnsupportedMediaType
from moegrad_service.api.inputs import dataplane_of, media_type_of, settings_of
from moegrad_service.connections import BODY_INTO, Received
from moegrad_service.memory import Admission, Peak
from moegrad_service.settings import Settings

__all__ = [
    "ADMISSION",
    "MSGPACK_MEDIA_TYPES",
    "admission_of",
    "byte_count",
    "cover",
    "read_body",
    "release_admission",
]

MSGPACK_MEDIA_TYPES = frozenset({"application/msgpack", "application/x-msgpack"})


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
    extra_bytes: int = 0,
) -> bytearray | memoryview:
    """The request body, admitted before it is read.

    Refused before reading: 415 when the media type is not in ``media_types``; 413 when
    Content-Length is over ``limit``; 503 + Retry-After when the pool could not take the call (not
    ready, the queue (the caller's token's share of it) full) or what the body holds (twice its
    bytes: MemoryBudget.reserve_body) does not fit the in-flight budget now (``max_inflight_bytes``).
    A body without Content-Length is counted against both as it arrives.
    408 when the body takes longer than ``body_timeout_s`` to arrive, or falls behind
    ``body_min_bytes_per_s`` once ``body_grace_s`` has passed: its reservation goes back at once. The
    request's admission (``DataPlane.admit``: the bytes reserved, the buffer the body is read into)
    is released by the route once the answer is sent (api/routing.py); once the body is decoded the
    route tops it up to what the call holds (:func:`cover`).

    ``lead`` > 0 puts that many zero bytes before the body in its buffer (whose start CPython
    aligns to 16 bytes) and returns a memoryview of the body alone: a caller that knows where
    binary data starts inside the body picks ``lead`` so that it lands 16-byte aligned, and its
    arrays can view the body instead of copying it (v2's binary tensor data).

    ``hold_per_byte``: what the request holds per byte of its body, when not a single call's
    (MemoryBudget.HOLD_PER_BODY_BYTE): a batch passes MemoryBudget.BATCH_HOLD_PER_BODY_BYTE, a v2
    JSON body JSON_HOLD_PER_BODY_BYTE. ``extra_bytes``: reserved besides, with a declared body (a
    v2 body's JSON header as it is parsed)."""
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
    admission = dataplane_of(request).admit(
        expected, per_byte=hold_per_byte, extra_bytes=extra_bytes if expected else 0, tenant=tenant_of(request.scope)
    )
    request.scope["state"][ADMISSION] = admission  # released by the route (release_admission)
    pace = _BodyPace(settings_of(request))
    try:
        async with asyncio.timeout(None) as timeout:
            pace.watch(timeout)
            return await _receive(request, admission, limit, expected, lead, pace.received)
    except TimeoutError:
        raise RequestTimeout(pace.late()) from None
    finally:
        pace.stop()


class _BodyPace:
    """The body's time limits: all of it within ``body_timeout_s``, and from ``body_grace_s`` on
    at least ``body_min_bytes_per_s`` on average past the grace (mod_reqtimeout's MinRate: each byte
    received extends the time by 1/rate). A timer looks at the bytes received when that time comes
    and, when they are too few, ends the read through the request's timeout."""

    def __init__(self, settings: Settings) -> None:
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.time()
        self.received = Received()
        self.timeout_s = settings.body_timeout_s
        self.grace_s = settings.body_grace_s
        self.rate = settings.body_min_bytes_per_s
        self.slow = False
        self._timeout: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, timeout: asyncio.Timeout) -> None:
        self._timeout = timeout
        timeout.reschedule(self.started + self.timeout_s)
        if self.rate > 0 and self.grace_s < self.timeout_s:
            self._timer = self._loop.call_at(self.started + self.grace_s, self._look)

    def due(self) -> float:
        """When the body falls behind the floor, given the bytes received so far (loop time)."""
        return self.started + self.grace_s + self.received.nbytes / self.rate

    def _look(self) -> None:
        self._timer = None
        due = self.due()
        if due > self._loop.time():
            self._timer = self._loop.call_at(due, self._look)
        elif self._timeout is not None and not self._timeout.expired():
            self.slow = True
            self._timeout.reschedule(self._loop.time())  # the read ends now, as at body_timeout_s

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def late(self) -> str:
        """The 408's detail: the floor the body fell behind, or the time it ran out of."""
        if self.slow:
            elapsed = self._loop.time() - self.started
            return (
                f"the body arrived too slowly: {self.received.nbytes} bytes in {elapsed:.1f} s, behind the floor "
                f"of {self.rate} bytes/s after the first {self.grace_s:g} s (body_min_bytes_per_s, body_grace_s); "
                "send it at once, or in smaller calls"
            )
        within = f"{self.timeout_s:g} s (body_timeout_s)"
        return f"the body did not arrive within {within}; send it at once, or in smaller calls"


def cover(request: Request, peak: Callable[..., Peak], *args: Any, **kwargs: Any) -> None:
    """Top the request's admission up to ``peak(*args, body_bytes=<its body's size>, **kwargs)``
    (moegrad_service.memory.peaks) once its body is decoded, before anything runs.

    Raises:
        PayloadTooLarge: (413) the request could never fit the in-flight budget.
        DeviceBusy: (503 + Retry-After) what it holds beyond its body's reservation does not fit now.
    """
    admission = admission_of(request.scope)
    if admission is not None:
        admission.cover(peak(*args, body_bytes=admission.body_bytes, **kwargs))


async def _receive(
    request: Request, admission: Admission, limit: int, expected: int | None, lead: int, received: Received
) -> bytearray | memoryview:
    if expected is not None:
        return await _receive_declared(request, admission, expected, lead, received)
    # Without a Content-Length the body grows as bytes arrive (each chunk reserved from the budget first).
    body = bytearray(lead)
    async for chunk in request.stream():
        if len(body) - lead + len(chunk) > limit:
            raise PayloadTooLarge(f"the body grew past the limit of {limit} bytes")
        admission.reserve(len(chunk))
        body += chunk
        received.nbytes += len(chunk)
    admission.body_complete = True
    return memoryview(body)[lead:] if lead else body


async def _receive_declared(
    request: Request, admission: Admission, expected: int, lead: int, received: Received
) -> memoryview:
    # The declared length is already reserved from the in-flight budget, so the buffer is taken
    # whole and each chunk is copied once, in place.
    buffer = admission.body_buffer(lead + expected)  # a large one is given back once the answer is sent
    view = buffer.data[: lead + expected]
    filled = lead
    if lead:
        buffer[:lead] = 0
    body_into = request.scope.get("extensions", {}).get(BODY_INTO)
    if body_into is not None and expected and await body_into(request.scope, view[lead:], received):
        admission.body_complete = True
        admission.read_in_place = expected  # not seen by receive(): for the access log
        return view[lead:]
    async for chunk in request.stream():
        end = filled + len(chunk)
        if end - lead > expected:
            raise MalformedRequest("the body is longer than its Content-Length")
        view[filled:end] = chunk
        filled = end
        received.nbytes = filled - lead
    admission.body_complete = True
    if filled - lead != expected:
        raise MalformedRequest(f"the body ended after {filled - lead} of {expected} bytes")
    return view[lead:]
