"""Receive buffers: request bodies are read, and large results written, into buffers that finished calls leave behind.

A buffer over glibc's mmap threshold is a fresh mapping: every 4 KiB page of it faults, and is
zeroed, as the body arrives (the cost is measured in bench/RESULTS.md). :class:`ReceiveBuffers` keeps
the buffers of answered calls, pages resident, and lends them (a :class:`Loan`) for the next body of
their size (:meth:`ReceiveBuffers.body_loan`) and for grad_x (:meth:`ReceiveBuffers.loan`). A loan
comes back when its borrower gives it back, done with it (:meth:`Loan.give_back`: a result the worker
has written and the reply has sent), or else, once the borrower lets go of it (:meth:`Loan.forget`),
when the lent array and every view of it are gone: a body whose decoded tensors view it, a worker
still writing a result after its call was given up on. Ownership, not a count of references, says
when a buffer is free.

What is kept is part of the in-flight budget (:class:`~moegrad_service.memory.budget.MemoryBudget`),
held as a request's bytes are: a buffer is kept only while the budget has room for it beside what
requests hold, a reservation that finds no room gives up kept buffers first, and a kept buffer
unused for ``keep_s`` seconds is given up, so that an idle server returns its memory.
"""

from __future__ import annotations

import asyncio
import collections
import math
import mmap
import threading
import time
import weakref

import numpy as np

from moegrad_service.memory.budget import MemoryBudget

__all__ = ["HUGE_PAGE_MIN_BYTES", "REUSE_MIN_BYTES", "Loan", "ReceiveBuffers", "fresh_buffer"]

#: Bodies of at least this many bytes are read into reusable buffers (smaller ones cost no page faults).
REUSE_MIN_BYTES = 1 << 20
#: Fresh buffers of at least this many bytes are mapped with transparent huge pages where the
#: kernel offers them (``madvise``): one fault per 2 MiB instead of per 4 KiB as the body arrives.
HUGE_PAGE_MIN_BYTES = 16 << 20


def fresh_buffer(nbytes: int) -> np.ndarray:
    """An untouched byte buffer of ``nbytes`` (uint8): an anonymous mapping advised for huge pages
    when large (unmapped when its last view goes), else ``numpy.empty``. Pages become resident as
    they are written, so a client that declares much and sends little pins only what it sent."""
    if nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: ordinary pages
            pass
        return np.frombuffer(mapping, dtype=np.uint8)
    return np.empty(nbytes, dtype=np.uint8)


