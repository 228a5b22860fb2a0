"""Protocol v1: ``POST /v1/moe_init_routing_v2_grad`` (msgpack or frames in, the same out),
``POST /v1/moe_init_routing_v2_grad/batch`` (many calls in one msgpack body) and ``GET /v1/info``.

The wire format is docs/protocol.md. The handlers decode (api/inputs.py), run the calls on the
dataplane, and encode their answers: a reply is frames when the request's Accept names
``application/vnd.moegrad.frames``, else msgpack.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from moegrad import (
    FRAMES_MEDIA_TYPE,
    MAX_BATCH_CALLS,
    REQUEST_LIMITS,
    AclnnStatus,
    MalformedRequest,
    MoegradError,
    MoeInitRoutingV2GradCall,
    decode_batch,
    encode_body_view,
    encode_frames,
    encode_tensor,
)
from moegrad_service.api.errors import answer_for, message_of
from moegrad_service.api.grouping import group_calls
from moegrad_service.api.inputs import (
    INLINE_DECODE_BYTES,
    MSGPACK_MEDIA_TYPES,
    dataplane_of,
    disconnected,
    metrics_of,
    off_loop,
    read_body,
    read_call,
    request_timeout,
    result_buffer,
    settings_of,
)
from moegrad_service.api.outputs import PartsResponse
from moegrad_service.api.routing import EndpointRoute, msgpack_operation
from moegrad_service.dataplane import (
    CompareOutcome,
    Comparison,
    DataPlane,
    GradOutcome,
    GroupMember,
    GroupOutcome,
    MemberOutcome,
    MemoryBudget,
)
from moegrad_service.engine import Timings
from moegrad_service.metrics import Metrics

__all__ = [
    "BATCH_PATH",
    "GRAD_PATH",
    "msgpack_response",
    "problem_document",
    "reply_document",
    "reply_response",
    "router",
    "routes",
    "timings_ms",
]

router = APIRouter()
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
MSGPACK = "application/msgpack"


def msgpack_response(document: dict[str, Any], metrics: Metrics) -> Response:
    """Pack a reply document (no copy out of msgpack's buffer: a large grad_x is held once) and count its bytes."""
    body = encode_body_view(document)
    metrics.bytes_out.inc(len(body))
    return Response(content=body, media_type=MSGPACK)


def reply_response(request: Request, document: dict[str, Any], metrics: Metrics) -> Response:
    """The reply in the form the request accepts: frames (its tensors sent from their own buffers,
    not packed) when Accept names application/vnd.moegrad.frames, else msgpack; its bytes counted."""
    if FRAMES_MEDIA_TYPE not in request.headers.get("accept", ""):
        return msgpack_response(document, metrics)
    parts, length = encode_frames(document)
    metrics.bytes_out.inc(length)
    return PartsResponse(parts, FRAMES_MEDIA_TYPE)


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


async def moe_init_routing_v2_grad(request: Request) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    call = await read_call(request)
    outcome = await dataplane_of(request).infer(
        call,
        timeout_s=request_timeout(request),
        disconnected=partial(disconnected, request),
        received_s=started,
        out=result_buffer(request, call),
    )
    reply = {
        "grad_x": encode_tensor(outcome.grad_x),
        **reply_document(outcome),
        "timings_ms": timings_ms(started, outcome.timings),
    }
    metrics = metrics_of(request)
    response = reply_response(request, reply, metrics)
    metrics.succeeded(GRAD_PATH, started)
    return response


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
        "detail": getattr(exc, "message", None) or message_of(exc),
        "field": getattr(exc, "field", None),
        "aclnn_status": status,
        "aclnn_name": None if status is None else AclnnStatus.name_of(status),
    }
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:  # what a single call's Retry-After header says: when to send it again
        document["retry_after_s"] = retry_after_s
    return document


#: The fields a batch item may carry besides a call's: ``op`` ("grad", the default, or "compare").
_OPS = ("grad", "compare")


