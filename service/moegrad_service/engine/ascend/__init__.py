"""The ascend backend: aclnnMoeInitRoutingV2Grad on an Ascend NPU, through CANN's C ABI with ctypes.

Importing this package loads nothing. The CANN libraries are loaded when an :class:`AscendBackend`
is made (or :func:`ascend_available` probes for them), from ``<ascend_home_path>/lib64`` first and
then the dynamic loader's path, with ``RTLD_GLOBAL``:

- ``libascendcl.so`` (or ``libacl_rt.so``): ``aclInit``, ``aclrt*``, ``aclGetRecentErrMsg``;
- ``libnnopbase.so``: ``aclCreateTensor``, ``aclDestroyTensor``, ``aclDestroyAclOpExecutor``;
- ``libopapi.so``, and ``libopapi_transformer.so`` where it exists (CANN 8.3 and later keep the
  operator there): ``aclnnMoeInitRoutingV2GradGetWorkspaceSize`` / ``aclnnMoeInitRoutingV2Grad``.

Modules, in the direction of their imports::

    _abi      enum values, error codes, C prototypes, library loading (ascend_available)
    _buffers  host arrays in the device's layout, the per-stream device buffer cache
    _device   aclInit reference count, the per-thread device context, streams and frees
    _backend  AscendBackend and its workers (one stream each)

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

from moegrad import DeviceFault  # noqa: F401 - the base of CannUnavailable, reachable from here as before
from moegrad_service.engine.ascend._abi import ACL_DATA_TYPES, CannUnavailable, ascend_available
from moegrad_service.engine.ascend._backend import AscendBackend

__all__ = ["ACL_DATA_TYPES", "AscendBackend", "CannUnavailable", "ascend_available"]
