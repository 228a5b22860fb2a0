"""The dataplane: what every protocol shares, with no HTTP in it.

The protocol endpoints (``api/``: v1 msgpack, compare, v2 HTTP) decode a request into a validated
call, hand it to the :class:`DataPlane`, and encode what it answers. The dataplane runs the call
through the :class:`~moegrad_service.engine.StreamPool`, answers empty calls without the device,
computes the compare report, reports health and metadata, and observes the engine's metrics. It
speaks :mod:`moegrad`'s arrays, calls and domain errors only, so a new protocol is a new decoder
and encoder around the same methods::

    api/v1.py ─┐                         ┌─> StreamPool ─> Backend (reference | ascend)
    api/compare.py ─┼─> DataPlane (this) ─┤
    api/v2 ───┘                         └─> moegrad.compare (float64 golden, standards)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from moegrad import (
    MAX_BATCH_CALLS,
    AclnnStatus,
    CallGroup,
    ComparisonReport,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MoegradError,
    MoeInitRoutingV2GradCall,
    PayloadTooLarge,
    __version__,
    check_compare_arguments,
    compare,
)
from moegrad_service.buffers import ReceiveBuffers
from moegrad_service.engine import StreamPool, Timings
from moegrad_service.heap import HeapTrimmer
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = [
    "ClientDisconnected",
    "CompareOutcome",
    "Comparison",
    "DataPlane",
    "Duration",
    "GradOutcome",
    "GroupMember",
    "GroupOutcome",
    "InferenceStatistics",
    "MemberOutcome",
    "MemoryBudget",
]

T = TypeVar("T")
#: The fewest grad calls a batch hands to one worker at once (fewer only when the batch has fewer).
BATCH_CHUNK_CALLS = 16
#: The most calls, and input bytes, of one part of a batch's share: a worker checks the deadline
#: (and whether the caller is still there) before each part, so a batch past its deadline stops
#: within about one part's compute instead of running to its end.
BATCH_PART_CALLS = 64
BATCH_PART_BYTES = 4 << 20
#: Longest a readiness check waits for the backend's health check, in seconds.
HEALTH_CHECK_TIMEOUT_S = 5.0


class ClientDisconnected(MoegradError):
    """The caller went away before its answer was ready (logged as 499; nobody reads the answer)."""


class MemoryBudget:
    """The bytes that admitted requests may hold at once, in bytes.

    A request's body holds twice its bytes (:meth:`reserve_body`): the body itself, and as much
    again for its answer (grad_x and grad_x's encoding, each N x H elements: together the body's
    size for a dropless call with top_k 2, less for a larger top_k). It is reserved before the body
    is read (Content-Length) or as it arrives (chunked), and given back once the answer is sent.
    The last eighth of the budget is kept for small reservations (up to SMALL_BYTES each): clients
    holding large bodies, even slow or stalled ones, cannot keep a small call out. Spare room may
    hold buffers kept for reuse (:meth:`hold_spare`, moegrad_service.buffers); a reservation that
    finds no room has ``reclaim`` give them up first. Every release is also told to ``released``
    (the service's heap trimmer, moegrad_service.heap). Thread-safe.

    Args:
        limit_bytes: the budget.
        retry_after_s: the retry hint of the DeviceBusy a refusal raises.
    """

    #: What a request holds per byte of its body: the body, and as much again for its answer.
    HOLD_PER_BODY_BYTE = 2
    #: What a batch holds per byte of its body: the body, its calls decoded (msgpack copies each
    #: tensor's bytes out), their results and the reply packed from them (measured: 4.5 for calls
    #: with top_k 1, whose grad_x is as large as their input).
    BATCH_HOLD_PER_BODY_BYTE = 5
    #: A reservation up to this size (a body up to 1 MiB) may use the part of the budget kept for small ones.
    SMALL_BYTES = 2 << 20

    def __init__(self, limit_bytes: int, *, retry_after_s: float = 1.0) -> None:
        self.limit_bytes = limit_bytes
        self._large_limit = limit_bytes - limit_bytes // 8
        self.retry_after_s = retry_after_s
        self._held = 0
        self._lock = threading.Lock()
        #: ``reclaim(nbytes) -> bytes released``: gives up buffers held with hold_spare.
        self.reclaim: Callable[[int], int] | None = None
        #: ``released(nbytes)``: told of every release, on the releasing thread (moegrad_service.heap).
        self.released: Callable[[int], None] | None = None

    @property
    def held_bytes(self) -> int:
        return self._held

    def ceiling(self, nbytes: int) -> int:
        """The most a reservation of ``nbytes`` may find held, itself included: the whole budget for
        a small one, seven eighths for a larger one."""
        return self.limit_bytes if nbytes <= self.SMALL_BYTES else self._large_limit

    def reserve_body(self, body_bytes: int, *, so_far: int = 0, per_byte: int | None = None) -> int:
        """Reserve what a body of ``body_bytes`` holds until its answer is sent (``per_byte`` times
        its size, default HOLD_PER_BODY_BYTE; a batch's BATCH_HOLD_PER_BODY_BYTE); returns the
        bytes reserved, to give back with :meth:`release`.

        ``so_far``: the bytes of the same body already reserved (a body without Content-Length is
        reserved chunk by chunk as it arrives); the limits apply to the whole body so far, so a
        chunked body is as large a call as a declared one of its size.

        Raises:
            PayloadTooLarge: (413) the body could never fit, even with nothing else held.
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        per_byte = per_byte or self.HOLD_PER_BODY_BYTE
        held = body_bytes * per_byte
        whole = (so_far + body_bytes) * per_byte
        ceiling = self.ceiling(whole)
        if whole > ceiling:
            share = "all" if ceiling == self.limit_bytes else "seven eighths"
            what = (
                "the body, and as much again for grad_x"
                if per_byte == self.HOLD_PER_BODY_BYTE
                else f"{per_byte} times the body: its calls decoded, their results and the reply"
            )
            raise PayloadTooLarge(
                f"a body of {so_far + body_bytes} bytes holds {whole} bytes while it is answered ({what}), over "
                f"the {ceiling} bytes ({share} of the service's in-flight budget of {self.limit_bytes} bytes, "
                "max_inflight_bytes) that one request may take; send smaller calls or batches, "
                "or raise max_inflight_bytes"
            )
        self.reserve(held, whole=whole)
        return held

    def reserve(self, nbytes: int, *, whole: int | None = None) -> None:
        """Take ``nbytes`` from the budget; ``whole``: what the request holds with them (the share of
        the budget it may take, :meth:`ceiling`, is decided by that), ``nbytes`` when None.

        Raises:
            PayloadTooLarge: (413) ``nbytes`` could never fit (over :meth:`ceiling`).
            DeviceBusy: (503 + Retry-After) it does not fit now, beside what others hold.
        """
        limit = self.ceiling(nbytes if whole is None else whole)
        if nbytes > limit:
            raise PayloadTooLarge(
                f"the request needs {nbytes} bytes, over the {limit} a call may take of the service's "
                f"in-flight budget of {self.limit_bytes} bytes (max_inflight_bytes); send smaller calls"
            )
        for first in (True, False):
            with self._lock:
                if self._held + nbytes <= limit:
                    self._held += nbytes
                    return
                shortfall, held = self._held + nbytes - limit, self._held
            if not (first and self.reclaim is not None and self.reclaim(shortfall)):
                raise DeviceBusy(
                    f"the service holds {held} of its {self.limit_bytes} in-flight bytes; retry later",
                    retry_after_s=self.retry_after_s,
                )

    def hold_spare(self, nbytes: int) -> bool:
        """Take ``nbytes`` for a kept buffer if they fit now within seven eighths of the budget
        (never the part kept for small calls); False, taking nothing, when they do not."""
        with self._lock:
            if self._held + nbytes > self._large_limit:
                return False
            self._held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken by :meth:`reserve` or :meth:`hold_spare`."""
        with self._lock:
            self._held -= nbytes
        if self.released is not None:
            self.released(nbytes)


@dataclass(frozen=True)
class GradOutcome:
    """One call's answer.

    Attributes:
        grad_x: [N, H], the dtype of the call's grad_expanded_x, C-contiguous, owned by the caller.
        timings: seconds queued and computing (zero for an empty call, which never reaches a worker).
        backend: the backend's name (``"reference"`` or ``"ascend"``).
        order: the accumulation order the result follows (``"unknown"`` from a chip whose order
            moegrad does not know).
        device: the device that computed it (``"Ascend910B3 #0"``), or None for the CPU emulation.
    """

    grad_x: np.ndarray
    timings: Timings
    backend: str
    order: str
    device: str | None


class GroupMember(NamedTuple):
    """One call of a batch, validated with the others of its shape: member ``member`` of ``group``
    (:class:`moegrad.CallGroup`), run with them by :meth:`DataPlane.infer_batch`."""

    group: CallGroup
    member: int


@dataclass(frozen=True)
class GroupOutcome:
    """The answer of group members run together, all of them successfully.

    Attributes:
        grad_x: [B, N, H], the members' dtype, C-contiguous: member b's grad_x is ``grad_x[b]``.
        timings: each member's share: the run's seconds queued, and its compute seconds over B.
        backend, order, device: as :class:`GradOutcome`'s, the same for every member.
    """

    grad_x: np.ndarray
    timings: Timings
    backend: str
    order: str
    device: str | None


class MemberOutcome(NamedTuple):
    """One batch call's answer as member ``member`` of a :class:`GroupOutcome`."""

    outcome: GroupOutcome
    member: int


@dataclass(frozen=True)
class Comparison:
    """A validated compare request: a call, a candidate grad_x and the options.

    Attributes:
        call: the validated call.
        candidate: [N, H], the call's dtype or float32 (checked by :func:`moegrad.check_compare_arguments`).
        standards: the standards to judge, or None for the default set.
        return_grad_x: also answer the device's grad_x.
    """

    call: MoeInitRoutingV2GradCall
    candidate: np.ndarray
    standards: tuple[str, ...] | None
    return_grad_x: bool

    @classmethod
    def checked(
        cls,
        call: MoeInitRoutingV2GradCall,
        candidate: np.ndarray | None,
        standards: Sequence[str] | None,
        return_grad_x: bool,
    ) -> Comparison:
        """A comparison whose candidate and standards are checked before anything runs.

        Raises:
            InvalidArgument: the candidate is missing (161001) or has the wrong dtype or shape, or a
                standard is unknown (161002).
        """
        names = check_compare_arguments(call, candidate, standards)
        assert candidate is not None  # check_compare_arguments refuses a missing one
        return cls(call, candidate, None if standards is None else tuple(names), return_grad_x)


@dataclass(frozen=True)
class CompareOutcome:
    """A compare request's answer: the device's result and the report, with the seconds each step took."""

    grad: GradOutcome
    report: ComparisonReport
    golden_s: float
    compare_s: float


@dataclass
class Duration:
    """A count of events and their total duration in nanoseconds (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` events that took ``seconds`` each."""
        self.count += count
        self.ns += count * max(0, round(seconds * 1e9))


@dataclass
class InferenceStatistics:
    """The model's inference statistics in Triton's schema (``InferStatistics`` of its service
    definition), over every protocol since the process started.

    Attributes:
        success: calls answered with a result; ns from the request's arrival (when the endpoint says
            when, else from the dataplane's start) to the result.
        fail: calls that reached the dataplane validated and then failed (queue full, not ready,
            deadline, the device's rejection or fault, the caller gone); ns as for success. A request
            refused while being decoded never reaches the dataplane and is not counted here.
        queue: time the successful calls waited for a worker.
        compute_input: time from the request's arrival to the dataplane: reading, decoding and
            validating the inputs (0 ns for an endpoint that does not say when its request arrived).
        compute_infer: time a worker spent computing (the backend's run, copies included).
        compute_output: time from the worker's result to the dataplane's answer; encoding the reply
            is the protocol's and is not included.
        inference_count: inferences performed (one per successful call: no batching).
        execution_count: executions (equal to inference_count).
        last_inference_ms: when the last successful call finished, in milliseconds since the epoch (0: none yet).
    """

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0


class DataPlane:
    """Runs validated calls for every protocol endpoint.

    Args:
        settings: the service's configuration (limits, default order).
        pool: the stream pool over the opened backend.
        metrics: the app's metrics; queue and compute durations are observed here.
    """

    def __init__(self, settings: Settings, pool: StreamPool, metrics: Metrics) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.statistics = InferenceStatistics()
        self.budget = MemoryBudget(settings.max_inflight_bytes, retry_after_s=settings.retry_after_s)
        self.receive_buffers = ReceiveBuffers(self.budget, keep_s=settings.receive_keep_s)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # made off the event loop (a test): no heap trims
            self.heap_trimmer = None
        else:
            buffers = self.receive_buffers
            self.heap_trimmer = HeapTrimmer(loop, lambda: self.budget.held_bytes, lambda: buffers.kept_bytes)
            self.budget.released = self.heap_trimmer.released

    def admit(self) -> None:
        """Refuse a call now, before its body is read, when the pool could not take it anyway.

        Raises:
            DeviceBusy: (503 + Retry-After) not admitting (starting, draining), no worker can run
                calls, or the queue is full.
        """
        pool = self.pool
        if not pool.ready:
            raise DeviceBusy(pool.not_ready_reason or "the service is not ready", retry_after_s=pool.retry_after_s)
        if pool.queue_depth >= pool.max_queue:
            raise DeviceBusy(f"the queue is full ({pool.max_queue} calls waiting)", retry_after_s=pool.retry_after_s)

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
        """The order the device's chip computes (from its SoC name), or None: the emulation, or a
        chip whose order moegrad does not know."""
        return None if self.emulation else self.pool.backend.order

    @property
    def default_order(self) -> str:
        """The order of calls that name none: the chip's own on a device that reports a known SoC,
        else ``settings.order``."""
        return self.device_order or self.settings.order

    def check_order(self, named: object) -> None:
        """Refuse, before anything runs, a call that names an order its device does not compute.

        Args:
            named: the order the request names, or None when it names none.

        Raises:
            InvalidArgument: (161002, field ``order``) on a device, an order other than its chip's
                (an Atlas A2/A3 computes ``ascend910b``, an Ascend 950 ``ascend950``), or any order
                on a chip whose order is unknown; the emulation (reference backend) takes every order.
        """
        if named is None or self.emulation:
            return
        device = self.device or self.backend_name
        if self.device_order is None:
            raise InvalidArgument(
                f"order={named!r}: {device} is an SoC whose order of adds moegrad does not know; leave order "
                "unnamed (the reply then says order 'unknown'), or call a server with backend=reference for an "
                "emulated order",
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
        """The order a device's results follow (``"unknown"`` on an unknown chip); None on the
        emulation, whose results follow each call's order."""
        return None if self.emulation else (self.device_order or "unknown")

    # --- calls ---------------------------------------------------------------------------------

    async def infer(
        self,
        call: MoeInitRoutingV2GradCall,
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
        received_s: float | None = None,
        out: np.ndarray | None = None,
    ) -> GradOutcome:
        """grad_x for a validated call: an empty one (N = 0 or H = 0) is answered at once, the rest
        run on the pool. Every call is counted in :attr:`statistics`.

        Args:
            call: the validated call.
            timeout_s: seconds from now until the call's deadline.
            disconnected: a coroutine function that returns once the caller has gone (an HTTP
                disconnect); a call still queued then is dropped unrun and a running one's result
                discarded.
            received_s: the ``time.perf_counter()`` reading when the call's request arrived, or
                None (the statistics then start the call here).
            out: where the worker writes grad_x ([N, H], the call's dtype, C-contiguous, writeable),
                or None for a fresh array (:meth:`StreamPool.run`).

        Raises:
            DeviceBusy: (503) the queue is full or the service is not ready.
            DeadlineExceeded: (504) the deadline passed.
            InvalidArgument: the device's phase one rejected the call (its aclnn code).
            DeviceFault: the device failed.
            ClientDisconnected: ``disconnected`` returned first.
        """
        entered = time.perf_counter()
        received = entered if received_s is None else min(received_s, entered)
        try:
            if call.num_tokens == 0 or call.hidden_size == 0:  # the documentation allows empty tensors
                grad_x = np.zeros((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype)
                timings = Timings(0.0, 0.0)
            else:
                run = self.pool.run(call, timeout_s=timeout_s, out=out)
                grad_x, timings = await (run if disconnected is None else _unless(disconnected, run))
                self.metrics.queue_duration.observe(timings.queue_s)
                self.metrics.compute_duration.observe(timings.compute_s)
            computed = time.perf_counter()
            outcome = self._outcome(call, grad_x, timings)
        except BaseException:
            self.statistics.fail.add(time.perf_counter() - received)
            raise
        self._count_success(received, entered, computed, timings)
        return outcome

    def _count_success(
        self, received: float, entered: float, computed: float, timings: Timings, count: int = 1
    ) -> None:
        """Count ``count`` successful calls that each took these times (a batch chunk's calls share them)."""
        stats, done = self.statistics, time.perf_counter()
        stats.success.add(done - received, count)
        stats.queue.add(timings.queue_s, count)
        stats.compute_input.add(entered - received, count)
        stats.compute_infer.add(timings.compute_s, count)
        stats.compute_output.add(done - computed, count)
        stats.inference_count += count
        stats.execution_count += count
        stats.last_inference_ms = time.time_ns() // 1_000_000

    def _outcome(self, call: MoeInitRoutingV2GradCall, grad_x: np.ndarray, timings: Timings) -> GradOutcome:
        return GradOutcome(grad_x, timings, self.backend_name, self.answer_order or call.order, self.device)

    async def compare(
        self, comparison: Comparison, *, timeout_s: float, disconnected: Callable[[], Awaitable[object]] | None = None
    ) -> CompareOutcome:
        """Run the call, then judge the candidate against its result and the float64 golden (on a
        worker thread: CPU work in float64).

        Raises:
            The errors of :meth:`infer`.
        """
        grad = await self.infer(comparison.call, timeout_s=timeout_s, disconnected=disconnected)
        report, golden_s, compare_s = await asyncio.to_thread(_judge, comparison, grad.grad_x)
        return CompareOutcome(grad, report, golden_s, compare_s)

    async def infer_batch(
        self,
        items: Sequence[MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException],
        *,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[object]] | None = None,
    ) -> list[GradOutcome | MemberOutcome | CompareOutcome | BaseException]:
        """Run a batch of independent calls and comparisons; answer each in order, alone.

        The grad calls, the groups' members and the comparisons' calls run on the pool in one share
        per worker (:meth:`StreamPool.run_parts`: one queue entry and one hand-off each, however
        many calls and groups, and never more shares than the queue holds, so a batch alone is never
        refused for its own size; a group's chunk in one computation where the backend can), all
        under the batch's one deadline; then the comparisons are judged, one after another on one
        thread. A call that fails gets its own error in its place; its neighbours are unaffected (a
        share the pool refuses or that runs out of time answers that error for each of its calls).

        Args:
            items: validated calls (:meth:`infer`), members of validated groups, validated
                comparisons (:meth:`compare`), or the error an item already earned while it was
                decoded (passed through in place).
            timeout_s: seconds from now until the batch's deadline.
            disconnected: as for :meth:`infer`: once it returns, the shares still queued are
                dropped unrun, the running ones' results discarded, and ClientDisconnected raised.

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
        answers: list[Any] = list(items)  # each item's place, filled with its answer
        grads: list[tuple[int, MoeInitRoutingV2GradCall]] = []
        groups: dict[int, tuple[CallGroup, list[int]]] = {}  # id(group) -> (group, each member's place)
        comparisons: list[tuple[int, Comparison]] = []
        for index, item in enumerate(items):
            if type(item) is GroupMember:
                entry = groups.get(id(item.group))
                if entry is None:
                    entry = groups[id(item.group)] = (item.group, [0] * len(item.group))
                entry[1][item.member] = index
                continue
            call = item.call if isinstance(item, Comparison) else item
            if isinstance(item, Comparison):  # its call runs with the others; it is judged after
                comparisons.append((index, item))
            if isinstance(call, MoeInitRoutingV2GradCall):
                if call.num_tokens == 0 or call.hidden_size == 0:
                    answers[index] = self._outcome(
                        call,
                        np.zeros((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype),
                        Timings(0.0, 0.0),
                    )
                else:
                    grads.append((index, call))

        def refused(places: list[int], exc: MoegradError, entered: float) -> None:
            """The whole chunk was refused or timed out: each of its calls says so."""
            exc.with_traceback(None)  # kept as an answer: see Returns
            for index in places:
                answers[index] = exc
            self.statistics.fail.add(time.perf_counter() - entered, len(places))

        def settle(
            places: list[int],
            calls: Sequence[MoeInitRoutingV2GradCall],
            outcomes: list[tuple[np.ndarray | None, BaseException | None]],
            share: Timings,
            entered: float,
            computed: float,
        ) -> None:
            """Each call's own answer, from a chunk whose calls ran one by one."""
            failed = 0
            for index, call, (grad_x, error) in zip(places, calls, outcomes, strict=True):
                if error is not None:
                    answers[index] = error
                    failed += 1
                else:
                    assert grad_x is not None
                    answers[index] = self._outcome(call, grad_x, share)
            if failed:
                self.statistics.fail.add(computed - entered, failed)
            if failed < len(places):
                self._count_success(entered, entered, computed, share, len(places) - failed)

        def observed(timings: Timings, count: int) -> Timings:
            self.metrics.queue_duration.observe(timings.queue_s)
            self.metrics.compute_duration.observe(timings.compute_s)
            return Timings(timings.queue_s, timings.compute_s / count)

        async def run_share(share: list[tuple[tuple[MoeInitRoutingV2GradCall, ...] | CallGroup, list[int]]]) -> None:
            """One worker's share of the batch: runs of calls and chunks of groups, one queue entry."""
            entered = time.perf_counter()
            try:
                outcomes, timings = await self.pool.run_parts(
                    [part for part, _ in share], timeout_s=max(deadline - loop.time(), 1e-6)
                )
            except MoegradError as exc:
                refused([index for _, places in share for index in places], exc, entered)
                return
            computed = time.perf_counter()
            each = observed(timings, sum(len(places) for _, places in share))
            for (part, places), outcome in zip(share, outcomes, strict=True):
                if isinstance(outcome, np.ndarray):  # a group's members, run as one
                    assert isinstance(part, CallGroup)
                    like = part.like
                    together = GroupOutcome(
                        outcome, each, self.backend_name, self.answer_order or like.order, self.device
                    )
                    for member, index in enumerate(places):
                        answers[index] = MemberOutcome(together, member)
                    self._count_success(entered, entered, computed, each, len(places))
                else:
                    calls = [part.like] * len(places) if isinstance(part, CallGroup) else part
                    settle(places, calls, outcome, each, entered, computed)

        def judge(judged: list[tuple[int, Comparison, GradOutcome]]) -> None:
            """Each comparison whose call succeeded, against its device result (on a worker thread)."""
            for index, comparison, grad in judged:
                try:
                    report, golden_s, compare_s = _judge(comparison, grad.grad_x)
                except MoegradError as exc:
                    answers[index] = exc.with_traceback(None)
                else:
                    answers[index] = CompareOutcome(grad, report, golden_s, compare_s)

        # The grad calls and group members go to the pool in as many shares as workers, one queue
        # entry each (at least BATCH_CHUNK_CALLS calls a share, fewer when there are fewer): a run
        # of consecutive calls is one part of a share, a chunk of a group another.
        total = len(grads) + sum(len(group) for group, _ in groups.values())
        workers = max(1, min(self.settings.streams, self.pool.max_queue))  # a batch alone always fits the queue
        size = max(BATCH_CHUNK_CALLS, -(-total // workers))
        shares: list[list[tuple[tuple[MoeInitRoutingV2GradCall, ...] | CallGroup, list[int]]]] = [[]]
        room = size

        def take(count: int) -> int:
            """Room for ``count`` more calls in the current share (a new share when it is full)."""
            nonlocal room
            if room == 0:
                shares.append([])
                room = size
            taken = min(room, count)
            room -= taken
            return taken

        for group, places in groups.values():
            per_part = max(1, BATCH_PART_BYTES // max(group.like.grad_expanded_x.nbytes, 1))
            start = 0
            while start < len(group):
                stop = start + take(min(len(group) - start, per_part))
                shares[-1].append((group[start:stop], places[start:stop]))
                start = stop
        start = 0
        while start < len(grads):
            stop, part_bytes = start + 1, grads[start][1].grad_expanded_x.nbytes
            while stop < len(grads) and stop - start < BATCH_PART_CALLS:
                part_bytes += grads[stop][1].grad_expanded_x.nbytes
                if part_bytes > BATCH_PART_BYTES:
                    break
                stop += 1
            stop = start + take(stop - start)
            run = grads[start:stop]
            shares[-1].append((tuple(call for _, call in run), [index for index, _ in run]))
            start = stop
        running = asyncio.gather(*(run_share(share) for share in shares if share))
        await (running if disconnected is None else _unless(disconnected, running))
        judged = [(index, item, answers[index]) for index, item in comparisons if type(answers[index]) is GradOutcome]
        if judged:
            await asyncio.to_thread(judge, judged)
        return answers

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


def _judge(comparison: Comparison, device_result: np.ndarray) -> tuple[ComparisonReport, float, float]:
    """The report, and the seconds it took: the golden is computed within the comparison (one
    compiled pass with the metrics), so its own share is 0."""
    started = time.perf_counter()
    report = compare(comparison.call, comparison.candidate, device_result=device_result, standards=comparison.standards)
    return report, 0.0, time.perf_counter() - started


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
