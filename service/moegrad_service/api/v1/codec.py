"""Protocol v1's codec: msgpack documents in, validated calls out; outcomes in, reply documents out. No HTTP here.

The wire format is docs/protocol.md. A call's document is moegrad's wire form of a call
(:meth:`moegrad.MoeInitRoutingV2GradCall.from_wire`); a compare document adds ``candidate``,
``standards`` and ``return_grad_x``; an explain document adds ``candidate``; a batch is an array of
a call's or a compare document, a compare item marked ``op: "compare"``. A call whose document
names no ``order`` names no profile (:func:`moegrad.operator.names_profile`): it is checked on, and
carries, the server's default profile; the profile a call names is the dataplane's to check against
its backend. A failed call of a batch is answered by its problem document: the fields of a single
call's application/problem+json.
"""

from __future__ import annotations

import time
from typing import Any

from moegrad import (
    AclnnStatus,
    MalformedRequest,
    MoegradError,
    MoeInitRoutingV2GradCall,
    decode_tensor,
    encode_tensor,
)
from moegrad_service.api.errors import answer_for, detail_of, field_of
from moegrad_service.api.v1.grouping import group_calls
from moegrad_service.dataplane import (
    BatchAnswer,
    BatchItem,
    CompareOutcome,
    Comparison,
    DataPlane,
    ExplainOutcome,
    ExplainRequest,
    GradOutcome,
    GroupOutcome,
    MemberOutcome,
)
from moegrad_service.engine import Timings

__all__ = [
    "COMPARE_FIELDS",
    "EXPLAIN_FIELDS",
    "batch_reply",
    "compare_reply",
    "decode_batch_items",
    "decode_call",
    "decode_comparison",
    "decode_explanation",
    "explain_reply",
    "grad_reply",
    "problem_document",
    "reply_document",
    "tensor_bytes",
    "timings_ms",
]

#: The fields a compare document has besides a call's.
COMPARE_FIELDS = frozenset({"candidate", "standards", "return_grad_x"})
#: The fields an explain document has besides a call's.
EXPLAIN_FIELDS = frozenset({"candidate"})
#: The fields a batch item may carry besides a call's: ``op`` ("grad", the default, or "compare").
_OPS = ("grad", "compare")


def decode_call(document: dict[str, Any], *, max_elements: int, default_order: str) -> MoeInitRoutingV2GradCall:
    """The call of a v1 document, validated with the app's limits; ``default_order`` when it names none.

    Raises:
        MalformedRequest: an unknown key or a broken tensor map (400).
        PayloadTooLarge: a tensor over ``max_elements`` (413).
        InvalidArgument: the call breaks a documented constraint (422, the field and the aclnn code).
    """
    return MoeInitRoutingV2GradCall.from_wire(document, max_elements=max_elements, default_order=default_order)


def tensor_bytes(document: dict[str, Any]) -> int:
    """The bytes of a decoded document's tensor data (where to validate it: inline or off the loop)."""
    total = 0
    for value in document.values():
        data = value.get("data") if isinstance(value, dict) else None
        if data is not None and not isinstance(data, (str, list, dict)) and hasattr(data, "__len__"):
            total += len(data)  # a msgpack bin, or a frames body's segment
    return total


def decode_comparison(document: dict[str, Any], *, max_elements: int, default_order: str) -> Comparison:
    """The call, the candidate and the options of a compare body, every check done (nothing has run
    yet; the order it names is the dataplane's to check).

    Raises:
        MalformedRequest: an unknown key, a broken tensor map, ``standards`` not a list of strings,
            ``return_grad_x`` not a bool (400).
        PayloadTooLarge: a tensor over ``max_elements`` (413).
        InvalidArgument: the call breaks a documented constraint, the candidate is missing (161001)
            or has the wrong dtype or shape, a standard is unknown (161002) (422).
    """
    call = MoeInitRoutingV2GradCall.from_wire(
        document, max_elements=max_elements, default_order=default_order, extra_fields=COMPARE_FIELDS
    )
    raw = document.get("candidate")
    candidate = None if raw is None else decode_tensor(raw, "candidate", max_elements=max_elements)
    standards = document.get("standards")
    if standards is not None and not (isinstance(standards, list) and all(isinstance(s, str) for s in standards)):
        raise MalformedRequest("standards must be a list of standard names (strings)", field="standards")
    return_grad_x = document.get("return_grad_x", False)
    if not isinstance(return_grad_x, bool):
        raise MalformedRequest(
            f"return_grad_x must be a bool, got {type(return_grad_x).__name__}", field="return_grad_x"
        )
    return Comparison.checked(call, candidate, standards, return_grad_x)


