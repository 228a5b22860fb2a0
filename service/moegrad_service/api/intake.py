"""A request's body taken in: admitted before it is read, read within its limit at its pace, and
what it holds of the service's memory given back once its answer is sent.

The route owns the intake (api/routing.py's EndpointRoute: ``with Intake(request) as intake``, the
answer sent inside the block) and hands it to its handler, which reads the body through it
(:meth:`Intake.read`: ``DataPlane.admit``, then the body into the admission's buffer) and, once the
body is decoded, tops the admission up to what the call holds (:meth:`Intake.cover`). Leaving the
block releases the :class:`~moegrad_service.memory.Admission` (its reserved bytes and buffers) on
every path, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fastapi import Request

from moegrad import MalformedRequest, PayloadTooLarge, brief
from moegrad_service.api.auth import tenant_of
from moegrad_service.api.errors import RequestTimeout, UnsupportedMediaType
from moegrad_service.api.inputs import dataplane_of, media_type_of, settings_of
from moegrad_service.connections import BODY_INTO, Received
from moegrad_service.memory import Admission, Peak
from moegrad_service.settings import Settings

__all__ = ["MSGPACK_MEDIA_TYPES", "Intake", "byte_count"]

MSGPACK_MEDIA_TYPES = frozenset({"application/msgpack", "application/x-msgpack"})


class Intake:
    """One request's body, taken in once, and its admission, held until the answer is sent.

    Made by the route before its handler runs and left once the answer is sent (``with``): leaving
    releases the admission (:meth:`release`, idempotent), whether the handler answered, raised, or
    never read the body. It is used on the event loop; it is not thread-safe.

    Attributes:
        request: the request whose body it takes in.
        admission: the request's admission once :meth:`read` has admitted it, else None.
        complete: the whole body has arrived (nothing of it is left unread on the connection).
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.admission: Admission | None = None
        self.complete = False

    async def read(
        self,
        media_types: frozenset[str] | None = MSGPACK_MEDIA_TYPES,
        *,
        limit: int | None = None,
        lead: int = 0,
        hold_per_byte: int | None = None,
        extra_bytes: int = 0,
    ) -> bytearray | memoryview:
        """The request body, admitted before it is read.

        Refused before reading: 415 when the media type is not in ``media_types`` (None: any); 413
        when Content-Length is over ``limit`` (None: ``max_body_bytes``); 503 + Retry-After when
        the pool could not take the call (not ready, the queue (the caller's token's share of it)
        full) or what the body holds (twice its bytes: MemoryBudget.reserve_body) does not fit the
        in-flight budget now (``max_inflight_bytes``). A body without Content-Length is counted against both as it
        arrives. 408 when the body takes longer than ``body_timeout_s`` to arrive, or falls behind
        ``body_min_bytes_per_s`` once ``body_grace_s`` has passed: its reservation goes back at
        once. Once the body is decoded the handler tops the admission up to what the call holds
        (:meth:`cover`).

        ``lead`` > 0 puts that many zero bytes before the body in its buffer (whose start CPython
        aligns to 16 bytes) and returns a memoryview of the body alone: a caller that knows where
        binary data starts inside the body picks ``lead`` so that it lands 16-byte aligned, and its
        arrays can view the body instead of copying it (v2's binary tensor data).

        ``hold_per_byte``: what the request holds per byte of its body, when not a single call's
        (MemoryBudget.HOLD_PER_BODY_BYTE): a batch passes MemoryBudget.BATCH_HOLD_PER_BODY_BYTE, a
        v2 JSON body JSON_HOLD_PER_BODY_BYTE. ``extra_bytes``: reserved besides, with a declared
        body (a v2 body's JSON header as it is parsed)."""
        assert self.admission is None, "a body is taken in once"
        request = self.request
        settings, dataplane, media_type = settings_of(request), dataplane_of(request), media_type_of(request)
        tenant = tenant_of(request.scope)
        limit = settings.max_body_bytes if limit is None else limit
        if media_types is not None and media_type not in media_types:
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
        extra = extra_bytes if expected else 0
        self.admission = dataplane.admit(expected, per_byte=hold_per_byte, extra_bytes=extra, tenant=tenant)
        pace = _BodyPace(settings)
        try:
            async with asyncio.timeout(None) as timeout:
                pace.watch(timeout)
                if expected is not None:
                    return await self._receive_declared(expected, lead, pace.received)
                return await self._receive(limit, lead, pace.received)
        except TimeoutError:
            raise RequestTimeout(pace.late()) from None
        finally:
            pace.stop()

    def cover(self, peak: Callable[..., Peak], *args: Any, **kwargs: Any) -> None:
        """Top the admission up to ``peak(*args, body_bytes=<its body's size>, **kwargs)``
        (moegrad_service.memory.peaks) once the body is decoded, before anything runs.

        Raises:
            PayloadTooLarge: (413) the request could never fit the in-flight budget.
            DeviceBusy: (503 + Retry-After) what it holds beyond its body's reservation does not fit now.
        """
        if self.admission is not None:
            self.admission.cover(peak(*args, body_bytes=self.admission.body_bytes, **kwargs))

    def release_body(self) -> None:
        """Let go of the body's buffer before the answer is sent (its tensors were copied out of it)."""
        if self.admission is not None:
            self.admission.release_body()

    @property
    def unread(self) -> bool:
        """Part of the body may still be on the connection (an answer before the body was all
        read: the server then closes the connection, lingering)."""
        if self.complete:
            return False
        headers = self.request.headers
        return headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers

    def release(self) -> None:
        """Give back what the request holds of the service's memory (:meth:`Admission.release`);
        idempotent. The route calls it once the answer is sent."""
        if self.admission is not None:
            self.admission.release()

    def __enter__(self) -> Intake:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    async def _receive(self, limit: int, lead: int, received: Received) -> bytearray | memoryview:
        # Without a Content-Length the body grows as bytes arrive (each chunk reserved from the budget first).
        admission = self.admission
        assert admission is not None
        body = bytearray(lead)
        async for chunk in self.request.stream():
            if len(body) - lead + len(chunk) > limit:
                raise PayloadTooLarge(f"the body grew past the limit of {limit} bytes")
            admission.reserve(len(chunk))
            body += chunk
            received.nbytes += len(chunk)
        self.complete = True
        return memoryview(body)[lead:] if lead else body

    async def _receive_declared(self, expected: int, lead: int, received: Received) -> memoryview:
        # The declared length is already reserved from the in-flight budget, so the buffer is taken
        # whole and each chunk is copied once, in place.
        admission = self.admission
        assert admission is not None
        buffer = admission.body_buffer(lead + expected)  # a large one is given back once the answer is sent
        view = buffer.data[: lead + expected]
        filled = lead
        if lead:
            buffer[:lead] = 0
        body_into = self.request.scope.get("extensions", {}).get(BODY_INTO)
        if body_into is not None and expected and await body_into(self.request.scope, view[lead:], received):
            self.complete = True
            return view[lead:]
        async for chunk in self.request.stream():
            end = filled + len(chunk)
            if end - lead > expected:
                raise MalformedRequest("the body is longer than its Content-Length")
            view[filled:end] = chunk
            filled = end
            received.nbytes = filled - lead
        self.complete = True
        if filled - lead != expected:
            raise MalformedRequest(f"the body ended after {filled - lead} of {expected} bytes")
        return view[lead:]


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
