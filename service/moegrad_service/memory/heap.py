"""Giving the C heap's free pages back to the system once the service is quiet.

Tensors under glibc's mmap threshold (4 MiB: ``moegrad-service serve`` fixes it there, see
:mod:`moegrad_service.memory.allocator`) live in the heap. When a batch of many such calls is
answered they are all freed, but glibc returns only the free space at the very top of each arena to
the system; the rest stays resident for the next allocations, so a server that has answered
batches of many calls of different shapes stays far above its idle size (bench/RESULTS.md, "Large
calls, frames and batches").
``malloc_trim(0)`` returns the free pages of every arena (glibc 2.8 and later; the manual page
malloc_trim(3)). :class:`HeapTrimmer` calls it a moment after the service has released enough bytes
of its in-flight budget, at a time when no request holds any, on a thread of the loop's default
executor.
Where the C library has no ``malloc_trim`` (musl, macOS), it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

__all__ = ["HeapTrimmer", "trim_heap"]

logger = logging.getLogger("moegrad_service.heap")

#: Bytes released from the in-flight budget since the last trim that make a trim worth it.
TRIM_AFTER_BYTES = 64 << 20
#: Seconds from the release that arms a trim to the trim (later while a request holds bytes).
QUIET_S = 1.0
#: Seconds between looks at the budget while a request holds bytes past that time.
RECHECK_S = 0.1


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        function = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # no C library found, or one without malloc_trim
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the system (``malloc_trim(0)``; ctypes releases the GIL
    while it runs). True when memory was returned, False when none was or the C library has no
    ``malloc_trim``."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class HeapTrimmer:
    """Trims the heap (:func:`trim_heap`) ``quiet_s`` seconds after ``after_bytes`` have been
    released from the in-flight budget, or as soon after that as the budget holds nothing but
    ``spare()`` bytes (kept buffers): it looks again every RECHECK_S while a request holds bytes.

    Releases after the arming one do not put the trim off, so a trickle of small calls does not
    keep the heap from being trimmed; a request that arrives while the trim runs may wait for it
    (it takes each arena's lock in turn, longer the more it frees).

    Args:
        loop: the service's event loop: the timer runs there, the trim on its default executor.
        held: the bytes the budget holds now (requests and kept buffers).
        spare: the bytes of those that are kept buffers (not requests).
        after_bytes: bytes released that arm the trim (default TRIM_AFTER_BYTES).
        quiet_s: seconds from the arming release to the trim (default QUIET_S).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        held: Callable[[], int],
        spare: Callable[[], int],
        *,
        after_bytes: int | None = None,
        quiet_s: float | None = None,
    ) -> None:
        self._loop = loop
        self._held = held
        self._spare = spare
        self.after_bytes = TRIM_AFTER_BYTES if after_bytes is None else after_bytes
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self._lock = threading.Lock()
        self._released = 0  # since the last trim
        self._armed = False  # a trim is due (its timer set, or being set)
        self.trims = 0  #: trims run so far

    def released(self, nbytes: int) -> None:
        """The budget gave back ``nbytes``; on any thread. Costs a lock and an add, except for the
        release that arms the trim (it wakes the loop)."""
        with self._lock:
            self._released += nbytes
            if self._armed or self._released < self.after_bytes:
                return
            self._armed = True
        try:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.quiet_s, self._due)
        except RuntimeError:  # the loop is closed: the service has stopped
            pass

    def _due(self) -> None:
        spare = self._spare()  # first: a buffer kept between the two reads then counts as a request's
        if self._held() > spare:  # a request holds bytes: look again shortly
            self._loop.call_later(RECHECK_S, self._due)
            return
        with self._lock:
            self._released, self._armed = 0, False
        self.trims += 1
        future = self._loop.run_in_executor(None, trim_heap)
        future.add_done_callback(self._done)

    @staticmethod
    def _done(future: asyncio.Future[bool]) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.warning("trimming the heap failed: %s", future.exception())
