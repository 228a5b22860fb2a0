"""One operator call, validated as aclnnMoeInitRoutingV2GradGetWorkspaceSize checks it on one device profile.

The client checks a call with this model before sending it; the service checks it again on receipt.
The call's ``order`` names a device profile (:mod:`moegrad.operator._profiles`: a chip at one CANN release),
and the profile decides three things here: which index values are accepted (rule 7), the status
of an attribute or shape failure (``S`` below: the profile's ``attribute_status``, 561002
ACLNN_ERR_INNER_TILING_ERROR before CANN 9.1, 561103 ACLNN_ERR_INNER_NULLPTR from 9.1), and what an
empty grad_x skips. Rules, codes and order follow the operator documentation's return codes
(docs/operator.md, "Return codes"); the index checks guard what the device would read out of
bounds (docs/semantics.md sections 2 and 8):

0. ``order`` not a profile name; ``allow_duplicate_indices`` not a bool -> 161002 ACLNN_ERR_PARAM_INVALID
1. a missing tensor                                               -> 161001 ACLNN_ERR_PARAM_NULLPTR
2. grad dtype not float16/bfloat16/float32, index dtype not int32 -> 161002 ACLNN_ERR_PARAM_INVALID
3. drop_pad_mode not in {0, 1}; top_k <= 0; active_num < 0        -> S
4. grad rank not 2 (mode 0) / not 3 (mode 1); index rank not 1    -> S
5. dropless: grad.shape[0] != len(idx); active: != active_num     -> S
6. len(idx) % top_k != 0                                          -> S
7. an index the profile's kernel would read outside its buffer    -> 161002
   (the profile's slots of +0.0 rows aside); a repeated index of a row the kernel reads
   (unless ``allow_duplicate_indices``)

From CANN 9.1 (``Profile.empty_out_skips_checks``) a call whose grad_x is empty (N = 0 or H = 0)
launches nothing and phase one succeeds with no attribute checks: rules 3-7 are skipped, and rule 2
for an empty tensor. moegrad still needs what sizes grad_x ([len(idx) / top_k, H]): top_k a
positive integer, a 1-D index whose length it divides (S), and an empty tensor's dtype one the wire
carries (161002).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError, field_validator, model_validator

from moegrad._dtypes import DTYPES, brief, dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument, MalformedRequest
from moegrad.operator._profiles import DEFAULT_PROFILE, PROFILE_NAMES, PROFILES, Profile, resolve_profile
from moegrad.wire._codec import decode_tensor, encode_tensor

__all__ = ["GRAD_DTYPES", "ORDERS", "CallGroup", "MoeInitRoutingV2GradCall", "names_profile"]

#: Every name ``order`` takes: the device profiles and their aliases (:data:`moegrad.PROFILES`).
ORDERS: tuple[str, ...] = PROFILE_NAMES
#: The dtypes gradExpandedX (and so gradX) may have (documentation, "Data Type").
GRAD_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")

_NULLPTR = AclnnStatus.ACLNN_ERR_PARAM_NULLPTR
_INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
_INT64 = (-(2**63), 2**63 - 1)
_INT32_LOW, _INT32_END = -(2**31), 2**31  # every int32 value is in [_INT32_LOW, _INT32_END)
_TENSORS = ("grad_expanded_x", "expanded_row_idx")
_ATTRIBUTES = ("top_k", "drop_pad_mode", "active_num")
_WIRE_FIELDS = frozenset(_TENSORS + _ATTRIBUTES + ("order", "allow_duplicate_indices"))
_INDEX_CHUNK = 1 << 20  # index elements per scatter in the uniqueness check
_SMALL_INDEX = 64  # up to this many index elements, rule 7 is checked on a Python list first
_UNIQUE = "indices other than -1 must be unique"
_UNIQUE_READ = "indices of rows read must be unique (the slots of +0.0 rows may repeat)"
_CAST_HINTS = {  # what to do about a dtype the operator does not take
    "grad_expanded_x": "cast it first, e.g. grad_expanded_x.astype(numpy.float32) (a torch tensor: .float())",
    "expanded_row_idx": "cast it first, e.g. expanded_row_idx.astype(numpy.int32) (a torch tensor: .int())",
}


def _fail(status: AclnnStatus, field: str | None, message: str) -> InvalidArgument:
    return InvalidArgument(message, aclnn_status=status, field=field)


@dataclass(frozen=True)
class _IndexRule:
    """Rule 7 of one call on one profile: the accepted values ``[low, high)`` and ``[0, rows)``,
    the values that read a row (unique unless duplicates are allowed); every other accepted value
    is a slot of +0.0 (docs/semantics.md section 2)."""

    low: int
    high: int
    rows: int
    text: str  # the accepted range in the documentation's letters

    def accepts(self, value: int) -> bool:
        return self.low <= value < self.high

    @staticmethod
    def of(profile: Profile, mode: int, active: int, slots: int, grad_shape: tuple[int, ...]) -> _IndexRule:
        """``slots`` = N*K = len(expanded_row_idx); ``grad_shape`` = grad_expanded_x's shape."""
        if mode == 1:  # drop/pad: -1 everywhere; any negative from 950@9.1; >= E*C is never defined
            rows = grad_shape[0] * grad_shape[1]
            if profile.skips_any_negative:
                return _IndexRule(_INT32_LOW, rows, rows, "any negative value or [0, E*C)")
            return _IndexRule(-1, rows, rows, "[-1, E*C)")
        negative, overflow = profile.skips_any_negative, profile.skips_dropless_overflow
        low = _INT32_LOW if negative else 0
        if overflow:  # 950@9.1: every value outside the rows read ([0, N*K) or [0, A)) is a +0.0 row
            return _IndexRule(low, _INT32_END, active if active > 0 else slots, "any value" if negative else "[0, inf)")
        # the documented [0, N*K), each value unique; in active mode the kernel reads only [0, A)
        return _IndexRule(low, slots, slots, "any negative value or [0, N*K)" if negative else "[0, N*K)")

    def bounds(self) -> str:
        return f"[{self.low}, {self.high})"


