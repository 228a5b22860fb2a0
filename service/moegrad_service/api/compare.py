"""Accuracy: ``POST /v1/moe_init_routing_v2_grad/compare`` (msgpack in, msgpack out).

A v1 call plus a ``candidate`` grad_x: the service runs the call on its backend (the device or the
emulation) with :func:`moegrad_service.api.v1.compute`, computes the float64 golden, and judges the
candidate with :func:`moegrad.compare` (docs/accuracy.md; wire format in docs/protocol.md). The body
is read, limited and decoded as v1's (api/inputs.py); the candidate and the standards are checked
before the backend runs, and the golden and the comparison (CPU work, float64) run on a worker
thread, off the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from moegrad import (
    ComparisonReport,
    MalformedRequest,
    MoeInitRoutingV2GradCall,
    check_compare_arguments,
    compare,
    decode_tensor,
    encode_tensor,
    moe_init_routing_v2_grad_golden,
)
from moegrad_service.api.auth import AuthenticatedRoute
from moegrad_service.api.inputs import metrics_of, pool_of, read_document, request_timeout, settings_of
from moegrad_service.api.v1 import compute, msgpack_openapi, msgpack_response, timings_ms
from moegrad_service.settings import Settings

__all__ = ["router"]

router = APIRouter(route_class=AuthenticatedRoute)
COMPARE_FIELDS = frozenset({"candidate", "standards", "return_grad_x"})
_MSGPACK_BODY = msgpack_openapi(
    "msgpack map: the fields of POST /v1/moe_init_routing_v2_grad plus candidate (tensor [N, H], the call's "
    "dtype or float32), optional standards (list of names) and return_grad_x (bool) (docs/protocol.md)",
    "msgpack map with report, backend, order, device, timings_ms and, when asked for, grad_x "
    "(docs/protocol.md, docs/accuracy.md)",
)


@dataclass(frozen=True)
class _Comparison:
    """A decoded, validated comparison request."""

    call: MoeInitRoutingV2GradCall
    candidate: np.ndarray
    standards: tuple[str, ...] | None
    return_grad_x: bool


def _decode(document: dict[str, Any], settings: Settings) -> _Comparison:
    """The call, the candidate and the options, every check done (nothing has run yet).

    Raises:
        MalformedRequest: an unknown key, a broken tensor map, ``standards`` not a list of strings,
            ``return_grad_x`` not a bool (400).
        PayloadTooLarge: a tensor over ``max_elements`` (413).
        InvalidArgument: the call breaks a documented constraint, the candidate is missing (161001)
            or has the wrong dtype or shape, a standard is unknown (161002) (422).
    """
    call = MoeInitRoutingV2GradCall.from_wire(document, max_elements=settings.max_elements,
                                              default_order=settings.order, extra_fields=COMPARE_FIELDS)
    raw = document.get("candidate")
    candidate = None if raw is None else decode_tensor(raw, "candidate", max_elements=settings.max_elements)
    standards = document.get("standards")
    if standards is not None and not (isinstance(standards, list) and all(isinstance(s, str) for s in standards)):
        raise MalformedRequest("standards must be a list of standard names (strings)", field="standards")
    return_grad_x = document.get("return_grad_x", False)
    if not isinstance(return_grad_x, bool):
        raise MalformedRequest(f"return_grad_x must be a bool, got {type(return_grad_x).__name__}",
                               field="return_grad_x")
    names = check_compare_arguments(call, candidate, standards)
    return _Comparison(call, candidate, None if standards is None else names, return_grad_x)


def _judge(request: _Comparison, device_result: np.ndarray) -> tuple[ComparisonReport, float, float]:
    """The golden and the report, with the seconds each took (CPU work: run on a worker thread)."""
    started = time.perf_counter()
    golden = moe_init_routing_v2_grad_golden(request.call)
    golden_done = time.perf_counter()
    report = compare(request.call, request.candidate, device_result=device_result, golden=golden,
                     standards=request.standards)
    return report, golden_done - started, time.perf_counter() - golden_done


@router.post("/v1/moe_init_routing_v2_grad/compare", openapi_extra=_MSGPACK_BODY, response_class=Response,
             summary="Judge a candidate grad_x against the device's result and a float64 golden")
async def compare_candidate(request: Request) -> Response:
    started = getattr(request.state, "started", time.perf_counter())
    document = await read_document(request)
    pool, metrics = pool_of(request), metrics_of(request)
    timeout_s = request_timeout(request)
    comparison = await run_in_threadpool(_decode, document, settings_of(request))
    grad_x, timings = await compute(comparison.call, pool, metrics, timeout_s, request)
    report, golden_s, compare_s = await run_in_threadpool(_judge, comparison, grad_x)
    measured = timings_ms(started, timings)
    reply = {
        "report": report.to_dict(),
        "backend": pool.backend.name,
        "order": comparison.call.order,
        "device": pool.backend.device,
        "timings_ms": {"queue": measured["queue"], "compute": measured["compute"], "golden": golden_s * 1e3,
                       "compare": compare_s * 1e3, "total": measured["total"]},
    }
    if comparison.return_grad_x:
        reply["grad_x"] = encode_tensor(grad_x)
    response = msgpack_response(reply, metrics)
    metrics.succeeded(request.scope["route"].path, started)
    return response
