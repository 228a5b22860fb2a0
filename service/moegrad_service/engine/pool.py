"""StreamPool: worker threads that each own one backend slot, behind a bounded queue shared out fairly.

Each of ``streams`` threads makes its :class:`~moegrad_service.engine.base.BackendWorker` on its own
thread (a device stream, or a CPU slot) and runs one call at a time. The event loop only enqueues
and awaits: no compute ever runs on it.

Life of a call::

    admitted ──> queued ──> running ──> done
        │          │           └─(deadline + grace passed)─> abandoned: 504, a fresh worker replaces it
        │          ├─(deadline passed)──> 504, never run
        │          └─(caller cancelled)─> dropped, never run (a disconnected client costs nothing)
        └─(queue full, not ready, closing, no worker can run calls)─> DeviceBusy (503 + Retry-After)

The queue is a :class:`~moegrad_service.engine.fair.FairQueue`: each tenant (a bearer token) has
its own lane and up to ``max_queue`` calls in it, and the workers take the lanes' calls in turn.

The express worker: with ``express_max_adds`` > 0 the pool has one more worker (slot index
``streams``) that takes only small calls, those of at most ``express_max_adds`` adds (N*K*H, or
grad_expanded_x's elements when more; over all of a batch share's calls), in the same turn
order. A running call is never interrupted, so without it a small call that arrives while every
worker runs a large one waits for the first to finish; with it, it waits at most for other small
calls. It is not counted in the capacity: the pool is ready while one of the ``streams`` workers
can run calls.

Capacity: a worker counts while it can run calls. One whose backend slot says it cannot
(:meth:`BackendWorker.accepts_calls` False: the ascend worker with too many kernels still running past their
deadline) stops taking calls and asks again every CAPACITY_POLL_S seconds; an abandoned worker
counts again once its replacement has opened. With none left the pool is not ready and refuses
calls (503) instead of letting them fail one by one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from moegrad import (
    CallGroup,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MoegradError,
    MoeInitRoutingV2GradCall,
)
from moegrad_service.engine.base import Backend, BackendWorker
from moegrad_service.engine.fair import FairQueue

__all__ = ["PartOutcome", "StreamPool", "Timings"]

log = logging.getLogger("moegrad_service.engine")

_STOP = object()


@dataclass(frozen=True)
class _Parts:
    """A batch's share run as one job (:meth:`StreamPool.run_parts`): runs of calls and groups."""

    parts: tuple[tuple[MoeInitRoutingV2GradCall, ...] | CallGroup, ...]


#: What :meth:`StreamPool.run_parts` answers for one part: each call's (grad_x, None) or (None,
#: error), or a group's members' grad_x as one [B, N, H] array.
PartOutcome = list[tuple[np.ndarray | None, BaseException | None]] | np.ndarray


#: How long past its deadline a running call may take before its worker is written off and replaced.
#: A backend that honours ``timeout_s`` itself (the ascend one does) answers well within it.
ABANDON_GRACE_S = 2.0
#: How often a worker that cannot run calls asks its slot again, in seconds.
CAPACITY_POLL_S = 0.5


@dataclass(frozen=True)
class Timings:
    """Where one call's time went, in seconds (monotonic clock)."""

    queue_s: float
    compute_s: float


