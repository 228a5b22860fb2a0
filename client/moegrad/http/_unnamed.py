"""A call made ready to send, checked once by the profile it will run on; and the arbitration of
calls that name no device profile, while the replicas' profile is not known (docs/protocol.md, "Errors").

A call that names no device profile (no ``order``) is run by the server with its own (a device's,
or ``MOEGRAD_ORDER``), so the client checks it by that profile too: such a call is an
:class:`Unnamed` until :func:`prepare` is given the replicas' profile. When the client does not know
it yet, :func:`prepare` checks the call by one profile of each set of rules (:data:`RULE_SETS`):
when all accept it, or all refuse it with the same status, field and message, that is the answer
whatever the server's profile, and no request is needed to learn it; otherwise it is undecided,
and the core asks the replicas' profile (``GET /v1/info``) or, when they do not agree, sends the
call unchecked for the server to judge. Whether a call names its profile is asked of
:func:`moegrad.operator.names_profile`, the one test of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from moegrad._errors import InvalidArgument
from moegrad.operator._call import MoeInitRoutingV2GradCall, names_profile
from moegrad.operator._profiles import PROFILE_NAMES, PROFILES
from moegrad.wire._bodies import decode_body
from moegrad.wire._codec import encode_body_view, fields_document

__all__ = ["RULE_SETS", "Prepared", "Unnamed", "prepare"]


def _check_no_arrays(document: Mapping[str, Any]) -> None:
    """A TypeError saying what to do when a wire document holds an array where a tensor map belongs."""
    for key, value in document.items():
        if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
            raise TypeError(
                f"{key} is an array: a wire document carries each tensor as a {{dtype, shape, data}} map "
                f"(moegrad.encode_tensor(array) makes one); or pass MoeInitRoutingV2GradCall("
                f"grad_expanded_x=..., expanded_row_idx=..., top_k=...), which takes the arrays"
            )


def _rules_of(name: str) -> tuple[Any, ...]:
    """What of a profile decides phase one's answer (every field but its name, chip, release,
    schedule of adds and source): profiles that agree here answer every call alike, but for the
    profile's name in a message."""
    profile = dataclasses.asdict(PROFILES[name])
    kept = profile.keys() - {"name", "chip", "release", "schedule", "source"}
    return tuple(value for key, value in profile.items() if key in kept)


def _rule_sets() -> tuple[str, ...]:
    first: dict[tuple[Any, ...], str] = {}
    for name in PROFILES:
        first.setdefault(_rules_of(name), name)
    return tuple(first.values())


#: One profile of each set of phase-one rules (the first of :data:`moegrad.PROFILES` with it): a
#: call they all accept, or all refuse alike, gets that answer on every profile.
RULE_SETS: tuple[str, ...] = _rule_sets()


@dataclasses.dataclass(frozen=True, eq=False)
class Unnamed:
    """A call that names no device profile, before it is checked by the replicas' (:func:`prepare`).

    Attributes:
        build: the call checked on a profile (raises as :class:`MoeInitRoutingV2GradCall` does).
        document: its wire document, as it is sent unchecked.
        given: it is a wire document the caller gave: sent exactly as given, whatever checks it.
    """

    build: Callable[[str], MoeInitRoutingV2GradCall]
    document: Callable[[], dict[str, Any]]
    given: bool

    @classmethod
    def of_fields(cls, fields: Mapping[str, Any]) -> Unnamed:
        """The keyword arguments of :class:`MoeInitRoutingV2GradCall`, without ``order`` (arrays, not tensor maps)."""
        fields = dict(fields)
        return cls(
            lambda order: MoeInitRoutingV2GradCall.with_default_order(order, **fields),
            lambda: fields_document(fields),
            False,
        )

    @classmethod
    def of_document(cls, document: Mapping[str, Any]) -> Unnamed:
        """A wire document whose ``order`` is absent or nil.

        Raises:
            TypeError: it cannot be packed as msgpack.
        """
        decoded = _decoded(document)
        return cls(
            lambda order: MoeInitRoutingV2GradCall.from_wire(decoded, default_order=order), lambda: dict(document), True
        )


def _decoded(document: Mapping[str, Any]) -> dict[str, Any]:
    """A wire document as the server reads it (packed, then unpacked).

    Raises:
        TypeError: it cannot be packed as msgpack.
    """
    try:
        return decode_body(encode_body_view(document))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None


def _same(first: InvalidArgument, other: InvalidArgument) -> bool:
    return (first.aclnn_status, first.field, first.message) == (other.aclnn_status, other.field, other.message)


def _judged(unnamed: Unnamed, profile: str | None) -> MoeInitRoutingV2GradCall | None:
    """``unnamed`` checked on ``profile``; with None, on every set of rules: the call when all accept
    it, their refusal when all refuse it alike (raised), None when they disagree.

    Raises:
        InvalidArgument, MalformedRequest: as :class:`MoeInitRoutingV2GradCall`.
    """
    if profile is not None:
        return unnamed.build(profile)
    accepted: MoeInitRoutingV2GradCall | None = None
    refused: InvalidArgument | None = None
    for name in RULE_SETS:
        try:
            call = unnamed.build(name)
        except InvalidArgument as exc:
            if accepted is not None or (refused is not None and not _same(refused, exc)):
                return None
            refused = exc
            continue
        if refused is not None:
            return None
        accepted = accepted or call
    if refused is not None:
        raise refused
    return accepted


#: A call ready to send: a validated call or a wire document; the validated call its answer is
#: checked against (None: not checked); whether it names no profile.
Prepared = tuple[MoeInitRoutingV2GradCall | dict[str, Any], MoeInitRoutingV2GradCall | None, bool]


def prepare(call: Any, *, validate: bool, profile: str | None, last: bool = False) -> Prepared | None:
    """A call as it is sent: checked locally when ``validate`` is on.

    Args:
        call: a :class:`MoeInitRoutingV2GradCall` (sent as it is), an :class:`Unnamed`, or a wire
            document (checked with ``from_wire`` when ``validate``; one that names no profile as an
            :class:`Unnamed`).
        validate: the client's ``validate``.
        profile: the profile of the replicas (:meth:`ReplicaSet.profile`), or None when unknown.
        last: no profile will be known: an undecided call is sent unchecked, for the server to judge.

    Returns:
        What to send, or None when the call names no profile and the profiles' rules disagree about
        it (the caller learns the replicas' profile and asks again, or asks with ``last``).

    Raises:
        InvalidArgument, MalformedRequest: the call broke a rule (the replicas' profile's, or every
            profile's alike). TypeError: a call of another type, or a wire document holding arrays.
    """
    if profile is not None and profile not in PROFILE_NAMES:
        profile = None  # a profile this client does not know: the server judges what the others disagree on
    if isinstance(call, MoeInitRoutingV2GradCall):
        return call, call, not names_profile(call)
    if isinstance(call, Mapping):
        _check_no_arrays(call)
        if not validate:
            return dict(call), None, not names_profile(call)
        if names_profile(call):
            return dict(call), MoeInitRoutingV2GradCall.from_wire(_decoded(call)), False
        call = Unnamed.of_document(call)
    if not isinstance(call, Unnamed):
        raise TypeError(
            f"call must be a MoeInitRoutingV2GradCall or a wire document mapping, got {type(call).__name__}"
        )
    if last and profile is None:
        return call.document(), None, True
    checked = _judged(call, profile)
    if checked is None:
        return None
    return (call.document() if call.given else checked), checked, True  # checked names none