def _accepting(value: int, mode: int, active: int, slots: int, grad_shape: tuple[int, ...]) -> list[str]:
    """The profiles whose rule 7 accepts the index ``value`` in a call of this mode and shape."""
    return [
        name
        for name, profile in PROFILES.items()
        if _IndexRule.of(profile, mode, active, slots, grad_shape).accepts(value)
    ]


class MoeInitRoutingV2GradCall(BaseModel):
    """One validated call of aclnnMoeInitRoutingV2Grad.

    Attributes:
        grad_expanded_x: [N*K, H] (dropless), [A, H] (active) or [E, C, H] (drop/pad); float16,
            bfloat16 (``ml_dtypes.bfloat16``) or float32; any strides.
        expanded_row_idx: [N*K] int32; slot ``i*K + t`` holds the row of grad_expanded_x that
            token i's t-th expert produced (-1: dropped, drop/pad mode only; on ``ascend950@9.1``
            any negative value, and in dropless/active mode any value past the rows, is a +0.0 row).
        top_k: K > 0; ``len(expanded_row_idx)`` must be a multiple of it.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        active_num: 0 dropless, A > 0 active (ignored when drop_pad_mode is 1).
        order: the device profile whose bits and rules apply, any name of :data:`ORDERS`
            (``"<chip>@<release>"``, a bare chip for its newest release, ``"sequential"`` for
            Huawei's golden, or an older alias); kept as the profile's canonical name, so
            ``order="ascend950"`` reads back ``"ascend950@9.1"``. Default ``"ascend910b@9.1"``.
        allow_duplicate_indices: accept repeated indices of rows read, which the documentation forbids.

    Construct with ``MoeInitRoutingV2GradCall(...)`` or :meth:`from_wire`; both raise
    :class:`~moegrad.InvalidArgument` (with the aclnn code and field) for the first rule broken.
    The arrays are kept as given, never copied.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    grad_expanded_x: Any = None
    expanded_row_idx: Any = None
    top_k: Any = None
    drop_pad_mode: Any = 0
    active_num: Any = 0
    order: StrictStr = DEFAULT_PROFILE
    allow_duplicate_indices: StrictBool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:  # only `order`, `allow_duplicate_indices` or an unknown keyword get here
            error = exc.errors()[0]
            field = ".".join(map(str, error["loc"])) or None
            message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
            raise _fail(_INVALID, field, f"{field}: {message}") from None

    @field_validator("order", mode="before")
    @classmethod
    def _no_order(cls, value: Any) -> Any:
        return DEFAULT_PROFILE if value is None else value  # None names no profile, as on the wire (nil)

    @field_validator("order")
    @classmethod
    def _canonical_order(cls, value: str) -> str:
        return resolve_profile(value).name  # ValueError (listing the names) for an unknown one

    @property
    def profile(self) -> Profile:
        """The device profile :attr:`order` names (:data:`moegrad.PROFILES`)."""
        return resolve_profile(self.order)

    @model_validator(mode="after")
    def _check(self) -> MoeInitRoutingV2GradCall:
        profile = self.profile
        status = profile.attribute_status
        empty_out = profile.empty_out_skips_checks and self._out_is_empty()
        grad, idx = self._check_tensors(empty_out)
        if empty_out:  # 9.1: no launch, no attribute checks; only what sizes grad_x
            top_k, mode, active = self._check_attributes(status, values=False)
            self._check_divisible(idx, top_k, status)
        else:
            top_k, mode, active = self._check_attributes(status)
            self._check_shapes(grad, idx, top_k, mode, active, status)
            self._check_indices(grad, idx, top_k, mode, active, profile)
        for name, value in (("top_k", top_k), ("drop_pad_mode", mode), ("active_num", active)):
            if value is not getattr(self, name):  # e.g. a numpy integer, kept as the int it is
                object.__setattr__(self, name, value)
        return self

    def _out_is_empty(self) -> bool:
        """Whether grad_x, [len(idx) / top_k, H], is empty: a 1-D index of length 0, or H = 0."""
        grad, idx = self.grad_expanded_x, self.expanded_row_idx
        if not (isinstance(grad, np.ndarray) and isinstance(idx, np.ndarray)):
            return False
        return grad.ndim >= 1 and idx.ndim == 1 and (idx.shape[0] == 0 or grad.shape[-1] == 0)

    # Rules 1-2: presence and dtypes.
    def _check_tensors(self, empty_out: bool) -> tuple[np.ndarray, np.ndarray]:
        for field in _TENSORS:
            if getattr(self, field) is None:
                raise _fail(_NULLPTR, field, f"{field} is missing (a null tensor)")
        arrays = []
        for field, allowed in (("grad_expanded_x", GRAD_DTYPES), ("expanded_row_idx", ("int32",))):
            value = getattr(self, field)
            if not isinstance(value, np.ndarray):
                hint = (
                    "; moegrad.Client and moegrad.torch take tensors, or pass tensor.numpy()"
                    if type(value).__module__.startswith("torch")
                    else ""
                )
                raise _fail(_INVALID, field, f"{field} must be a numpy.ndarray, got {type(value).__name__}{hint}")
            name = dtype_name(value.dtype)
            if empty_out and value.size == 0:  # 9.1 skips the dtype check of an empty tensor
                if name is None:
                    raise _fail(
                        _INVALID,
                        field,
                        f"{field}.dtype={value.dtype}: an empty tensor may have any dtype moegrad carries "
                        f"({', '.join(DTYPES)}), not this one; {_CAST_HINTS[field]}",
                    )
            elif name not in allowed:
                raise _fail(
                    _INVALID,
                    field,
                    f"{field}.dtype={value.dtype} is not one of {', '.join(allowed)}; {_CAST_HINTS[field]}",
                )
            arrays.append(value)
        return arrays[0], arrays[1]

    # Rule 3: attribute values.
    def _check_attributes(self, status: AclnnStatus, values: bool = True) -> tuple[int, int, int]:
        """The attributes as ints (each an integer that fits int64_t); ``values=False`` (an empty
        grad_x from 9.1) checks only top_k > 0, which sizes grad_x."""
        parsed = []
        for field in _ATTRIBUTES:
            raw = getattr(self, field)
            if type(raw) is int:  # the common case (bool is not int's type, so it is refused below)
                value = raw
            else:
                try:
                    if isinstance(raw, (bool, np.bool_)):
                        raise TypeError
                    value = operator.index(raw)
                except TypeError:
                    raise _fail(status, field, f"{field}={brief(raw)} must be an integer") from None
            if not _INT64[0] <= value <= _INT64[1]:
                raise _fail(status, field, f"{field}={value} does not fit the operator's int64_t")
            parsed.append(value)
        top_k, mode, active = parsed
        if values and mode not in (0, 1):
            raise _fail(status, "drop_pad_mode", f"drop_pad_mode={mode} must be 0 (dropless/active) or 1 (drop/pad)")
        if top_k <= 0:
            hint = "" if values else " (grad_x is [len(expanded_row_idx) / top_k, H])"
            raise _fail(status, "top_k", f"top_k={top_k} must be greater than 0{hint}")
        if values and active < 0:
            raise _fail(status, "active_num", f"active_num={active} must be >= 0")
        return top_k, mode, active

    # Rules 4-6: ranks, dim 0, divisibility.
    @classmethod
    def _check_shapes(
        cls, grad: np.ndarray, idx: np.ndarray, top_k: int, mode: int, active: int, status: AclnnStatus
    ) -> None:
        want = 3 if mode == 1 else 2
        if grad.ndim != want:
            layout = "[E, C, H] in drop/pad mode" if mode == 1 else "[rows, H] when drop_pad_mode=0"
            hint = ""
            if mode == 0 and grad.ndim == 3:
                hint = "; a 3-D [E, C, H] grad is the drop/pad layout: pass drop_pad_mode=1"
            elif mode == 1 and grad.ndim == 2:
                hint = "; a 2-D grad is the dropless/active layout: pass drop_pad_mode=0"
            raise _fail(
                status,
                "grad_expanded_x",
                f"grad_expanded_x has rank {grad.ndim} (shape {list(grad.shape)}); it must be {layout}{hint}",
            )
        if idx.ndim != 1:
            raise _fail(
                status,
                "expanded_row_idx",
                f"expanded_row_idx has rank {idx.ndim} (shape {list(idx.shape)}); it must be 1-D [N*K]",
            )
        if mode == 0 and active == 0 and grad.shape[0] != idx.shape[0]:
            raise _fail(
                status,
                "grad_expanded_x",
                f"grad_expanded_x.shape[0]={grad.shape[0]} must equal "
                f"expanded_row_idx.shape[0]={idx.shape[0]} in dropless mode",
            )
        if mode == 0 and active > 0 and grad.shape[0] != active:
            raise _fail(
                status,
                "grad_expanded_x",
                f"grad_expanded_x.shape[0]={grad.shape[0]} must equal active_num={active} in active mode",
            )
        cls._check_divisible(idx, top_k, status)

    @staticmethod
    def _check_divisible(idx: np.ndarray, top_k: int, status: AclnnStatus) -> None:
        if idx.shape[0] % top_k:
            raise _fail(
                status,
                "expanded_row_idx",
                f"expanded_row_idx.shape[0]={idx.shape[0]} is not divisible by top_k={top_k}",
            )

    # Rule 7: index values and uniqueness (vectorised: O(len) time, at most 8 bytes of table per index).
    def _check_indices(
        self, grad: np.ndarray, idx: np.ndarray, top_k: int, mode: int, active: int, profile: Profile
    ) -> None:
        if idx.size == 0:
            return
        rule = _IndexRule.of(profile, mode, active, idx.shape[0], grad.shape)
        low, high, rows = rule.low, rule.high, rule.rows
        if idx.size <= _SMALL_INDEX and self._short_index_holds(idx, rule):
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < low or hi >= high:
            where = int(np.flatnonzero((idx < low) | (idx >= high))[0])
            raise self._range_error(idx, where, rule, mode, active, grad.shape, profile)
        if self.allow_duplicate_indices:
            return
        partial = lo < 0 or hi >= rows  # some slots are +0.0 rows: leave them out
        if rows > 8 * idx.size:  # drop/pad with E*C far above N*K (e.g. H = 0): sort instead of a table of E*C
            used = np.sort(idx[(idx >= 0) & (idx < rows)] if partial else idx)
            if used.size > 1 and bool((used[1:] == used[:-1]).any()):
                raise self._duplicate_error(idx, rule)
            return
        seen = np.zeros(rows, dtype=np.bool_)
        count = 0
        for start in range(0, idx.size, _INDEX_CHUNK):  # chunks: the intp copy NumPy indexes with stays small
            block = idx[start : start + _INDEX_CHUNK].astype(np.intp)
            if partial:
                block = block[(block >= 0) & (block < rows)]
            seen[block] = True
            count += block.size
        if np.count_nonzero(seen) != count:
            raise self._duplicate_error(idx, rule)

    def _short_index_holds(self, idx: np.ndarray, rule: _IndexRule) -> bool:
        """Rule 7 for a short index, in plain Python (cheaper than NumPy's reductions at this size):
        True when it holds; False leaves the verdict, and the message naming the culprit, to the
        vectorised check."""
        values = idx.tolist()
        if min(values) < rule.low or max(values) >= rule.high:
            return False
        if self.allow_duplicate_indices:
            return True
        used = [value for value in values if 0 <= value < rule.rows]
        return len(set(used)) == len(used)

    @staticmethod
    def _range_error(
        idx: np.ndarray,
        where: int,
        rule: _IndexRule,
        mode: int,
        active: int,
        grad_shape: tuple[int, ...],
        profile: Profile,
    ) -> InvalidArgument:
        value = int(idx[where])
        reason = "whose kernel would read outside its buffer" if profile.chip else "which defines no row for it"
        accepting = _accepting(value, mode, active, idx.shape[0], grad_shape)
        if accepting:
            verb = "accepts" if len(accepting) == 1 else "accept"
            then = (
                f"; {', '.join(accepting)} {verb} it (a +0.0 row): to emulate that device, pass "
                f"order='{accepting[0]}' (moegrad.torch: using_order('{accepting[0]}'))"
            )
        else:
            then = "; no profile defines it: fix the index (it must come from the forward routing)"
        return _fail(
            _INVALID,
            "expanded_row_idx",
            f"expanded_row_idx[{where}]={value} is outside {rule.text} = {rule.bounds()} for this call on "
            f"profile {profile.name}, {reason}{then}",
        )

    @staticmethod
    def _duplicate_error(idx: np.ndarray, rule: _IndexRule) -> InvalidArgument:
        positions = np.flatnonzero((idx >= 0) & (idx < rule.rows))
        values = idx[positions]
        order = np.argsort(values, kind="stable")  # equal values keep increasing positions
        ranked = values[order]
        clash = np.flatnonzero(ranked[1:] == ranked[:-1])
        later, earlier = positions[order[clash + 1]], positions[order[clash]]
        k = int(np.argmin(later))  # the first position that repeats an earlier one
        where, previous = int(later[k]), int(earlier[k])
        return _fail(
            _INVALID,
            "expanded_row_idx",
            f"expanded_row_idx[{where}]={int(idx[where])} repeats expanded_row_idx[{previous}]; "
            f"{_UNIQUE if rule.low >= -1 else _UNIQUE_READ} (set allow_duplicate_indices to accept repeats)",
        )

    @property
    def num_tokens(self) -> int:
        """N, the number of rows of grad_x (``len(expanded_row_idx) // top_k``)."""
        return self.expanded_row_idx.shape[0] // self.top_k

    @property
    def hidden_size(self) -> int:
        """H, the last dimension of grad_expanded_x and grad_x."""
        return self.grad_expanded_x.shape[-1]

    @property
    def dtype_name(self) -> str:
        """The wire name of grad_expanded_x's (and grad_x's) dtype: one of :data:`GRAD_DTYPES`, or
        (an empty grad_expanded_x with an empty grad_x, from CANN 9.1) any wire dtype."""
        name = dtype_name(self.grad_expanded_x.dtype)
        assert name is not None, "grad_expanded_x's dtype was validated to be a wire dtype"
        return name

    def to_wire(self) -> dict[str, Any]:
        """This call as a request document (tensors encoded, ready for :func:`moegrad.encode_body`)."""
        return {
            "grad_expanded_x": encode_tensor(self.grad_expanded_x),
            "expanded_row_idx": encode_tensor(self.expanded_row_idx),
            "top_k": self.top_k,
            "drop_pad_mode": self.drop_pad_mode,
            "active_num": self.active_num,
            "order": self.order,
            "allow_duplicate_indices": self.allow_duplicate_indices,
        }

    @classmethod
    def from_wire(
        cls,
        document: Mapping[str, Any],
        *,
        max_elements: int | None = None,
        default_order: str = DEFAULT_PROFILE,
        extra_fields: frozenset[str] = frozenset(),
    ) -> MoeInitRoutingV2GradCall:
        """Build and validate a call from a decoded request document.

        Args:
            document: the msgpack map (docs/protocol.md, "The call"); a missing tensor is a null tensor.
            max_elements: the largest element count accepted per tensor, or None.
            default_order: the profile whose rules check a document that names none, and which the
                call then carries (any name of :data:`ORDERS`); the call still names none
                (:meth:`with_default_order`).
            extra_fields: further keys the caller handles itself (they are ignored here).

        Raises:
            MalformedRequest: an unknown key or a broken tensor map (HTTP 400).
            PayloadTooLarge: a tensor over ``max_elements``.
            InvalidArgument: a documented constraint is broken (HTTP 422, with the aclnn code).
        """
        unknown = (
            [] if _WIRE_FIELDS.issuperset(document) else sorted(map(str, set(document) - _WIRE_FIELDS - extra_fields))
        )
        if unknown:
            raise MalformedRequest(
                f"unknown field {brief(unknown[0])}; the fields are {sorted(_WIRE_FIELDS | extra_fields)}",
                field=unknown[0][:64],
            )
        fields: dict[str, Any] = {}
        for name in _TENSORS:
            raw = document.get(name)
            fields[name] = None if raw is None else decode_tensor(raw, name, max_elements=max_elements)
        for name in _ATTRIBUTES:
            if name in document:
                fields[name] = document[name]
        fields["order"] = document.get("order")  # absent or nil: names none; anything else is validated ("" too)
        if "allow_duplicate_indices" in document:
            fields["allow_duplicate_indices"] = document["allow_duplicate_indices"]
        return cls.with_default_order(default_order, **fields)

    @classmethod
    def with_default_order(cls, default_order: str, /, **fields: Any) -> MoeInitRoutingV2GradCall:
        """A call built from its keyword arguments; one whose ``order`` is absent or None is checked
        on ``default_order``'s rules and carries that profile, yet names none
        (:func:`names_profile` is False: the client sends it without ``order``, and a server runs it
        on its own profile).

        Raises:
            InvalidArgument: as the constructor (``default_order`` not a profile: field ``order``).
        """
        if fields.get("order") is not None:
            return cls(**fields)
        fields.pop("order", None)
        if default_order == DEFAULT_PROFILE:  # the field's default: not in model_fields_set
            return cls(**fields)
        call = cls(**fields, order=default_order)
        return cls.model_construct(_fields_set=call.model_fields_set - {"order"}, **dict(call))


def names_profile(call: MoeInitRoutingV2GradCall | Mapping[str, Any]) -> bool:
    """Whether a call names its device profile: a :class:`MoeInitRoutingV2GradCall` given an ``order``
    when it was built, or a wire document (or the keyword arguments of one) whose ``order`` is
    present and not nil. A call that names none runs on its server's profile (docs/protocol.md);
    this is the client's one test of it."""
    if isinstance(call, MoeInitRoutingV2GradCall):
        return "order" in call.model_fields_set
    return call.get("order") is not None


@dataclass(frozen=True, eq=False)
class CallGroup:
    """Many validated calls that share their attributes, dtypes and shapes, their tensors stacked.

    A batch of small calls (the service's batch endpoint) is checked and computed a group at a
    time instead of a call at a time. Member ``b`` is the call ``like`` describes with
    ``grad_expanded_x[b]`` and ``expanded_row_idx[b]``; :meth:`call` gives it as a call.

    Attributes:
        like: a validated call with the members' attributes (top_k, drop_pad_mode, active_num,
            order, allow_duplicate_indices) and their tensors' dtypes and shapes; its own tensors'
            values are not a member's.
        grad_expanded_x: [B, *like.grad_expanded_x.shape], like's dtype.
        expanded_row_idx: [B, N*K] int32, each row holding rule 7 of :class:`MoeInitRoutingV2GradCall`
            for its call (checked by :meth:`breaking_rule_7`).
    """

    like: MoeInitRoutingV2GradCall
    grad_expanded_x: np.ndarray
    expanded_row_idx: np.ndarray

    def __len__(self) -> int:
        return self.expanded_row_idx.shape[0]

    def __getitem__(self, members: slice) -> CallGroup:
        """The members in ``members`` (a slice) as a group of their own (views, no copy)."""
        return CallGroup(self.like, self.grad_expanded_x[members], self.expanded_row_idx[members])

    def call(self, member: int) -> MoeInitRoutingV2GradCall:
        """Member ``member`` as a call (its tensors are views of the stacks; not validated again)."""
        return self.like.model_copy(
            update={
                "grad_expanded_x": self.grad_expanded_x[member],
                "expanded_row_idx": self.expanded_row_idx[member],
            }
        )

    @staticmethod
    def breaking_rule_7(like: MoeInitRoutingV2GradCall, expanded_row_idx: np.ndarray) -> np.ndarray:
        """Which rows of ``expanded_row_idx`` ([B, N*K] int32), each the index of a call with
        like's attributes and shapes, break rule 7 on like's profile (a value outside the accepted
        range, or a repeated index of a row read unless duplicates are allowed): a [B] bool array.

        The same predicate as :class:`MoeInitRoutingV2GradCall`'s own check, over all rows at once;
        the message naming the culprit is left to that check (build the call to get it).
        """
        profile = like.profile
        nothing = np.zeros(expanded_row_idx.shape[0], dtype=np.bool_)
        if expanded_row_idx.shape[1] == 0 or (profile.empty_out_skips_checks and like.hidden_size == 0):
            return nothing  # no index, or (from 9.1) an empty grad_x: rule 7 is not checked
        grad = like.grad_expanded_x
        rule = _IndexRule.of(profile, like.drop_pad_mode, like.active_num, expanded_row_idx.shape[1], grad.shape)
        broken = (expanded_row_idx.min(axis=1) < rule.low) | (expanded_row_idx.max(axis=1) >= rule.high)
        if not like.allow_duplicate_indices:
            ordered = np.sort(expanded_row_idx, axis=1)
            repeats = ordered[:, 1:] == ordered[:, :-1]
            repeats &= (ordered[:, 1:] >= 0) & (ordered[:, 1:] < rule.rows)  # +0.0 slots (-1...) may repeat
            broken |= repeats.any(axis=1)
        return broken
