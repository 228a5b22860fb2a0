"""The ascend backend: aclnnMoeInitRoutingV2Grad on an Ascend NPU, through CANN's C ABI with ctypes.

Importing this module loads nothing. The CANN libraries are loaded when an :class:`AscendBackend`
is made (or :func:`ascend_available` probes for them), from ``<ascend_home_path>/lib64`` first and
then the dynamic loader's path, with ``RTLD_GLOBAL``:

- ``libascendcl.so`` (or ``libacl_rt.so``): ``aclInit``, ``aclrt*``, ``aclGetRecentErrMsg``;
- ``libnnopbase.so``: ``aclCreateTensor``, ``aclDestroyTensor``, ``aclDestroyAclOpExecutor``;
- ``libopapi.so``, and ``libopapi_transformer.so`` where it exists (CANN 8.3 and later keep the
  operator there): ``aclnnMoeInitRoutingV2GradGetWorkspaceSize`` / ``aclnnMoeInitRoutingV2Grad``.

Threads and streams. The device context is per thread in CANN, so every thread that touches the
device calls ``aclrtSetDevice`` first (a thread-local flag remembers it; each call is one reference
that ``close`` balances with ``aclrtResetDevice``). Each pool worker owns one stream and a cache of
device buffers keyed by size. One call on a worker::

    retired streams polled ─> device buffers (cached) ─> host->device copies ─> three aclTensors
    ─> phase one (GetWorkspaceSize) ─> workspace (cached) ─> phase two on the worker's stream
    ─> aclrtSynchronizeStreamWithTimeout(remaining deadline, ms) ─> device->host copy ─> tensors destroyed

Errors. A nonzero status from phase one is the caller's input error: :class:`moegrad.InvalidArgument`
with that aclnn code. A failure of the runtime (malloc, memcpy, phase two, sync) is a
:class:`moegrad.DeviceFault` carrying ``aclGetRecentErrMsg``'s text. A sync that times out is
:class:`moegrad.DeadlineExceeded`; the kernel may still be running, so its stream is *retired*, not
destroyed: the stream and every buffer the kernel uses stay allocated until a later poll
(``aclrtSynchronizeStreamWithTimeout(stream, 0)``) sees the kernel finish, and the worker carries
on with a fresh stream. Freeing that memory earlier would let a running kernel write into memory
handed out for the next call. A retired stream still busy at close is left to ``aclrtResetDevice``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
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

__all__ = ["ACL_DATA_TYPES", "AscendBackend", "CannUnavailable", "ascend_available"]

log = logging.getLogger("moegrad_service.engine.ascend")

#: Wire dtype name -> ``aclDataType`` (CANN ``include/acl/acl_base.h``, ``enum aclDataType``:
#: ACL_FLOAT = 0, ACL_FLOAT16 = 1, ACL_INT32 = 3, ACL_BF16 = 27). The one dtype table of this binding.
ACL_DATA_TYPES: Mapping[str, int] = {"float32": 0, "float16": 1, "int32": 3, "bfloat16": 27}

# Enum values and error codes, from the CANN headers named beside each.
ACL_FORMAT_ND = 2                      # acl/acl_base.h, aclFormat
ACL_MEM_MALLOC_HUGE_FIRST = 0          # acl/acl_rt.h, aclrtMemMallocPolicy
ACL_MEMCPY_HOST_TO_DEVICE = 1          # acl/acl_rt.h, aclrtMemcpyKind
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_HBM_MEM = 1                        # acl/acl_rt.h, aclrtMemAttr
ACL_ERROR_REPEAT_INITIALIZE = 100002   # acl/acl_base.h
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046  # acl/error_codes/rt_error_codes.h
_ACL_ERROR_NAMES = {
    100000: "ACL_ERROR_INVALID_PARAM", 100001: "ACL_ERROR_UNINITIALIZE", 107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID", 107002: "ACL_ERROR_RT_CONTEXT_NULL",
    107003: "ACL_ERROR_RT_STREAM_CONTEXT", 207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE", 507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507015: "ACL_ERROR_RT_AICORE_EXCEPTION", 507035: "ACL_ERROR_RT_VECTOR_CORE_EXCEPTION",
    507046: "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT", 507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}

#: The order of adds on the SoCs whose kernel moegrad emulates (DESIGN.md section 3).
A2_A3_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")
#: Device buffers are sized in multiples of this many bytes (CANN pads allocations to 32 bytes).
ALIGN_BYTES = 32
#: Retired (timed-out, maybe still running) streams a worker tolerates before it refuses new calls.
MAX_RETIRED_STREAMS = 4

SET_ENV_HINT = (
    "Source CANN's environment first (`source /usr/local/Ascend/ascend-toolkit/set_env.sh`, or the "
    "set_env.sh of your install), or set MOEGRAD_ASCEND_HOME_PATH to the CANN directory whose lib64 "
    "holds the libraries."
)


class CannUnavailable(DeviceFault):
    """CANN's libraries, an operator symbol, or the requested NPU cannot be found.

    Raised when an :class:`AscendBackend` is made; the message names what is missing and how to
    make it available (the ``set_env.sh`` hint). The service reports it as a startup error.
    """


# --- the C ABI ---------------------------------------------------------------------------------------

_c = ctypes
_STATUS = _c.c_int32  # aclError and aclnnStatus are int32_t
_PTR = _c.c_void_p
_I64P = _c.POINTER(_c.c_int64)

#: (symbol, where it lives, restype, argtypes, required). Prototypes from acl/acl.h, acl/acl_base.h,
#: acl/acl_rt.h, aclnn/acl_meta.h and aclnnop/aclnn_moe_init_routing_v2_grad.h; enums are C ints,
#: pointer returns are c_void_p.
_PROTOTYPES: tuple[tuple[str, str, object, tuple, bool], ...] = (
    ("aclInit", "runtime", _STATUS, (_c.c_char_p,), True),
    ("aclFinalize", "runtime", _STATUS, (), True),
    ("aclGetRecentErrMsg", "runtime", _PTR, (), True),
    ("aclrtGetSocName", "runtime", _PTR, (), False),
    ("aclrtGetDeviceCount", "runtime", _STATUS, (_c.POINTER(_c.c_uint32),), True),
    ("aclrtSetDevice", "runtime", _STATUS, (_c.c_int32,), True),
    ("aclrtResetDevice", "runtime", _STATUS, (_c.c_int32,), True),
    ("aclrtCreateStream", "runtime", _STATUS, (_c.POINTER(_PTR),), True),
    ("aclrtDestroyStream", "runtime", _STATUS, (_PTR,), True),
    ("aclrtSynchronizeStreamWithTimeout", "runtime", _STATUS, (_PTR, _c.c_int32), True),
    ("aclrtMalloc", "runtime", _STATUS, (_c.POINTER(_PTR), _c.c_size_t, _c.c_int), True),
    ("aclrtFree", "runtime", _STATUS, (_PTR,), True),
    ("aclrtMemcpy", "runtime", _STATUS, (_PTR, _c.c_size_t, _PTR, _c.c_size_t, _c.c_int), True),
    ("aclrtGetMemInfo", "runtime", _STATUS, (_c.c_int, _c.POINTER(_c.c_size_t), _c.POINTER(_c.c_size_t)), True),
    ("aclCreateTensor", "tensor", _PTR,
     (_I64P, _c.c_uint64, _c.c_int, _I64P, _c.c_int64, _c.c_int, _I64P, _c.c_uint64, _PTR), True),
    ("aclDestroyTensor", "tensor", _STATUS, (_PTR,), True),
    ("aclDestroyAclOpExecutor", "tensor", _STATUS, (_PTR,), False),
    ("aclnnMoeInitRoutingV2GradGetWorkspaceSize", "op", _STATUS,
     (_PTR, _PTR, _c.c_int64, _c.c_int64, _c.c_int64, _PTR, _c.POINTER(_c.c_uint64), _c.POINTER(_PTR)), True),
    ("aclnnMoeInitRoutingV2Grad", "op", _STATUS, (_PTR, _c.c_uint64, _PTR, _PTR), True),
)


def _open_library(names: tuple[str, ...], home: Path | None, *, required: bool) -> tuple[ctypes.CDLL | None, str]:
    """Load the first of ``names`` found in ``home/lib64``, then on the loader path (RTLD_GLOBAL)."""
    tried = []
    for name in names:
        if home is not None:
            path = home / "lib64" / name
            if path.is_file():
                try:
                    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL), str(path)
                except OSError as exc:
                    raise CannUnavailable(f"{path} exists but cannot be loaded: {exc}. {SET_ENV_HINT}") from exc
            tried.append(str(path))
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL), name
        except OSError:
            tried.append(f"{name} on the loader path (LD_LIBRARY_PATH, ld.so.cache)")
    if required:
        raise CannUnavailable(f"the CANN library {' or '.join(names)} was not found (tried {'; '.join(tried)}). "
                              f"{SET_ENV_HINT}")
    return None, ""


class _Cann:
    """The loaded libraries, with one prototyped ctypes function per symbol of ``_PROTOTYPES``."""

    def __init__(self, home: Path | None) -> None:
        runtime, runtime_path = _open_library(("libascendcl.so", "libacl_rt.so"), home, required=True)
        nnopbase, nnopbase_path = _open_library(("libnnopbase.so",), home, required=True)
        opapi, opapi_path = _open_library(("libopapi.so",), home, required=True)
        transformer, transformer_path = _open_library(("libopapi_transformer.so",), home, required=False)
        places = {
            "runtime": [(runtime, runtime_path)],
            "tensor": [(nnopbase, nnopbase_path), (opapi, opapi_path)],
            "op": [(lib, path) for lib, path in ((transformer, transformer_path), (opapi, opapi_path)) if lib],
        }
        #: symbol -> the library it was taken from
        self.where: dict[str, str] = {}
        for symbol, place, restype, argtypes, required in _PROTOTYPES:
            function = None
            for library, path in places[place]:
                try:
                    function = library[symbol]
                except AttributeError:
                    continue
                self.where[symbol] = path
                break
            if function is None:
                if required:
                    searched = ", ".join(path for _, path in places[place])
                    raise CannUnavailable(f"{symbol} is not exported by {searched}: this CANN is incomplete or too old "
                                          f"for aclnnMoeInitRoutingV2Grad (CANN 8.0 or later). {SET_ENV_HINT}")
            else:
                function.restype = restype
                function.argtypes = argtypes
            setattr(self, symbol, function)

    def recent_error(self) -> str | None:
        """``aclGetRecentErrMsg()`` of this thread (CANN clears it once read), or None."""
        pointer = self.aclGetRecentErrMsg()
        text = ctypes.string_at(pointer).decode("utf-8", "replace").strip() if pointer else ""
        return text or None

    def soc_name(self) -> str | None:
        if self.aclrtGetSocName is None:
            return None
        pointer = self.aclrtGetSocName()
        return ctypes.string_at(pointer).decode("utf-8", "replace").strip() or None if pointer else None


_LOADED: dict[str, _Cann] = {}
_LOAD_LOCK = threading.Lock()


def _load(ascend_home_path: str | Path | None) -> _Cann:
    home = None if ascend_home_path is None else Path(ascend_home_path)
    key = "" if home is None else str(home.resolve())
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = _Cann(home)
        return _LOADED[key]


# aclInit / aclFinalize are process-wide: reference-count the backends that use them.
_ACL_LOCK = threading.Lock()
_acl_users = 0
_acl_owned = False  # False when someone else in the process (e.g. torch_npu) had initialised ACL


def _acl_acquire(api: _Cann) -> None:
    global _acl_users, _acl_owned
    with _ACL_LOCK:
        if _acl_users == 0:
            status = api.aclInit(None)
            if status not in (0, ACL_ERROR_REPEAT_INITIALIZE):
                message = api.recent_error()
                raise DeviceFault(f"aclInit failed with {_code_name(status)}" + (f": {message}" if message else ""),
                                  aclnn_status=status, device_message=message)
            _acl_owned = status == 0
        _acl_users += 1


def _acl_release(api: _Cann) -> None:
    global _acl_users, _acl_owned
    with _ACL_LOCK:
        _acl_users -= 1
        if _acl_users == 0 and _acl_owned:
            _acl_owned = False
            status = api.aclFinalize()
            if status not in (0, ACL_ERROR_REPEAT_FINALIZE):
                log.error("aclFinalize failed with %s: %s", _code_name(status), api.recent_error())


def _code_name(code: int) -> str:
    name = _ACL_ERROR_NAMES.get(code) or AclnnStatus.name_of(code)
    return f"{name} ({code})"


def ascend_available(ascend_home_path: str | Path | None = None) -> bool:
    """True when CANN's libraries load and ``aclrtGetDeviceCount`` reports at least one NPU.

    Loads the libraries (nothing else: no ``aclInit``, no device is opened). Used by
    ``backend="auto"``.
    """
    try:
        api = _load(ascend_home_path)
    except CannUnavailable:
        return False
    count = ctypes.c_uint32(0)
    return api.aclrtGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0


# --- device buffers ----------------------------------------------------------------------------------


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class _BufferCache:
    """Free device buffers of one stream, by size (least recently returned size evicted first)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self._free: OrderedDict[int, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return sum(map(len, self._free.values()))

    def take(self, size: int) -> int | None:
        pointers = self._free.get(size)
        if not pointers:
            return None
        pointer = pointers.pop()
        if not pointers:
            del self._free[size]
        self.bytes -= size
        return pointer

    def give(self, size: int, pointer: int) -> list[int]:
        """Keep ``pointer``; returns the buffers evicted to stay under the limit (the caller frees them)."""
        self._free.setdefault(size, []).append(pointer)
        self._free.move_to_end(size)
        self.bytes += size
        evicted = []
        while self.bytes > self.limit_bytes:
            oldest, pointers = next(iter(self._free.items()))
            evicted.append(pointers.pop(0))
            self.bytes -= oldest
            if not pointers:
                del self._free[oldest]
        return evicted

    def drain(self) -> list[int]:
        pointers = [p for ps in self._free.values() for p in ps]
        self._free.clear()
        self.bytes = 0
        return pointers


@dataclass(eq=False)
class _Retired:
    """A stream whose kernel missed its deadline, and the device memory that kernel may still use."""

    stream: int
    pointers: list[int]


@dataclass(eq=False)
class _Lease:
    """The device buffers one call holds: (size, pointer) pairs."""

    blocks: list[tuple[int, int]] = field(default_factory=list)


# --- the backend -------------------------------------------------------------------------------------


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
        self._api = _load(ascend_home_path)
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._device_refs = 0
        self._workers: set[_AscendWorker] = set()
        self._abandoned: list[_Retired] = []
        self._closed = False
        _acl_acquire(self._api)
        try:
            count = ctypes.c_uint32(0)
            self._check("aclrtGetDeviceCount", self._api.aclrtGetDeviceCount(ctypes.byref(count)))
            if not 0 <= self.device_id < count.value:
                raise CannUnavailable(f"NPU {self.device_id} is not visible to this process: CANN reports "
                                      f"{count.value} device(s). Check /dev/davinci*, the container's device "
                                      "mounts and ASCEND_RT_VISIBLE_DEVICES.")
            self._ensure_device()
            soc = self._api.soc_name()
        except BaseException:
            self._reset_all_refs()
            _acl_release(self._api)
            raise
        self.soc_name = soc
        self.device = f"{soc} #{self.device_id}" if soc else f"ascend device {self.device_id}"
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
        self._ensure_device()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check("aclrtGetMemInfo", self._api.aclrtGetMemInfo(ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total)))
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
            self._ensure_device()
        except DeviceFault:
            log.exception("closing %s: cannot set the device on this thread", self.device)
        for worker in workers:
            worker._shutdown()
        for retired in self._take_abandoned():
            if self._wait_idle(retired.stream, self.drain_timeout_s):
                self._release_retired(retired)
            else:
                log.error("closing %s: a timed-out kernel is still running; its stream and %d buffers are left to "
                          "aclrtResetDevice", self.device, len(retired.pointers))
        self._reset_all_refs()
        _acl_release(self._api)

    # --- device context and helpers ----------------------------------------------------------------

    def _ensure_device(self) -> bool:
        """aclrtSetDevice on this thread unless it already did; True when this call set it."""
        if getattr(self._tls, "device_set", False):
            return False
        self._check("aclrtSetDevice", self._api.aclrtSetDevice(self.device_id))
        self._tls.device_set = True
        with self._lock:
            self._device_refs += 1
        return True

    def _reset_thread_device(self) -> None:
        """Balance this thread's aclrtSetDevice (a worker that set the device, at its close)."""
        if not getattr(self._tls, "device_set", False):
            return
        self._tls.device_set = False
        with self._lock:
            self._device_refs -= 1
        status = self._api.aclrtResetDevice(self.device_id)
        if status:
            log.error("aclrtResetDevice failed with %s: %s", _code_name(status), self._api.recent_error())

    def _reset_all_refs(self) -> None:
        """Balance every aclrtSetDevice this backend made (any thread's), from this thread."""
        with self._lock:
            refs, self._device_refs = self._device_refs, 0
        self._tls.device_set = False
        for _ in range(refs):
            status = self._api.aclrtResetDevice(self.device_id)
            if status:
                log.error("aclrtResetDevice failed with %s: %s", _code_name(status), self._api.recent_error())

    def _fault(self, what: str, status: int) -> DeviceFault:
        """The DeviceFault for a failed runtime call; reads this thread's aclGetRecentErrMsg."""
        message = self._api.recent_error()
        text = f"{what} failed on {getattr(self, 'device', 'the NPU')} with {_code_name(status)}"
        return DeviceFault(f"{text}: {message}" if message else text, aclnn_status=status, device_message=message)

    def _check(self, what: str, status: int) -> None:
        if status:
            raise self._fault(what, status)

    def _create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self._check("aclrtCreateStream", self._api.aclrtCreateStream(ctypes.byref(stream)))
        return stream.value

    def _destroy_stream(self, stream: int) -> None:
        status = self._api.aclrtDestroyStream(stream)
        if status:
            log.error("aclrtDestroyStream failed with %s: %s", _code_name(status), self._api.recent_error())

    def _free(self, pointer: int) -> None:
        status = self._api.aclrtFree(pointer)
        if status:
            log.error("aclrtFree failed with %s: %s", _code_name(status), self._api.recent_error())

    def _wait_idle(self, stream: int, timeout_s: float | None) -> bool:
        """Synchronise ``stream`` (``timeout_s`` 0: just poll); True when it is idle afterwards.

        A sync that reports an error other than a timeout also means the stream's work has ended.
        """
        status = self._api.aclrtSynchronizeStreamWithTimeout(stream, _timeout_ms(timeout_s))
        if status == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
            self._api.recent_error()  # consume it: it must not show up in a later error
            return False
        if status:
            log.warning("a retired stream finished with %s: %s", _code_name(status), self._api.recent_error())
        return True

    def _release_retired(self, retired: _Retired) -> None:
        for pointer in retired.pointers:
            self._free(pointer)
        self._destroy_stream(retired.stream)

    def _abandon(self, retired: list[_Retired]) -> None:
        with self._lock:
            self._abandoned.extend(retired)

    def _take_abandoned(self) -> list[_Retired]:
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        return abandoned


