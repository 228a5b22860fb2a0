"""CANN's C ABI for aclnnMoeInitRoutingV2Grad: enum values, error codes, prototypes, library loading.

Nothing is loaded at import time. :func:`load` opens the libraries once per install (cached) and
binds every symbol of :data:`PROTOTYPES` with its exact argument and return types:

- the runtime, ``libacl_rt.so`` (the 9.x name) or else ``libascendcl.so``, and ``libnnopbase.so``
  (tensors, executors), from ``<ascend_home_path>/lib64`` first, then the dynamic loader's path,
  with ``RTLD_GLOBAL`` (the operator libraries resolve their own imports against them);
- exactly one operator library, the first of :func:`operator_candidates` that exports both entry
  points, with ``RTLD_LOCAL``: custom packages first (``$ASCEND_CUSTOM_OPP_PATH`` entries, then
  ``$ASCEND_OPP_PATH/vendors/*`` in ``config.ini``'s ``load_priority``), then the per-repository
  ``libopapi_transformer.so`` (the operator's home from CANN 8.3), then the aggregate
  ``libopapi.so``. A candidate that loads but lacks the operator is closed again, so two operator
  libraries are never used together.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moegrad import AclnnStatus, DeviceFault

#: Wire dtype name -> ``aclDataType`` (CANN ``include/acl/acl_base.h``, ``enum aclDataType``:
#: ACL_FLOAT = 0, ACL_FLOAT16 = 1, ACL_INT32 = 3, ACL_BF16 = 27). The one dtype table of this binding.
ACL_DATA_TYPES: Mapping[str, int] = {"float32": 0, "float16": 1, "int32": 3, "bfloat16": 27}

# Enum values and error codes, from the CANN headers named beside each.
ACL_FORMAT_ND = 2  # acl/acl_base.h, aclFormat
ACL_MEM_MALLOC_HUGE_FIRST = 0  # acl/acl_rt.h, aclrtMemMallocPolicy
ACL_MEMCPY_HOST_TO_DEVICE = 1  # acl/acl_rt.h, aclrtMemcpyKind
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_HBM_MEM = 1  # acl/acl_rt.h, aclrtMemAttr
ACL_ERROR_REPEAT_INITIALIZE = 100002  # acl/acl_base.h
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046  # acl/error_codes/rt_error_codes.h
ACL_STREAM_STATUS_COMPLETE = 0  # acl/acl_rt.h, aclrtStreamStatus
ACL_STREAM_STATUS_NOT_READY = 1
ACL_PKG_VERSION_MAX_SIZE = 128  # acl/acl_rt.h: the size of aclsysGetVersionStr's output buffer
_ACL_ERROR_NAMES = {
    100000: "ACL_ERROR_INVALID_PARAM",
    100001: "ACL_ERROR_UNINITIALIZE",
    100003: "ACL_ERROR_INVALID_FILE",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    107003: "ACL_ERROR_RT_STREAM_CONTEXT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507015: "ACL_ERROR_RT_AICORE_EXCEPTION",
    507035: "ACL_ERROR_RT_VECTOR_CORE_EXCEPTION",
    507046: "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}  # aclnn codes are named by the client's one table, moegrad.AclnnStatus

SET_ENV_HINT = (
    "Source CANN's environment first (`source /usr/local/Ascend/cann/set_env.sh` from CANN 8.5, "
    "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` before, or the set_env.sh of your install): it "
    "sets ASCEND_HOME_PATH, ASCEND_OPP_PATH and the loader path; MOEGRAD_ASCEND_HOME_PATH can name the CANN "
    "directory whose lib64 holds the libraries."
)
#: The runtime library, newest name first.
RUNTIME_LIBRARIES = ("libacl_rt.so", "libascendcl.so")
#: The built-in operator libraries, per-repository first, then the aggregate.
OPERATOR_LIBRARIES = ("libopapi_transformer.so", "libopapi.so")
#: The operator's two entry points; an operator library must export both.
OPERATOR_SYMBOLS = ("aclnnMoeInitRoutingV2GradGetWorkspaceSize", "aclnnMoeInitRoutingV2Grad")


class CannUnavailable(DeviceFault):
    """CANN's libraries, an operator symbol, or the requested NPU cannot be found.

    Raised when an :class:`AscendBackend` is made; the message names what is missing and how to
    make it available (the ``set_env.sh`` hint). The service reports it as a startup error.
    """


def code_name(code: int) -> str:
    """``"NAME (code)"`` for an aclError or aclnnStatus."""
    name = _ACL_ERROR_NAMES.get(code) or AclnnStatus.name_of(code)
    return f"{name} ({code})"


_c = ctypes
_STATUS = _c.c_int32  # aclError and aclnnStatus are int32_t
_PTR = _c.c_void_p
_I64P = _c.POINTER(_c.c_int64)

#: (symbol, where it lives, restype, argtypes, required). Prototypes from acl/acl.h, acl/acl_base.h,
#: acl/acl_rt.h, aclnn/acl_meta.h and aclnnop/aclnn_moe_init_routing_v2_grad.h; enums are C ints,
#: pointer returns are c_void_p. ``aclError aclsysGetVersionStr(char *pkgName, char *versionStr)``
#: (hicann/runtime docs/api_docs/aclsysGetVersionStr.md @ 06531b19; exported by libacl_rt.so, built
#: from src/acl/aclrt/acl_rt.cpp, src/acl/aclrt/CMakeLists.txt @ 0ea26851) is a CANN 9.0 addition.
PROTOTYPES: tuple[tuple[str, str, object, tuple, bool], ...] = (
    ("aclInit", "runtime", _STATUS, (_c.c_char_p,), True),
    ("aclFinalizeReference", "runtime", _STATUS, (_c.POINTER(_c.c_uint64),), False),
    ("aclGetRecentErrMsg", "runtime", _PTR, (), True),
    ("aclrtGetSocName", "runtime", _PTR, (), False),
    ("aclsysGetVersionStr", "runtime", _STATUS, (_c.c_char_p, _c.c_char_p), False),
    ("aclrtGetDeviceCount", "runtime", _STATUS, (_c.POINTER(_c.c_uint32),), True),
    ("aclrtSetDevice", "runtime", _STATUS, (_c.c_int32,), True),
    ("aclrtResetDevice", "runtime", _STATUS, (_c.c_int32,), True),
    ("aclrtCreateStream", "runtime", _STATUS, (_c.POINTER(_PTR),), True),
    ("aclrtDestroyStream", "runtime", _STATUS, (_PTR,), True),
    ("aclrtDestroyStreamForce", "runtime", _STATUS, (_PTR,), False),
    ("aclrtSynchronizeStreamWithTimeout", "runtime", _STATUS, (_PTR, _c.c_int32), True),
    ("aclrtStreamQuery", "runtime", _STATUS, (_PTR, _c.POINTER(_c.c_int)), False),
    ("aclrtMalloc", "runtime", _STATUS, (_c.POINTER(_PTR), _c.c_size_t, _c.c_int), True),
    ("aclrtFree", "runtime", _STATUS, (_PTR,), True),
    ("aclrtMemcpy", "runtime", _STATUS, (_PTR, _c.c_size_t, _PTR, _c.c_size_t, _c.c_int), True),
    ("aclrtGetMemInfo", "runtime", _STATUS, (_c.c_int, _c.POINTER(_c.c_size_t), _c.POINTER(_c.c_size_t)), True),
    (
        "aclCreateTensor",
        "tensor",
        _PTR,
        (_I64P, _c.c_uint64, _c.c_int, _I64P, _c.c_int64, _c.c_int, _I64P, _c.c_uint64, _PTR),
        True,
    ),
    ("aclDestroyTensor", "tensor", _STATUS, (_PTR,), True),
    ("aclDestroyAclOpExecutor", "tensor", _STATUS, (_PTR,), False),
    (
        "aclnnMoeInitRoutingV2GradGetWorkspaceSize",
        "op",
        _STATUS,
        (_PTR, _PTR, _c.c_int64, _c.c_int64, _c.c_int64, _PTR, _c.POINTER(_c.c_uint64), _c.POINTER(_PTR)),
        True,
    ),
    ("aclnnMoeInitRoutingV2Grad", "op", _STATUS, (_PTR, _c.c_uint64, _PTR, _PTR), True),
)


def _open_library(names: tuple[str, ...], home: Path | None) -> tuple[ctypes.CDLL, str]:
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
    raise CannUnavailable(
        f"the CANN library {' or '.join(names)} was not found (tried {'; '.join(tried)}). {SET_ENV_HINT}"
    )


def _vendor_order(vendors: Path) -> list[str]:
    """Vendor package names under ``vendors``: ``config.ini``'s ``load_priority`` first, then by name."""
    names = sorted(entry.name for entry in vendors.iterdir() if entry.is_dir())
    priority: list[str] = []
    config = vendors / "config.ini"
    if config.is_file():
        for line in config.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "load_priority":
                priority = [name.strip() for name in value.split(",") if name.strip()]
    return [name for name in priority if name in names] + [name for name in names if name not in priority]