def decode_explanation(document: dict[str, Any], *, max_elements: int, default_order: str) -> ExplainRequest:
    """The call and the candidate of an explain body, every check done (nothing has run yet; the
    order it names is the dataplane's to check).

    Raises:
        MalformedRequest: an unknown key or a broken tensor map (400).
        PayloadTooLarge: a tensor over ``max_elements`` (413).
        InvalidArgument: the call breaks a documented constraint, the candidate is missing (161001)
            or is not of the call's dtype and shape [N, H] (161002) (422).
    """
    call = MoeInitRoutingV2GradCall.from_wire(
        document, max_elements=max_elements, default_order=default_order, extra_fields=EXPLAIN_FIELDS
    )
    raw = document.get("candidate")
    candidate = None if raw is None else decode_tensor(raw, "candidate", max_elements=max_elements)
    return ExplainRequest.checked(call, candidate)


def decode_batch_items(
    items: list[dict[str, Any] | MalformedRequest], dataplane: DataPlane, *, max_elements: int
) -> list[BatchItem]:
    """Each batch item as a validated call, a member of a
    validated group of small calls of one shape (:func:`~moegrad_service.api.v1.grouping.group_calls`),
    a validated comparison, or the error that item alone earns (as the single-call endpoints would
    answer it: the same field, rule and aclnn code). ``dataplane``: its ``default_order``."""
    decoded: list[BatchItem] = []
    default_order = dataplane.default_order
    for item, member in zip(items, group_calls(items, dataplane, max_elements=max_elements), strict=True):
        if member is not None:
            decoded.append(member)
            continue
        if isinstance(item, BaseException):
            decoded.append(item)
            continue
        try:
            op = item.pop("op", None)
            if op is None:  # absent or nil: a grad call (as a nil order is the default order)
                op = "grad"
            if op not in _OPS:
                raise MalformedRequest(
                    f"op={op!r} is not one of {list(_OPS)}; leave it out for a grad call", field="op"
                )
            if op == "compare":
                decoded.append(decode_comparison(item, max_elements=max_elements, default_order=default_order))
            else:
                decoded.append(decode_call(item, max_elements=max_elements, default_order=default_order))
        except MoegradError as exc:
            # without its traceback, whose first frame is this one: through ``decoded`` it would
            # be a cycle holding every item's tensors until the garbage collector next runs
            decoded.append(exc.with_traceback(None))
    return decoded


def timings_ms(started: float, timings: Timings) -> dict[str, float]:
    """The reply's ``timings_ms``: queue, compute and total (since the request arrived), in ms."""
    return {
        "queue": timings.queue_s * 1e3,
        "compute": timings.compute_s * 1e3,
        "total": (time.perf_counter() - started) * 1e3,
    }


def reply_document(outcome: GradOutcome | GroupOutcome) -> dict[str, Any]:
    """The fields every v1 reply carries about who computed it: backend, order, device."""
    return {"backend": outcome.backend, "order": outcome.order, "device": outcome.device}


def grad_reply(outcome: GradOutcome, started: float) -> dict[str, Any]:
    """A call's reply document: grad_x, backend, order, device and timings_ms (``started``: the
    ``time.perf_counter()`` reading when the request arrived)."""
    return {
        "grad_x": encode_tensor(outcome.grad_x),
        **reply_document(outcome),
        "timings_ms": timings_ms(started, outcome.timings),
    }