def _timeout_ms(timeout_s: float | None) -> int:
    """aclrtSynchronizeStreamWithTimeout's argument: -1 waits forever, 0 only polls."""
    if timeout_s is None:
        return -1
    return min(2**31 - 1, max(0, math.ceil(timeout_s * 1000)))


def _host_array(array: object, field_name: str) -> tuple[np.ndarray, int]:
    """A C-contiguous little-endian copy (or the array itself when it already is one) and its aclDataType."""
    if not isinstance(array, np.ndarray):
        raise InvalidArgument(f"{field_name} must be a numpy.ndarray, got {type(array).__name__}",
                              aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID, field=field_name)
    name = dtype_name(array.dtype)
    if name is None:
        raise InvalidArgument(f"{field_name}.dtype={array.dtype} has no aclDataType in this binding "
                              f"(one of {', '.join(ACL_DATA_TYPES)})",
                              aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID, field=field_name)
    return np.ascontiguousarray(array, dtype=DTYPES[name]), ACL_DATA_TYPES[name]


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
        self._owns_device_ref = backend._ensure_device()
        try:
            self._stream: int | None = backend._create_stream()
        except BaseException:
            if self._owns_device_ref:
                backend._reset_thread_device()
            raise
        self._cache = _BufferCache(backend.cache_bytes_per_stream)
        self._workspace: tuple[int, int] | None = None  # (size, pointer)
        self._retired: list[_Retired] = []
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
        backend = self._backend
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
        if call.grad_expanded_x is not None:
            grad, grad_type = _host_array(call.grad_expanded_x, "grad_expanded_x")
        if call.expanded_row_idx is not None:
            idx, idx_type = _host_array(call.expanded_row_idx, "expanded_row_idx")
        tokens = idx.shape[0] // top_k if idx is not None and idx.ndim >= 1 and top_k > 0 else 0
        hidden = grad.shape[-1] if grad is not None and grad.ndim >= 1 else 0
        result = np.empty((tokens, hidden), dtype=DTYPES["float32"] if grad is None else grad.dtype)

        backend._ensure_device()
        self._poll_retired()
        if len(self._retired) >= MAX_RETIRED_STREAMS:
            raise DeviceFault(f"{len(self._retired)} kernels that missed their deadline are still running on "
                              f"{backend.device}; this worker takes no more calls until they finish")
        if self._stream is None:  # replacing a timed-out stream failed last time
            self._stream = backend._create_stream()
        lease = _Lease()
        tensors: list[int] = []
        retired = False
        try:
            handles = []
            for array, acl_type in ((grad, grad_type if grad is not None else 0),
                                    (idx, idx_type if idx is not None else 0)):
                pointer = None if array is None else self._upload(array, lease)
                handles.append(None if array is None else self._tensor(array.shape, acl_type, pointer, tensors))
            out_pointer = self._acquire(result.nbytes, lease) if result.nbytes else None
            out_type = ACL_DATA_TYPES[dtype_name(result.dtype)]
            out = self._tensor(result.shape, out_type, out_pointer, tensors)

            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                handles[0], handles[1], top_k, drop_pad_mode, active_num, out,
                ctypes.byref(workspace_size), ctypes.byref(executor))
            if status:
                message = self._api.recent_error()
                raise InvalidArgument(
                    f"the NPU rejected the call (aclnnMoeInitRoutingV2GradGetWorkspaceSize: {_code_name(status)})"
                    + (f": {message}" if message else ""), aclnn_status=status, field=None)
            try:
                workspace = self._ensure_workspace(workspace_size.value)
            except BaseException:
                self._discard_executor(executor.value)
                raise
            status = self._api.aclnnMoeInitRoutingV2Grad(workspace, workspace_size.value, executor, self._stream)
            if status:
                fault = backend._fault("aclnnMoeInitRoutingV2Grad", status)
                retired = not self._settle(deadline, lease)  # a failed launch may have queued part of its work
                raise fault
            status = self._api.aclrtSynchronizeStreamWithTimeout(self._stream, _timeout_ms(_left(deadline)))
            if status == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
                message = self._api.recent_error()
                retired = True
                self._retire(lease)
                budget = "no deadline" if timeout_s is None else f"{timeout_s:.3f} s"
                raise DeadlineExceeded(f"{backend.device} did not finish within the deadline ({budget}); "
                                       "the stream was replaced" + (f" ({message})" if message else ""))
            if status:
                fault = backend._fault("aclrtSynchronizeStreamWithTimeout", status)
                self._replace_stream()  # the kernel ended in error: start the next call on a fresh stream
                raise fault
            if result.nbytes:
                backend._check("aclrtMemcpy (device to host)", self._api.aclrtMemcpy(
                    result.ctypes.data, result.nbytes, out_pointer, result.nbytes, ACL_MEMCPY_DEVICE_TO_HOST))
            return result
        finally:
            for tensor in tensors:
                status = self._api.aclDestroyTensor(tensor)
                if status:
                    log.error("aclDestroyTensor failed with %s: %s", _code_name(status), self._api.recent_error())
            if not retired:
                for size, pointer in lease.blocks:
                    for evicted in self._cache.give(size, pointer):
                        backend._free(evicted)

    def close(self) -> None:
        """Synchronise, free the cache and workspace, destroy the stream, balance this thread's aclrtSetDevice."""
        if self._closed:
            return
        backend = self._backend
        if not backend._closed:
            try:
                backend._ensure_device()
            except DeviceFault:
                log.exception("closing worker %d: cannot set the device on this thread", self.index)
            self._shutdown()
        if self._owns_device_ref:
            backend._reset_thread_device()

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
        backend = self._backend
        with backend._lock:
            backend._workers.discard(self)
        leftover = []
        if self._stream is not None and not backend._wait_idle(self._stream, backend.drain_timeout_s):
            leftover.append(_Retired(self._stream, self._cache.drain() + self._take_workspace()))
            self._stream = None
        for retired in self._retired:
            if backend._wait_idle(retired.stream, backend.drain_timeout_s):
                backend._release_retired(retired)
            else:
                leftover.append(retired)
        self._retired = []
        backend._abandon(leftover)
        for pointer in self._cache.drain() + self._take_workspace():
            backend._free(pointer)
        if self._stream is not None:
            backend._destroy_stream(self._stream)
            self._stream = None

    def _malloc(self, size: int) -> int:
        """aclrtMalloc; on failure, free this worker's idle cached buffers and try once more."""
        pointer = ctypes.c_void_p()
        status = self._api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
        if status and len(self._cache):
            first = self._backend._fault("aclrtMalloc", status)
            for cached in self._cache.drain():
                self._backend._free(cached)
            status = self._api.aclrtMalloc(ctypes.byref(pointer), size, ACL_MEM_MALLOC_HUGE_FIRST)
            if status:
                raise self._backend._fault("aclrtMalloc", status) from first
        self._backend._check(f"aclrtMalloc ({size} bytes)", status)
        return pointer.value

    def _acquire(self, nbytes: int, lease: _Lease) -> int:
        size = _aligned(nbytes)
        pointer = self._cache.take(size)
        if pointer is None:
            pointer = self._malloc(size)
        lease.blocks.append((size, pointer))
        return pointer

    def _upload(self, array: np.ndarray, lease: _Lease) -> int | None:
        if array.nbytes == 0:
            return None
        pointer = self._acquire(array.nbytes, lease)
        self._backend._check("aclrtMemcpy (host to device)", self._api.aclrtMemcpy(
            pointer, _aligned(array.nbytes), array.ctypes.data, array.nbytes, ACL_MEMCPY_HOST_TO_DEVICE))
        return pointer

    def _tensor(self, shape: tuple[int, ...], acl_type: int, pointer: int | None, tensors: list[int]) -> int:
        rank = len(shape)
        dims = (ctypes.c_int64 * rank)(*shape)
        strides = (ctypes.c_int64 * rank)(*(int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)))
        tensor = self._api.aclCreateTensor(dims, rank, acl_type, strides, 0, ACL_FORMAT_ND, dims, rank, pointer)
        if not tensor:
            message = self._api.recent_error()
            raise DeviceFault(f"aclCreateTensor returned NULL for shape {list(shape)}" + (f": {message}" if message else ""),
                              device_message=message)
        tensors.append(tensor)
        return tensor

    def _ensure_workspace(self, size: int) -> int | None:
        if size == 0:
            return None
        if self._workspace is not None and self._workspace[0] >= size:
            return self._workspace[1]
        for pointer in self._take_workspace():  # the stream is idle: the old one is free to go
            self._backend._free(pointer)
        aligned = _aligned(size)
        self._workspace = (aligned, self._malloc(aligned))
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
            log.error("aclDestroyAclOpExecutor failed with %s: %s", _code_name(status), self._api.recent_error())

    def _settle(self, deadline: float | None, lease: _Lease) -> bool:
        """After a failed launch: wait for whatever it queued; True when the stream is idle (else it is retired)."""
        if self._backend._wait_idle(self._stream, _left(deadline)):
            return True
        self._retire(lease)
        return False

    def _retire(self, lease: _Lease) -> None:
        """Set the current stream aside with the buffers its kernel may still use; continue on a new stream."""
        pointers = [pointer for _, pointer in lease.blocks] + self._take_workspace()
        self._retired.append(_Retired(self._stream, pointers))
        self._stream = None
        try:
            self._stream = self._backend._create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _replace_stream(self) -> None:
        old, self._stream = self._stream, None
        self._backend._destroy_stream(old)
        try:
            self._stream = self._backend._create_stream()
        except DeviceFault:
            log.exception("worker %d: no replacement stream; the next call tries again", self.index)

    def _poll_retired(self) -> None:
        """Release every retired stream whose kernel has finished by now (a zero-timeout sync)."""
        still = []
        for retired in self._retired:
            if self._backend._wait_idle(retired.stream, 0):
                self._backend._release_retired(retired)
            else:
                still.append(retired)
        self._retired = still


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