def decode_batch_items(
    items: list[dict[str, Any] | MalformedRequest], dataplane: DataPlane, *, max_elements: int
) -> list[MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException]:
    """Each batch item as a validated call, a member of a validated group of small calls of one
    shape (:func:`~moegrad_service.api.grouping.group_calls`), a validated comparison, or the error
    that item alone earns (as the single-call endpoints would answer it: the same field, rule and
    aclnn code)."""
    from moegrad_service.api.compare import decode_comparison  # compare imports this module

    decoded: list[MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException] = []
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
            dataplane.check_order(item.get("order"))
            if op == "compare":
                decoded.append(decode_comparison(item, max_elements=max_elements, default_order=default_order))
            else:
                decoded.append(
                    MoeInitRoutingV2GradCall.from_wire(item, max_elements=max_elements, default_order=default_order)
                )
        except MoegradError as exc:
            # without its traceback, whose first frame is this one: through ``decoded`` it would
            # be a cycle holding every item's tensors until the garbage collector next runs
            decoded.append(exc.with_traceback(None))
    return decoded


def batch_reply(
    items: list[MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException],
    answers: list[GradOutcome | MemberOutcome | CompareOutcome | BaseException],
) -> list[dict[str, Any]]:
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


async def moe_init_routing_v2_grad_batch(request: Request) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    dataplane, metrics, settings = dataplane_of(request), metrics_of(request), settings_of(request)
    timeout_s = request_timeout(request)
    body = await read_body(
        request, settings.max_body_bytes, MSGPACK_MEDIA_TYPES, hold_per_byte=MemoryBudget.BATCH_HOLD_PER_BODY_BYTE
    )
    metrics.bytes_in.inc(len(body))

    def decode() -> list[MoeInitRoutingV2GradCall | GroupMember | Comparison | BaseException]:
        items = decode_batch(body, REQUEST_LIMITS, max_calls=MAX_BATCH_CALLS)
        return decode_batch_items(items, dataplane, max_elements=settings.max_elements)

    items = await off_loop(decode) if len(body) > INLINE_DECODE_BYTES else decode()
    answers = await dataplane.infer_batch(items, timeout_s=timeout_s, disconnected=partial(disconnected, request))
    reply = {"results": batch_reply(items, answers), "timings_ms": {"total": (time.perf_counter() - started) * 1e3}}
    response = msgpack_response(reply, metrics)
    failed = [answer for answer in answers if isinstance(answer, BaseException)]
    for answer in failed:  # each call of a batch is counted, as a single call would be
        metrics.failure.labels(endpoint=BATCH_PATH, reason=answer_for(answer).reason).inc()
    metrics.succeeded(BATCH_PATH, started, calls=len(answers) - len(failed))
    return response


routes = [
    EndpointRoute(
        GRAD_PATH,
        moe_init_routing_v2_grad,
        operation=msgpack_operation(
            "Run aclnnMoeInitRoutingV2Grad: grad_x[i] = sum_t grad_expanded_x[expanded_row_idx[i*K+t]]",
            "msgpack map: grad_expanded_x, expanded_row_idx (tensors), top_k, drop_pad_mode, active_num, "
            "optional order and allow_duplicate_indices (docs/protocol.md)",
            "msgpack map with grad_x (docs/protocol.md)",
        ),
    ),
    EndpointRoute(
        BATCH_PATH,
        moe_init_routing_v2_grad_batch,
        operation=msgpack_operation(
            "Run many independent calls (and comparisons) in one request, each answered on its own, in order",
            "msgpack array of call maps, each as the body of POST /v1/moe_init_routing_v2_grad, optionally with "
            "op='compare' and the compare fields (docs/protocol.md, Batches)",
            "msgpack map: results (one map per call: its reply, or problem) and timings_ms (docs/protocol.md)",
        ),
    ),
]


@router.get("/v1/info", summary="Version, backend, device and limits of this service")
async def info(request: Request) -> dict[str, Any]:
    return dataplane_of(request).info()
