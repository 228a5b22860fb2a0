"""Protocol v1: ``POST /v1/moe_init_routing_v2_grad`` (msgpack in, msgpack out) and ``GET /v1/info``.

The wire format is docs/protocol.md. The handler decodes (api/inputs.py), runs the call on the
dataplane, and encodes its answer.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from moegrad import encode_body_view, encode_tensor
from moegrad_service.api.inputs import dataplane_of, disconnected, metrics_of, read_call, request_timeout
from moegrad_service.api.routing import EndpointRoute, msgpack_operation
from moegrad_service.dataplane import GradOutcome
from moegrad_service.engine import Timings
from moegrad_service.metrics import Metrics

__all__ = ["GRAD_PATH", "msgpack_response", "reply_document", "router", "routes", "timings_ms"]

router = APIRouter()
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
MSGPACK = "application/msgpack"


def msgpack_response(document: dict[str, Any], metrics: Metrics) -> Response:
    """Pack a reply document (no copy out of msgpack's buffer: a large grad_x is held once) and count its bytes."""
    body = encode_body_view(document)
    metrics.bytes_out.inc(len(body))
    return Response(content=body, media_type=MSGPACK)


def timings_ms(started: float, timings: Timings) -> dict[str, float]:
    """The reply's ``timings_ms``: queue, compute and total (since the request arrived), in ms."""
    return {"queue": timings.queue_s * 1e3, "compute": timings.compute_s * 1e3,
            "total": (time.perf_counter() - started) * 1e3}


def reply_document(outcome: GradOutcome) -> dict[str, Any]:
    """The fields every v1 reply carries about who computed it: backend, order, device."""
    return {"backend": outcome.backend, "order": outcome.order, "device": outcome.device}


async def moe_init_routing_v2_grad(request: Request) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    call = await read_call(request)
    outcome = await dataplane_of(request).infer(call, timeout_s=request_timeout(request),
                                                disconnected=partial(disconnected, request), received_s=started)
    reply = {"grad_x": encode_tensor(outcome.grad_x), **reply_document(outcome),
             "timings_ms": timings_ms(started, outcome.timings)}
    metrics = metrics_of(request)
    response = msgpack_response(reply, metrics)
    metrics.succeeded(GRAD_PATH, started)
    return response


routes = [EndpointRoute(GRAD_PATH, moe_init_routing_v2_grad, operation=msgpack_operation(
    "Run aclnnMoeInitRoutingV2Grad: grad_x[i] = sum_t grad_expanded_x[expanded_row_idx[i*K+t]]",
    "msgpack map: grad_expanded_x, expanded_row_idx (tensors), top_k, drop_pad_mode, active_num, "
    "optional order and allow_duplicate_indices (docs/protocol.md)",
    "msgpack map with grad_x (docs/protocol.md)"))]


@router.get("/v1/info", summary="Version, backend, device and limits of this service")
async def info(request: Request) -> dict[str, Any]:
    return dataplane_of(request).info()
