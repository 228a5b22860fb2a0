"""JudgePool: the threads that judge comparisons and explain candidates, behind a queue shared out
fairly between tenants.

A comparison runs its call on the :class:`~moegrad_service.engine.StreamPool` (the device), then is
judged on the host: the float64 golden and three comparisons' statistics (moegrad.compare). That
judging is work like a call's: it waits for one of ``workers`` threads in a
:class:`~moegrad_service.engine.fair.FairQueue` (each tenant's in turn), it counts in the queue
gauges, and work whose caller has gone is dropped unrun or stopped::

    queued ──> running ──> done
      │          └─(caller gone, or deadline passed)─> stop set: the work stops at its next block
      └─(caller gone, or deadline passed)─> dropped, never run

The work is ``work(stop)``: a function of a :class:`threading.Event` that it looks at as it goes
(moegrad.compare's and moegrad.explain's ``stop``) and that is set once its result is no longer wanted.
An explanation (moegrad_service.dataplane.judging) waits and stops the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from moegrad import DeadlineExceeded, DeviceBusy, MoegradError
from moegrad_service.engine.fair import FairQueue

__all__ = ["JudgePool"]

T = TypeVar("T")
_STOP = object()


@dataclass(eq=False)
class _Work(Generic[T]):
    work: Callable[[threading.Event], T] | None  # None once taken
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued -> running -> done; queued -> dropped
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transition(self, old: str, new: str) -> bool:
        with self.lock:
            if self.state != old:
                return False
            self.state = new
            return True


class JudgePool:
    """``workers`` threads taking work from a fair queue (each tenant's in turn).

    Args:
        workers: the judging threads (``judge_workers``).
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.workers = workers
        self._queue: FairQueue[Any] = FairQueue()
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0
        self._threads: list[threading.Thread] = []
        self._waiting: set[_Work[Any]] = set()  # queued, not yet taken or dropped

    def start(self) -> None:
        """Start the threads (idempotent)."""
        if self._threads:
            return
        for index in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"moegrad-judge-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop the threads (waiting up to ``timeout_s`` for the running work); work still waiting
        then is answered DeviceBusy (503), never run."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(_STOP, _STOP)
        await asyncio.to_thread(_join, threads, timeout_s)
        for job in list(self._waiting):
            if job.transition("queued", "dropped"):
                job.work = None
                _settle(job.future, None, DeviceBusy("the service is shutting down", retry_after_s=1.0))
        self._waiting.clear()

    @property
    def queue_depth(self) -> int:
        """Judgings waiting for a thread."""
        return self._queued

    @property
    def in_flight(self) -> int:
        """Judgings running now."""
        return self._running

    def alone(self) -> bool:
        """Whether the judging asking (on a judging thread) is the only one waiting or running: it
        may then spread its rows over the thread pool the calls share (moegrad.compare's
        ``parallel``); else each judging keeps to its own thread, so that judgings queue here, in
        their tenants' turns, not there, ahead of the calls."""
        return self._queued == 0 and self._running <= 1

    async def run(
        self,
        work: Callable[[threading.Event], T],
        *,
        timeout_s: float | None,
        tenant: Hashable = None,
        verb: str = "judged",
    ) -> T:
        """``work(stop)`` on the next free thread in ``tenant``'s turn; its result.

        Cancelling the awaiting task (its caller has gone) drops the work while it waits, or sets
        its ``stop`` while it runs; so does the deadline, raising DeadlineExceeded at once (its
        message says whether the work was ``verb`` yet: "judged", "explained").

        Raises:
            DeadlineExceeded: (504) ``timeout_s`` passed first (the work was not run, or was stopped).
            What ``work`` raises.
        """
        if not self._threads:
            self.start()
        loop = asyncio.get_running_loop()
        job: _Work[T] = _Work(work, loop, loop.create_future())
        with self._lock:
            self._queued += 1
            self._waiting.add(job)
        self._queue.put(job, tenant)
        timer = None if timeout_s is None else loop.call_later(timeout_s, self._expire, job, timeout_s, verb)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._give_up(job)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            del job  # the future's exception would hold this frame, and the frame the work

    def _give_up(self, job: _Work[Any]) -> None:
        """Nobody wants the work's result any more: drop it if it waits, else stop it."""
        if job.transition("queued", "dropped"):
            job.work = None
            with self._lock:
                self._queued -= 1
                self._waiting.discard(job)
        else:
            job.stop.set()

    def _expire(self, job: _Work[Any], timeout_s: float, verb: str) -> None:
        if job.future.done():
            return
        ran = job.state != "queued"
        self._give_up(job)
        where = f"while it was {verb} (stopped)" if ran else f"before it was {verb} (it was not)"
        job.future.set_exception(DeadlineExceeded(f"the deadline of {timeout_s:.3f} s passed {where}"))

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if not job.transition("queued", "running"):
                continue  # dropped while it waited, already counted out
            with self._lock:
                self._queued -= 1
                self._running += 1
                self._waiting.discard(job)
            work, job.work = job.work, None
            error: BaseException | None = None
            try:
                result = work(job.stop)
            except MoegradError as exc:  # an answer: its frames (and the work's arrays) may go
                result, error = None, exc.with_traceback(None)
            except Exception as exc:  # a bug: the caller's to see (if it still waits), traceback and all
                result, error = None, exc
            finally:
                del work
                with self._lock:
                    self._running -= 1
            job.state = "done"
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            except RuntimeError:  # the loop has closed: nobody waits
                pass
            job = result = error = None  # an idle thread holds nothing of the last work


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    for thread in threads:
        thread.join(timeout_s)
