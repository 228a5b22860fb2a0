"""What the dataplane is handed and what it answers: validated requests and their outcomes, no HTTP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from moegrad import (
    CallGroup,
    ComparisonReport,
    Explanation,
    MoegradError,
    MoeInitRoutingV2GradCall,
    check_compare_arguments,
    check_explain_arguments,
)
from moegrad_service.engine import Timings

__all__ = [
    "BatchAnswer",
    "BatchItem",
    "ClientDisconnected",
    "CompareOutcome",
    "Comparison",
    "ExplainOutcome",
    "ExplainRequest",
    "GradOutcome",
    "GroupMember",
    "GroupOutcome",
    "MemberOutcome",
    "ResultLender",
]


class ResultLender(Protocol):
    """Where a call's grad_x is written, when the caller lends a buffer for it: the dataplane asks
    for one before the call runs and says when its worker is done with it. The request's
    :class:`moegrad_service.memory.Admission` is one (the buffer comes back when it is released)."""

    def result_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A writeable C-contiguous array of ``shape`` ([N, H]) and ``dtype`` (native byte order)
        for grad_x, or None: the backend allocates it."""
        ...

    def result_written(self) -> None:
        """The worker has written the buffer and let go of it: only the reply reads it now."""
        ...


class ClientDisconnected(MoegradError):
    """The caller went away before its answer was ready (logged as 499; nobody reads the answer)."""


class GroupMember(NamedTuple):
    """One call of a batch, validated with the others of its shape: member ``member`` of ``group``
    (:class:`moegrad.CallGroup`), run with them by ``DataPlane.infer_batch``. Whether the members
    name their profile is the group's ``like`` call's (:func:`moegrad.operator.names_profile`): it
    is part of what they share."""

    group: CallGroup
    member: int


@dataclass(frozen=True)
class Comparison:
    """A validated compare request: a call, a candidate grad_x and the options.

    Attributes:
        call: the validated call.
        candidate: [N, H], the call's dtype or float32 (checked by :func:`moegrad.check_compare_arguments`).
        standards: the standards to judge, or None for the default set.
        return_grad_x: also answer the device's grad_x.
    """

    call: MoeInitRoutingV2GradCall
    candidate: np.ndarray
    standards: tuple[str, ...] | None
    return_grad_x: bool

    @classmethod
    def checked(
        cls,
        call: MoeInitRoutingV2GradCall,
        candidate: np.ndarray | None,
        standards: Sequence[str] | None,
        return_grad_x: bool,
    ) -> Comparison:
        """A comparison whose candidate and standards are checked before anything runs.

        Raises:
            InvalidArgument: the candidate is missing (161001) or has the wrong dtype or shape, or a
                standard is unknown (161002).
        """
        names = check_compare_arguments(call, candidate, standards)
        assert candidate is not None  # check_compare_arguments refuses a missing one
        return cls(call, candidate, None if standards is None else tuple(names), return_grad_x)


@dataclass(frozen=True)
class ExplainRequest:
    """A validated explain request: a call and a candidate grad_x of the call's dtype.

    Attributes:
        call: the validated call.
        candidate: [N, H], the call's dtype, C-contiguous (:func:`moegrad.check_explain_arguments`).
    """

    call: MoeInitRoutingV2GradCall
    candidate: np.ndarray

    @classmethod
    def checked(cls, call: MoeInitRoutingV2GradCall, candidate: np.ndarray | None) -> ExplainRequest:
        """An explain request whose candidate is checked before anything runs.

        Raises:
            InvalidArgument: the candidate is missing (161001), not of the call's dtype or not [N, H] (161002).
        """
        return cls(call, check_explain_arguments(call, candidate))


@dataclass(frozen=True)
class GradOutcome:
    """One call's answer.

    Attributes:
        grad_x: [N, H], the dtype of the call's grad_expanded_x, C-contiguous, owned by the caller.
        timings: seconds queued and computing (zero for an empty call, which never reaches a worker).
        backend: the backend's name (``"reference"`` or ``"ascend"``).
        order: the accumulation order the result follows (``"unknown"`` from a chip whose order
            moegrad does not know).
        device: the device that computed it (``"Ascend910B3 #0"``), or None for the CPU emulation.
    """

    grad_x: np.ndarray
    timings: Timings
    backend: str
    order: str
    device: str | None


@dataclass(frozen=True)
class GroupOutcome:
    """The answer of group members run together, all of them successfully.

    Attributes:
        grad_x: [B, N, H], the members' dtype, C-contiguous: member b's grad_x is ``grad_x[b]``.
        timings: each member's share: the run's seconds queued, and its compute seconds over B.
        backend, order, device: as :class:`GradOutcome`'s, the same for every member.
    """

    grad_x: np.ndarray
    timings: Timings
    backend: str
    order: str
    device: str | None


class MemberOutcome(NamedTuple):
    """One batch call's answer as member ``member`` of a :class:`GroupOutcome`."""

    outcome: GroupOutcome
    member: int


@dataclass(frozen=True)
class CompareOutcome:
    """A compare request's answer: the device's result and the report, with the seconds each step took."""

    grad: GradOutcome
    report: ComparisonReport
    golden_s: float
    compare_s: float


@dataclass(frozen=True)
class ExplainOutcome:
    """An explain request's answer: the device's result, the explanation, and the seconds explain took."""

    grad: GradOutcome
    explanation: Explanation
    explain_s: float


#: One item of a batch (``DataPlane.infer_batch``): a validated call, a member of a validated group,
#: a validated comparison, or the error the item already earned while it was decoded (passed
#: through in place).
BatchItem = MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException
#: One item's answer: a GradOutcome, a MemberOutcome (a group member's), a CompareOutcome, or the
#: exception that item alone raised.
BatchAnswer = GradOutcome | MemberOutcome | CompareOutcome | BaseException