def compare_reply(comparison: Comparison, outcome: CompareOutcome, started: float) -> dict[str, Any]:
    """A comparison's reply document: report, backend, order, device, timings_ms (queue, compute,
    golden, compare, total) and, when asked for, grad_x."""
    measured = timings_ms(started, outcome.grad.timings)
    reply = {
        "report": outcome.report.to_dict(),
        **reply_document(outcome.grad),
        "timings_ms": {
            "queue": measured["queue"],
            "compute": measured["compute"],
            "golden": outcome.golden_s * 1e3,
            "compare": outcome.compare_s * 1e3,
            "total": measured["total"],
        },
    }
    if comparison.return_grad_x:
        reply["grad_x"] = encode_tensor(outcome.grad.grad_x)
    return reply


def explain_reply(outcome: ExplainOutcome, started: float) -> dict[str, Any]:
    """An explanation's reply document: explanation, backend, order, device, timings_ms (queue,
    compute, explain, total)."""
    measured = timings_ms(started, outcome.grad.timings)
    return {
        "explanation": outcome.explanation.to_dict(),
        **reply_document(outcome.grad),
        "timings_ms": {
            "queue": measured["queue"],
            "compute": measured["compute"],
            "explain": outcome.explain_s * 1e3,
            "total": measured["total"],
        },
    }


def problem_document(exc: BaseException) -> dict[str, Any]:
    """The problem document of one failed call in a batch: the fields of an error reply's
    application/problem+json (status, title, detail, field, aclnn_status, aclnn_name), and
    ``retry_after_s`` where a single call's answer would carry a Retry-After header (503)."""
    answer = answer_for(exc)
    status = getattr(exc, "aclnn_status", None)
    document = {
        "type": "about:blank",
        "title": answer.title,
        "status": answer.status,
        "detail": detail_of(exc),
        "field": field_of(exc),
        "aclnn_status": status,
        "aclnn_name": None if status is None else AclnnStatus.name_of(status),
    }
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:  # what a single call's Retry-After header says: when to send it again
        document["retry_after_s"] = retry_after_s
    return document


def batch_reply(items: list[BatchItem], answers: list[BatchAnswer]) -> list[dict[str, Any]]:
    """One reply map per answer: a grad call's (grad_x, backend, order, device, timings_ms; a group
    member's the same fields), a comparison's (report, ..., grad_x when asked), or
    ``{"problem": {...}}``."""
    results: list[dict[str, Any]] = []
    groups: dict[int, tuple[str, list[int], memoryview, int, dict[str, Any]]] = {}  # per GroupOutcome
    for item, answer in zip(items, answers, strict=True):
        if isinstance(answer, MemberOutcome):
            encoded = groups.get(id(answer.outcome))
            if encoded is None:
                outcome = answer.outcome
                tensor = encode_tensor(outcome.grad_x)
                fields = {
                    **reply_document(outcome),
                    "timings_ms": {"queue": outcome.timings.queue_s * 1e3, "compute": outcome.timings.compute_s * 1e3},
                }
                size = len(tensor["data"]) // max(len(outcome.grad_x), 1)
                encoded = groups[id(outcome)] = (tensor["dtype"], tensor["shape"][1:], tensor["data"], size, fields)
            name, shape, data, size, fields = encoded
            start = answer.member * size
            results.append({"grad_x": {"dtype": name, "shape": shape, "data": data[start : start + size]}, **fields})
        elif isinstance(answer, GradOutcome):
            results.append(
                {
                    "grad_x": encode_tensor(answer.grad_x),
                    **reply_document(answer),
                    "timings_ms": {"queue": answer.timings.queue_s * 1e3, "compute": answer.timings.compute_s * 1e3},
                }
            )
        elif isinstance(answer, CompareOutcome):
            result = {
                "report": answer.report.to_dict(),
                **reply_document(answer.grad),
                "timings_ms": {
                    "queue": answer.grad.timings.queue_s * 1e3,
                    "compute": answer.grad.timings.compute_s * 1e3,
                    "golden": answer.golden_s * 1e3,
                    "compare": answer.compare_s * 1e3,
                },
            }
            if isinstance(item, Comparison) and item.return_grad_x:
                result["grad_x"] = encode_tensor(answer.grad.grad_x)
            results.append(result)
        else:
            results.append({"problem": problem_document(answer)})
    return results
