"""Protocol v1: ``POST /v1/moe_init_routing_v2_grad`` (msgpack in, msgpack out) and ``GET /v1/info``.

The wire format is docs/protocol.md; the handler only decodes (api/inputs.py), runs on the pool, and
encodes. Empty calls (N = 0 or H = 0) are answered here without touching the backend (DESIGN.md
section 3: the documentation supports empty tensors; the 8.x kernel's tiling would reject them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request, Response

from moegrad import MoeInitRoutingV2GradCall, __version__, encode_tensor
from moegrad._wire import encode_body_view
from moegrad_service.api.auth import AuthenticatedRoute
from moegrad_service.api.inputs import metrics_of, pool_of, read_call, request_timeout, settings_of
from moegrad_service.api.problems import ClientDisconnected
from moegrad_service.engine import StreamPool, Timings
from moegrad_service.metrics import Metrics

__all__ = ["GRAD_PATH", "compute", "msgpack_openapi", "router"]

router = APIRouter(route_class=AuthenticatedRoute)
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
T = TypeVar("T")
MSGPACK = "application/msgpack"


def msgpack_openapi(request: str, reply: str) -> dict[str, Any]:
    """OpenAPI ``openapi_extra`` for a route whose body and 200 reply are msgpack maps (described in words)."""
    return {
        "requestBody": {"required": True, "description": request,
                        "content": {MSGPACK: {"schema": {"type": "string", "format": "binary"}}}},
        "responses": {"200": {"content": {MSGPACK: {}}, "description": reply}},
    }


_MSGPACK_BODY = msgpack_openapi(
    "msgpack map: grad_expanded_x, expanded_row_idx (tensors), top_k, drop_pad_mode, active_num, "
    "optional order and allow_duplicate_indices (docs/protocol.md)",
    "msgpack map with grad_x (docs/protocol.md)",
)


async def compute(call: MoeInitRoutingV2GradCall, pool: StreamPool, metrics: Metrics,
                  timeout_s: float, request: Request | None = None) -> tuple[np.ndarray, Timings]:
    """grad_x for a validated call: empty calls answered at once, the rest run on the pool.

    With ``request`` given, a client that disconnects while its call is queued costs nothing: the
    call is dropped unrun (ClientDisconnected); a running one finishes and its result is discarded.
    """
    if call.num_tokens == 0 or call.hidden_size == 0:
        return np.zeros((call.num_tokens, call.hidden_size), dtype=call.grad_expanded_x.dtype), Timings(0.0, 0.0)
    run = pool.run(call, timeout_s=timeout_s)
    grad_x, timings = await (run if request is None else _unless_disconnected(request, run))
    metrics.queue_duration.observe(timings.queue_s)
    metrics.compute_duration.observe(timings.compute_s)
    return grad_x, timings


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it and raise ClientDisconnected.

    One watcher task per call, which cancels this (the handler's) task when ``http.disconnect``
    arrives; ``work`` is awaited in place (a task of its own plus asyncio.wait cost more server CPU
    per small call than the call's compute).
    """
    handler = asyncio.current_task()
    gone = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, handler))
    try:
        return await work
    except asyncio.CancelledError:
        if not _finished(gone):
            raise  # cancelled for another reason (e.g. shutdown)
        handler.uncancel()
        raise ClientDisconnected("the client disconnected before its result was ready") from None
    finally:
        gone.cancel()


def _finished(task: asyncio.Task) -> bool:
    """True when ``task`` ran to its end (not cancelled, no exception)."""
    return task.done() and not task.cancelled() and task.exception() is None


async def _cancel_on_disconnect(request: Request, handler: asyncio.Task) -> None:
    """Once the client has gone (the body is already read, so only http.disconnect is left), cancel ``handler``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handler.cancel()


def msgpack_response(document: dict[str, Any], metrics: Metrics) -> Response:
    """Pack a reply document (no copy out of msgpack's buffer: a large grad_x is held once) and count its bytes."""
    body = encode_body_view(document)
    metrics.bytes_out.inc(len(body))
    return Response(content=body, media_type=MSGPACK)


def timings_ms(started: float, timings: Timings) -> dict[str, float]:
    """The reply's ``timings_ms``: queue, compute and total (since the handler started), in ms."""
    return {"queue": timings.queue_s * 1e3, "compute": timings.compute_s * 1e3,
            "total": (time.perf_counter() - started) * 1e3}


@router.post(GRAD_PATH, openapi_extra=_MSGPACK_BODY, response_class=Response,
             summary="Run aclnnMoeInitRoutingV2Grad: grad_x[i] = sum_t grad_expanded_x[expanded_row_idx[i*K+t]]")
async def moe_init_routing_v2_grad(request: Request) -> Response:
    started = getattr(request.state, "started", time.perf_counter())
    call = await read_call(request)
    pool, metrics = pool_of(request), metrics_of(request)
    grad_x, timings = await compute(call, pool, metrics, request_timeout(request), request)
    reply = {
        "grad_x": encode_tensor(grad_x),
        "backend": pool.backend.name,
        "order": call.order,
        "device": pool.backend.device,
        "timings_ms": timings_ms(started, timings),
    }
    response = msgpack_response(reply, metrics)
    metrics.succeeded(request.scope["route"].path, started)
    return response


@router.get("/v1/info", summary="Version, backend, device and limits of this service")
async def info(request: Request) -> dict[str, Any]:
    pool, settings = pool_of(request), settings_of(request)
    return {
        "version": __version__,
        "backend": pool.backend.name,
        "device": pool.backend.device,
        "order": settings.order,
        "streams": settings.streams,
        "max_queue": settings.max_queue,
        "max_body_bytes": settings.max_body_bytes,
        "max_elements": settings.max_elements,
        "request_timeout_s": settings.request_timeout_s,
    }