def operator_candidates(home: Path | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Where the operator may live, in the order they are tried (paths, or bare names for the loader path)."""
    candidates: list[str] = []
    for entry in environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":"):
        if entry and (Path(entry) / "op_api" / "lib" / "libcust_opapi.so").is_file():
            candidates.append(str(Path(entry) / "op_api" / "lib" / "libcust_opapi.so"))
    opp = environ.get("ASCEND_OPP_PATH")
    if opp and (Path(opp) / "vendors").is_dir():
        for name in _vendor_order(Path(opp) / "vendors"):
            library = Path(opp) / "vendors" / name / "op_api" / "lib" / "libcust_opapi.so"
            if library.is_file():
                candidates.append(str(library))
    for name in OPERATOR_LIBRARIES:
        if home is not None and (home / "lib64" / name).is_file():
            candidates.append(str(home / "lib64" / name))
        candidates.append(name)
    return list(dict.fromkeys(candidates))


def _close(library: ctypes.CDLL) -> None:
    import _ctypes

    dlclose = getattr(_ctypes, "dlclose", None)
    if dlclose is not None:
        dlclose(library._handle)


def _open_operator(home: Path | None) -> tuple[ctypes.CDLL, str]:
    """The first candidate library that exports both entry points, opened RTLD_LOCAL (the others closed)."""
    tried = []
    for candidate in operator_candidates(home):
        try:
            library = ctypes.CDLL(candidate, mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            if "/" in candidate:  # a file that exists but does not load is worth naming
                tried.append(f"{candidate} (does not load: {exc})")
            else:
                tried.append(f"{candidate} on the loader path (not found)")
            continue
        if all(hasattr(library, symbol) for symbol in OPERATOR_SYMBOLS):
            return library, candidate
        _close(library)
        tried.append(f"{candidate} (loads, but lacks the operator)")
    raise CannUnavailable(
        f"{OPERATOR_SYMBOLS[0]} is not exported by any operator library (tried "
        f"{'; '.join(tried)}): this CANN is incomplete or too old for aclnnMoeInitRoutingV2Grad "
        f"(CANN 8.0 or later; from 8.3 the operator is in libopapi_transformer.so). {SET_ENV_HINT}"
    )


class Cann:
    """The loaded libraries, with one prototyped ctypes function per symbol of :data:`PROTOTYPES`.

    Attributes:
        where: symbol -> the library it was taken from.
        operator_library: the one operator library in use (a path, or a name found on the loader path).
    """

    if TYPE_CHECKING:

        def __getattr__(self, symbol: str) -> Any:  # the prototyped functions, set per PROTOTYPES
            ...

    def __init__(self, home: Path | None) -> None:
        runtime, runtime_path = _open_library(RUNTIME_LIBRARIES, home)
        nnopbase, nnopbase_path = _open_library(("libnnopbase.so",), home)
        operator_library, operator_path = _open_operator(home)
        self.operator_library = operator_path
        places = {
            "runtime": (runtime, runtime_path),
            "tensor": (nnopbase, nnopbase_path),
            "op": (operator_library, operator_path),
        }
        self.where: dict[str, str] = {}
        for symbol, place, restype, argtypes, required in PROTOTYPES:
            library, path = places[place]
            function: Any
            try:
                function = library[symbol]
            except AttributeError:
                if required:
                    raise CannUnavailable(
                        f"{symbol} is not exported by {path}: this CANN is incomplete or too "
                        f"old for aclnnMoeInitRoutingV2Grad (CANN 8.0 or later). {SET_ENV_HINT}"
                    ) from None
                function = None
            else:
                function.restype = restype
                function.argtypes = argtypes
                self.where[symbol] = path
            setattr(self, symbol, function)

    def recent_error(self) -> str | None:
        """``aclGetRecentErrMsg()`` of this thread (CANN clears it once read), or None."""
        pointer = self.aclGetRecentErrMsg()
        text = ctypes.string_at(pointer).decode("utf-8", "replace").strip() if pointer else ""
        return text or None

    def version_str(self, package: str) -> tuple[int, str | None]:
        """``aclsysGetVersionStr(package, buffer)``: the ``Version=`` of ``package``'s version.info.

        Returns:
            (status, version): 0 and the version string (``"9.1.0"``), or the aclError (100003
            ACL_ERROR_INVALID_FILE: no such package or no ``Version=`` line) and None. (-1, None)
            when the runtime does not export the function (before CANN 9.0).
        """
        if self.aclsysGetVersionStr is None:
            return -1, None
        buffer = ctypes.create_string_buffer(ACL_PKG_VERSION_MAX_SIZE)
        status = self.aclsysGetVersionStr(package.encode(), buffer)
        text = buffer.value.decode("utf-8", "replace").strip() if status == 0 else ""
        return status, text or None

    def soc_name(self) -> str | None:
        """``aclrtGetSocName()`` (``const char *``, NULL on failure), or None."""
        if self.aclrtGetSocName is None:
            return None
        pointer = self.aclrtGetSocName()
        return ctypes.string_at(pointer).decode("utf-8", "replace").strip() or None if pointer else None


_LOADED: dict[str, Cann] = {}
_LOAD_LOCK = threading.Lock()


def load(ascend_home_path: str | Path | None) -> Cann:
    """The libraries of ``ascend_home_path`` (None: the loader path), loaded once per process."""
    home = None if ascend_home_path is None else Path(ascend_home_path)
    key = "" if home is None else str(home.resolve())
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = Cann(home)
        return _LOADED[key]


def ascend_available(ascend_home_path: str | Path | None = None) -> bool:
    """True when CANN's libraries load and ``aclrtGetDeviceCount`` reports at least one NPU.

    Loads the libraries (nothing else: no ``aclInit``, no device is opened). Used by
    ``backend="auto"``.
    """
    try:
        api = load(ascend_home_path)
    except CannUnavailable:
        return False
    count = ctypes.c_uint32(0)
    return api.aclrtGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0
