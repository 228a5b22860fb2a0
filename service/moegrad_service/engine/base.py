"""The engine's contract: what a backend is, and the domain errors it may raise.

The engine speaks ``numpy.ndarray`` and :mod:`moegrad`'s domain errors only (never HTTP). A
backend owns one device (or the CPU); the :class:`~moegrad_service.engine.pool.StreamPool` owns its
worker threads and gives each one a :class:`BackendWorker` made on that thread, so a device whose
context is per thread (CANN's ``aclrtSetDevice``) is set on every thread that touches it.

Every member a caller may use is declared here, the optional capabilities too, each with a default
that declines: an implementation subclasses :class:`Backend` and :class:`BackendWorker` (as the
reference and ascend backends do), inherits those defaults, and overrides what it can do better.
Nothing probes a backend with ``getattr``.

=================  ==============================  ===========================================
member             default (declining)             who overrides it
=================  ==============================  ===========================================
``accepts_calls``  True: the slot always can       ascend: False while too many kernels that
                                                   missed their deadline still run
``run_many``       None: the pool runs each call   reference: small calls computed together
``run_group``      None: each member on its own    reference: a CallGroup as one [B, N, H]
``order``          None: follows the call's order  ascend: the order its SoC computes
``warm_up``        True                            reference(warm_up=False): nothing compiled
=================  ==============================  ===========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from moegrad import CallGroup, MoeInitRoutingV2GradCall

__all__ = ["Backend", "BackendWorker"]


@runtime_checkable
class BackendWorker(Protocol):
    """One execution slot: a device stream (ascend) or a CPU slot (reference), bound to one thread.

    Required: :meth:`run` and :meth:`close`. Optional, with declining defaults: :meth:`accepts_calls`,
    :meth:`run_many`, :meth:`run_group`. Every method is called on the worker's own thread.
    """

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

    def accepts_calls(self) -> bool:
        """Whether the slot can run a call now; asked before each call, and every
        ``CAPACITY_POLL_S`` seconds while it cannot. False takes the slot out of the pool's capacity
        until it answers True again; an exception counts as False.

        Default: True (a slot that can always run calls).
        """
        return True

    def run_many(
        self, calls: Sequence[MoeInitRoutingV2GradCall], *, timeout_s: float | None
    ) -> list[np.ndarray] | None:
        """A batch's validated, non-empty calls at once.

        Args:
            calls: the calls, in order.
            timeout_s: seconds left before the batch's deadline (> 0), or None for no deadline.

        Returns:
            each call's grad_x as :meth:`run` gives it (the same bits), in the calls' order; or None
            to decline, and the pool runs the calls one by one through :meth:`run`. Should it raise,
            the pool likewise runs them one by one, so that each call gets its own answer.

        Default: None (declines).
        """
        return None

    def run_group(self, group: CallGroup, *, timeout_s: float | None) -> np.ndarray | None:
        """Every member of a :class:`moegrad.CallGroup` (calls of one shape, stacked) at once.

        Args:
            group: B validated, non-empty calls of one [N, H], dtype and attributes.
            timeout_s: seconds left before the batch's deadline (> 0), or None for no deadline.

        Returns:
            one [B, N, H] array in the group's dtype, member b's grad_x at [b] (the bits :meth:`run`
            gives it); or None to decline, and the pool runs the members one by one. Should it
            raise, the pool likewise runs them one by one.

        Default: None (declines).
        """
        return None


@runtime_checkable
class Backend(Protocol):
    """A device (or the CPU emulation) that runs aclnnMoeInitRoutingV2Grad.

    Required: :attr:`name`, :attr:`device`, :meth:`open_worker`, :meth:`check_health`,
    :meth:`close`. Optional, with declining defaults: :attr:`order`, :attr:`warm_up`.

    Attributes:
        name: ``"reference"`` or ``"ascend"``.
        order: the device profile this backend's results follow (a canonical name of
            :data:`moegrad.PROFILES`, e.g. ``"ascend910b@9.1"``; docs/semantics.md), or None when it
            follows the call's ``order`` (the reference backend emulates every profile) or does not
            know its own (a chip or CANN release not in the table). Default: None.
        warm_up: whether the service may compile its host-side kernels (the comparison's numba
            kernels) in the background once this backend is open; a backend made with
            ``warm_up=False`` (tests) keeps the process free of that compilation. Default: True.
    """

    name: str
    order: str | None = None
    warm_up: bool = True

    @property
    def device(self) -> str | None:  # read-only here, so a backend whose device is always named (str) conforms
        """A human description of the device (``"Ascend910B3 #0"``), or None for the CPU."""
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
