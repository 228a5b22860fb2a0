"""Accuracy: ``POST /v1/moe_init_routing_v2_grad/compare`` (msgpack in, msgpack out).

A v1 call plus a ``candidate`` grad_x: the dataplane runs the call on its backend (the device or
the emulation), computes the float64 golden, and judges the candidate with :func:`moegrad.compare`
(docs/accuracy.md; wire format in docs/protocol.md). The body is read, limited and decoded as v1's
(api/inputs.py); the candidate and the standards are checked before the backend runs.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import Request, Response

from moegrad import MalformedRequest, MoeInitRoutingV2GradCall, decode_tensor, encode_tensor
from moegrad_service.api.inputs import (
    dataplane_of,
    disconnected,
    metrics_of,
    off_loop,
    read_document,
    request_timeout,
    settings_of,
)
from moegrad_service.api.routing import EndpointRoute, msgpack_operation
from moegrad_service.api.v1 import msgpack_response, reply_document, timings_ms
from moegrad_service.dataplane import Comparison

__all__ = ["COMPARE_PATH", "routes"]

COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
COMPARE_FIELDS = frozenset({"candidate", "standards", "return_grad_x"})


def decode_comparison(document: dict[str, Any], *, max_elements: int, default_order: str) -> Comparison:
    """The call, the candidate and the options of a compare body, every check done (nothing has run yet).

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


async def compare_candidate(request: Request) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    document = await read_document(request)
    dataplane, metrics = dataplane_of(request), metrics_of(request)
    timeout_s = request_timeout(request)
    dataplane.check_order(document.get("order"))
    comparison = await off_loop(
        decode_comparison,
        document,
        max_elements=settings_of(request).max_elements,
        default_order=dataplane.default_order,
    )
    outcome = await dataplane.compare(comparison, timeout_s=timeout_s, disconnected=partial(disconnected, request))
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
    response = msgpack_response(reply, metrics)
    metrics.succeeded(COMPARE_PATH, started)
    return response


routes = [
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
    )
]
