"""The ascend backend and its workers: one call of aclnnMoeInitRoutingV2Grad on one stream."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import operator
import threading
import time
from pathlib import Path

import numpy as np

from moegrad import (
    DTYPES,
    AclnnStatus,
    DeadlineExceeded,
    DeviceFault,
    InvalidArgument,
    MoeInitRoutingV2GradCall,
    dtype_name,
)
from moegrad_service.engine.ascend._abi import (
    ACL_DATA_TYPES,
    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    ACL_FORMAT_ND,
    ACL_HBM_MEM,
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    CannUnavailable,
    code_name,
    load,
)
from moegrad_service.engine.ascend._buffers import BufferCache, Lease, Retired, aligned, host_array
from moegrad_service.engine.ascend._device import Device, acl_acquire, acl_release, left, timeout_ms

log = logging.getLogger("moegrad_service.engine.ascend")

#: The order of adds on the SoCs whose kernel moegrad emulates (the A2/A3 kernel).
A2_A3_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")
#: Retired (timed-out, maybe still running) streams a worker tolerates before it refuses new calls.
MAX_RETIRED_STREAMS = 4


class AscendBackend:
    """An Ascend NPU running aclnnMoeInitRoutingV2Grad (Atlas A2/A3: ascend910b, ascend910_93).

    Args:
        device_id: the NPU, an index among those ``ASCEND_RT_VISIBLE_DEVICES`` exposes.
        ascend_home_path: the CANN install whose ``lib64`` holds the libraries; None searches the
            loader path only (what CANN's ``set_env.sh`` sets up).
        cache_bytes_per_stream: device memory each worker keeps for reuse between calls, in bytes.
        drain_timeout_s: how long closing waits for a stream to finish, in seconds.

    Attributes:
        name: ``"ascend"``.
        device: ``"<SoC name> #<device_id>"`` (``aclrtGetSocName``), else ``"ascend device <id>"``.
        order: ``"ascend910b"`` on Atlas A2/A3; None on another SoC (its own order, not emulated).

    Raises:
        CannUnavailable: the libraries, a symbol or the device cannot be found (a startup error).
        DeviceFault: ``aclInit`` or ``aclrtSetDevice`` failed (the runtime's message attached).
    """

    name = "ascend"

    def __init__(self, *, device_id: int = 0, ascend_home_path: str | Path | None = None,
                 cache_bytes_per_stream: int = 1 << 30, drain_timeout_s: float = 10.0) -> None:
        self.device_id = int(device_id)
        self.cache_bytes_per_stream = cache_bytes_per_stream
        self.drain_timeout_s = drain_timeout_s
        self._api = load(ascend_home_path)
        self._device = Device(self._api, self.device_id)
        self._lock = threading.Lock()
        self._workers: set[_AscendWorker] = set()
        self._abandoned: list[Retired] = []
        self._closed = False
        with contextlib.ExitStack() as undo:  # on failure: reset the device, then release ACL
            acl_acquire(self._api)
            undo.callback(acl_release, self._api)
            undo.callback(self._device.reset_all)
            count = ctypes.c_uint32(0)
            self._device.check("aclrtGetDeviceCount", self._api.aclrtGetDeviceCount(ctypes.byref(count)))
            if not 0 <= self.device_id < count.value:
                raise CannUnavailable(f"NPU {self.device_id} is not visible to this process: CANN reports "
                                      f"{count.value} device(s). Check /dev/davinci*, the container's device "
                                      "mounts and ASCEND_RT_VISIBLE_DEVICES.")
            self._device.ensure()
            soc = self._api.soc_name()
            undo.pop_all()
        self.soc_name = soc
        self.device = f"{soc} #{self.device_id}" if soc else f"ascend device {self.device_id}"
        self._device.description = self.device
        self.order = "ascend910b" if soc and soc.startswith(A2_A3_SOC_PREFIXES) else None
        if self.order is None:
            log.warning("%s is not an Atlas A2/A3 SoC: its results follow its own order of adds, which moegrad's "
                        "reference does not emulate", self.device)

    def __repr__(self) -> str:
        return f"AscendBackend(device={self.device!r}, closed={self._closed})"

    # --- the protocol ------------------------------------------------------------------------------

    def open_worker(self, index: int) -> _AscendWorker:
        """A worker owning one stream; call it on the thread that will run the worker's calls."""
        if self._closed:
            raise DeviceFault("the ascend backend is closed")
        return _AscendWorker(self, index)

    def check_health(self) -> None:
        """Query the NPU's HBM (``aclrtGetMemInfo``) from this thread.

        Raises:
            DeviceFault: the backend is closed or the runtime reports an error (message attached).
        """
        if self._closed:
            raise DeviceFault("the ascend backend is closed")
        self._device.ensure()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._device.check("aclrtGetMemInfo",
                           self._api.aclrtGetMemInfo(ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total)))
        if total.value == 0:
            raise DeviceFault(f"{self.device} reports no HBM")

    def close(self) -> None:
        """Synchronise, free the caches, destroy the streams, reset the device, finalise (in that order).

        Workers still open are shut down from this thread. Never raises; failures are logged.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        try:
            self._device.ensure()
        except DeviceFault:
            log.exception("closing %s: cannot set the device on this thread", self.device)
        for worker in workers:
            worker._shutdown()
        for retired in self._take_abandoned():
            if self._device.wait_idle(retired.stream, self.drain_timeout_s):
                self._device.release_retired(retired)
            else:
                log.error("closing %s: a timed-out kernel is still running; its stream and %d buffers are left to "
                          "aclrtResetDevice", self.device, len(retired.pointers))
        self._device.reset_all()
        acl_release(self._api)

    # --- helpers of the workers ----------------------------------------------------------------------

    def _abandon(self, retired: list[Retired]) -> None:
        with self._lock:
            self._abandoned.extend(retired)

    def _take_abandoned(self) -> list[Retired]:
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        return abandoned


def _attribute(call: MoeInitRoutingV2GradCall, name: str) -> int:
    try:
        return operator.index(getattr(call, name))
    except TypeError:
        raise InvalidArgument(f"{name}={getattr(call, name)!r} must be an integer",
                              aclnn_status=AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR, field=name) from None


class _AscendWorker:
    """One stream of an :class:`AscendBackend`, used from one thread."""

    def __init__(self, backend: AscendBackend, index: int) -> None:
        self.index = index
        self._backend = backend
        self._api = backend._api
        self._device = backend._device
        with contextlib.ExitStack() as undo:
            self._owns_device_ref = self._device.ensure()
            if self._owns_device_ref:
                undo.callback(self._device.reset_thread)
            self._stream: int | None = self._device.create_stream()
            undo.pop_all()
        self._cache = BufferCache(backend.cache_bytes_per_stream)
        self._workspace: tuple[int, int] | None = None  # (size, pointer)
        self._retired: list[Retired] = []
        self._closed = False
        self._busy = threading.Lock()  # held by run(); a shutdown from another thread waits for it
        with backend._lock:
            backend._workers.add(self)

    # --- the protocol ------------------------------------------------------------------------------

    def run(self, call: MoeInitRoutingV2GradCall, *, timeout_s: float | None) -> np.ndarray:
        """grad_x of ``call`` computed on the NPU; see :meth:`BackendWorker.run`.

        The call's arrays may be non-contiguous, read-only or big-endian: they are copied to
        contiguous host buffers when needed. ``call.order`` must be ``"ascend910b"`` (the device's).

        Raises:
            InvalidArgument: phase one rejected the call (its aclnn code: 161001, 161002, 561002),
                or ``call.order`` is not the order this device computes in.
            DeadlineExceeded: ``timeout_s`` passed before the kernel finished (the stream is replaced).
            DeviceFault: the runtime failed (``aclGetRecentErrMsg``'s text attached).
        """
        with self._busy:
            return self._run(call, timeout_s)

    def _run(self, call: MoeInitRoutingV2GradCall, timeout_s: float | None) -> np.ndarray:
        backend, device = self._backend, self._device
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._closed or backend._closed:
            raise DeviceFault("the ascend backend is closed")
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the deadline passed before the call reached the NPU")
        if call.order != "ascend910b":  # the only order a device computes in; "sequential" is a CPU golden
            raise InvalidArgument(f"order={call.order!r}: {backend.device} computes in the device's own order "
                                  "('ascend910b' on Atlas A2/A3); the 'sequential' golden is only served by the "
                                  "reference backend", aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID, field="order")
        top_k, drop_pad_mode, active_num = (_attribute(call, n) for n in ("top_k", "drop_pad_mode", "active_num"))
        grad = idx = None
        grad_type = idx_type = 0
        if call.grad_expanded_x is not None:
            grad, grad_type = host_array(call.grad_expanded_x, "grad_expanded_x")
        if call.expanded_row_idx is not None:
            idx, idx_type = host_array(call.expanded_row_idx, "expanded_row_idx")
        tokens = idx.shape[0] // top_k if idx is not None and idx.ndim >= 1 and top_k > 0 else 0
        hidden = grad.shape[-1] if grad is not None and grad.ndim >= 1 else 0
        result = np.empty((tokens, hidden), dtype=DTYPES["float32"] if grad is None else grad.dtype)

        device.ensure()
        self._poll_retired()
        if len(self._retired) >= MAX_RETIRED_STREAMS:
            raise DeviceFault(f"{len(self._retired)} kernels that missed their deadline are still running on "
                              f"{backend.device}; this worker takes no more calls until they finish")
        if self._stream is None:  # replacing a timed-out stream failed last time
            self._stream = device.create_stream()
        lease = Lease()
        with contextlib.ExitStack() as cleanup:  # last in, first out: tensors destroyed, then buffers returned
            cleanup.callback(self._give_back, lease)
            handles = []
            for array, acl_type in ((grad, grad_type), (idx, idx_type)):
                pointer = None if array is None else self._upload(array, lease)
                handles.append(None if array is None else self._tensor(array.shape, acl_type, pointer, cleanup))
            out_pointer = self._acquire(result.nbytes, lease) if result.nbytes else None
            out = self._tensor(result.shape, ACL_DATA_TYPES[dtype_name(result.dtype)], out_pointer, cleanup)

            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                handles[0], handles[1], top_k, drop_pad_mode, active_num, out,
                ctypes.byref(workspace_size), ctypes.byref(executor))
            if status:
                message = self._api.recent_error()
                raise InvalidArgument(
                    f"the NPU rejected the call (aclnnMoeInitRoutingV2GradGetWorkspaceSize: {code_name(status)})"
                    + (f": {message}" if message else ""), aclnn_status=status, field=None)
            with contextlib.ExitStack() as unlaunched:  # an executor that never runs is destroyed
                unlaunched.callback(self._discard_executor, executor.value)
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
                raise DeadlineExceeded(f"{backend.device} did not finish within the deadline ({budget}); "
                                       "the stream was replaced" + (f" ({message})" if message else ""))
            if status:
                fault = device.fault("aclrtSynchronizeStreamWithTimeout", status)
                self._replace_stream()  # the kernel ended in error: start the next call on a fresh stream
                raise fault
            if result.nbytes:
                device.check("aclrtMemcpy (device to host)", self._api.aclrtMemcpy(
                    result.ctypes.data, result.nbytes, out_pointer, result.nbytes, ACL_MEMCPY_DEVICE_TO_HOST))
            return result

    def close(self) -> None:
        """Synchronise, free the cache and workspace, destroy the stream, balance this thread's aclrtSetDevice."""
        if self._closed:
            return
        if not self._backend._closed:
            try:
                self._device.ensure()
            except DeviceFault:
                log.exception("closing worker %d: cannot set the device on this thread", self.index)
            self._shutdown()
        if self._owns_device_ref:
            self._device.reset_thread()

    # --- internals -----------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Release the worker's device resources from the calling thread (which has the device set).

        From another thread (the backend closing a worker nobody closed), a call still running gets
        ``drain_timeout_s`` to finish; after that its resources are left to ``aclrtResetDevice``.
        """
        if self._closed:
            return
        backend = self._backend
        if not self._busy.acquire(timeout=backend.drain_timeout_s):
            self._closed = True
            with backend._lock:
                backend._workers.discard(self)
            log.error("worker %d is still running a call; its stream and buffers are left to aclrtResetDevice",
                      self.index)
            return
        try:
            self._release_all()
        finally:
            self._busy.release()

    def _release_all(self) -> None:
        self._closed = True
        backend, device = self._backend, self._device
        with backend._lock:
            backend._workers.discard(self)
        leftover = []
        if self._stream is not None and not device.wait_idle(self._stream, backend.drain_timeout_s):
            leftover.append(Retired(self._stream, self._cache.drain() + self._take_workspace()))
            self._stream = None
        for retired in self._retired:
            if device.wait_idle(retired.stream, backend.drain_timeout_s):
                device.release_retired(retired)
            else:
                leftover.append(retired)
        self._retired = []
        backend._abandon(leftover)
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
            for cached in self._cache.drain():
                device.free(cached)
            status = self._api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
            if status:
                raise device.fault("aclrtMalloc", status) from first
        device.check(f"aclrtMalloc ({size} bytes)", status)
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
        self._device.check("aclrtMemcpy (host to device)", self._api.aclrtMemcpy(
            pointer, aligned(array.nbytes), array.ctypes.data, array.nbytes, ACL_MEMCPY_HOST_TO_DEVICE))
        return pointer

    def _tensor(self, shape: tuple[int, ...], acl_type: int, pointer: int | None,
                cleanup: contextlib.ExitStack) -> int:
        """aclCreateTensor (ND, contiguous strides in elements, offset 0); destroyed when ``cleanup`` unwinds."""
        rank = len(shape)
        dims = (ctypes.c_int64 * rank)(*shape)
        strides = (ctypes.c_int64 * rank)(*(int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)))
        tensor = self._api.aclCreateTensor(dims, rank, acl_type, strides, 0, ACL_FORMAT_ND, dims, rank, pointer)
        if not tensor:
            message = self._api.recent_error()
            raise DeviceFault(f"aclCreateTensor returned NULL for shape {list(shape)}" + (f": {message}" if message else ""),
                              device_message=message)
        cleanup.callback(self._destroy_tensor, tensor)
        return tensor

    def _destroy_tensor(self, tensor: int) -> None:
        status = self._api.aclDestroyTensor(tensor)
        if status:
            log.error("aclDestroyTensor failed with %s: %s", code_name(status), self._api.recent_error())

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

    def _discard_executor(self, executor: int | None) -> None:
        """An executor phase one made but that will never run (its workspace could not be had)."""
        if not executor:
            return
        if self._api.aclDestroyAclOpExecutor is None:
            log.warning("this CANN has no aclDestroyAclOpExecutor: an executor that never ran is leaked (host memory)")
            return
        status = self._api.aclDestroyAclOpExecutor(executor)
        if status:
            log.error("aclDestroyAclOpExecutor failed with %s: %s", code_name(status), self._api.recent_error())

    def _settle(self, deadline: float | None, lease: Lease) -> None:
        """After a failed launch: wait for whatever it queued; retire the stream if it does not finish in time."""
        if not self._device.wait_idle(self._stream, left(deadline)):
            self._retire(lease)

    def _retire(self, lease: Lease) -> None:
        """Set the current stream aside with the buffers its kernel may still use; continue on a new stream."""
        lease.retired = True
        pointers = [pointer for _, pointer in lease.blocks] + self._take_workspace()
        self._retired.append(Retired(self._stream, pointers))
        self._stream = None
        try:
            self._stream = self._device.create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _replace_stream(self) -> None:
        old, self._stream = self._stream, None
        self._device.destroy_stream(old)
        try:
            self._stream = self._device.create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _poll_retired(self) -> None:
        """Release every retired stream whose kernel has finished by now (a zero-timeout sync)."""
        still = []
        for retired in self._retired:
            if self._device.wait_idle(retired.stream, 0):
                self._device.release_retired(retired)
            else:
                still.append(retired)
        self._retired = still
