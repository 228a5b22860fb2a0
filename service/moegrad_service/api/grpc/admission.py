"""Protocol v2 over gRPC, the admission of a message before it is read: :class:`MessageGate`.

gRPC carries no length before the message itself, and grpc's Python server hands a handler a
message only once all of it has arrived. Every RPC that needs its request is therefore registered
request-streaming (the handler runs before a byte of the message is asked for) and reads it through
:meth:`MessageGate.receive`, which first reserves, of the in-flight budget
(``max_inflight_bytes``), what the largest message gRPC lets through could hold
(:data:`HOLD_PER_MESSAGE_BYTE` times :func:`max_message_bytes`), then reads it, then keeps only what
the message it got holds. Until its handler reads, HTTP/2 flow control holds a message back at the
client: the server announces :data:`LOOKAHEAD_BYTES` of window per stream and no more (its
bandwidth probe, which would widen that window, is off), and grpc refuses a message longer than its
limit from its 5-byte length prefix, before reading it. RPCs wait for room in arrival order, each
until ``body_timeout_s`` after it began (as many as ``max_connections`` lets in: a waiting RPC
holds no more than its stream's window), then have ``body_timeout_s`` for their message to arrive.
Once a ModelInfer's message is decoded, its reservation becomes what its call holds from then on
(:meth:`Reservation.cover`, moegrad_service.memory.peaks), as an HTTP body's admission is topped
up to its call's peak.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from moegrad import DeviceBusy
from moegrad_service.api.errors import RequestTimeout
from moegrad_service.memory import MemoryBudget, Peak
from moegrad_service.settings import Settings

__all__ = [
    "GRPC_MAX_MESSAGE_BYTES",
    "HOLD_PER_MESSAGE_BYTE",
    "LOOKAHEAD_BYTES",
    "READS_AT_ONCE",
    "MessageGate",
    "Reservation",
    "max_message_bytes",
]

#: The largest message gRPC can take (its lengths are signed 32-bit).
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
#: What a ModelInfer holds per byte of its message, at its peak: the message as grpc gathers it,
#: the copy grpc's Python layer grows as it converts it and the bytes it hands over, all three for
#: a moment; then the parsed message, the tensors copied out of it, grad_x and the reply
#: (measured in bench/RESULTS.md, "gRPC admission").
HOLD_PER_MESSAGE_BYTE = 4
#: Reads of the largest message that the default ``grpc_max_message_bytes`` lets the budget hold at once.
READS_AT_ONCE = 4
#: The flow-control window each stream is given before its handler reads (HTTP/2's default 65,535
#: rounded up; grpc's ``grpc.http2.lookahead_bytes``).
LOOKAHEAD_BYTES = 64 << 10
_POLL_S = 0.01


def max_message_bytes(settings: Settings, budget: MemoryBudget) -> int:
    """The largest message gRPC receives: ``grpc_max_message_bytes``, by default the smallest of
    ``max_body_bytes``, GRPC_MAX_MESSAGE_BYTES and what READS_AT_ONCE reads let the part of the
    budget one call may take hold.

    Raises:
        ValueError: ``grpc_max_message_bytes`` is set so large that a message of that size could never
            be admitted (HOLD_PER_MESSAGE_BYTE times it over seven eighths of ``max_inflight_bytes``).
    """
    share = budget.ceiling(budget.limit_bytes)  # seven eighths: the most a large reservation may take
    if settings.grpc_max_message_bytes is None:
        return max(
            1024, min(settings.max_body_bytes, GRPC_MAX_MESSAGE_BYTES, share // (HOLD_PER_MESSAGE_BYTE * READS_AT_ONCE))
        )
    if settings.grpc_max_message_bytes * HOLD_PER_MESSAGE_BYTE > share:
        raise ValueError(
            f"grpc_max_message_bytes={settings.grpc_max_message_bytes} is more than a message can hold of "
            f"max_inflight_bytes={settings.max_inflight_bytes}: a message being read reserves "
            f"{HOLD_PER_MESSAGE_BYTE} times it, and one call may take {share} bytes; lower "
            f"grpc_max_message_bytes to {share // HOLD_PER_MESSAGE_BYTE} or less, or raise max_inflight_bytes"
        )
    return min(settings.grpc_max_message_bytes, GRPC_MAX_MESSAGE_BYTES)


class Reservation:
    """Bytes of the in-flight budget one RPC holds for its message; :meth:`release` gives them back
    (idempotent)."""

    def __init__(self, budget: MemoryBudget, nbytes: int, released: asyncio.Event) -> None:
        self._budget = budget
        self._released = released
        self.nbytes = nbytes

    def keep(self, nbytes: int) -> None:
        """Hold ``nbytes`` (no more than now) and give the rest back."""
        excess, self.nbytes = self.nbytes - min(nbytes, self.nbytes), min(nbytes, self.nbytes)
        if excess:
            self._budget.release(excess)
            self._released.set()

    def release(self) -> None:
        self.keep(0)

    def cover(self, peak: Peak) -> None:
        """Hold ``peak.total`` bytes from now until the reply is sent: what the decoded call's shapes
        say answering it holds (moegrad_service.memory.peaks). More than is held is reserved
        (MemoryBudget.top_up); what the read held beyond it (HOLD_PER_MESSAGE_BYTE times the
        message: the message, its parsed copy and the tensors copied out, the first two gone once
        it is decoded) is given back.

        Raises:
            PayloadTooLarge: (RESOURCE_EXHAUSTED) the call could never fit the budget; the message
                names its parts. What is held is unchanged.
            DeviceBusy: (UNAVAILABLE + retry-after) the difference does not fit now, beside what
                others hold. What is held is unchanged.
        """
        more = peak.total - self.nbytes
        if more > 0:
            self._budget.top_up(more, whole=peak.total, needs=peak.describe())
            self.nbytes = peak.total
        else:
            self.keep(peak.total)


class MessageGate:
    """Reads each RPC's one request message once the in-flight budget holds room for the largest
    message gRPC lets through (module docstring).

    Args:
        budget: the service's in-flight budget.
        max_message_bytes: the largest message gRPC receives (:func:`max_message_bytes`).
        timeout_s: how long after its RPC began a message must have been read (``body_timeout_s``).
        retry_after_s: the retry hint of a refusal.
    """

    def __init__(self, budget: MemoryBudget, *, max_message_bytes: int, timeout_s: float, retry_after_s: float) -> None:
        self.budget = budget
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._turn = asyncio.Lock()  # wakes its waiters in the order they came
        self._released = asyncio.Event()

    @property
    def upper_bytes(self) -> int:
        """What a message being read may hold: HOLD_PER_MESSAGE_BYTE times the largest message."""
        return HOLD_PER_MESSAGE_BYTE * self.max_message_bytes

    async def receive(self, context: grpc.aio.ServicerContext, started: float) -> tuple[bytes, Reservation]:
        """The RPC's request message (b"" when the client sent none), read once room was reserved for
        it, and what is reserved now: HOLD_PER_MESSAGE_BYTE times the message's size.

        Args:
            context: the RPC's context (its ``read`` gives the message).
            started: when the RPC began (``time.perf_counter()``).

        Raises:
            DeviceBusy: (UNAVAILABLE + retry-after) there was no room within ``body_timeout_s`` of
                ``started``.
            RequestTimeout: (DEADLINE_EXCEEDED) the message did not arrive within ``body_timeout_s``
                of the server asking for it.
        """
        reservation = await self._reserve(started + self.timeout_s)
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    message: Any = await context.read()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request message did not arrive within {self.timeout_s:g} s (body_timeout_s); "
                    "send it at once, or in less time"
                ) from None
            raw = message if isinstance(message, bytes) else b""  # grpc.aio.EOF: no message sent
            reservation.keep(HOLD_PER_MESSAGE_BYTE * len(raw))
            return raw, reservation
        except BaseException:
            reservation.release()
            raise

    async def _reserve(self, deadline: float) -> Reservation:
        """Reserve :attr:`upper_bytes`, waiting in arrival order until ``deadline`` for room."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())), self._turn:
                while True:
                    self._released.clear()
                    try:
                        self.budget.reserve(self.upper_bytes)
                        return Reservation(self.budget, self.upper_bytes, self._released)
                    except DeviceBusy:
                        if time.perf_counter() >= deadline:
                            raise self._no_room() from None
                    # another RPC's release sets the event; HTTP's releases are seen on the next poll
                    try:
                        async with asyncio.timeout(_POLL_S):
                            await self._released.wait()
                    except TimeoutError:
                        pass
        except TimeoutError:
            raise self._no_room() from None

    def _no_room(self) -> DeviceBusy:
        return DeviceBusy(
            f"the service holds {self.budget.held_bytes} of its {self.budget.limit_bytes} in-flight bytes, "
            f"and a message being read reserves {self.upper_bytes} (the largest message, "
            f"{self.max_message_bytes} bytes, {HOLD_PER_MESSAGE_BYTE} times); retry later",
            retry_after_s=self.retry_after_s,
        )
