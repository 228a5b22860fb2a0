"""The ascend backend: aclnnMoeInitRoutingV2Grad on an Ascend NPU, through CANN's C ABI with ctypes.

Importing this package loads nothing. The CANN libraries are loaded when an :class:`AscendBackend`
is made (or :func:`ascend_available` probes for them), from ``<ascend_home_path>/lib64`` first and
then the dynamic loader's path:

- ``libacl_rt.so`` (CANN 9.x) or ``libascendcl.so``: ``aclInit``, ``aclrt*``, ``aclGetRecentErrMsg``;
- ``libnnopbase.so``: ``aclCreateTensor``, ``aclDestroyTensor``, ``aclDestroyAclOpExecutor``;
- exactly one operator library (``RTLD_LOCAL``) exporting ``aclnnMoeInitRoutingV2GradGetWorkspaceSize``
  / ``aclnnMoeInitRoutingV2Grad``: a custom package's ``libcust_opapi.so``, else
  ``libopapi_transformer.so`` (CANN 8.3 and later), else the aggregate ``libopapi.so``.

``ASCEND_OPP_PATH`` must be set (opbase finds the kernels through it), and phase one of the
documentation's example must succeed at startup, or the backend is not made.

Modules, in the direction of their imports::

    _abi      enum values, error codes, C prototypes, library loading (ascend_available)
    _buffers  host arrays in the device's layout, the per-stream device buffer cache
    _device   ACL references, the per-thread device context, streams, tensors, frees
    _release  the CANN release of the operator's package (aclsysGetVersionStr, or its version.info)
    _call     one call as the device takes it: the SoC -> chip table, the arguments marshalled
              on the host, what a phase-one status means on the device's profile
    _worker   AscendWorker: one stream, its buffers, the two-phase run of one call, retirement
    _backend  AscendBackend: the device opened and probed, workers made, health, the ordered close

Threads and streams. The device context is per thread in CANN, so every thread that touches the
device calls ``aclrtSetDevice`` first (a thread-local flag remembers it; each call is one reference
that ``close`` balances with ``aclrtResetDevice``). Each pool worker owns one stream and a cache of
device buffers keyed by size. One call on a worker::

    retired streams queried ─> device buffers (cached) ─> host->device copies ─> three aclTensors
    ─> phase one (GetWorkspaceSize) ─> workspace (cached) ─> phase two on the worker's stream
    ─> aclrtSynchronizeStreamWithTimeout(remaining deadline, >= 1 ms) ─> device->host copy ─> tensors destroyed

Profile. The device's results are the bits of one profile of moegrad.operator's, a chip running one
CANN release: the chip from ``aclrtGetSocName``, the release from the operator package's version.info
(``aclsysGetVersionStr("ops_transformer")`` where the runtime has it). ``AscendBackend.order`` names it
(``"ascend910b@9.1"``), or is None when the chip or the release is unknown.

Errors. Phase one's documented input checks (161001, 161002, and 561002, or 561103 from CANN 9.1)
are the caller's: :class:`moegrad.InvalidArgument`. Any other phase-one code, and any failure of the runtime (malloc,
memcpy, phase two, sync), is a :class:`moegrad.DeviceFault` carrying ``aclGetRecentErrMsg``'s text.
A sync that times out is :class:`moegrad.DeadlineExceeded`; the kernel may still be running, so its
stream is *retired*, not destroyed: the stream and every buffer the kernel uses stay allocated
until ``aclrtStreamQuery`` reports the stream complete (``aclrtFree`` does not wait for kernels),
and the worker carries on with a fresh stream. A retired stream still busy at close is destroyed
with ``aclrtDestroyStreamForce`` and its memory is left to ``aclrtResetDevice``.
"""

from __future__ import annotations

from moegrad import DeviceFault  # noqa: F401 - the base of CannUnavailable, reachable from here as before
from moegrad_service.engine.ascend._abi import ACL_DATA_TYPES, CannUnavailable, ascend_available
from moegrad_service.engine.ascend._backend import AscendBackend
from moegrad_service.engine.ascend._call import SOC_CHIPS, chip_of_soc
from moegrad_service.engine.ascend._release import Release, operator_release

__all__ = [
    "ACL_DATA_TYPES",
    "SOC_CHIPS",
    "AscendBackend",
    "CannUnavailable",
    "Release",
    "ascend_available",
    "chip_of_soc",
    "operator_release",
]
