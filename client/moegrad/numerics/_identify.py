"""Which device profile made these bits? :func:`identify` emulates every profile and compares.

A gradX that came from an NPU (or from a port of the operator) is compared bit for bit with the
emulation of every profile of :data:`moegrad.operator._profiles.PROFILES` (a chip at one CANN release, and
Huawei's sequential golden): the profiles whose result is bit-identical are the ones that could
have made it. Profiles whose arithmetic is the same for the call are computed once: the result
depends only on the schedule of adds (:attr:`Profile.schedule`) and, for an index outside the documented
range (docs/semantics.md section 2), on which invalid slots contribute a +0.0 row; every profile
of one kernel schedule is therefore one emulation, and A2 and A3 at every release are one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import TypeAdapter

from moegrad._dtypes import dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad.numerics._ascend950 import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad.numerics._reference import moe_init_routing_v2_grad
from moegrad.operator._call import MoeInitRoutingV2GradCall
from moegrad.operator._profiles import PROFILES, resolve_profile

__all__ = ["Identification", "ProfileMatch", "identify", "profiles_matching"]

Outcome = Literal["identical", "differs", "refuses"]
_FIELDS = ("grad_expanded_x", "expanded_row_idx", "top_k", "drop_pad_mode", "active_num", "allow_duplicate_indices")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


@dataclass(frozen=True)
class ProfileMatch:
    """One profile's answer to "did you make these bits?".

    Attributes:
        profile: the profile's name (a key of :data:`moegrad.PROFILES`, e.g. ``"ascend950@9.1"``).
        outcome: ``"identical"`` (every element's bits equal grad_x's, NaN payloads and the sign of
            zero included), ``"differs"``, or ``"refuses"`` (the profile rejects the call, as that
            chip's phase one or moegrad's guard against an undefined read does).
        differing_elements: elements whose bits differ from grad_x's (0 when identical); None when
            the profile refuses the call.
        aclnn_status: the status code of the refusal (161002, 561002, 561103...), else None.
        reason: the refusal's message, else None.
        computed_with: the profile whose emulation was computed for this one: itself, or the first
            profile with the same arithmetic for this call; None when it refuses.
    """

    profile: str
    outcome: Outcome
    differing_elements: int | None
    aclnn_status: int | None = None
    reason: str | None = None
    computed_with: str | None = None


@dataclass(frozen=True)
class Identification:
    """What :func:`identify` found: one :class:`ProfileMatch` per profile, in :data:`PROFILES` order.

    Attributes:
        dtype: grad_x's dtype name.
        shape: grad_x's shape [N, H].
        profiles: every profile's outcome.
    """

    dtype: str
    shape: tuple[int, int]
    profiles: tuple[ProfileMatch, ...]

    @property
    def matching(self) -> tuple[str, ...]:
        """The profiles whose emulation is bit-identical to grad_x (possibly none)."""
        return tuple(p.profile for p in self.profiles if p.outcome == "identical")

    @property
    def refusing(self) -> tuple[str, ...]:
        """The profiles that reject the call."""
        return tuple(p.profile for p in self.profiles if p.outcome == "refuses")

    def outcome_of(self, profile: str) -> ProfileMatch:
        """The outcome of ``profile`` (a profile name or an alias such as ``"ascend950"``).

        Raises:
            ValueError: not a profile name or alias.
            KeyError: a profile that was not asked about.
        """
        name = resolve_profile(profile).name
        for match in self.profiles:
            if match.profile == name:
                return match
        raise KeyError(f"profile {name!r} is not in this identification")

    def to_dict(self) -> dict[str, Any]:
        """This result as a JSON- and msgpack-safe dict (``matching`` included)."""
        data: dict[str, Any] = _adapter(Identification).dump_python(self, mode="json")
        data["matching"] = list(self.matching)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Identification:
        """Rebuild the result from :meth:`to_dict`'s output (``matching`` is derived, so ignored).

        Raises:
            ValueError: a field is missing or has the wrong type (the message names it).
        """
        fields = {key: value for key, value in data.items() if key != "matching"}
        result: Identification = _adapter(Identification).validate_python(fields)
        return result

    def __str__(self) -> str:
        count = self.shape[0] * self.shape[1]
        head = f"grad_x {self.dtype} {list(self.shape)} ({count} elements): "
        head += (
            f"bit-identical to {', '.join(self.matching)}"
            if self.matching
            else "no profile is bit-identical"
            + (" (every profile refuses the call)" if len(self.refusing) == len(self.profiles) else "")
        )
        width = max([len("profile"), *(len(p.profile) for p in self.profiles)])
        lines = [head, "", f"{'profile':<{width}}  {'result':<9}  {'elements that differ':>22}  same arithmetic as"]
        for match in self.profiles:
            if match.outcome == "refuses":
                lines.append(f"{match.profile:<{width}}  refuses    {match.aclnn_status}: {match.reason}")
                continue
            differing = match.differing_elements or 0
            share = f"{differing} ({100 * differing / count:.1f}%)" if count else "0"
            same = "-" if match.computed_with in (None, match.profile) else str(match.computed_with)
            lines.append(f"{match.profile:<{width}}  {match.outcome:<9}  {share:>22}  {same}")
        return "\n".join(lines) + "\n"


def _call_fields(call: MoeInitRoutingV2GradCall | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(call, MoeInitRoutingV2GradCall):
        return {name: getattr(call, name) for name in _FIELDS}
    if not isinstance(call, Mapping):
        raise TypeError(
            f"call must be a MoeInitRoutingV2GradCall or a mapping of its fields, got {type(call).__name__}"
        )
    unknown = sorted(set(call) - set(_FIELDS) - {"order"})
    if unknown:
        raise TypeError(f"call has unknown field {unknown[0]!r}; the fields are {', '.join(_FIELDS)}")
    return {name: call[name] for name in _FIELDS if name in call}


def _outside_documented_range(call: MoeInitRoutingV2GradCall) -> bool:
    """True when an index leaves the documented range (docs/semantics.md section 2: [-1, E*C) in
    drop/pad mode, [0, N*K) otherwise), where profiles differ in which slots contribute +0.0."""
    index = call.expanded_row_idx
    if index.size == 0:
        return False
    grad = call.grad_expanded_x
    low, high = (-1, grad.shape[0] * grad.shape[1]) if call.drop_pad_mode == 1 else (0, index.shape[0])
    return bool(int(index.min()) < low or int(index.max()) >= high)


def _differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ, a NaN matching any NaN (its payload is not part of the contract:
    docs/semantics.md section 4)."""
    words = _UINT[a.dtype.itemsize]
    differ = a.view(words) != b.view(words)
    if differ.any():
        with np.errstate(invalid="ignore"):
            differ &= ~(np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32)))
    return int(np.count_nonzero(differ))


