"""The service's memory (:class:`Memory`) and what one admitted request holds of it (:class:`Admission`).

Every request that carries tensors, on every protocol, is admitted the same way::

    admission = dataplane.admit(body_bytes)   # the pool's queue, then Memory.admit: the budget
    ... read the body into admission.body_buffer(n), decode it ...
    admission.cover(call_peak(call, ...))     # topped up to what its shapes hold (memory.peaks)
    ... run the call (the dataplane writes a large grad_x into admission.result_buffer(...)),
        send the reply ...
    admission.release()                       # once the reply is sent: bytes and buffers back

:class:`Memory` is built once by the app (``create_app``) and handed to the dataplane; it owns the
in-flight budget, the receive buffers kept inside it and the heap trimmer told of its releases.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

import numpy as np

from moegrad_service.memory.budget import MemoryBudget
from moegrad_service.memory.buffers import REUSE_MIN_BYTES, Loan, ReceiveBuffers
from moegrad_service.memory.heap import HeapTrimmer
from moegrad_service.memory.peaks import Peak

__all__ = ["Admission", "Memory"]


class Memory:
    """The service's memory policy: the in-flight budget, the receive buffers kept in it and the
    heap trimmer told of every release.

    Args:
        limit_bytes: the in-flight budget (``max_inflight_bytes``).
        retry_after_s: the retry hint of a refusal (``retry_after_s``).
        keep_s: how long a receive buffer is kept unused, in seconds (``receive_keep_s``; 0: none kept).
        loop: the service's event loop, where the heap trimmer's timer runs; None: no heap trims.

    Attributes:
        budget: the in-flight budget (:class:`MemoryBudget`).
        buffers: the receive buffers (:class:`ReceiveBuffers`).
        trimmer: the heap trimmer (:class:`HeapTrimmer`), or None without a loop.
    """

    def __init__(
        self,
        limit_bytes: int,
        *,
        retry_after_s: float = 1.0,
        keep_s: float = 0.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.trimmer = (
            None if loop is None else HeapTrimmer(loop, lambda: self.budget.held_bytes, lambda: self.buffers.kept_bytes)
        )
        self.budget = MemoryBudget(
            limit_bytes,
            retry_after_s=retry_after_s,
            released=None if self.trimmer is None else self.trimmer.released,
        )
        self.buffers = ReceiveBuffers(self.budget, keep_s=keep_s)

    def admit(
        self,
        body_bytes: int | None = None,
        *,
        per_byte: int | None = None,
        extra_bytes: int = 0,
        tenant: str | None = None,
    ) -> Admission:
        """An admission for a request whose body holds ``per_byte`` times its bytes while it is
        answered (default MemoryBudget.HOLD_PER_BODY_BYTE; a batch's BATCH_HOLD_PER_BODY_BYTE),
        ``body_bytes`` of them reserved now (None: a body of unknown size, reserved as it arrives
        with :meth:`Admission.reserve`), with ``extra_bytes`` besides (a v2 body's JSON part as it
        is parsed; only with ``body_bytes``). ``tenant``: whose request it is (the caller's token,
        by its identity; None without authentication).

        Raises:
            PayloadTooLarge: (413) the body could never fit the budget.
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        admission = Admission(
            self.budget, self.buffers, per_byte=per_byte or MemoryBudget.HOLD_PER_BODY_BYTE, tenant=tenant
        )
        if body_bytes is not None:
            admission.reserve(body_bytes, extra=extra_bytes)
        return admission


class Admission:
    """What one admitted request holds of the service's memory until its answer is sent: the bytes
    reserved of the in-flight budget for its body, the buffer its body is read into and the buffer
    its grad_x is written into.

    Made by :meth:`Memory.admit` (through ``DataPlane.admit``). :meth:`release` gives everything
    back once the answer is sent (idempotent; ``with admission:`` releases on exit). The request's
    handler uses it on the event loop; it is not thread-safe.

    Attributes:
        per_byte: what the request holds per byte of its body until it is decoded.
        tenant: whose request it is (a token's identity), or None.
        body_bytes: the body's bytes reserved so far.
    """

    def __init__(
        self, budget: MemoryBudget, buffers: ReceiveBuffers, *, per_byte: int, tenant: str | None = None
    ) -> None:
        self._budget = budget
        self._buffers = buffers
        self.per_byte = per_byte
        self.tenant = tenant
        self.body_bytes = 0
        self._reserved = 0
        self._body: Loan | None = None
        self._loan: Loan | None = None
        self._result_written = False

    @property
    def reserved_bytes(self) -> int:
        """The bytes of the in-flight budget this request holds now."""
        return self._reserved

    def reserve(self, body_bytes: int, *, extra: int = 0) -> None:
        """Reserve what ``body_bytes`` more of the body hold (``per_byte`` times them), and
        ``extra`` bytes besides; the limits apply to the whole body so far
        (MemoryBudget.reserve_body).

        Raises:
            PayloadTooLarge: (413) the body so far could never fit the budget.
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        self._reserved += self._budget.reserve_body(
            body_bytes, so_far=self.body_bytes, per_byte=self.per_byte, extra=extra
        )
        self.body_bytes += body_bytes

    def cover(self, peak: Peak) -> None:
        """Hold at least ``peak.total`` bytes from now until the answer is sent: what the decoded
        request's shapes say answering it holds (moegrad_service.memory.peaks). Reserves the
        difference when it is more than the request holds; never gives any back.

        Raises:
            PayloadTooLarge: (413) the request could never fit the budget; the message names its parts.
            DeviceBusy: (503 + Retry-After) the difference does not fit now, beside what others hold.
        """
        more = peak.total - self._reserved
        if more > 0:
            self._budget.top_up(more, whole=peak.total, needs=peak.describe())
            self._reserved += more

    def body_buffer(self, nbytes: int) -> np.ndarray:
        """A byte buffer (uint8) of at least ``nbytes`` to read the body into: from the receive
        buffers (a kept one, pages resident, or a fresh one) when ``nbytes`` is REUSE_MIN_BYTES or
        more, lent until :meth:`release_body` or :meth:`release`; else a fresh ``numpy.empty``.
        The reservation already covers it."""
        if nbytes < REUSE_MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        self.release_body()
        self._body = self._buffers.body_loan(nbytes)
        assert self._body.array is not None
        return self._body.array

    def release_body(self) -> None:
        """The request lets go of its body's buffer (its tensors were copied out, or its answer is
        sent): the buffer serves the next body once nothing views it any more
        (:meth:`ReceiveBuffers.body_loan`)."""
        loan, self._body = self._body, None
        if loan is not None:
            loan.forget()

    def result_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """Where grad_x ([N, H] = ``shape``, ``dtype`` in native byte order) is written: when it has
        REUSE_MIN_BYTES or more, an array lent by the receive buffers (a buffer an answered call
        left behind, pages resident, so the kernel's writes fault none in); None (the backend
        allocates) for a smaller one. The reservation already counts grad_x
        (MemoryBudget.HOLD_PER_BODY_BYTE).

        It comes back at :meth:`release`: at once when :meth:`result_written` was called, else
        once its worker lets go of it (a call given up on while it ran may still be writing)."""
        if math.prod(shape) * dtype.itemsize < REUSE_MIN_BYTES:
            return None
        self._forget_result()
        self._loan = self._buffers.loan(shape, dtype)
        return self._loan.array

    def result_written(self) -> None:
        """The worker has written the result buffer and returned it: nothing but the reply reads it
        any more, so :meth:`release` keeps it for the next call at once."""
        self._result_written = True

    def release(self) -> None:
        """Give back the reserved bytes, then the body buffer (kept for reuse if nothing views it)
        and the result buffer (see :meth:`result_buffer`). Idempotent; call it once the reply is
        sent."""
        reserved, self._reserved = self._reserved, 0
        if reserved:
            self._budget.release(reserved)
        self.release_body()
        loan, self._loan = self._loan, None
        if loan is not None:
            if self._result_written:
                loan.give_back()
            else:
                loan.forget()

    def _forget_result(self) -> None:
        loan, self._loan = self._loan, None
        if loan is not None:
            loan.forget()
        self._result_written = False

    def __enter__(self) -> Admission:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()