@dataclass(eq=False)
class _Job:
    call: MoeInitRoutingV2GradCall | _Parts | None  # None once settled
    deadline: float | None
    out: np.ndarray | None  # where the worker writes grad_x (None: the backend allocates); None once settled
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    worker: int = -1
    tenant: Hashable = None  # whose call it is: its lane of the fair queue
    state: str = "queued"  # queued -> running -> done | abandoned; queued -> cancelled
    lock: threading.Lock = field(default_factory=threading.Lock)
    unwanted: bool = False  # its caller went away while it ran: the parts not yet started are skipped

    def transition(self, old: str, new: str) -> bool:
        with self.lock:
            if self.state != old:
                return False
            self.state = new
            return True

    def settle(self, result: np.ndarray | None, error: BaseException | None) -> None:
        # Let go of the call before its answer is sent: its tensors view the request's receive
        # buffer, which is reused only once nothing else references it.
        self.call = self.out = None
        self.finished = time.monotonic()
        self.loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: np.ndarray | None, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class StreamPool:
    """A fixed set of worker threads over one backend, with a bounded queue in front.

    Args:
        backend: the device (or emulation); the pool closes it in :meth:`close`.
        streams: worker threads, each owning one backend slot made on its own thread.
        max_queue: calls admitted but not yet started, a tenant's, beyond which its new calls get DeviceBusy.
        retry_after_s: the retry hint, in seconds, that DeviceBusy carries.
        express_max_adds: the adds (N*K*H, or grad_expanded_x's elements when more) of the
            largest call the express worker takes; 0: no express worker.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        streams: int,
        max_queue: int,
        retry_after_s: float = 1.0,
        express_max_adds: int = 0,
    ) -> None:
        if streams < 1 or max_queue < 1 or express_max_adds < 0:
            raise ValueError(
                f"streams={streams} and max_queue={max_queue} must both be >= 1, "
                f"express_max_adds={express_max_adds} >= 0"
            )
        self.backend = backend
        self.streams = streams
        self.express_max_adds = express_max_adds
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._queue: FairQueue[Any] = FairQueue()
        self._lock = threading.Lock()
        self._queued = 0
        self._queued_by: collections.Counter[Hashable] = collections.Counter()
        self._running = 0
        self._threads: set[threading.Thread] = set()
        self._serial = 0
        self._admitting = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._pending: set[_Job] = set()
        self._capable: set[int] = set()  # indices of the workers that can run calls now (not the express one)
        self._closing = threading.Event()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start every worker and wait until each has opened its slot.

        Raises:
            DeviceFault: a worker could not open its slot (the first error is attached).
        """
        self._loop = asyncio.get_running_loop()
        slots = self.streams + (self.express_max_adds > 0)
        results = await asyncio.gather(*(asyncio.to_thread(self._spawn, i, timeout_s) for i in range(slots)))
        errors = [e for e in results if e is not None]
        if errors:
            await self.close(grace_s=0)
            raise DeviceFault(f"could not open {len(errors)} of {slots} backend workers: {errors[0]}") from errors[0]
        self._admitting = True

    def _spawn(self, index: int, timeout_s: float) -> BaseException | None:
        opened = threading.Event()
        outcome: list[BaseException | None] = [None]
        with self._lock:
            self._serial += 1
            name = f"moegrad-stream-{index}.{self._serial}"
        thread = threading.Thread(target=self._work, args=(index, opened, outcome), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        if not opened.wait(timeout_s):
            return DeviceFault(f"backend worker {index} did not open within {timeout_s} s")
        return outcome[0]

    def stop_admitting(self) -> None:
        """New calls get DeviceBusy from now on; admitted ones run to completion. Thread-safe."""
        with self._lock:
            self._admitting = False

    async def close(self, grace_s: float = 30.0) -> None:
        """Stop admitting, let admitted calls finish (up to ``grace_s`` seconds), stop the workers,
        then close the backend. Calls still queued after the grace period fail with DeviceBusy."""
        self.stop_admitting()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
        except TimeoutError:
            log.warning(
                "shutdown grace of %.1f s passed with %d queued, %d running", grace_s, self._queued, self._running
            )
        self._closing.set()  # a worker waiting for its capacity stops waiting
        with self._lock:
            threads = list(self._threads)
        for _ in threads:  # one each: express, so that the express worker can take one
            self._queue.put(_STOP, _STOP, express=True)
        await asyncio.to_thread(self._join, threads, max(grace_s, 1.0))
        for job in list(self._pending):  # anything that never got to run
            if job.transition("queued", "cancelled"):
                job._settle(None, DeviceBusy("the service is shutting down", retry_after_s=self.retry_after_s))
        await asyncio.to_thread(self.backend.close)

    @staticmethod
    def _join(threads: list[threading.Thread], timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))

    # --- state -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True while the pool admits calls (started, not closing) and at least one worker can run them."""
        return self._admitting and bool(self._capable)

    @property
    def capacity(self) -> int:
        """Workers that can run calls now (``streams`` when all can)."""
        return len(self._capable)

    @property
    def not_ready_reason(self) -> str | None:
        """Why the pool is not ready, in words (None when it is)."""
        if not self._admitting:
            return "the service is starting or shutting down"
        if not self._capable:
            return (
                f"none of the {self.streams} backend workers can run calls now (each is replaced or "
                "recovers on its own)"
            )
        return None

    @property
    def queue_depth(self) -> int:
        """Calls admitted and waiting for a worker."""
        return self._queued

    def queued_by(self, tenant: Hashable) -> int:
        """Calls of ``tenant`` admitted and waiting for a worker."""
        return self._queued_by[tenant]

    @property
    def in_flight(self) -> int:
        """Calls running on a worker now."""
        return self._running

    # --- the call path -----------------------------------------------------------------------------

    async def run(
        self,
        call: MoeInitRoutingV2GradCall,
        *,
        timeout_s: float | None,
        out: np.ndarray | None = None,
        tenant: Hashable = None,
    ) -> tuple[np.ndarray, Timings]:
        """Run a validated, non-empty call on the next free worker, in ``tenant``'s turn.

        Args:
            call: the validated call.
            timeout_s: seconds from now until the call's deadline (None: no deadline).
            tenant: whose call it is (a token's identity; None: no authentication): its lane of the
                fair queue, holding up to ``max_queue`` of its calls.
            out: a writeable C-contiguous [N, H] array of the call's dtype for the worker to write
                grad_x into (:meth:`BackendWorker.run`), or None. A call that times out may still
                be writing into it after this returns: the worker holds it until its job ends.

        Returns:
            (grad_x [N, H] in the call's dtype (``out`` when given), where the time went).

        Raises:
            DeviceBusy: not admitting, or ``max_queue`` calls of ``tenant`` already wait.
            DeadlineExceeded: the deadline passed while queued (the call never ran) or while running.
            InvalidArgument: the device's phase one rejected the call.
            DeviceFault: the backend failed; an unexpected exception is wrapped into one.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        job = _Job(call=call, deadline=deadline, out=out, loop=loop, future=loop.create_future(), tenant=tenant)
        with self._lock:
            if not self._admitting:
                raise DeviceBusy("the service is not ready or is shutting down", retry_after_s=self.retry_after_s)
            if not self._capable:
                raise DeviceBusy(
                    self.not_ready_reason or "the service has no worker that can run calls",
                    retry_after_s=self.retry_after_s,
                )
            if self._queued_by[tenant] >= self.max_queue:
                raise DeviceBusy(
                    f"the queue is full ({self.max_queue} calls waiting{'' if tenant is None else ' for this token'})",
                    retry_after_s=self.retry_after_s,
                )
            self._queued += 1
            self._queued_by[tenant] += 1
            self._pending.add(job)
            self._idle.clear()
        self._queue.put(job, tenant, express=0 < self._size(call) <= self.express_max_adds)
        # The deadline is a timer on the loop that settles the job's future itself (cheaper per call
        # than wait_for + shield, which wrap the future in two more).
        timer = None if timeout_s is None else loop.call_at(loop.time() + timeout_s, self._expire, job, timeout_s)
        try:
            result = await job.future
        except asyncio.CancelledError:
            if job.transition("queued", "cancelled"):  # the caller went away before its turn: costs nothing
                self._dequeued(job)
            else:  # running: a batch's share skips the parts it has not started
                job.unwanted = True
            del job  # see below
            raise
        except BaseException:
            # The job's future holds what is raised, and its traceback holds this frame: with the job
            # still in it, that would be a cycle keeping the call's tensors until the next collection.
            del job
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return result, Timings(
            queue_s=(job.started or job.enqueued) - job.enqueued,
            compute_s=(job.finished or job.enqueued) - (job.started or job.enqueued),
        )

    async def run_many(
        self,
        calls: Sequence[MoeInitRoutingV2GradCall],
        *,
        timeout_s: float | None,
        tenant: Hashable = None,
    ) -> tuple[list[tuple[np.ndarray | None, BaseException | None]], Timings]:
        """Run validated, non-empty calls one after another on the next free worker, as one queue entry.

        For many small calls (a batch): one hand-off to a worker thread for all of them, instead of
        one each. The calls share the deadline; each one's failure is its own.

        Returns:
            ([(grad_x, None) or (None, error)] in the calls' order, the whole run's timings).

        Raises:
            The errors of :meth:`run` that concern the whole run: DeviceBusy (not admitting, queue
            full) and DeadlineExceeded (the deadline passed before the run finished).
        """
        (outcomes,), timings = await self.run_parts([tuple(calls)], timeout_s=timeout_s, tenant=tenant)
        return cast(list[tuple[np.ndarray | None, BaseException | None]], outcomes), timings

    async def run_parts(
        self,
        parts: Sequence[Sequence[MoeInitRoutingV2GradCall] | CallGroup],
        *,
        timeout_s: float | None,
        tenant: Hashable = None,
    ) -> tuple[list[PartOutcome], Timings]:
        """Run a batch's share as one queue entry: each part a run of validated, non-empty calls (as
        :meth:`run_many` runs them) or a :class:`moegrad.CallGroup` (through the worker's
        :meth:`~BackendWorker.run_group` unless it declines: all members in one computation; else
        one member after another). However many parts, the batch takes one place in the queue.

        Returns:
            (one outcome per part, in order: for calls, [(grad_x, None) or (None, error)]; for a
            group, every member's grad_x as one [B, N, H] array, or that list when its members ran
            one by one; the whole run's timings).

        Raises:
            The errors of :meth:`run_many`.
        """
        work = _Parts(tuple(part if isinstance(part, CallGroup) else tuple(part) for part in parts))
        outcomes, timings = await self.run(work, timeout_s=timeout_s, tenant=tenant)  # type: ignore[arg-type]
        return cast(list[PartOutcome], outcomes), timings

    @staticmethod
    def _size(work: MoeInitRoutingV2GradCall | _Parts) -> int:
        """What the express threshold measures: a call's adds (N*K*H), or the elements of its
        grad_expanded_x when more (active or drop/pad mode: A or E*C rows, every one copied to the
        device); summed over every call of a batch's share (a group's members: B times its like's)."""
        if isinstance(work, _Parts):
            return sum(
                max(part.expanded_row_idx.size * part.like.hidden_size, part.grad_expanded_x.size)
                if isinstance(part, CallGroup)
                else sum(StreamPool._size(call) for call in part)
                for part in work.parts
            )
        return max(work.expanded_row_idx.size * work.hidden_size, work.grad_expanded_x.size)

    def _expire(self, job: _Job, timeout_s: float) -> None:
        """The call's deadline passed (on the loop): drop it if still queued, else give up on it."""
        if job.future.done():
            return
        if job.transition("queued", "cancelled"):
            self._dequeued(job)
            job.future.set_exception(
                DeadlineExceeded(f"the deadline of {timeout_s:.3f} s passed while the call was queued; it was not run")
            )
        elif job.state == "running":
            job.loop.call_later(ABANDON_GRACE_S, self._abandon, job)
            job.future.set_exception(
                DeadlineExceeded(f"the deadline of {timeout_s:.3f} s passed while the call was running")
            )
        # else it is done: its outcome is already on its way to the future

    def _dequeued(self, job: _Job) -> None:
        """``job``, cancelled while queued, leaves the queue (what waits behind it in its lane, an
        express worker may now take) and the counts."""
        self._queue.remove(job, job.tenant)
        with self._lock:
            self._count_out(job)
            self._pending.discard(job)
            self._check_idle()

    def _count_out(self, job: _Job) -> None:  # with self._lock held: ``job`` leaves the queue
        self._queued -= 1
        self._queued_by[job.tenant] -= 1
        if not self._queued_by[job.tenant]:
            del self._queued_by[job.tenant]

    def _check_idle(self) -> None:  # with self._lock held
        if self._queued == 0 and self._running == 0:
            self._loop.call_soon_threadsafe(self._idle.set)

    def _abandon(self, job: _Job) -> None:
        """A running call is far past its deadline: write its worker off and start a fresh one."""
        if job.transition("running", "abandoned"):
            log.error("a backend worker is stuck %.1f s past a deadline; replacing it", ABANDON_GRACE_S)
            with self._lock:
                self._running -= 1
                self._pending.discard(job)
                self._capable.discard(job.worker)  # lost until the replacement has opened
                self._check_idle()
            threading.Thread(target=self._spawn, args=(job.worker, 600.0), name="moegrad-respawn", daemon=True).start()

    # --- the worker thread -------------------------------------------------------------------------

    def _work(self, index: int, opened: threading.Event, outcome: list) -> None:
        me = threading.current_thread()
        try:
            worker = self.backend.open_worker(index)
            if not isinstance(worker, BackendWorker):  # every member is declared: none is probed later
                missing = [name for name in vars(BackendWorker) if name[0] != "_" and not hasattr(worker, name)]
                raise TypeError(
                    f"{type(worker).__name__} is not a BackendWorker (it lacks {', '.join(missing)}): "
                    "subclass moegrad_service.engine.BackendWorker for the optional members' defaults"
                )
        except BaseException as exc:  # reported to start()
            outcome[0] = exc
            with self._lock:
                self._threads.discard(me)
            opened.set()
            return
        express = index >= self.streams
        with self._lock:
            if not express:
                self._capable.add(index)
        opened.set()
        try:
            while True:
                if not self._wait_for_capacity(index, worker):
                    return
                job = self._queue.get(express=express)
                if job is _STOP:
                    return
                if not job.transition("queued", "running"):
                    job = None  # cancelled while queued, already accounted for: wait holding nothing of it
                    continue
                job.started, job.worker = time.monotonic(), index
                with self._lock:
                    self._count_out(job)
                    self._running += 1
                result, error = self._execute(worker, job)
                if job.transition("running", "done"):
                    with self._lock:
                        self._running -= 1
                        self._pending.discard(job)
                        self._check_idle()
                    job.settle(result, error)
                else:  # abandoned: a replacement thread already took this slot
                    job.settle(result, error)
                    return
                # Drop this call before waiting for the next: an idle worker must not keep the last
                # call's tensors and result alive (they can be GiBs).
                job = result = error = None
        finally:
            with self._lock:
                self._threads.discard(me)
            try:
                worker.close()
            except Exception:
                log.exception("closing backend worker %d failed", index)

    def _wait_for_capacity(self, index: int, worker: BackendWorker) -> bool:
        """Return once ``worker`` can run calls (True), or when the pool closes first (False)."""
        if self._accepts(worker):
            return True
        counted = index < self.streams  # the express worker is not part of the capacity
        with self._lock:
            self._capable.discard(index)
        log.error(
            "backend worker %d cannot run calls now; %d of %d workers can", index, len(self._capable), self.streams
        )
        while not self._closing.wait(CAPACITY_POLL_S):
            if self._accepts(worker):
                if counted:
                    with self._lock:
                        self._capable.add(index)
                log.warning("backend worker %d runs calls again", index)
                return True
        return False

    @staticmethod
    def _accepts(worker: BackendWorker) -> bool:
        try:
            return bool(worker.accepts_calls())
        except Exception:  # a slot that cannot even answer this cannot run calls
            log.exception("asking a backend worker whether it can run calls failed")
            return False

    @staticmethod
    def _execute(worker: BackendWorker, job: _Job) -> tuple[Any, BaseException | None]:
        work = job.call
        assert work is not None  # only a settled job has let go of its call
        if isinstance(work, _Parts):  # run_parts: each part's own outcome, in order
            outcomes: list[PartOutcome] = []
            for part in work.parts:  # the deadline is checked before each part, as is the caller
                if job.unwanted:
                    gone = DeadlineExceeded("the caller went away before this call ran; it was not run")
                    outcomes.append([(None, gone)] * len(part))
                else:
                    outcomes.append(StreamPool._execute_part(worker, part, job.deadline))
            return outcomes, None
        return StreamPool._execute_one(worker, work, job.deadline, job.out)

    @staticmethod
    def _execute_part(
        worker: BackendWorker, part: tuple[MoeInitRoutingV2GradCall, ...] | CallGroup, deadline: float | None
    ) -> PartOutcome:
        if isinstance(part, CallGroup):
            stacked = StreamPool._execute_group(worker, part, deadline)
            if stacked is not None:
                return stacked
            return [StreamPool._execute_one(worker, part.call(member), deadline) for member in range(len(part))]
        together = StreamPool._execute_together(worker, part, deadline)
        if together is not None:
            return together
        return [StreamPool._execute_one(worker, call, deadline) for call in part]

    @staticmethod
    def _execute_together(
        worker: BackendWorker, calls: tuple[MoeInitRoutingV2GradCall, ...], deadline: float | None
    ) -> list[tuple[np.ndarray | None, BaseException | None]] | None:
        """The calls through the worker's :meth:`~BackendWorker.run_many` (all of them at once), or
        None: the worker declines (the default), it raised, or the deadline passed, and each call then
        runs on its own so that each gets its own answer."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        try:
            results = worker.run_many(calls, timeout_s=remaining)
        except Exception:
            log.exception("the backend's run_many failed; running the calls one by one")
            return None
        return None if results is None else [(grad_x, None) for grad_x in results]

    @staticmethod
    def _execute_group(worker: BackendWorker, group: CallGroup, deadline: float | None) -> np.ndarray | None:
        """The group through the worker's :meth:`~BackendWorker.run_group`, or None (it declines, the
        default, or raises, or the deadline passed): then each member runs on its own and gets its
        own answer."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        try:
            return worker.run_group(group, timeout_s=remaining)
        except Exception:
            log.exception("the backend's run_group failed; running the members one by one")
            return None

    @staticmethod
    def _execute_one(
        worker: BackendWorker, call: MoeInitRoutingV2GradCall, deadline: float | None, out: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, BaseException | None]:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None, DeadlineExceeded("the deadline passed while the call was queued; it was not run")
        try:
            if out is None:
                return worker.run(call, timeout_s=remaining), None
            return worker.run(call, timeout_s=remaining, out=out), None
        except (InvalidArgument, DeadlineExceeded, DeviceFault, DeviceBusy) as exc:
            return None, exc.with_traceback(None)  # an answer: its frames (and the call's tensors) may go
        except MoegradError as exc:
            return None, DeviceFault(str(exc))
        except Exception as exc:  # a backend bug is a device fault, never a crash
            log.exception("backend raised an unexpected error")
            return None, DeviceFault(f"{type(exc).__name__}: {exc}")
