"""The engine: backends, the stream pool and the judges, each behind a queue shared out fairly
between tenants. No FastAPI here; arrays in, arrays and domain errors out."""

from __future__ import annotations

from moegrad import DeviceFault
from moegrad_service.engine.base import Backend, BackendWorker
from moegrad_service.engine.fair import FairQueue
from moegrad_service.engine.judges import JudgePool
from moegrad_service.engine.pool import StreamPool, Timings
from moegrad_service.engine.reference import ReferenceBackend
from moegrad_service.settings import Settings

__all__ = [
    "Backend",
    "BackendWorker",
    "FairQueue",
    "JudgePool",
    "ReferenceBackend",
    "StreamPool",
    "Timings",
    "open_backend",
]


#: The most the ascend backend's close waits for kernels still running, in seconds (shutdown_grace_s when smaller).
DEVICE_DRAIN_MAX_S = 10.0


def open_backend(settings: Settings) -> Backend:
    """The backend ``settings.backend`` names: ``reference``, ``ascend``, or ``auto``.

    ``auto`` is ascend when the CANN libraries load and report a device, else reference.
    CANN is loaded here (never at import time), and only for ``ascend`` or ``auto``.

    Raises:
        DeviceFault: ``backend="ascend"`` and CANN or the device is not available (the message
            names what is missing).
    """
    if settings.backend == "reference":
        return _reference_backend(settings)
    from moegrad_service.engine import ascend  # lazy: loads nothing until a backend is made

    if settings.backend == "auto" and not ascend.ascend_available(settings.ascend_home_path):
        return _reference_backend(settings)
    try:
        return ascend.AscendBackend(
            device_id=settings.device_id,
            ascend_home_path=settings.ascend_home_path,
            # closing waits for a still-running kernel no longer than shutdown waits for calls
            drain_timeout_s=min(DEVICE_DRAIN_MAX_S, settings.shutdown_grace_s),
        )
    except DeviceFault:
        raise
    except Exception as exc:  # a startup failure must read as one sentence
        raise DeviceFault(f"the ascend backend could not start: {type(exc).__name__}: {exc}") from exc


def _reference_backend(settings: Settings) -> ReferenceBackend:
    return ReferenceBackend(
        warm_up=settings.warm_up,
        ub_size_bytes=settings.ascend950_ub_size_bytes,
        vector_core_count=settings.ascend950_vector_core_count,
    )
