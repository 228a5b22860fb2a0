"""The wire documents and bodies of every endpoint: a call's, a comparison's, an explanation's, a
batch's items (docs/protocol.md), with no I/O.

A call is validated before its document is made when the client's ``validate`` is on
(:mod:`moegrad.http._unnamed`), so a bad call raises before it is sent; a comparison's candidate and
standards are checked against the validated call (:func:`moegrad.accuracy.check_compare_arguments`),
an explanation's candidate too (:func:`moegrad.accuracy.check_explain_arguments`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple

import numpy as np

from moegrad._errors import MoegradError
from moegrad.http._accuracy import check_compare_arguments, check_explain_arguments
from moegrad.http._unnamed import Prepared, Unnamed
from moegrad.operator._call import MoeInitRoutingV2GradCall, names_profile
from moegrad.wire._codec import encode_body_view, encode_tensor, fields_document

__all__ = [
    "BatchCompare",
    "Sent",
    "batch_calls",
    "batch_compares",
    "batch_items",
    "call_document",
    "compare_body",
    "compare_call",
    "explain_document",
    "grad_body",
    "grad_call",
]


@dataclasses.dataclass(frozen=True)
class BatchCompare:
    """A comparison to send in a batch (:meth:`Client.batch`), answered as a :class:`CompareResult`.

    Attributes:
        call: the operator call: a :class:`~moegrad.MoeInitRoutingV2GradCall`, or a wire document
            (docs/protocol.md; checked first when the client's ``validate`` is on, by the replicas'
            profile when it names none).
        candidate: [N, H] grad_x of the implementation under test, in the call's dtype or float32.
        standards: names from :data:`moegrad.STANDARDS` (one or several); None: all.
        return_grad_x: also return the device's grad_x.
    """

    call: MoeInitRoutingV2GradCall | Mapping[str, Any] | Unnamed
    candidate: Any
    standards: Iterable[str] | str | None = None
    return_grad_x: bool = False


class Sent(NamedTuple):
    """What a batch item's answer is checked against: the operation, the validated call (None for a
    raw document) and whether grad_x was asked for; and whether it named no profile (its answer's
    ``order`` is then its replica's profile)."""

    op: Literal["grad", "compare"]
    call: MoeInitRoutingV2GradCall | None
    return_grad_x: bool
    unnamed: bool = False


def call_document(call: MoeInitRoutingV2GradCall) -> dict[str, Any]:
    """The wire document of a validated call; its ``order`` only when it was set explicitly."""
    document = call.to_wire()
    if not names_profile(call):
        del document["order"]
    return document


def grad_call(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: Any,
    drop_pad_mode: Any,
    active_num: Any,
    order: str | None,
    allow_duplicate_indices: bool,
    *,
    validate: bool,
) -> MoeInitRoutingV2GradCall | Unnamed | dict[str, Any]:
    """The keyword API's arguments as a validated call (``validate=True``; an :class:`Unnamed`, to be
    checked by the replicas' profile, when ``order`` is None) or a raw wire document."""
    fields: dict[str, Any] = {
        "grad_expanded_x": grad_expanded_x,
        "expanded_row_idx": expanded_row_idx,
        "top_k": top_k,
        "drop_pad_mode": drop_pad_mode,
        "active_num": active_num,
        "allow_duplicate_indices": allow_duplicate_indices,
    }
    if not validate:
        return fields_document({**fields, "order": order} if order is not None else fields)
    if order is None:
        return Unnamed.of_fields(fields)
    return MoeInitRoutingV2GradCall(**fields, order=order)


def compare_call(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: Any,
    drop_pad_mode: Any,
    active_num: Any,
    order: str | None,
    allow_duplicate_indices: bool,
    *,
    validate: bool,
) -> MoeInitRoutingV2GradCall | Unnamed | dict[str, Any]:
    """:func:`grad_call`, or a :class:`MoeInitRoutingV2GradCall` passed as the first argument
    with no other call argument (as :func:`moegrad.compare` and :class:`BatchCompare` take it)."""
    if not isinstance(grad_expanded_x, MoeInitRoutingV2GradCall):
        return grad_call(
            grad_expanded_x,
            expanded_row_idx,
            top_k,
            drop_pad_mode,
            active_num,
            order,
            allow_duplicate_indices,
            validate=validate,
        )
    given = any(value is not None for value in (expanded_row_idx, top_k, order))
    if given or (drop_pad_mode, active_num, allow_duplicate_indices) != (0, 0, False):
        raise TypeError(
            "compare(call, candidate=...) takes a MoeInitRoutingV2GradCall alone: pass the candidate "
            "(and standards, return_grad_x, ...) by keyword, and no other call argument"
        )
    return grad_expanded_x


def grad_body(call: MoeInitRoutingV2GradCall | Mapping[str, Any]) -> memoryview:
    """The msgpack body of a prepared call (:func:`prepare`): a :class:`MoeInitRoutingV2GradCall`'s
    document (its ``order`` only when it was set explicitly, else the server's profile applies), or
    a wire document exactly as given.

    Raises:
        TypeError: a document that cannot be packed as msgpack.
    """
    if isinstance(call, MoeInitRoutingV2GradCall):
        return encode_body_view(call_document(call))
    try:
        return encode_body_view(call)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None


def compare_body(
    call: MoeInitRoutingV2GradCall | Mapping[str, Any],
    checked: MoeInitRoutingV2GradCall | None,
    candidate: Any,
    standards: Any,
    return_grad_x: Any,
) -> memoryview:
    """The msgpack body of a comparison: a prepared call's fields (:func:`prepare`) plus
    ``candidate``, ``standards``, ``return_grad_x``.

    The candidate and standards of a ``checked`` call are checked by
    :func:`moegrad.check_compare_arguments` first, so a bad one raises InvalidArgument before any
    I/O; those of a call not checked are sent as given.
    """
    if not isinstance(return_grad_x, bool):
        raise TypeError(f"return_grad_x must be a bool, got {type(return_grad_x).__name__}")
    document = call_document(call) if isinstance(call, MoeInitRoutingV2GradCall) else dict(call)
    _add_comparison(document, checked, candidate, standards, return_grad_x)
    try:
        return encode_body_view(document)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the comparison cannot be packed as msgpack: {exc}") from None


def explain_document(
    call: MoeInitRoutingV2GradCall | Mapping[str, Any], checked: MoeInitRoutingV2GradCall | None, candidate: Any
) -> dict[str, Any]:
    """The wire document of an explanation: a prepared call's fields (:func:`prepare`) plus
    ``candidate``; the candidate of a ``checked`` call checked first
    (:func:`moegrad.check_explain_arguments`), so a bad one raises InvalidArgument before any I/O;
    that of a call not checked is sent as given (absent: the wire's null tensor)."""
    document = call_document(call) if isinstance(call, MoeInitRoutingV2GradCall) else dict(call)
    if checked is not None:
        candidate = check_explain_arguments(checked, candidate)
    if candidate is not None:
        document["candidate"] = encode_tensor(np.asarray(candidate))
    return document


def _add_comparison(
    document: dict[str, Any],
    checked: MoeInitRoutingV2GradCall | None,
    candidate: Any,
    standards: Any,
    return_grad_x: bool,
) -> None:
    """A comparison's fields added to its call's document: ``candidate`` (absent: the wire's null
    tensor), ``standards``, ``return_grad_x``; checked first (:func:`moegrad.check_compare_arguments`)
    against a validated call, so a bad candidate or standard raises InvalidArgument before any I/O."""
    if checked is not None:
        names: Any = check_compare_arguments(checked, candidate, standards)
    else:
        names = (standards,) if isinstance(standards, str) else standards
    if candidate is not None:
        document["candidate"] = encode_tensor(np.asarray(candidate))
    if standards is not None:
        document["standards"] = list(names)
    if return_grad_x:
        document["return_grad_x"] = True


def batch_calls(items: list[Any]) -> list[Any]:
    """Each batch item's call (a :class:`BatchCompare`'s ``call``), for :func:`prepare`.

    Raises:
        TypeError: an item of another type, or a BatchCompare whose ``return_grad_x`` is not a bool.
    """
    calls = []
    for item in items:
        if isinstance(item, BatchCompare):
            if not isinstance(item.return_grad_x, bool):
                raise TypeError(f"return_grad_x must be a bool, got {type(item.return_grad_x).__name__}")
            calls.append(item.call)
        elif isinstance(item, (MoeInitRoutingV2GradCall, Mapping, Unnamed)):
            calls.append(item)
        else:
            raise TypeError(
                f"a batch item must be a MoeInitRoutingV2GradCall, a wire document mapping or a "
                f"BatchCompare, got {type(item).__name__}"
            )
    return calls


def batch_items(
    items: list[Any], prepared: list[Prepared | MoegradError]
) -> tuple[list[dict[str, Any] | MoegradError], list[Sent]]:
    """Each batch item's wire document (or the error it raised locally), and what its answer is
    checked against; ``prepared``: each item's call from :func:`prepare` (or the error it raised)."""
    documents: list[dict[str, Any] | MoegradError] = []
    sent: list[Sent] = []
    for item, ready in zip(items, prepared, strict=True):
        if isinstance(ready, MoegradError):  # refused locally: its own answer, not sent
            documents.append(ready)
            sent.append(Sent("grad", None, False))
            continue
        call, checked, unnamed = ready
        document = call_document(call) if isinstance(call, MoeInitRoutingV2GradCall) else dict(call)
        try:
            if isinstance(item, BatchCompare):
                document["op"] = "compare"
                _add_comparison(document, checked, item.candidate, item.standards, item.return_grad_x)
                sent.append(Sent("compare", checked, item.return_grad_x, unnamed))
            else:
                sent.append(Sent("grad", checked, True, unnamed))
            documents.append(document)
        except MoegradError as exc:  # a candidate or standard refused locally
            # without its traceback: through ``documents`` it would be a cycle holding every item's arrays
            documents.append(exc.with_traceback(None))
            sent.append(Sent("grad", None, False))
    return documents, sent


def batch_compares(
    pairs: Iterable[tuple[MoeInitRoutingV2GradCall | Mapping[str, Any], Any]], standards: Any
) -> list[BatchCompare]:
    """A sweep's ``(call, candidate)`` pairs as batch items; a call given as keyword arguments
    (a case that names no profile) is an :class:`Unnamed`, checked by the replicas' profile."""
    items = []
    for call, candidate in pairs:
        sent = call if isinstance(call, MoeInitRoutingV2GradCall) else Unnamed.of_fields(call)
        items.append(BatchCompare(sent, candidate, standards))
    return items
