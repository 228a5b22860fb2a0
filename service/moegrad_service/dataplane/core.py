"""The dataplane: what every protocol shares, with no HTTP in it.

The protocol endpoints (``api/``: v1 msgpack and compare, v2 over HTTP and gRPC) admit a request
(:meth:`DataPlane.admit`), decode it into a validated call, hand the call to the
:class:`DataPlane`, and encode what it answers. The dataplane checks the profile a call names
(:func:`moegrad.operator.names_profile`) against its backend, runs the call through the
:class:`~moegrad_service.engine.StreamPool` (a large grad_x into a buffer its caller lends, a
:class:`ResultLender`), answers empty calls without the device, computes the compare report and
the explanation, reports health and metadata, and observes the engine's metrics. It speaks
:mod:`moegrad`'s arrays, calls and domain errors only, so a new protocol is a new decoder and
encoder around the same methods::

    api/v1 ───┐                          ┌─> StreamPool ─> Backend (reference | ascend)
    api/v2 ───┼─> DataPlane (this) ──────┼─> JudgePool ─> moegrad.compare, moegrad.explain (float64 golden)
    api/grpc ─┘                          └─> memory.Memory (budget, buffers: the admissions)

Every call and every judging carries its tenant (a bearer token's identity, or None): the pool's
and the judges' queues take the tenants' work in turn, and each tenant may queue ``max_queue``
calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from moegrad import (
    MAX_BATCH_CALLS,
    PROFILES,
    AclnnStatus,
    CallGroup,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MoegradError,
    MoeInitRoutingV2GradCall,
    __version__,
)
from moegrad.operator import names_profile
from moegrad_service.dataplane.batching import Part, plan_batch
from moegrad_service.dataplane.judging import explain_candidate, judge, judge_each
from moegrad_service.dataplane.records import (
    BatchAnswer,
    BatchItem,
    ClientDisconnected,
    CompareOutcome,
    Comparison,
    ExplainOutcome,
    ExplainRequest,
    GradOutcome,
    GroupMember,
    GroupOutcome,
    MemberOutcome,
    ResultLender,
)
from moegrad_service.dataplane.statistics import InferenceStatistics
from moegrad_service.engine import JudgePool, StreamPool, Timings
from moegrad_service.memory import Admission, Memory
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = ["HEALTH_CHECK_TIMEOUT_S", "DataPlane"]

T = TypeVar("T")
#: Longest a readiness check waits for the backend's health check, in seconds.
HEALTH_CHECK_TIMEOUT_S = 5.0


class DataPlane:
    """Runs validated calls for every protocol endpoint.

    Args:
        settings: the service's configuration (limits, default order).
        pool: the stream pool over the opened backend.
        metrics: the app's metrics; queue and compute durations are observed here.
        memory: the service's memory (built by the app); None: one of ``settings``' sizes, with
            heap trims when made on the event loop.

    Attributes:
        judges: the threads that judge comparisons (``judge_workers``), started at the first
            judging; the app closes them (:meth:`close`).
    """

    def __init__(self, settings: Settings, pool: StreamPool, metrics: Metrics, memory: Memory | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.judges = JudgePool(settings.judge_workers)
        self.statistics = InferenceStatistics()
        if memory is None:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:  # made off the event loop (a test): no heap trims
                loop = None
            memory = Memory(
                settings.max_inflight_bytes,
                retry_after_s=settings.retry_after_s,
                keep_s=settings.receive_keep_s,
                loop=loop,
            )
        self.memory = memory

    def admit(
        self,
        body_bytes: int | None = None,
        *,
        per_byte: int | None = None,
        extra_bytes: int = 0,
        tenant: str | None = None,
    ) -> Admission:
        """Admit a request before its body is read: refused now when the pool could not take its
        call anyway, else what its body holds is reserved of the in-flight budget
        (:meth:`moegrad_service.memory.Memory.admit`: ``per_byte`` times ``body_bytes`` and
        ``extra_bytes``, or as the body arrives when None). Once decoded, the request is topped up
        to what its shapes hold (:meth:`Admission.cover`). Release the admission once the answer is
        sent.

        Args:
            tenant: whose request it is (a bearer token's identity; None without authentication):
                its share of the queue is checked, and its calls wait in its lane.

        Raises:
            DeviceBusy: (503 + Retry-After) not admitting (starting, draining), no worker can run
                calls, the tenant's queue is full, or the body does not fit the in-flight budget now.
            PayloadTooLarge: (413) the body could never fit the in-flight budget.
        """
        pool = self.pool
        if not pool.ready:
            raise DeviceBusy(pool.not_ready_reason or "the service is not ready", retry_after_s=pool.retry_after_s)
        if pool.queued_by(tenant) >= pool.max_queue:
            mine = "" if tenant is None else " for this token"
            raise DeviceBusy(
                f"the queue is full ({pool.max_queue} calls waiting{mine})", retry_after_s=pool.retry_after_s
            )
        return self.memory.admit(body_bytes, per_byte=per_byte, extra_bytes=extra_bytes, tenant=tenant)

    async def close(self) -> None:
        """Stop the judges (the app calls this after the pool has closed)."""
        await self.judges.close()

    @property
    def queue_depth(self) -> int:
        """Work admitted and waiting: calls for a worker, comparisons for a judge (the gauge
        ``moegrad_inference_pending_request_count``)."""
        return self.pool.queue_depth + self.judges.queue_depth

    @property
    def in_flight(self) -> int:
        """Work running: calls on a worker, comparisons being judged (``moegrad_inference_exec_count``)."""
        return self.pool.in_flight + self.judges.in_flight

    @property
    def backend_name(self) -> str:
        return self.pool.backend.name

    @property
    def device(self) -> str | None:
        return self.pool.backend.device

    @property
    def emulation(self) -> bool:
        """True when the backend emulates (the reference backend computes whichever order a call names)."""
        return self.backend_name == "reference"

    @property
    def device_order(self) -> str | None:
        """The device profile the device computes (its chip and CANN release, canonical name), or
        None: the emulation, or a device whose profile moegrad does not know."""
        return None if self.emulation else self.pool.backend.order

    @property
    def default_order(self) -> str:
        """The profile of calls that name none: the device's own where it is known, else
        ``settings.order``."""
        return self.device_order or self.settings.order

    def _check_order(self, call: MoeInitRoutingV2GradCall) -> None:
        """Refuse, before anything runs, a call that names a profile its device does not compute
        (:func:`moegrad.operator.names_profile`; a call that names none carries :attr:`default_order`).

        Raises:
            InvalidArgument: (161002, field ``order``) on a device, a profile other than its own
                (another chip, or another CANN release), or any profile on a device whose profile
                is unknown; the emulation (reference backend) takes every profile.
        """
        if self.emulation or not names_profile(call):
            return
        named = call.order  # the profile's canonical name, whichever of its names the call gave
        device = self.device or self.backend_name
        if self.device_order is None:
            raise InvalidArgument(
                f"order={named!r}: {device} is a device whose profile (chip and CANN release) moegrad does "
                "not know; leave order unnamed (the reply then says order 'unknown'), or call a server with "
                "backend=reference for an emulated profile",
                aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
                field="order",
            )
        if named != self.device_order:
            raise InvalidArgument(
                f"order={named!r}: {device} computes {self.device_order!r}; leave order unnamed or name "
                f"{self.device_order!r}, or call a server with backend=reference for the {named!r} emulation",
                aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
                field="order",
            )

    @property
    def answer_order(self) -> str | None:
        """The profile a device's results follow (``"unknown"`` on a device whose profile is
        unknown); None on the emulation, whose results follow each call's (canonical) order."""
        return None if self.emulation else (self.device_order or "unknown")

    # --- calls ---------------------------------------------------------------------------------

    async def infer(
        self,
        call: MoeInitRoutingV2GradCall,
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
        received_s: float | None = None,
        lender: ResultLender | None = None,
        tenant: str | None = None,
    ) -> GradOutcome:
        """grad_x for a validated call: an empty one (N = 0 or H = 0) is answered at once, the rest
        run on the pool. Every call that passes the order check is counted in :attr:`statistics`.

        Args:
            call: the validated call; one that names no profile carries :attr:`default_order`.
            timeout_s: seconds from now until the call's deadline.
            disconnected: a coroutine function that returns once the caller has gone (an HTTP
                disconnect); a call still queued then is dropped unrun and a running one's result
                discarded.
            received_s: the ``time.perf_counter()`` reading when the call's request arrived, or
                None (the statistics then start the call here).
            lender: lends the buffer grad_x is written into (the request's admission lends one
                for a grad_x of REUSE_MIN_BYTES or more: :meth:`Admission.result_buffer`), and is
                told once the worker has let go of it; None: the backend allocates grad_x.
            tenant: whose call it is (its lane of the pool's fair queue); None: no authentication.

        Raises:
            InvalidArgument: (161002, field ``order``) the call names a profile its device does not compute.
            DeviceBusy: (503) the queue is full or the service is not ready.
            DeadlineExceeded: (504) the deadline passed.
            InvalidArgument: the device's phase one rejected the call (its aclnn code).
            DeviceFault: the device failed.
            ClientDisconnected: ``disconnected`` returned first.
        """
        self._check_order(call)
        entered = time.perf_counter()
        received = entered if received_s is None else min(received_s, entered)
        try:
            if call.num_tokens == 0 or call.hidden_size == 0:  # the documentation allows empty tensors
                grad_x = np.zeros((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype)
                timings = Timings(0.0, 0.0)
            else:
                out = None
                if lender is not None:
                    dtype = call.grad_expanded_x.dtype.newbyteorder("=")
                    out = lender.result_buffer((call.num_tokens, call.hidden_size), dtype)
                run = self.pool.run(call, timeout_s=timeout_s, out=out, tenant=tenant)
                grad_x, timings = await (run if disconnected is None else _unless(disconnected, run))
                if lender is not None:
                    lender.result_written()
                self.metrics.queue_duration.observe(timings.queue_s)
                self.metrics.compute_duration.observe(timings.compute_s)
            computed = time.perf_counter()
            outcome = self._outcome(call, grad_x, timings)
        except BaseException:
            self.statistics.fail.add(time.perf_counter() - received)
            raise
        self.statistics.count_success(received, entered, computed, timings)
        return outcome

    def _outcome(self, call: MoeInitRoutingV2GradCall, grad_x: np.ndarray, timings: Timings) -> GradOutcome:
        return GradOutcome(grad_x, timings, self.backend_name, self.answer_order or call.order, self.device)

    async def compare(
        self,
        comparison: Comparison,
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
        tenant: str | None = None,
    ) -> CompareOutcome:
        """Run the call on the pool, then judge the candidate against its result and the float64
        golden on the judges (:class:`~moegrad_service.engine.JudgePool`: CPU work in float64, in
        the tenant's turn), both within the one deadline.

        Once ``disconnected`` returns, a call or a judging still queued is dropped unrun and a
        running judging stopped at its next block of rows (its memory freed), then
        ClientDisconnected is raised; at the deadline the same, with DeadlineExceeded.

        Raises:
            The errors of :meth:`infer` (the order check is of ``comparison.call``).
        """
        self._check_order(comparison.call)
        deadline = asyncio.get_running_loop().time() + timeout_s
        work = self._compare(comparison, deadline, tenant)
        return await (work if disconnected is None else _unless(disconnected, work))

    async def _compare(self, comparison: Comparison, deadline: float, tenant: str | None) -> CompareOutcome:
        loop = asyncio.get_running_loop()
        grad = await self.infer(comparison.call, timeout_s=_seconds_until(deadline, loop), tenant=tenant)
        judging = partial(judge, comparison, grad.grad_x, alone=self.judges.alone)
        report, golden_s, compare_s = await self.judges.run(
            judging, timeout_s=_seconds_until(deadline, loop), tenant=tenant
        )
        return CompareOutcome(grad, report, golden_s, compare_s)

    async def explain(
        self,
        request: ExplainRequest,
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
        tenant: str | None = None,
    ) -> ExplainOutcome:
        """Run the call on the pool, then explain the candidate's rows that differ from its result
        (:func:`moegrad.explain`, against the profile that computed it) on the judges, in the
        tenant's turn, both within the one deadline: as :meth:`compare` (a client gone or the
        deadline passed drops the explanation unrun or stops it within its next few rows).

        Raises:
            The errors of :meth:`infer` (the order check is of ``request.call``).
        """
        self._check_order(request.call)
        deadline = asyncio.get_running_loop().time() + timeout_s
        work = self._explain(request, deadline, tenant)
        return await (work if disconnected is None else _unless(disconnected, work))

    async def _explain(self, request: ExplainRequest, deadline: float, tenant: str | None) -> ExplainOutcome:
        loop = asyncio.get_running_loop()
        grad = await self.infer(request.call, timeout_s=_seconds_until(deadline, loop), tenant=tenant)
        profile = grad.order if grad.order in PROFILES else None  # a device moegrad does not know: the call's
        explanation, explain_s = await self.judges.run(
            partial(explain_candidate, request, grad.grad_x, profile),
            timeout_s=_seconds_until(deadline, loop),
            tenant=tenant,
            verb="explained",
        )
        return ExplainOutcome(grad, explanation, explain_s)

    async def infer_batch(
        self,
        items: Sequence[BatchItem],
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
        tenant: str | None = None,
    ) -> list[BatchAnswer]:
        """Run a batch of independent calls and comparisons; answer each in order, alone.

        The profile each item names is checked first (a refused item answers its InvalidArgument and is
        not counted in :attr:`statistics`). The rest run as
        :func:`~moegrad_service.dataplane.batching.plan_batch` plans them: on the pool in one share
        per worker (:meth:`StreamPool.run_parts`: one queue entry and one hand-off each, however
        many calls and groups, and never more shares than the queue holds, so a batch alone is never
        refused for its own size; a group's chunk in one computation where the backend can), all
        under the batch's one deadline; then the comparisons are judged, one after another, as one
        judging of the judges' queue (each comparison the deadline leaves unjudged answers
        DeadlineExceeded). A call that fails gets its own error in its place; its neighbours are
        unaffected (a share the pool refuses or that runs out of time answers that error for each
        of its calls).

        Args:
            items: validated calls (:meth:`infer`), members of validated groups, validated
                comparisons (:meth:`compare`), or the error an item already earned while it was
                decoded (passed through in place).
            timeout_s: seconds from now until the batch's deadline.
            disconnected: as for :meth:`infer`: once it returns, the shares still queued are
                dropped unrun, the running ones' results discarded, the judging dropped or stopped,
                and ClientDisconnected raised.
            tenant: whose batch it is: its shares and its judging wait in its lanes.

        Returns:
            One entry per item, in order: a GradOutcome, a MemberOutcome (a group member's), a
            CompareOutcome, or the exception (MoegradError: DeviceBusy, DeadlineExceeded,
            InvalidArgument, DeviceFault ...) that item alone raised, without its traceback: a
            caught exception kept in a list that its own traceback's frames reach is a reference
            cycle, which would hold the batch's tensors until the garbage collector next runs (an
            idle server may not run it for a long time).

        Raises:
            ClientDisconnected: ``disconnected`` returned first.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        answers: list[Any] = [self._order_refusal(item) or item for item in items]  # each place, filled in
        workers = max(1, min(self.settings.streams, self.pool.max_queue))  # a batch alone always fits the queue
        plan = plan_batch(answers, workers=workers)
        for index, call in plan.empty:
            answers[index] = self._outcome(
                call, np.zeros((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype), Timings(0.0, 0.0)
            )
        work = self._run_batch(plan.shares, plan.comparisons, answers, deadline, tenant)
        await (work if disconnected is None else _unless(disconnected, work))
        return answers

    async def _run_batch(
        self,
        shares: list[list[Part]],
        comparisons: list[tuple[int, Comparison]],
        answers: list[Any],
        deadline: float,
        tenant: str | None,
    ) -> None:
        await asyncio.gather(*(self._run_share(share, answers, deadline, tenant) for share in shares))
        judged = [
            (index, comparison, answers[index])
            for index, comparison in comparisons
            if type(answers[index]) is GradOutcome
        ]
        if not judged:
            return
        done: dict[int, Any] = {}  # written by the judging thread, one answer at a time
        loop = asyncio.get_running_loop()
        try:
            await self.judges.run(
                partial(judge_each, judged, done, alone=self.judges.alone),
                timeout_s=_seconds_until(deadline, loop),
                tenant=tenant,
            )
        except DeadlineExceeded as exc:
            exc.with_traceback(None)  # kept as an answer: see infer_batch's Returns
            finished = dict(done)  # what was judged before the deadline
            for index, _, _ in judged:
                answers[index] = finished.get(index, exc)
            return
        for index, answer in done.items():
            answers[index] = answer

    def _order_refusal(self, item: BatchItem) -> InvalidArgument | None:
        """The refusal of a batch item that names a profile its device does not compute, else None."""
        if isinstance(item, BaseException):
            return None
        call = item.group.like if isinstance(item, GroupMember) else item.call if isinstance(item, Comparison) else item
        try:
            self._check_order(call)
        except InvalidArgument as exc:
            return exc.with_traceback(None)  # kept as an answer: see infer_batch's Returns
        return None

    async def _run_share(self, share: list[Part], answers: list[Any], deadline: float, tenant: str | None) -> None:
        """One worker's share of a batch: runs of calls and chunks of groups, one queue entry; each
        call's answer goes to its place in ``answers``."""
        loop = asyncio.get_running_loop()
        entered = time.perf_counter()
        try:
            outcomes, timings = await self.pool.run_parts(
                [part.work for part in share], timeout_s=max(deadline - loop.time(), 1e-6), tenant=tenant
            )
        except MoegradError as exc:  # the whole share was refused or timed out: each of its calls says so
            exc.with_traceback(None)  # kept as an answer: see infer_batch's Returns
            refused = [index for part in share for index in part.places]
            for index in refused:
                answers[index] = exc
            self.statistics.fail.add(time.perf_counter() - entered, len(refused))
            return
        computed = time.perf_counter()
        self.metrics.queue_duration.observe(timings.queue_s)
        self.metrics.compute_duration.observe(timings.compute_s)
        each = Timings(timings.queue_s, timings.compute_s / sum(len(part.places) for part in share))
        for (work, places), outcome in zip(share, outcomes, strict=True):
            if isinstance(outcome, np.ndarray):  # a group's members, run as one
                assert isinstance(work, CallGroup)
                together = GroupOutcome(
                    outcome, each, self.backend_name, self.answer_order or work.like.order, self.device
                )
                for member, index in enumerate(places):
                    answers[index] = MemberOutcome(together, member)
                self.statistics.count_success(entered, entered, computed, each, len(places))
                continue
            # each call's own answer, from a part whose calls ran one by one
            calls = [work.like] * len(places) if isinstance(work, CallGroup) else work
            failed = 0
            for index, call, (grad_x, error) in zip(places, calls, outcome, strict=True):
                if error is not None:
                    answers[index] = error
                    failed += 1
                else:
                    assert grad_x is not None
                    answers[index] = self._outcome(call, grad_x, each)
            if failed:
                self.statistics.fail.add(computed - entered, failed)
            if failed < len(places):
                self.statistics.count_success(entered, entered, computed, each, len(places) - failed)

    # --- health and metadata ---------------------------------------------------------------------

    async def check_ready(self) -> None:
        """Return when the pool admits calls and the backend's health check passes.

        Raises:
            DeviceBusy: (503) not admitting, the check failed, or it took over HEALTH_CHECK_TIMEOUT_S.
        """
        pool = self.pool
        if not pool.ready:
            raise DeviceBusy(pool.not_ready_reason or "the service is not ready", retry_after_s=pool.retry_after_s)
        try:
            await asyncio.wait_for(asyncio.to_thread(pool.backend.check_health), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise DeviceBusy(
                f"the backend's health check took over {HEALTH_CHECK_TIMEOUT_S} s", retry_after_s=pool.retry_after_s
            ) from None
        except DeviceFault as exc:
            raise DeviceBusy(f"the backend is unhealthy: {exc}", retry_after_s=pool.retry_after_s) from None

    def info(self) -> dict[str, Any]:
        """Version, backend, device, default order and limits (sizes in bytes, times in seconds)."""
        settings = self.settings
        return {
            "version": __version__,
            "backend": self.backend_name,
            "device": self.device,
            "order": self.default_order,
            "device_order": self.answer_order,
            "streams": settings.streams,
            "max_queue": settings.max_queue,
            "max_body_bytes": settings.max_body_bytes,
            "max_elements": settings.max_elements,
            "request_timeout_s": settings.request_timeout_s,
            "wire_formats": ["msgpack", "frames"],
            "max_batch_calls": MAX_BATCH_CALLS,
        }


def _seconds_until(deadline: float, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds from now to ``deadline`` (loop time), at least a microsecond: a deadline already
    past times the work out at once rather than never."""
    return max(deadline - loop.time(), 1e-6)


async def _unless(gone: Callable[[], Awaitable[object]], work: Awaitable[T]) -> T:
    """Await ``work`` unless ``gone()`` returns first; then cancel it and raise ClientDisconnected.

    One watcher task per call, which cancels this task when ``gone()`` returns; ``work`` is awaited
    in place (a task of its own plus asyncio.wait cost more server CPU per small call than the
    call's compute).
    """
    current = asyncio.current_task()
    assert current is not None
    watcher = asyncio.get_running_loop().create_task(_cancel_after(gone, current))
    try:
        return await work
    except asyncio.CancelledError:
        if not (watcher.done() and not watcher.cancelled() and watcher.exception() is None):
            raise  # cancelled for another reason (e.g. shutdown)
        current.uncancel()
        raise ClientDisconnected("the client disconnected before its result was ready") from None
    finally:
        watcher.cancel()


async def _cancel_after(gone: Callable[[], Awaitable[object]], task: asyncio.Task) -> None:
    await gone()
    task.cancel()
