"""The engine's contract: what a backend is, and the domain errors it may raise.

The engine speaks ``numpy.ndarray`` and :mod:`moegrad`'s domain errors only (never HTTP). A
backend owns one device (or the CPU); the :class:`~moegrad_service.engine.pool.StreamPool` owns its
worker threads and gives each one a :class:`BackendWorker` made on that thread, so a device whose
context is per thread (CANN's ``aclrtSetDevice``) is set on every thread that touches it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from moegrad import MoeInitRoutingV2GradCall

__all__ = ["Backend", "BackendWorker"]


@runtime_checkable
class BackendWorker(Protocol):
    """One execution slot: a device stream (ascend) or a CPU slot (reference), bound to one thread."""

    def run(
        self, call: MoeInitRoutingV2GradCall, *, timeout_s: float | None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Compute grad_x for a validated, non-empty call.

        Args:
            call: the validated call (N > 0 and H > 0; empty calls never reach a backend).
            timeout_s: seconds left before the request's deadline, or None for no deadline.
            out: a writeable, C-contiguous [N, H] array of the call's dtype, sharing no memory with
                the call's tensors, to write grad_x into (every element), as aclnn writes into the
                gradX its caller allocated; None: the worker allocates grad_x. The pool passes it
                only when it has one (a service reusing result buffers).

        Returns:
            grad_x, [N, H] in the dtype of ``call.grad_expanded_x`` (``out`` when given), owned by the caller.

        Raises:
            InvalidArgument: the device's phase one rejected the call (its aclnn code passes through).
            DeadlineExceeded: the device did not finish within ``timeout_s``.
            DeviceFault: the device failed (its own message attached).
        """
        ...

    def close(self) -> None:
        """Release the slot's resources (on the thread that made it)."""
        ...

    # Optional: ``accepts_calls() -> bool``, asked on the worker's own thread before each call and
    # while it cannot: False takes the slot out of the pool's capacity until it answers True again.
    # Optional: ``run_many(calls, *, timeout_s) -> list[np.ndarray] | None``, a batch's calls at once
    # (each grad_x as ``run`` gives it), or None to have them run one by one; should it raise, the
    # pool runs them one by one, so that each call gets its own answer.
    # Optional: ``run_group(group, *, timeout_s) -> np.ndarray | None``, every member of a
    # ``moegrad.CallGroup`` at once as one [B, N, H] array (member b's grad_x at [b], the bits
    # ``run`` gives it), or None to have the members run one by one; likewise should it raise.


@runtime_checkable
class Backend(Protocol):
    """A device (or the CPU emulation) that runs aclnnMoeInitRoutingV2Grad.

    Attributes:
        name: ``"reference"`` or ``"ascend"``.
        device: a human description of the device (``"Ascend910B3 #0"``), or None for the CPU.
        order: the accumulation order this backend's results follow, or None when it follows the
            call's ``order`` (the reference backend emulates either).
    """

    name: str

    @property
    def device(self) -> str | None:  # read-only here, so a backend whose device is always named (str) conforms
        ...

    def open_worker(self, index: int) -> BackendWorker:
        """Make worker slot ``index``; called on the worker's own thread, once per thread."""
        ...

    def check_health(self) -> None:
        """Raise :class:`moegrad.DeviceFault` when the device cannot take work."""
        ...

    def close(self) -> None:
        """Release the device; called once, after every worker has closed."""
        ...