class Loan:
    """A buffer lent for one result (:meth:`ReceiveBuffers.loan`).

    Attributes:
        array: the C-contiguous array over the buffer that the borrower writes (None once given
            back or forgotten).

    The buffer comes back once: by :meth:`give_back` (the borrower is done with it: nothing writes
    or reads it any more), or, when the borrower lets go of it (:meth:`forget`), once ``array``
    and every view of it are gone, on whichever thread lets go of the last one.
    """

    def __init__(self, buffers: ReceiveBuffers, buffer: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
        count = math.prod(shape)
        # every view of the result has this array as its base (numpy collapses bases to it), and it
        # holds ``buffer`` through its memoryview: it goes only when they all have
        flat = np.frombuffer(buffer.data, dtype=dtype, count=count)
        self._back = weakref.finalize(flat, buffers._lent_back, buffer)
        self._back.atexit = False
        self._buffers = buffers
        self.array: np.ndarray | None = flat.reshape(shape)

    def give_back(self) -> None:
        """The borrower is done with the buffer: it is kept for the next call now (if the budget
        has room), whatever still references the array. Idempotent."""
        self.array = None
        back = self._back.detach()  # None when it already came back
        if back is not None:
            _, _, (buffer,), _ = back
            self._buffers.keep(buffer)

    def forget(self) -> None:
        """The borrower lets go of ``array`` while something else may still write it (a worker whose
        call was given up on): the buffer comes back once the last view of it is gone."""
        self.array = None


class ReceiveBuffers:
    """Buffers of answered calls' bodies, kept inside the in-flight budget for the next body of their size.

    A kept buffer is taken by a body of at least half its size. At most ``max_kept`` are kept
    (the oldest goes first). Thread-safe: the HTTP side takes and gives on the event loop, a
    reservation on any thread may :meth:`reclaim`.

    Args:
        budget: the in-flight budget the kept bytes are held in (with :meth:`reclaim`, which a
            reservation that finds no room calls).
        keep_s: how long a buffer is kept unused, in seconds (0: never kept).
        max_kept: the most buffers kept at once.
    """

    def __init__(self, budget: MemoryBudget, *, keep_s: float, max_kept: int = 4) -> None:
        self.budget = budget
        self.keep_s = keep_s
        self.max_kept = max_kept
        self._kept: list[tuple[np.ndarray, float]] = []  # oldest first, with when each was kept
        self._lock = threading.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._returned: collections.deque[np.ndarray] = collections.deque()  # lent buffers back, not yet kept
        self._loop: asyncio.AbstractEventLoop | None = None  # where trims run: the loop it is made on, or keeps on
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass

    @property
    def kept_bytes(self) -> int:
        self._keep_returned()
        with self._lock:
            return sum(buffer.nbytes for buffer, _ in self._kept)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (uint8): a kept one of at most twice that when there is
        one (its bytes leave the budget: the caller's reservation covers them now), else a fresh one.

        A fresh one is rounded up to a granule of 1/16 to 1/8 of its size (2 MiB at least), so that
        bodies of nearly the same size (one call in msgpack, frames or v2 form) share a kept buffer;
        pages past the body are never written, so never resident."""
        self._keep_returned()
        with self._lock:
            for index, (buffer, _) in enumerate(self._kept):
                if nbytes <= buffer.nbytes <= 2 * nbytes:
                    del self._kept[index]
                    self.budget.release(buffer.nbytes)
                    return buffer
        granule = max(2 << 20, 1 << max(0, nbytes.bit_length() - 4))
        return fresh_buffer(-(-nbytes // granule) * granule)

    def loan(self, shape: tuple[int, ...], dtype: np.dtype) -> Loan:
        """A C-contiguous ``shape`` array of ``dtype`` (``loan.array``) over a buffer from
        :meth:`take`, for a result the service writes and sends; it comes back by
        :meth:`Loan.give_back`, or once the array and every view of it are gone (see :class:`Loan`).

        A worker that times out still holds its result, so the buffer of a call given up on comes
        back only when the worker is done writing."""
        return Loan(self, self.take(math.prod(shape) * dtype.itemsize), shape, dtype)

    def body_loan(self, nbytes: int) -> Loan:
        """A buffer of at least ``nbytes`` to read a body into (``loan.array``, uint8, the whole
        buffer from :meth:`take`). The body's decoded tensors may view it, so its borrower lets go
        of it with :meth:`Loan.forget` once the answer is sent: it comes back once that array and
        every view of it (the call's tensors, a worker still reading them) are gone."""
        buffer = self.take(nbytes)
        return Loan(self, buffer, (buffer.nbytes,), buffer.dtype)

    def lend(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """``loan(shape, dtype).array``, forgotten at once: the buffer comes back once that array
        and every view of it are gone."""
        loan = self.loan(shape, dtype)
        array = loan.array
        loan.forget()
        assert array is not None
        return array

    def _lent_back(self, buffer: np.ndarray) -> None:
        # The last view of a forgotten loan is gone: its buffer is free. No lock here: a collection
        # may finalize a lent array inside any allocation, one made under this pool's lock on this
        # very thread included. The buffer waits in ``_returned`` (a deque: appending takes no
        # lock) until the loop, or the next take, keeps it.
        self._returned.append(buffer)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._keep_returned)

    def _keep_returned(self) -> None:
        while True:
            try:
                buffer = self._returned.popleft()
            except IndexError:
                return
            self.keep(buffer)
            del buffer

    def keep(self, buffer: np.ndarray) -> bool:
        """Keep ``buffer``, which the caller owns outright (nothing writes or reads it any more), for
        the next body of its size if it is at least REUSE_MIN_BYTES and the budget has room for it;
        True when kept."""
        if buffer.nbytes < REUSE_MIN_BYTES or self.keep_s <= 0:
            return False
        if not self.budget.hold_spare(buffer.nbytes, self.reclaim):
            return False
        dropped = []
        with self._lock:
            self._kept.append((buffer, time.monotonic()))
            while len(self._kept) > self.max_kept:
                dropped.append(self._kept.pop(0)[0])
        for old in dropped:
            self.budget.release(old.nbytes)
        self._schedule_trim()
        return True

    def reclaim(self, nbytes: int) -> int:
        """Give up kept buffers, oldest first, until ``nbytes`` are free or none is left; returns
        the bytes given back to the budget."""
        freed = 0
        with self._lock:
            while self._kept and freed < nbytes:
                freed += self._kept.pop(0)[0].nbytes
        if freed:
            self.budget.release(freed)
        return freed

    def trim(self) -> None:
        """Give up the buffers kept unused for ``keep_s`` seconds or more."""
        self._timer = None
        stale_before = time.monotonic() - self.keep_s
        freed = 0
        with self._lock:
            while self._kept and self._kept[0][1] <= stale_before:
                freed += self._kept.pop(0)[0].nbytes
            left = bool(self._kept)
        if freed:
            self.budget.release(freed)
        if left:
            self._schedule_trim()

    def _schedule_trim(self) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # given back off the event loop (a lent buffer): schedule it there
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._schedule_trim)
            return
        self._loop = loop
        with self._lock:
            oldest = self._kept[0][1] if self._kept else time.monotonic()
        self._timer = loop.call_later(max(0.0, oldest + self.keep_s - time.monotonic()) + 0.01, self.trim)
