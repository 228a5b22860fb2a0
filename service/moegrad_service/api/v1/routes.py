"""Protocol v1's routes: ``POST /v1/moe_init_routing_v2_grad`` (msgpack or frames in, the same out),
``POST /v1/moe_init_routing_v2_grad/batch`` (many calls in one msgpack body),
``POST /v1/moe_init_routing_v2_grad/compare`` (a call and a candidate grad_x, msgpack in and out),
``POST /v1/moe_init_routing_v2_grad/explain`` (a call and a candidate grad_x, msgpack or frames in,
msgpack out) and ``GET /v1/info``.

Each is read (api/intake.py: admission and a size-limited body) -> decode (api/v1/codec.py) ->
dataplane -> encode. A call's reply is frames when the request's Accept names
``application/vnd.moegrad.frames``, else msgpack. The compare endpoint judges the candidate with
:func:`moegrad.compare` against the backend's result and the float64 golden (docs/accuracy.md);
the candidate and the standards are checked before the backend runs. The explain endpoint
explains each row of the candidate that differs from the backend's result with
:func:`moegrad.explain` (docs/accuracy.md, "Explaining a mismatch"); the candidate is checked, and
the request's admission topped up to what the explanation holds (memory.peaks.explain_peak), before
the backend runs.
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
    MoeInitRoutingV2GradCall,
    decode_frames,
    encode_frames,
)
from moegrad.wire import EXPLAIN_PATH, VIEW_MIN_BYTES, decode_batch, decode_body, holds_views
from moegrad_service.api.auth import tenant_of
from moegrad_service.api.errors import answer_for
from moegrad_service.api.inputs import (
    INLINE_DECODE_BYTES,
    dataplane_of,
    disconnected,
    media_type_of,
    metrics_of,
    off_loop,
    request_timeout,
    settings_of,
)
from moegrad_service.api.intake import MSGPACK_MEDIA_TYPES, Intake
from moegrad_service.api.outputs import PartsResponse
from moegrad_service.api.routing import EndpointRoute, msgpack_operation
from moegrad_service.api.v1.codec import (
    batch_reply,
    compare_reply,
    decode_batch_items,
    decode_call,
    decode_comparison,
    decode_explanation,
    explain_reply,
    grad_reply,
    tensor_bytes,
)
from moegrad_service.api.v1.grouping import GROUP_CALL_BYTES
from moegrad_service.api.v1.parts import encode_parts
from moegrad_service.dataplane import BatchItem, Comparison, GroupMember
from moegrad_service.memory import MemoryBudget, Peak, batch_peak, call_peak, compare_peak, explain_peak
from moegrad_service.metrics import Metrics

__all__ = [
    "BATCH_PATH",
    "COMPARE_PATH",
    "EXPLAIN_PATH",
    "GRAD_PATH",
    "V1_MEDIA_TYPES",
    "msgpack_response",
    "read_document",
    "reply_response",
    "router",
    "routes",
]

router = APIRouter()
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
MSGPACK = "application/msgpack"
#: What a v1 call's body may be: msgpack, or frames (a msgpack header, then the tensors' bytes).
V1_MEDIA_TYPES = MSGPACK_MEDIA_TYPES | {FRAMES_MEDIA_TYPE}
#: Batch bodies larger than this are decoded on a worker thread: a batch's cost is its items (up to
#: MAX_BATCH_CALLS), which a few KiB already hold many of.
INLINE_BATCH_BYTES = 64 << 10
#: Batches of more items than this have their reply built on a worker thread (a comparison's
#: report alone takes longer to write out than a small call to run: bench/RESULTS.md, "Notes kept
#: from earlier runs").
INLINE_BATCH_ITEMS = 16


def msgpack_response(document: dict[str, Any], metrics: Metrics) -> Response:
    """A reply document as msgpack, its large bins sent from their own buffers (grad_x from the
    buffer it was computed into: :func:`~moegrad_service.api.v1.parts.encode_parts`), its
    bytes counted."""
    parts, length = encode_parts(document)
    metrics.bytes_out.inc(length)
    if len(parts) == 1:
        return Response(content=parts[0], media_type=MSGPACK)
    return PartsResponse(parts, MSGPACK)


def reply_response(request: Request, document: dict[str, Any], metrics: Metrics) -> Response:
    """The reply in the form the request accepts: frames (its tensors sent from their own buffers,
    not packed) when Accept names application/vnd.moegrad.frames, else msgpack; its bytes counted."""
    if FRAMES_MEDIA_TYPE not in request.headers.get("accept", ""):
        return msgpack_response(document, metrics)
    parts, length = encode_frames(document)
    metrics.bytes_out.inc(length)
    return PartsResponse(parts, FRAMES_MEDIA_TYPE)


async def read_document(request: Request, intake: Intake) -> dict[str, Any]:
    """The v1 body as a map (415/413/400 per :meth:`Intake.read` and :func:`moegrad.decode_body`), its
    bytes counted: msgpack (:func:`moegrad.wire.decode_body` with ``min_view_bytes``: a large
    tensor's data views the body, no copy) or frames (:func:`moegrad.decode_frames`: every
    tensor's data views the body); bodies over INLINE_DECODE_BYTES are decoded on a worker thread."""
    body = await intake.read(V1_MEDIA_TYPES)
    metrics_of(request).bytes_in.inc(len(body))
    if media_type_of(request) == FRAMES_MEDIA_TYPE:  # the call's arrays will view the body
        if len(body) > INLINE_DECODE_BYTES:
            return await off_loop(decode_frames, body, REQUEST_LIMITS)
        return decode_frames(body, REQUEST_LIMITS)
    if len(body) > INLINE_DECODE_BYTES:
        document = await off_loop(decode_body, body, REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES)
    else:
        document = decode_body(body, REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES)
    if holds_views(document):  # the tensors view the body: it goes back once the reply is sent
        return document
    # msgpack copied every bin out of the body: let the body go now, not after the reply
    del body
    intake.release_body()
    return document


async def read_call(request: Request, intake: Intake) -> MoeInitRoutingV2GradCall:
    """The v1 body as a call validated with the app's limits and default profile (InvalidArgument,
    422, names the field and the aclnn code); large tensors are validated on a worker thread."""
    document = await read_document(request, intake)
    build = partial(
        decode_call,
        document,
        max_elements=settings_of(request).max_elements,
        default_order=dataplane_of(request).default_order,
    )
    return await off_loop(build) if tensor_bytes(document) > INLINE_DECODE_BYTES else build()


async def moe_init_routing_v2_grad(request: Request, intake: Intake) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    call = await read_call(request, intake)
    intake.cover(call_peak, call)
    outcome = await dataplane_of(request).infer(
        call,
        timeout_s=request_timeout(request),
        disconnected=partial(disconnected, request),
        received_s=started,
        lender=intake.admission,
        tenant=tenant_of(request.scope),
    )
    metrics = metrics_of(request)
    response = reply_response(request, grad_reply(outcome, started), metrics)
    metrics.succeeded(GRAD_PATH, started)
    return response


async def moe_init_routing_v2_grad_batch(request: Request, intake: Intake) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    dataplane, metrics, settings = dataplane_of(request), metrics_of(request), settings_of(request)
    timeout_s = request_timeout(request)
    body = await intake.read(MSGPACK_MEDIA_TYPES, hold_per_byte=MemoryBudget.BATCH_HOLD_PER_BODY_BYTE)
    metrics.bytes_in.inc(len(body))

    def decode() -> list[BatchItem]:
        items = decode_batch(body, REQUEST_LIMITS, max_calls=MAX_BATCH_CALLS, min_view_bytes=GROUP_CALL_BYTES + 1)
        return decode_batch_items(items, dataplane, max_elements=settings.max_elements)

    items = await off_loop(decode) if len(body) > INLINE_BATCH_BYTES else decode()
    intake.cover(_batch_peak, items)
    answers = await dataplane.infer_batch(
        items, timeout_s=timeout_s, disconnected=partial(disconnected, request), tenant=tenant_of(request.scope)
    )

    def encode() -> Response:
        reply = {"results": batch_reply(items, answers), "timings_ms": {"total": (time.perf_counter() - started) * 1e3}}
        return msgpack_response(reply, metrics)

    response = await off_loop(encode) if len(answers) > INLINE_BATCH_ITEMS else encode()
    failed = [answer for answer in answers if isinstance(answer, BaseException)]
    for answer in failed:  # each call of a batch is counted, as a single call would be
        metrics.failure.labels(endpoint=BATCH_PATH, reason=answer_for(answer).reason).inc()
    metrics.succeeded(BATCH_PATH, started, calls=len(answers) - len(failed))
    return response


async def compare_candidate(request: Request, intake: Intake) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    document = await read_document(request, intake)
    dataplane, metrics = dataplane_of(request), metrics_of(request)
    timeout_s = request_timeout(request)
    comparison = await off_loop(
        decode_comparison,
        document,
        max_elements=settings_of(request).max_elements,
        default_order=dataplane.default_order,
    )
    intake.cover(compare_peak, comparison.call, comparison.candidate.nbytes)
    outcome = await dataplane.compare(
        comparison, timeout_s=timeout_s, disconnected=partial(disconnected, request), tenant=tenant_of(request.scope)
    )
    response = msgpack_response(compare_reply(comparison, outcome, started), metrics)
    metrics.succeeded(COMPARE_PATH, started)
    return response


def _batch_peak(items: list[BatchItem], *, body_bytes: int) -> Peak:
    """What a decoded batch holds (moegrad_service.memory.batch_peak): its calls, comparisons and refused items."""
    calls, comparisons, refused = [], [], 0
    for item in items:
        if isinstance(item, Comparison):
            comparisons.append((item.call, item.candidate.nbytes))
        elif isinstance(item, GroupMember):
            calls.append(item.group.like)  # every member has the shape of the group's first
        elif isinstance(item, BaseException):
            refused += 1
        else:
            calls.append(item)
    return batch_peak(calls, comparisons, refused=refused, body_bytes=body_bytes)


async def explain_candidate(request: Request, intake: Intake) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    document = await read_document(request, intake)
    dataplane, metrics = dataplane_of(request), metrics_of(request)
    timeout_s = request_timeout(request)
    explained = await off_loop(
        decode_explanation,
        document,
        max_elements=settings_of(request).max_elements,
        default_order=dataplane.default_order,
    )
    intake.cover(explain_peak, explained.call, explained.candidate.nbytes)
    outcome = await dataplane.explain(
        explained, timeout_s=timeout_s, disconnected=partial(disconnected, request), tenant=tenant_of(request.scope)
    )
    reply = await off_loop(explain_reply, outcome, started)
    response = msgpack_response(reply, metrics)
    metrics.succeeded(EXPLAIN_PATH, started)
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
    EndpointRoute(
        COMPARE_PATH,
        compare_candidate,
        operation=msgpack_operation(
            "Judge a candidate grad_x against the device's result and a float64 golden",
            "msgpack map: the fields of POST /v1/moe_init_routing_v2_grad plus candidate (tensor [N, H], the call's "
            "dtype or float32), optional standards (list of names) and return_grad_x (bool) (docs/protocol.md)",
            "msgpack map with report, backend, order, device, timings_ms and, when asked for, grad_x "
            "(docs/protocol.md, docs/accuracy.md)",
        ),
    ),
    EndpointRoute(
        EXPLAIN_PATH,
        explain_candidate,
        operation=msgpack_operation(
            "Explain each row of a candidate grad_x that differs from the device's: order, a wrong summand, "
            "precision, NaN/Inf",
            "msgpack map (or frames): the fields of POST /v1/moe_init_routing_v2_grad plus candidate (tensor "
            "[N, H], the call's dtype) (docs/protocol.md)",
            "msgpack map with explanation, backend, order, device and timings_ms (docs/protocol.md, docs/accuracy.md)",
        ),
    ),
]


@router.get("/v1/info", summary="Version, backend, device and limits of this service")
async def info(request: Request) -> dict[str, Any]:
    return dataplane_of(request).info()