def _check_grad_x(grad_x: Any, call: MoeInitRoutingV2GradCall) -> np.ndarray:
    invalid = AclnnStatus.ACLNN_ERR_PARAM_INVALID
    if not isinstance(grad_x, np.ndarray):
        raise InvalidArgument(
            f"grad_x must be a numpy.ndarray, got {type(grad_x).__name__}", aclnn_status=invalid, field="grad_x"
        )
    if grad_x.dtype.newbyteorder("=") != call.grad_expanded_x.dtype.newbyteorder("="):
        raise InvalidArgument(
            f"grad_x.dtype={grad_x.dtype} must be grad_expanded_x's dtype {call.grad_expanded_x.dtype}: "
            "only a result in the operator's own dtype can be bit-identical to a profile's",
            aclnn_status=invalid,
            field="grad_x",
        )
    shape = (call.num_tokens, call.hidden_size)
    if grad_x.shape != shape:
        raise InvalidArgument(
            f"grad_x has shape {list(grad_x.shape)}; this call's grad_x is {list(shape)} [N, H]",
            aclnn_status=invalid,
            field="grad_x",
        )
    return np.ascontiguousarray(grad_x).astype(grad_x.dtype.newbyteorder("="), copy=False)


def identify(
    call: MoeInitRoutingV2GradCall | Mapping[str, Any],
    grad_x: np.ndarray,
    *,
    profiles: Iterable[str] | None = None,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> Identification:
    """Which profiles' emulation of ``call`` is bit-identical to ``grad_x``.

    Each profile validates the call as that chip and release do (a refusal is an outcome, not an
    error); each accepting profile's emulation (:func:`moegrad.moe_init_routing_v2_grad` with
    ``order=`` the profile) is compared with ``grad_x`` as unsigned integers, so the sign of zero
    counts; a NaN matches a NaN at the same position whatever its payload (the payload is not part
    of the contract, docs/semantics.md section 4). Profiles with the same arithmetic for this call share one emulation
    (module docstring), so at most four are computed (A2/A3, the 950's groups of four with and
    without its 9.1 invalid-slot rule, the chain).

    Args:
        call: a :class:`~moegrad.MoeInitRoutingV2GradCall`, or a mapping of its fields
            (``grad_expanded_x`` [N*K, H] / [A, H] / [E, C, H] float16 / bfloat16 / float32,
            ``expanded_row_idx`` [N*K] int32, ``top_k``, and optionally ``drop_pad_mode``,
            ``active_num``, ``allow_duplicate_indices``; an ``order`` is ignored). A mapping lets a
            call that some profiles refuse (an index -1 in dropless mode) be asked about at all.
        grad_x: [N, H] in grad_expanded_x's dtype (bfloat16 as ``ml_dtypes.bfloat16``), any strides.
        profiles: profile names or aliases to ask (default: every profile, :data:`PROFILES` order);
            a single name is one profile.
        ub_size_bytes, vector_core_count: the 950 platform (docs/semantics.md section 7.4); they
            decide the 950's K chunk and so its bits.

    Returns:
        An :class:`Identification`; ``.matching`` lists the bit-identical profiles. When every
        profile refuses the call, every outcome is ``"refuses"`` and grad_x is not examined.

    Raises:
        InvalidArgument: grad_x is not an ndarray, or not of the call's dtype or [N, H] shape (161002,
            field ``grad_x``).
        TypeError: ``call`` is neither a call nor a mapping, or names an unknown field.
        ValueError: an unknown profile name, or no profile to ask.
    """
    names = _profile_names(profiles)
    accepted, refused = _judged(_call_fields(call), names)
    if not accepted:
        refusals = tuple(
            ProfileMatch(name, "refuses", None, refused[name].aclnn_status, refused[name].message) for name in names
        )
        array = grad_x if isinstance(grad_x, np.ndarray) else np.empty((0, 0))
        shape = (int(array.shape[0]), int(array.shape[1])) if array.ndim == 2 else (0, 0)
        return Identification(dtype=dtype_name(array.dtype) or str(array.dtype), shape=shape, profiles=refusals)
    first = next(iter(accepted.values()))
    wanted = _check_grad_x(grad_x, first)
    special = _outside_documented_range(first)
    computed: dict[tuple[Any, ...], tuple[str, int]] = {}
    outcomes = []
    for name in names:
        if name in refused:
            refusal = refused[name]
            outcomes.append(ProfileMatch(name, "refuses", None, refusal.aclnn_status, refusal.message))
            continue
        profile = PROFILES[name]
        key = (profile.schedule, (profile.skips_any_negative, profile.skips_dropless_overflow) if special else None)
        if key not in computed:
            emulated = moe_init_routing_v2_grad(
                accepted[name], ub_size_bytes=ub_size_bytes, vector_core_count=vector_core_count
            )
            computed[key] = (name, _differing(emulated, wanted))
        source, differing = computed[key]
        outcomes.append(ProfileMatch(name, "identical" if differing == 0 else "differs", differing, None, None, source))
    dtype = dtype_name(first.grad_expanded_x.dtype) or str(first.grad_expanded_x.dtype)
    return Identification(dtype=dtype, shape=(first.num_tokens, first.hidden_size), profiles=tuple(outcomes))


def _profile_names(profiles: Iterable[str] | str | None) -> list[str]:
    """The canonical names to ask, each once (None: every profile).

    Raises:
        ValueError: an unknown name, or none at all.
    """
    if isinstance(profiles, str):
        profiles = (profiles,)
    names = list(PROFILES) if profiles is None else list(dict.fromkeys(resolve_profile(p).name for p in profiles))
    if not names:
        raise ValueError("profiles is empty: name at least one profile, or pass None for every profile")
    return names


def _judged(
    fields: Mapping[str, Any], names: list[str]
) -> tuple[dict[str, MoeInitRoutingV2GradCall], dict[str, InvalidArgument]]:
    """The call as each profile validates it: the accepted calls and the refusals, by name."""
    accepted: dict[str, MoeInitRoutingV2GradCall] = {}
    refused: dict[str, InvalidArgument] = {}
    for name in names:
        try:
            accepted[name] = MoeInitRoutingV2GradCall(**fields, order=name)
        except InvalidArgument as exc:
            refused[name] = exc
    return accepted, refused


def profiles_matching(call: MoeInitRoutingV2GradCall, candidate: np.ndarray) -> tuple[str, ...]:
    """The profiles whose emulation of ``call`` is bit-identical to ``candidate`` (:func:`identify`).

    Args:
        call: a validated call.
        candidate: [N, H], the call's dtype or float32 (a comparison's candidate); a float32 candidate
            of a float16 or bfloat16 call matches no profile (a profile's result has the call's dtype).

    Raises:
        InvalidArgument: the candidate is not an [N, H] ndarray (161002, field ``grad_x``).
    """
    if isinstance(candidate, np.ndarray) and candidate.dtype != call.grad_expanded_x.dtype:
        if dtype_name(candidate.dtype) == "float32":  # a widened candidate: no profile gives float32 bits here
            return ()
    return identify(call, candidate).matching
