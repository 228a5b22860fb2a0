"""ACL initialisation, the per-thread device context, streams and the runtime calls around them.

The device context is per thread in CANN, so every thread that touches the device calls
``aclrtSetDevice`` first: :meth:`Device.ensure` does it once per thread (a thread-local flag
remembers it) and counts the reference, which :meth:`Device.reset_thread` / :meth:`Device.reset_all`
balance with ``aclrtResetDevice``. ``aclInit`` / ``aclFinalize`` are process-wide and
reference-counted across the backends of this process (:func:`acl_acquire` / :func:`acl_release`).
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
    Cann,
    code_name,
)
from moegrad_service.engine.ascend._buffers import Retired

log = logging.getLogger("moegrad_service.engine.ascend")

# aclInit / aclFinalize are process-wide: reference-count the backends that use them.
_ACL_LOCK = threading.Lock()
_acl_users = 0
_acl_owned = False  # False when someone else in the process (e.g. torch_npu) had initialised ACL


def acl_acquire(api: Cann) -> None:
    """``aclInit`` for the first backend of the process (an ACL someone else initialised is shared)."""
    global _acl_users, _acl_owned
    with _ACL_LOCK:
        if _acl_users == 0:
            status = api.aclInit(None)
            if status not in (0, ACL_ERROR_REPEAT_INITIALIZE):
                message = api.recent_error()
                raise DeviceFault(f"aclInit failed with {code_name(status)}" + (f": {message}" if message else ""),
                                  aclnn_status=status, device_message=message)
            _acl_owned = status == 0
        _acl_users += 1


def acl_release(api: Cann) -> None:
    """Balance :func:`acl_acquire`; the last backend finalises ACL if this process initialised it."""
    global _acl_users, _acl_owned
    with _ACL_LOCK:
        _acl_users -= 1
        if _acl_users == 0 and _acl_owned:
            _acl_owned = False
            status = api.aclFinalize()
            if status not in (0, ACL_ERROR_REPEAT_FINALIZE):
                log.error("aclFinalize failed with %s: %s", code_name(status), api.recent_error())


def timeout_ms(timeout_s: float | None) -> int:
    """aclrtSynchronizeStreamWithTimeout's argument: -1 waits forever, 0 only polls."""
    if timeout_s is None:
        return -1
    return min(2**31 - 1, max(0, math.ceil(timeout_s * 1000)))


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

    # --- the per-thread context ----------------------------------------------------------------------

    def ensure(self) -> bool:
        """aclrtSetDevice on this thread unless it already did; True when this call set it."""
        if getattr(self._tls, "device_set", False):
            return False
        self.check("aclrtSetDevice", self.api.aclrtSetDevice(self.device_id))
        self._tls.device_set = True
        with self._lock:
            self._refs += 1
        return True

    def reset_thread(self) -> None:
        """Balance this thread's aclrtSetDevice (a worker that set the device, at its close)."""
        if not getattr(self._tls, "device_set", False):
            return
        self._tls.device_set = False
        with self._lock:
            self._refs -= 1
        status = self.api.aclrtResetDevice(self.device_id)
        if status:
            log.error("aclrtResetDevice failed with %s: %s", code_name(status), self.api.recent_error())

    def reset_all(self) -> None:
        """Balance every aclrtSetDevice this device made (any thread's), from this thread."""
        with self._lock:
            refs, self._refs = self._refs, 0
        self._tls.device_set = False
        for _ in range(refs):
            status = self.api.aclrtResetDevice(self.device_id)
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
        return stream.value

    def destroy_stream(self, stream: int) -> None:
        status = self.api.aclrtDestroyStream(stream)
        if status:
            log.error("aclrtDestroyStream failed with %s: %s", code_name(status), self.api.recent_error())

    def free(self, pointer: int) -> None:
        status = self.api.aclrtFree(pointer)
        if status:
            log.error("aclrtFree failed with %s: %s", code_name(status), self.api.recent_error())

    def wait_idle(self, stream: int, timeout_s: float | None) -> bool:
        """Synchronise ``stream`` (``timeout_s`` 0: just poll); True when it is idle afterwards.

        A sync that reports an error other than a timeout also means the stream's work has ended.
        """
        status = self.api.aclrtSynchronizeStreamWithTimeout(stream, timeout_ms(timeout_s))
        if status == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
            self.api.recent_error()  # consume it: it must not show up in a later error
            return False
        if status:
            log.warning("a retired stream finished with %s: %s", code_name(status), self.api.recent_error())
        return True

    def release_retired(self, retired: Retired) -> None:
        """Free what a retired stream's kernel used, then destroy the stream (it is idle)."""
        for pointer in retired.pointers:
            self.free(pointer)
        self.destroy_stream(retired.stream)
