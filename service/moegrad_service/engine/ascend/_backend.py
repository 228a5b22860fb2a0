"""The ascend backend and its workers: one call of aclnnMoeInitRoutingV2Grad on one stream."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import operator
import os
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
    MoegradError,
    MoeInitRoutingV2GradCall,
    dtype_name,
)
from moegrad_service.engine.ascend._abi import (
    ACL_DATA_TYPES,
    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    ACL_HBM_MEM,
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    SET_ENV_HINT,
    CannUnavailable,
    code_name,
    load,
)
from moegrad_service.engine.ascend._buffers import BufferCache, Lease, Retired, aligned, host_array
from moegrad_service.engine.ascend._device import Device, acl_acquire, acl_release, left, timeout_ms

log = logging.getLogger("moegrad_service.engine.ascend")

#: SoC name (``aclrtGetSocName``) prefix -> the accumulation order that SoC's kernel computes:
#: Atlas A2 (Ascend910B*) and A3 (Ascend910_93*) run the A2/A3 kernel, Ascend 950PR/950DT the arch35
#: one (docs/semantics.md, sections 3 and 7). The one table of its kind; an SoC not in it has no order.
SOC_ORDERS: tuple[tuple[str, str], ...] = (
    ("Ascend910B", "ascend910b"),
    ("Ascend910_93", "ascend910b"),
    ("Ascend950", "ascend950"),
)
#: The orders a device computes; the others ("sequential") are CPU goldens.
DEVICE_ORDERS = frozenset(order for _, order in SOC_ORDERS)


def order_of_soc(soc_name: str | None) -> str | None:
    """The accumulation order the SoC named ``soc_name`` computes, or None for an SoC not in :data:`SOC_ORDERS`."""
    if not soc_name:
        return None
    return next((order for prefix, order in SOC_ORDERS if soc_name.startswith(prefix)), None)


#: Retired (timed-out, maybe still running) streams a worker tolerates before it refuses new calls.
MAX_RETIRED_STREAMS = 4

#: Phase-one codes that answer the call's input: the documented checks (161001 null tensor, 161002
#: dtype, 561002 attributes and shapes). moegrad validates inputs before phase one, so any other
#: code is the installation's or the runtime's: a DeviceFault (HTTP 500), never a 422.
CALLER_STATUSES = frozenset(
    {AclnnStatus.ACLNN_ERR_PARAM_NULLPTR, AclnnStatus.ACLNN_ERR_PARAM_INVALID, AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR}
)
#: What a phase-one code other than :data:`CALLER_STATUSES` most likely means, and what to do.
PHASE_ONE_HINTS = {
    361001: "a runtime call inside the operator failed; check the device with npu-smi and the plog",
    561003: "no kernel binary of the operator for this SoC was found: install the operator package "
    "(ops-transformer) built for this CANN and SoC, and check ASCEND_OPP_PATH",
    561103: "an internal null pointer; on the 2026 entry point this code also answers shape and attribute "
    "errors (561002 on CANN 8.x), which moegrad's own validation answers before the device",
    561107: "ASCEND_OPP_PATH is not set in this process: source CANN's set_env.sh before starting the service",
    561108: "the operator's kernel description (JSON) under ASCEND_OPP_PATH could not be loaded",
    561112: "the operator's binary kernel package was not found under ASCEND_OPP_PATH: install it",
}

#: The documentation's example, run through phase one at startup: grad_expanded_x [4, 2] float32,
#: expanded_row_idx [2, 0, 1, 3], top_k 2, dropless; grad_x [2, 2].
_PROBE_GRAD = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], dtype=np.float32)
_PROBE_IDX = np.array([2, 0, 1, 3], dtype=np.int32)


def phase_one_error(status: int, message: str | None, device: str) -> MoegradError:
    """The error a nonzero status of aclnnMoeInitRoutingV2GradGetWorkspaceSize stands for.

    Returns:
        InvalidArgument for the documented input checks (161001, 161002, 561002); DeviceFault with
        the library's message and a hint for every other code (an installation or runtime fault).
    """
    text = f"aclnnMoeInitRoutingV2GradGetWorkspaceSize: {code_name(status)}" + (f": {message}" if message else "")
    if status in CALLER_STATUSES:
        return InvalidArgument(f"the NPU rejected the call ({text})", aclnn_status=status, field=None)
    hint = PHASE_ONE_HINTS.get(status, "the operator failed for a reason that is not the call's input")
    return DeviceFault(f"phase one failed on {device} ({text}); {hint}", aclnn_status=status, device_message=message)


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
        soc_name: what ``aclrtGetSocName`` reports (``"Ascend910B3"``), or None when it reports nothing.
        device: ``"<SoC name> #<device_id>"`` (``"Ascend910B3 #0"``), else ``"ascend device <id>"``.
        order: the accumulation order this chip computes (:data:`SOC_ORDERS`): ``"ascend910b"`` on
            Atlas A2/A3, ``"ascend950"`` on Ascend 950PR/950DT, None for an SoC not in the table.

    Raises:
        CannUnavailable: the libraries, a symbol or the device cannot be found, ``ASCEND_OPP_PATH`` is
            not a directory, or phase one of the documentation's example fails (its aclnn code
            attached: 561003, 561107, ...). A startup error.
        DeviceFault: ``aclInit`` or ``aclrtSetDevice`` failed (the runtime's message attached).
    """

    name = "ascend"

    def __init__(
        self,
        *,
        device_id: int = 0,
        ascend_home_path: str | Path | None = None,
        cache_bytes_per_stream: int = 1 << 30,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.device_id = int(device_id)
        self.cache_bytes_per_stream = cache_bytes_per_stream
        self.drain_timeout_s = drain_timeout_s
        self._api = load(ascend_home_path)
        _check_opp_path(ascend_home_path)
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
                raise CannUnavailable(
                    f"NPU {self.device_id} is not visible to this process: CANN reports "
                    f"{count.value} device(s). Check /dev/davinci*, the container's device "
                    "mounts and ASCEND_RT_VISIBLE_DEVICES."
                )
            self._device.ensure()
            soc = self._api.soc_name()
            self.soc_name = soc
            self.device = f"{soc} #{self.device_id}" if soc else f"ascend device {self.device_id}"
            self._device.description = self.device
            self._probe()
            undo.pop_all()
        self.order = order_of_soc(soc)
        if self.order is None:
            log.warning(
                "%s is not an SoC whose order of adds moegrad knows (%s): its results are served with the "
                "order unknown",
                self.device,
                ", ".join(prefix + "*" for prefix, _ in SOC_ORDERS),
            )

    def __repr__(self) -> str:
        return f"AscendBackend(device={self.device!r}, closed={self._closed})"

    def _probe(self) -> None:
        """Phase one of the documentation's example, so a host that cannot run the operator never starts.

        Raises:
            CannUnavailable: phase one fails (a missing kernel package, ASCEND_OPP_PATH, ...).
        """
        device = self._device
        with contextlib.ExitStack() as cleanup:
            pointers = []
            for array in (_PROBE_GRAD, _PROBE_IDX, np.empty((2, 2), np.float32)):
                pointer = device.malloc(aligned(array.nbytes))
                cleanup.callback(device.free, pointer)
                pointers.append(pointer)
            for probe, pointer in zip((_PROBE_GRAD, _PROBE_IDX), pointers, strict=False):
                device.check(
                    "aclrtMemcpy (host to device)",
                    self._api.aclrtMemcpy(
                        pointer, aligned(probe.nbytes), probe.ctypes.data, probe.nbytes, ACL_MEMCPY_HOST_TO_DEVICE
                    ),
                )
            tensors = []
            for shape, acl_type, pointer in (
                ((4, 2), ACL_DATA_TYPES["float32"], pointers[0]),
                ((4,), ACL_DATA_TYPES["int32"], pointers[1]),
                ((2, 2), ACL_DATA_TYPES["float32"], pointers[2]),
            ):
                tensors.append(device.create_tensor(shape, acl_type, pointer))
                cleanup.callback(device.destroy_tensor, tensors[-1])
            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                tensors[0], tensors[1], 2, 0, 0, tensors[2], ctypes.byref(workspace_size), ctypes.byref(executor)
            )
            if status:
                error = phase_one_error(status, self._api.recent_error(), self.device)
                raise CannUnavailable(
                    f"{self.device} cannot run aclnnMoeInitRoutingV2Grad: the documentation's "
                    f"example fails at startup: {error}. {SET_ENV_HINT}",
                    aclnn_status=status,
                    device_message=getattr(error, "device_message", None),
                )
            device.discard_executor(executor.value)

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
        self._device.check(
            "aclrtGetMemInfo", self._api.aclrtGetMemInfo(ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total))
        )
        if total.value == 0:
            raise DeviceFault(f"{self.device} reports no HBM")

    def close(self) -> None:
        """Synchronise, free the caches, destroy the streams, reset the device, release ACL (in that order).

        Workers still open are shut down from this thread. Bounded: every wait shares one budget of
        ``drain_timeout_s``; a stream whose kernel is still running after it is destroyed with
        ``aclrtDestroyStreamForce`` (no wait), and the memory that kernel used is left to
        ``aclrtResetDevice``. Never raises; failures are logged.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        deadline = time.monotonic() + self.drain_timeout_s
        try:
            self._device.ensure()
        except DeviceFault:
            log.exception("closing %s: cannot set the device on this thread", self.device)
        for worker in workers:
            worker._shutdown(deadline)
        for retired in self._take_abandoned():
            if self._device.wait_idle(retired.stream, left(deadline)):
                self._device.release_retired(retired)
                continue
            forced = self._device.force_destroy_stream(retired.stream)
            log.error(
                "closing %s: a kernel that missed its deadline is still running; its stream was %s and its "
                "%d buffers are left to aclrtResetDevice",
                self.device,
                "destroyed by force" if forced else "left too",
                len(retired.pointers),
            )
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


def _check_opp_path(ascend_home_path: str | Path | None) -> None:
    """ASCEND_OPP_PATH must name a directory: opbase finds the operator's kernels through it.

    Raises:
        CannUnavailable: it is unset, empty or not a directory.
    """
    opp = os.environ.get("ASCEND_OPP_PATH", "")
    if opp and Path(opp).is_dir():
        return
    guess = None if ascend_home_path is None else Path(ascend_home_path) / "opp"
    suggestion = f" (for this install: export ASCEND_OPP_PATH={guess})" if guess is not None and guess.is_dir() else ""
    problem = "is not set" if not opp else f"={opp} is not a directory"
    raise CannUnavailable(
        f"ASCEND_OPP_PATH {problem}: CANN's operator library finds the kernels of "
        f"aclnnMoeInitRoutingV2Grad through it, so every call would fail (561107){suggestion}. "
        f"{SET_ENV_HINT}"
    )


def _attribute(call: MoeInitRoutingV2GradCall, name: str) -> int:
    try:
        return operator.index(getattr(call, name))
    except TypeError:
        raise InvalidArgument(
            f"{name}={getattr(call, name)!r} must be an integer",
            aclnn_status=AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR,
            field=name,
        ) from None


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

    def run(
        self, call: MoeInitRoutingV2GradCall, *, timeout_s: float | None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """grad_x of ``call`` computed on the NPU; see :meth:`BackendWorker.run`.

        The call's arrays may be non-contiguous, read-only or big-endian: they are copied to
        contiguous host buffers when needed. The result is in the chip's own order
        (:attr:`AscendBackend.order`), whatever ``call.order`` names among the device orders; whether
        a call naming another chip's order is served is the caller's policy. ``call.order`` must
        not be a CPU golden (``"sequential"``).

        Raises:
            InvalidArgument: phase one rejected the call's input (161001 null tensor, 161002 dtype,
                561002 attribute or shape), or ``call.order`` is not the order this device computes in.
            DeadlineExceeded: ``timeout_s`` passed before the kernel finished (the stream is replaced).
            DeviceFault: phase one failed with any other code (an installation fault: 561003 no
                kernel, 561107 no ASCEND_OPP_PATH, ...), or the runtime failed (``aclGetRecentErrMsg``'s
                text attached).
        """
        with self._busy:
            return self._run(call, timeout_s, out)

    def _run(self, call: MoeInitRoutingV2GradCall, timeout_s: float | None, into: np.ndarray | None) -> np.ndarray:
        backend, device = self._backend, self._device
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._closed or backend._closed:
            raise DeviceFault("the ascend backend is closed")
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the deadline passed before the call reached the NPU")
        if call.order not in DEVICE_ORDERS:  # "sequential" is a CPU golden no device computes
            raise InvalidArgument(
                f"order={call.order!r}: {backend.device} computes in the device's own order "
                f"({backend.order or 'unknown for this SoC'}); the {call.order!r} golden is only "
                "served by the reference backend",
                aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
                field="order",
            )
        top_k, drop_pad_mode, active_num = (_attribute(call, n) for n in ("top_k", "drop_pad_mode", "active_num"))
        grad = idx = None
        grad_type = idx_type = 0
        if call.grad_expanded_x is not None:
            grad, grad_type = host_array(call.grad_expanded_x, "grad_expanded_x")
        if call.expanded_row_idx is not None:
            idx, idx_type = host_array(call.expanded_row_idx, "expanded_row_idx")
        tokens = idx.shape[0] // top_k if idx is not None and idx.ndim >= 1 and top_k > 0 else 0
        hidden = grad.shape[-1] if grad is not None and grad.ndim >= 1 else 0
        dtype = DTYPES["float32"] if grad is None else grad.dtype
        if (
            into is not None
            and into.shape == (tokens, hidden)
            and into.dtype == dtype
            and into.flags.c_contiguous
            and into.flags.writeable
        ):
            result = into  # the device copy lands in the caller's buffer
        else:
            result = np.empty((tokens, hidden), dtype=dtype)

        device.ensure()
        self._poll_retired()
        if len(self._retired) >= MAX_RETIRED_STREAMS:
            raise DeviceFault(
                f"{len(self._retired)} kernels that missed their deadline are still running on "
                f"{backend.device}; this worker takes no more calls until they finish"
            )
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
            result_type = dtype_name(result.dtype)
            assert result_type is not None  # the result has the call's validated wire dtype
            out = self._tensor(result.shape, ACL_DATA_TYPES[result_type], out_pointer, cleanup)

            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                handles[0],
                handles[1],
                top_k,
                drop_pad_mode,
                active_num,
                out,
                ctypes.byref(workspace_size),
                ctypes.byref(executor),
            )
            if status:
                raise phase_one_error(status, self._api.recent_error(), backend.device)
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
                    f"{backend.device} did not finish within the deadline ({budget}); "
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
        if self._closed or self._backend._closed:
            return False
        if self._retired:
            self._poll_retired()
        return len(self._retired) < MAX_RETIRED_STREAMS

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

    def _shutdown(self, deadline: float | None = None) -> None:
        """Release the worker's device resources from the calling thread (which has the device set).

        Waits until ``deadline`` (``time.monotonic()``; None: ``drain_timeout_s`` from now). From another
        thread (the backend closing a worker nobody closed), a call still running gets that long to
        finish; after that its resources are left to ``aclrtResetDevice``. Streams still busy at the
        deadline are handed to the backend, which destroys them by force.
        """
        backend = self._backend
        if deadline is None:
            deadline = time.monotonic() + backend.drain_timeout_s
        timeout = left(deadline)
        assert timeout is not None  # deadline is set just above, so left() gives seconds
        # _busy is held while a call runs and while the worker releases its resources: the backend
        # closing from another thread waits here for a worker that is closing itself (else it would
        # reset the device under the worker's last stream calls)
        if not self._busy.acquire(timeout=timeout):
            if self._closed:
                return
            self._closed = True
            with backend._lock:
                backend._workers.discard(self)
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
        backend = self._backend
        try:
            self._release_streams(deadline)
        finally:  # only now: until here the backend's close waits for this worker (see _shutdown)
            with backend._lock:
                backend._workers.discard(self)

    def _release_streams(self, deadline: float) -> None:
        backend, device = self._backend, self._device
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
