"""ACL initialisation, the per-thread device context, streams and the runtime calls around them.

The device context is per thread in CANN, so every thread that touches the device calls
``aclrtSetDevice`` first: :meth:`Device.ensure` does it once per thread (a thread-local flag
remembers it) and counts the reference, which :meth:`Device.reset_thread` / :meth:`Device.reset_all`
balance with ``aclrtResetDevice``.

ACL's own reference count: every ``aclInit`` counts one reference, a repeated one too (it answers
100002), and ``aclFinalizeReference`` releases one, deinitialising at zero. ``aclFinalize`` would
drop every reference of the process, other ACL users' included, so it is never called: each
backend takes one reference (:func:`acl_acquire`) and gives it back with ``aclFinalizeReference``
where the runtime has it (:func:`acl_release`); an older runtime is left initialised.

Streams. ``aclrtSynchronizeStreamWithTimeout`` accepts -1 (wait forever) or a timeout > 0 ms; 0 is
refused with 107000, so a poll is ``aclrtStreamQuery`` (:meth:`Device.is_idle`). A stream is idle
only when the runtime says so: an error or a status this binding cannot read keeps it busy, and
nothing its kernel uses is freed (``aclrtFree`` frees at once, without waiting for kernels).
``aclrtDestroyStream`` waits for the stream's kernels, so it is only called on an idle stream; a
stream that never becomes idle is dropped with ``aclrtDestroyStreamForce``, which does not wait.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time

from moegrad import DeviceFault
from moegrad_service.engine.ascend._abi import (
    ACL_ERROR_REPEAT_FINALIZE,
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    ACL_FORMAT_ND,
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_STREAM_STATUS_COMPLETE,
    ACL_STREAM_STATUS_NOT_READY,
    Cann,
    code_name,
)
from moegrad_service.engine.ascend._buffers import Retired

log = logging.getLogger("moegrad_service.engine.ascend")


def acl_acquire(api: Cann) -> None:
    """One ``aclInit`` reference for a backend (a repeated aclInit, 100002, counts as one too).

    Raises:
        DeviceFault: aclInit failed (its code and the runtime's message attached).
    """
    status = api.aclInit(None)
    if status not in (0, ACL_ERROR_REPEAT_INITIALIZE):
        message = api.recent_error()
        raise DeviceFault(
            f"aclInit failed with {code_name(status)}" + (f": {message}" if message else ""),
            aclnn_status=status,
            device_message=message,
        )


def acl_release(api: Cann) -> None:
    """Give back the reference of :func:`acl_acquire` (``aclFinalizeReference``; nothing on older runtimes)."""
    if api.aclFinalizeReference is None:
        log.info(
            "this CANN has no aclFinalizeReference: ACL stays initialised (aclFinalize would end it for "
            "every ACL user of the process)"
        )
        return
    left_refs = ctypes.c_uint64(0)
    status = api.aclFinalizeReference(ctypes.byref(left_refs))
    if status not in (0, ACL_ERROR_REPEAT_FINALIZE):
        log.error("aclFinalizeReference failed with %s: %s", code_name(status), api.recent_error())


#: The longest wait aclrtSynchronizeStreamWithTimeout takes, in ms (its argument is an int32_t).
MAX_TIMEOUT_MS = 2**31 - 1


def timeout_ms(timeout_s: float | None) -> int:
    """aclrtSynchronizeStreamWithTimeout's argument for a budget of ``timeout_s`` seconds.

    -1 (wait forever) for None; otherwise the budget rounded *up* to whole milliseconds and at
    least 1, because the runtime accepts only -1 or a timeout > 0 (0 and < -1 are refused with
    107000 ACL_ERROR_RT_PARAM_INVALID). A budget already spent therefore becomes a 1 ms wait, and a
    kernel still running after it is a timeout (DeadlineExceeded), never a refused call.
    """
    if timeout_s is None:
        return -1
    return min(MAX_TIMEOUT_MS, max(1, math.ceil(timeout_s * 1000)))


def left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), never negative; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Device:
    """One NPU of this process: its per-thread context and the runtime calls a backend makes on it."""

    def __init__(self, api: Cann, device_id: int) -> None:
        self.api = api
        self.device_id = device_id
        #: ``"<SoC> #<id>"`` once known; used in messages
        self.description = f"ascend device {device_id}"
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._refs = 0
        #: Bumped by reset_all: a thread's aclrtSetDevice of an earlier generation is already balanced.
        self._generation = 0

    # --- the per-thread context ----------------------------------------------------------------------

    def ensure(self) -> bool:
        """aclrtSetDevice on this thread unless it already did; True when this call set it."""
        if getattr(self._tls, "device_set", False) and self._tls.generation == self._generation:
            return False
        self.check("aclrtSetDevice", self.api.aclrtSetDevice(self.device_id))
        self._tls.device_set = True
        with self._lock:
            self._refs += 1
            self._tls.generation = self._generation
        return True

    def reset_thread(self) -> None:
        """Balance this thread's aclrtSetDevice (a worker that set the device, at its close); nothing
        when :meth:`reset_all` has balanced it already (the backend closed first, from its thread)."""
        if not getattr(self._tls, "device_set", False):
            return
        self._tls.device_set = False
        with self._lock:  # held through the reset: reset_all cannot count this reference in between
            if self._tls.generation != self._generation:
                return
            self._refs -= 1
            status = self.api.aclrtResetDevice(self.device_id)
        if status:
            log.error("aclrtResetDevice failed with %s: %s", code_name(status), self.api.recent_error())

    def reset_all(self) -> None:
        """Balance every aclrtSetDevice this device made (any thread's), from this thread."""
        with self._lock:
            refs, self._refs = self._refs, 0
            self._generation += 1
            statuses = [self.api.aclrtResetDevice(self.device_id) for _ in range(refs)]
        self._tls.device_set = False
        for status in statuses:
            if status:
                log.error("aclrtResetDevice failed with %s: %s", code_name(status), self.api.recent_error())

    # --- errors --------------------------------------------------------------------------------------

    def fault(self, what: str, status: int) -> DeviceFault:
        """The DeviceFault for a failed runtime call; reads this thread's aclGetRecentErrMsg."""
        message = self.api.recent_error()
        text = f"{what} failed on {self.description} with {code_name(status)}"
        return DeviceFault(f"{text}: {message}" if message else text, aclnn_status=status, device_message=message)

    def check(self, what: str, status: int) -> None:
        if status:
            raise self.fault(what, status)

    # --- streams and memory --------------------------------------------------------------------------

    def create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self.check("aclrtCreateStream", self.api.aclrtCreateStream(ctypes.byref(stream)))
        assert stream.value is not None  # check() raised unless the runtime filled it in
        return stream.value

    def destroy_stream(self, stream: int) -> None:
        """aclrtDestroyStream, which waits for the stream's kernels: only for a stream known idle."""
        status = self.api.aclrtDestroyStream(stream)
        if status:
            log.error("aclrtDestroyStream failed with %s: %s", code_name(status), self.api.recent_error())

    def force_destroy_stream(self, stream: int) -> bool:
        """aclrtDestroyStreamForce (does not wait; the stream's unfinished work is dropped).

        Returns False when the runtime has no aclrtDestroyStreamForce or it failed: the stream is then
        left to aclrtResetDevice.
        """
        if self.api.aclrtDestroyStreamForce is None:
            return False
        status = self.api.aclrtDestroyStreamForce(stream)
        if status:
            log.error("aclrtDestroyStreamForce failed with %s: %s", code_name(status), self.api.recent_error())
        return status == 0

    def free(self, pointer: int) -> None:
        """aclrtFree, which frees at once and waits for nothing: only memory no unfinished kernel uses."""
        status = self.api.aclrtFree(pointer)
        if status:
            log.error("aclrtFree failed with %s: %s", code_name(status), self.api.recent_error())

    def is_idle(self, stream: int) -> bool:
        """Whether ``stream`` has finished all its work, without waiting (``aclrtStreamQuery``).

        False unless the runtime reports ACL_STREAM_STATUS_COMPLETE: a failed query or a status this
        binding cannot read keeps the stream busy. A runtime without aclrtStreamQuery is asked with
        the shortest valid sync, 1 ms.
        """
        if self.api.aclrtStreamQuery is None:
            return self._sync(stream, 1) == 0
        status = ctypes.c_int(-1)
        code = self.api.aclrtStreamQuery(stream, ctypes.byref(status))
        if code:
            log.warning(
                "aclrtStreamQuery failed with %s: %s; the stream is kept as busy",
                code_name(code),
                self.api.recent_error(),
            )
            return False
        if status.value not in (ACL_STREAM_STATUS_COMPLETE, ACL_STREAM_STATUS_NOT_READY):
            log.warning(
                "aclrtStreamQuery reported status %d, which this binding cannot read; the stream is kept as busy",
                status.value,
            )
        return status.value == ACL_STREAM_STATUS_COMPLETE

    def wait_idle(self, stream: int, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` seconds (None: forever) for ``stream``; True when it is idle afterwards.

        A sync that fails with an error other than a timeout says the work has ended, but not that the
        stream is idle: that is asked again with :meth:`is_idle`.
        """
        status = self._sync(stream, timeout_ms(timeout_s))
        if status == 0:
            return True
        if status == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
            return False
        return self.is_idle(stream)

    def _sync(self, stream: int, milliseconds: int) -> int:
        """aclrtSynchronizeStreamWithTimeout; a failure's message is consumed (logged unless a timeout)."""
        status = self.api.aclrtSynchronizeStreamWithTimeout(stream, milliseconds)
        if status:
            message = self.api.recent_error()  # consumed: it must not show up in a later error
            if status != ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
                log.warning("a stream sync failed with %s: %s", code_name(status), message)
        return status

    def malloc(self, size: int) -> int:
        """aclrtMalloc(ACL_MEM_MALLOC_HUGE_FIRST) of ``size`` bytes.

        Raises:
            DeviceFault: the runtime refused (207001 when out of device memory).
        """
        pointer = ctypes.c_void_p()
        self.check(
            f"aclrtMalloc ({size} bytes)", self.api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
        )
        assert pointer.value is not None  # check() raised unless the runtime filled it in
        return pointer.value

    # --- tensors and executors -----------------------------------------------------------------------

    def create_tensor(self, shape: tuple[int, ...], acl_type: int, pointer: int | None) -> int:
        """aclCreateTensor: ND, contiguous strides in elements, offset 0, storage shape = view shape."""
        rank = len(shape)
        dims = (ctypes.c_int64 * rank)(*shape)
        strides = (ctypes.c_int64 * rank)(*(math.prod(shape[d + 1 :]) for d in range(rank)))
        tensor = self.api.aclCreateTensor(dims, rank, acl_type, strides, 0, ACL_FORMAT_ND, dims, rank, pointer)
        if not tensor:
            message = self.api.recent_error()
            text = f"aclCreateTensor returned NULL for shape {list(shape)}"
            raise DeviceFault(f"{text}: {message}" if message else text, device_message=message)
        return tensor

    def destroy_tensor(self, tensor: int) -> None:
        status = self.api.aclDestroyTensor(tensor)
        if status:
            log.error("aclDestroyTensor failed with %s: %s", code_name(status), self.api.recent_error())

    def discard_executor(self, executor: int | None) -> None:
        """An executor phase one made but that will never run."""
        if not executor:
            return
        if self.api.aclDestroyAclOpExecutor is None:
            log.warning("this CANN has no aclDestroyAclOpExecutor: an executor that never ran is leaked (host memory)")
            return
        status = self.api.aclDestroyAclOpExecutor(executor)
        if status:
            log.error("aclDestroyAclOpExecutor failed with %s: %s", code_name(status), self.api.recent_error())

    def release_retired(self, retired: Retired) -> None:
        """Free what a retired stream's kernel used, then destroy the stream (it is idle)."""
        for pointer in retired.pointers:
            self.free(pointer)
        self.destroy_stream(retired.stream)
