"""An ascend backend's worker: one stream, its device buffers, and the two-phase run of one call
(the package's docstring draws its steps, from the retired streams' query to the tensors' destruction).

A sync that times out retires the stream with the buffers its kernel may still use, and the worker
carries on with a fresh stream; :class:`Workers` is what the workers share with their backend: the
open workers, the retired streams left for the backend's close, and whether it is closed."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time

import numpy as np

from moegrad import DeadlineExceeded, DeviceFault, MoeInitRoutingV2GradCall, Profile
from moegrad_service.engine.ascend._abi import (
    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    Cann,
)
from moegrad_service.engine.ascend._buffers import BufferCache, Lease, Retired, aligned
from moegrad_service.engine.ascend._call import marshal, phase_one_error
from moegrad_service.engine.ascend._device import Device, left, timeout_ms
from moegrad_service.engine.base import BackendWorker

__all__ = ["MAX_RETIRED_STREAMS", "AscendWorker", "Workers"]

log = logging.getLogger("moegrad_service.engine.ascend")

#: Retired (timed-out, maybe still running) streams a worker tolerates before it refuses new calls.
MAX_RETIRED_STREAMS = 4


class Workers:
    """What an ascend backend shares with its workers, under one lock: the workers open now, the
    retired streams they handed over at close (still busy: the backend destroys them by force), and
    whether the backend is closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[AscendWorker] = set()
        self._abandoned: list[Retired] = []
        #: Set once by :meth:`close`; read without the lock (a bool).
        self.closed = False

    def add(self, worker: AscendWorker) -> None:
        with self._lock:
            self._open.add(worker)

    def discard(self, worker: AscendWorker) -> None:
        with self._lock:
            self._open.discard(worker)

    def abandon(self, retired: list[Retired]) -> None:
        """Hand streams still busy at a worker's close to the backend."""
        with self._lock:
            self._abandoned.extend(retired)

    def take_abandoned(self) -> list[Retired]:
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        return abandoned

    def close(self) -> list[AscendWorker] | None:
        """Mark the backend closed; the workers still open, or None when it was closed already."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
            return list(self._open)


class AscendWorker(BackendWorker):
    """One stream of an :class:`~moegrad_service.engine.ascend.AscendBackend`, used from one thread.

    Args:
        api: the loaded CANN libraries.
        device: the backend's device (its ACL references and per-thread context).
        index: the worker's slot in the pool.
        workers: the backend's :class:`Workers`, which this worker joins.
        profile: the device's profile (chip and CANN release), or None when unknown: named in
            refusals, and it says which phase-one codes are the caller's.
        cache_bytes_per_stream: device memory the worker keeps for reuse between calls, in bytes.
        drain_timeout_s: how long closing waits for the stream to finish, in seconds.

    Raises:
        DeviceFault: the device cannot be set on this thread or no stream can be made.
    """

    def __init__(
        self,
        api: Cann,
        device: Device,
        index: int,
        *,
        workers: Workers,
        profile: Profile | None,
        cache_bytes_per_stream: int,
        drain_timeout_s: float,
    ) -> None:
        self.index = index
        self._api = api
        self._device = device
        self._workers = workers
        self._profile = profile
        self._drain_timeout_s = drain_timeout_s
        with contextlib.ExitStack() as undo:
            self._owns_device_ref = self._device.ensure()
            if self._owns_device_ref:
                undo.callback(self._device.reset_thread)
            self._stream: int | None = self._device.create_stream()
            undo.pop_all()
        self._cache = BufferCache(cache_bytes_per_stream)
        self._workspace: tuple[int, int] | None = None  # (size, pointer)
        self._retired: list[Retired] = []
        self._closed = False
        self._busy = threading.Lock()  # held by run(); a shutdown from another thread waits for it
        workers.add(self)

    # --- the protocol ------------------------------------------------------------------------------

    def run(
        self, call: MoeInitRoutingV2GradCall, *, timeout_s: float | None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """grad_x of ``call`` computed on the NPU; see :meth:`BackendWorker.run`.

        The call's arrays may be non-contiguous, read-only or big-endian: they are copied to
        contiguous host buffers when needed (:func:`~._call.marshal`). The result is the device's
        profile's bits (``AscendBackend.order``), whatever device profile ``call.order`` names;
        whether a call naming another profile is served is the caller's policy. ``call.order``
        must not be a CPU golden (``"sequential"``).

        Raises:
            InvalidArgument: phase one rejected the call's input (161001 null tensor, 161002 dtype,
                561002 attribute or shape, 561103 from CANN 9.1), or ``call.order`` names no device
                profile.
            DeadlineExceeded: ``timeout_s`` passed before the kernel finished (the stream is replaced).
            DeviceFault: phase one failed with any other code (an installation fault: 561003 no
                kernel, 561107 no ASCEND_OPP_PATH, ...), or the runtime failed (``aclGetRecentErrMsg``'s
                text attached).
        """
        with self._busy:
            return self._run(call, timeout_s, out)

    def _run(self, call: MoeInitRoutingV2GradCall, timeout_s: float | None, into: np.ndarray | None) -> np.ndarray:
        device = self._device
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._closed or self._workers.closed:
            raise DeviceFault("the ascend backend is closed")
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the deadline passed before the call reached the NPU")
        arguments = marshal(call, into, device=device.description, profile=self._profile)
        result = arguments.result

        device.ensure()
        self._poll_retired()
        if len(self._retired) >= MAX_RETIRED_STREAMS:
            raise DeviceFault(
                f"{len(self._retired)} kernels that missed their deadline are still running on "
                f"{device.description}; this worker takes no more calls until they finish"
            )
        if self._stream is None:  # replacing a timed-out stream failed last time
            self._stream = device.create_stream()
        lease = Lease()
        with contextlib.ExitStack() as cleanup:  # last in, first out: tensors destroyed, then buffers returned
            cleanup.callback(self._give_back, lease)
            handles = []
            for array, acl_type in arguments.inputs:
                pointer = None if array is None else self._upload(array, lease)
                handles.append(None if array is None else self._tensor(array.shape, acl_type, pointer, cleanup))
            out_pointer = self._acquire(result.nbytes, lease) if result.nbytes else None
            out = self._tensor(result.shape, arguments.result_type, out_pointer, cleanup)

            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                handles[0],
                handles[1],
                arguments.top_k,
                arguments.drop_pad_mode,
                arguments.active_num,
                out,
                ctypes.byref(workspace_size),
                ctypes.byref(executor),
            )
            if status:
                raise phase_one_error(status, self._api.recent_error(), device.description, self._profile)
            with contextlib.ExitStack() as unlaunched:  # an executor that never runs is destroyed
                unlaunched.callback(device.discard_executor, executor.value)
                workspace = self._ensure_workspace(workspace_size.value)
                unlaunched.pop_all()
            status = self._api.aclnnMoeInitRoutingV2Grad(workspace, workspace_size.value, executor, self._stream)
            if status:
                fault = device.fault("aclnnMoeInitRoutingV2Grad", status)
                self._settle(deadline, lease)  # a failed launch may have queued part of its work
                raise fault
            status = self._api.aclrtSynchronizeStreamWithTimeout(self._stream, timeout_ms(left(deadline)))
            if status == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
                message = self._api.recent_error()
                self._retire(lease)
                budget = "no deadline" if timeout_s is None else f"{timeout_s:.3f} s"
                raise DeadlineExceeded(
                    f"{device.description} did not finish within the deadline ({budget}); "
                    "the stream was replaced" + (f" ({message})" if message else "")
                )
            if status:
                fault = device.fault("aclrtSynchronizeStreamWithTimeout", status)
                if device.is_idle(self._stream):  # the kernel ended in error: next call on a fresh stream
                    self._replace_stream()
                else:  # not known to be idle: nothing it may use is freed
                    self._retire(lease)
                raise fault
            if result.nbytes:
                device.check(
                    "aclrtMemcpy (device to host)",
                    self._api.aclrtMemcpy(
                        result.ctypes.data, result.nbytes, out_pointer, result.nbytes, ACL_MEMCPY_DEVICE_TO_HOST
                    ),
                )
            return result

    def accepts_calls(self) -> bool:
        """False while MAX_RETIRED_STREAMS kernels that missed their deadline still run on this worker's
        retired streams (it refuses calls until one finishes), or once closed; polls them
        (``aclrtStreamQuery``, no wait) on the calling thread, the worker's own."""
        if self._closed or self._workers.closed:
            return False
        if self._retired:
            self._poll_retired()
        return len(self._retired) < MAX_RETIRED_STREAMS

    def close(self) -> None:
        """Synchronise, free the cache and workspace, destroy the stream, balance this thread's aclrtSetDevice."""
        if self._closed:
            return
        if not self._workers.closed:
            try:
                self._device.ensure()
            except DeviceFault:
                log.exception("closing worker %d: cannot set the device on this thread", self.index)
            self._shutdown()
        if self._owns_device_ref:
            self._device.reset_thread()

    # --- internals -----------------------------------------------------------------------------------

    def _shutdown(self, deadline: float | None = None) -> None:
        """Release the worker's device resources from the calling thread (which has the device set).

        Waits until ``deadline`` (``time.monotonic()``; None: ``drain_timeout_s`` from now). From another
        thread (the backend closing a worker nobody closed), a call still running gets that long to
        finish; after that its resources are left to ``aclrtResetDevice``. Streams still busy at the
        deadline are handed to the backend, which destroys them by force.
        """
        if deadline is None:
            deadline = time.monotonic() + self._drain_timeout_s
        timeout = left(deadline)
        assert timeout is not None  # deadline is set just above, so left() gives seconds
        # _busy is held while a call runs and while the worker releases its resources: the backend
        # closing from another thread waits here for a worker that is closing itself (else it would
        # reset the device under the worker's last stream calls)
        if not self._busy.acquire(timeout=timeout):
            if self._closed:
                return
            self._closed = True
            self._workers.discard(self)
            log.error(
                "worker %d is still running a call; its stream and buffers are left to aclrtResetDevice", self.index
            )
            return
        try:
            if not self._closed:
                self._release_all(deadline)
        finally:
            self._busy.release()

    def _release_all(self, deadline: float) -> None:
        self._closed = True
        try:
            self._release_streams(deadline)
        finally:  # only now: until here the backend's close waits for this worker (see _shutdown)
            self._workers.discard(self)

    def _release_streams(self, deadline: float) -> None:
        device = self._device
        leftover = []
        if self._stream is not None and not device.wait_idle(self._stream, left(deadline)):
            leftover.append(Retired(self._stream, self._cache.drain() + self._take_workspace()))
            self._stream = None
        for retired in self._retired:
            if device.wait_idle(retired.stream, left(deadline)):
                device.release_retired(retired)
            else:
                leftover.append(retired)
        self._retired = []
        self._workers.abandon(leftover)
        for pointer in self._cache.drain() + self._take_workspace():
            device.free(pointer)
        if self._stream is not None:
            device.destroy_stream(self._stream)
            self._stream = None

    def _give_back(self, lease: Lease) -> None:
        """Return a finished call's buffers to the cache (never those of a retired stream)."""
        if lease.retired:
            return
        for size, pointer in lease.blocks:
            for evicted in self._cache.give(size, pointer):
                self._device.free(evicted)

    def _malloc(self, size: int) -> int:
        """aclrtMalloc; on failure, free this worker's idle cached buffers and try once more."""
        device = self._device
        pointer = ctypes.c_void_p()
        status = self._api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
        if status and len(self._cache):
            first = device.fault("aclrtMalloc", status)
            for cached in self._cache.drain():  # idle: their kernels have finished
                device.free(cached)
            status = self._api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
            if status:
                raise device.fault("aclrtMalloc", status) from first
        device.check(f"aclrtMalloc ({size} bytes)", status)
        assert pointer.value is not None  # check() raised unless the runtime filled it in
        return pointer.value

    def _acquire(self, nbytes: int, lease: Lease) -> int:
        size = aligned(nbytes)
        pointer = self._cache.take(size)
        if pointer is None:
            pointer = self._malloc(size)
        lease.blocks.append((size, pointer))
        return pointer

    def _upload(self, array: np.ndarray, lease: Lease) -> int | None:
        if array.nbytes == 0:
            return None
        pointer = self._acquire(array.nbytes, lease)
        self._device.check(
            "aclrtMemcpy (host to device)",
            self._api.aclrtMemcpy(
                pointer, aligned(array.nbytes), array.ctypes.data, array.nbytes, ACL_MEMCPY_HOST_TO_DEVICE
            ),
        )
        return pointer

    def _tensor(self, shape: tuple[int, ...], acl_type: int, pointer: int | None, cleanup: contextlib.ExitStack) -> int:
        """aclCreateTensor (ND, contiguous); destroyed when ``cleanup`` unwinds."""
        tensor = self._device.create_tensor(shape, acl_type, pointer)
        cleanup.callback(self._device.destroy_tensor, tensor)
        return tensor

    def _ensure_workspace(self, size: int) -> int | None:
        if size == 0:
            return None
        if self._workspace is not None and self._workspace[0] >= size:
            return self._workspace[1]
        for pointer in self._take_workspace():  # the stream is idle: the old one is free to go
            self._device.free(pointer)
        size = aligned(size)
        self._workspace = (size, self._malloc(size))
        return self._workspace[1]

    def _take_workspace(self) -> list[int]:
        workspace, self._workspace = self._workspace, None
        return [] if workspace is None else [workspace[1]]

    def _settle(self, deadline: float | None, lease: Lease) -> None:
        """After a failed launch: wait for whatever it queued; retire the stream if it does not finish in time."""
        if self._stream is not None and not self._device.wait_idle(self._stream, left(deadline)):
            self._retire(lease)

    def _retire(self, lease: Lease) -> None:
        """Set the current stream aside with the buffers its kernel may still use; continue on a new stream."""
        lease.retired = True
        pointers = [pointer for _, pointer in lease.blocks] + self._take_workspace()
        assert self._stream is not None  # a call that launched had a stream
        self._retired.append(Retired(self._stream, pointers))
        self._stream = None
        try:
            self._stream = self._device.create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _replace_stream(self) -> None:
        old, self._stream = self._stream, None
        if old is not None:  # None: an earlier replacement failed; nothing to destroy
            self._device.destroy_stream(old)
        try:
            self._stream = self._device.create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _poll_retired(self) -> None:
        """Release every retired stream the runtime reports idle by now (``aclrtStreamQuery``, no wait)."""
        still = []
        for retired in self._retired:
            if self._device.is_idle(retired.stream):
                self._device.release_retired(retired)
            else:
                still.append(retired)
        self._retired = still
