"""The embedded default backend: ``moegrad``'s CPU emulation of the device kernels (A2/A3 and Ascend 950)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

import moegrad
from moegrad import (
    CallGroup,
    MoeInitRoutingV2GradCall,
    moe_init_routing_v2_grad,
    moe_init_routing_v2_grad_group,
    moe_init_routing_v2_grad_many,
)
from moegrad.numerics import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad_service.engine.base import Backend, BackendWorker
from moegrad_service.engine.compiling import warm_up_logged

__all__ = ["ReferenceBackend"]

log = logging.getLogger("moegrad_service.engine")

FaultHook = Callable[[MoeInitRoutingV2GradCall, float | None], None]


class ReferenceBackend(Backend):
    """Runs calls with :func:`moegrad.moe_init_routing_v2_grad` on the CPU, as the device profile the
    call's ``order`` names computes (every profile of :data:`moegrad.PROFILES`).

    Args:
        warm_up: compile the kernel when the first worker opens (:func:`moegrad.warm_up`), so the
            pool, and with it readiness, waits for the compilation instead of the first calls.
        fault_hook: called as ``hook(call, timeout_s)`` on the worker thread before each compute;
            tests use it to slow the backend down, raise, or hang (fault injection).
        ub_size_bytes: the UB size in bytes the ``ascend950`` profiles tile for (the 950's tiling,
            and so its order of adds, depends on it; default Ascend 950PR/950DT's 253952).
        vector_core_count: the vector core count the ``ascend950`` profiles tile for (default 64).
    """

    name = "reference"
    device: str | None = None

    def __init__(
        self,
        *,
        warm_up: bool = True,
        fault_hook: FaultHook | None = None,
        ub_size_bytes: int = UB_SIZE_BYTES,
        vector_core_count: int = VECTOR_CORE_COUNT,
    ) -> None:
        self.warm_up = warm_up
        self.fault_hook = fault_hook
        self.ub_size_bytes = ub_size_bytes
        self.vector_core_count = vector_core_count

    def open_worker(self, index: int) -> _ReferenceWorker:
        """A CPU slot; the first one compiles the kernel (or loads it from numba's cache) when
        ``warm_up`` is set, and logs which (:func:`~moegrad_service.engine.compiling.warm_up_logged`)."""
        if index == 0 and self.warm_up:
            waiting = "compiling takes one to two minutes; nothing listens meanwhile"
            warm_up_logged(log, "the reference kernel", moegrad.warm_up, moegrad.kernel_cache, waiting=waiting)
        return _ReferenceWorker(self)

    def check_health(self) -> None:
        """The CPU is always healthy."""

    def close(self) -> None:
        """Nothing to release."""


class _ReferenceWorker(BackendWorker):
    def __init__(self, backend: ReferenceBackend) -> None:
        self._backend = backend

    def run(
        self, call: MoeInitRoutingV2GradCall, *, timeout_s: float | None, out: np.ndarray | None = None
    ) -> np.ndarray:
        if self._backend.fault_hook is not None:
            self._backend.fault_hook(call, timeout_s)
        return moe_init_routing_v2_grad(
            call, ub_size_bytes=self._backend.ub_size_bytes, vector_core_count=self._backend.vector_core_count, out=out
        )

    def run_many(
        self, calls: Sequence[MoeInitRoutingV2GradCall], *, timeout_s: float | None
    ) -> list[np.ndarray] | None:
        """grad_x of each call, small ones computed together (``moe_init_routing_v2_grad_many``: the
        same bits); None when a fault hook is set, so that it sees each call on its own."""
        if self._backend.fault_hook is not None:
            return None
        return moe_init_routing_v2_grad_many(
            calls, ub_size_bytes=self._backend.ub_size_bytes, vector_core_count=self._backend.vector_core_count
        )

    def run_group(self, group: CallGroup, *, timeout_s: float | None) -> np.ndarray | None:
        """grad_x of every member as one [B, N, H] array (``moe_init_routing_v2_grad_group``: the
        same bits); None when a fault hook is set, so that it sees each member on its own."""
        if self._backend.fault_hook is not None:
            return None
        return moe_init_routing_v2_grad_group(
            group, ub_size_bytes=self._backend.ub_size_bytes, vector_core_count=self._backend.vector_core_count
        )

    def close(self) -> None:
        pass
