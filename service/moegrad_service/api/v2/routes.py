"""Protocol v2's routes: the Open Inference Protocol (KServe v2, Triton's HTTP/REST API) for one model.

Routes (docs/protocol.md, "Protocol v2")::

    GET  /v2                                            server metadata
    GET  /v2/health/live, /v2/health/ready              liveness, readiness
    GET  /v2/models/{name}[/versions/{version}]         model metadata
    GET  /v2/models/{name}[/versions/{version}]/ready   model readiness
    POST /v2/models/{name}[/versions/{version}]/infer   inference: JSON, or JSON + binary tensor data
    GET  /v2/models/{name}[/versions/{version}]/config  model configuration (extension)
    GET  /v2/models[/{name}[/versions/{version}]]/stats statistics (extension)
    POST /v2/repository/index                           repository index (extension)

Each is decode (api/v2/codec.py) -> dataplane -> encode. Errors are ``{"error": "..."}`` as the
protocol has them: the one renderer (api/errors.py) answers every path under ``/v2`` so.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from moegrad import MalformedRequest
from moegrad_service.api.auth import tenant_of
from moegrad_service.api.errors import NotFound
from moegrad_service.api.inputs import (
    dataplane_of,
    disconnected,
    metrics_of,
    off_loop,
    request_timeout,
    settings_of,
)
from moegrad_service.api.intake import Intake, byte_count
from moegrad_service.api.outputs import PartsResponse
from moegrad_service.api.routing import EndpointRoute
from moegrad_service.api.v2.codec import (
    HEADER_LENGTH,
    INLINE_ENCODE_ELEMENTS,
    MODEL_NAME,
    MODEL_VERSION,
    binary_lead,
    decode_infer_request,
    encode_infer_response,
)
from moegrad_service.api.v2.model import (
    check_model,
    model_config,
    model_metadata,
    model_statistics,
    repository_index,
    server_metadata,
)
from moegrad_service.dataplane import GradOutcome
from moegrad_service.memory import JSON_HOLD_PER_BODY_BYTE, MemoryBudget, call_peak

__all__ = ["INFER_PATHS", "router", "routes"]

router = APIRouter()
#: v2 bodies larger than this are decoded on a worker thread: JSON costs far more per byte than
#: binary tensor data, so the event loop keeps only small requests.
INLINE_JSON_BYTES = 64 << 10

#: The versioned routes read model_version from the path (one handler serves both forms); declared for OpenAPI.
_VERSION_PARAMETER = {
    "name": "model_version",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "enum": [MODEL_VERSION]},
}
_MODEL_PARAMETER = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
INFER_PATHS = ("/v2/models/{model_name}/infer", "/v2/models/{model_name}/versions/{model_version}/infer")


def _check_model(request: Request) -> None:
    check_model(request.path_params["model_name"], request.path_params.get("model_version", MODEL_VERSION))


@router.get("/v2", summary="v2 server metadata")
async def get_server_metadata() -> dict[str, Any]:
    return server_metadata(binary_tensor_data=True)


@router.get("/v2/health/live", summary="v2 liveness (never touches the device)")
async def server_live() -> dict[str, bool]:
    return {"live": True}


@router.get("/v2/health/ready", summary="v2 readiness: the backend is healthy and the pool admits calls")
async def server_ready(request: Request) -> dict[str, bool]:
    await dataplane_of(request).check_ready()
    return {"ready": True}


@router.get("/v2/models/stats", summary="v2 statistics of every model (the one model)")
async def all_statistics(request: Request) -> dict[str, Any]:
    return model_statistics(dataplane_of(request))


@router.get("/v2/models/{model_name}", summary="v2 model metadata")
@router.get(
    "/v2/models/{model_name}/versions/{model_version}",
    summary="v2 model metadata (a version)",
    openapi_extra={"parameters": [_VERSION_PARAMETER]},
)
async def get_model_metadata(request: Request, model_name: str) -> dict[str, Any]:
    _check_model(request)
    return model_metadata(dataplane_of(request))


@router.get("/v2/models/{model_name}/config", summary="v2 model configuration (Triton's ModelConfig)")
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/config",
    summary="v2 model configuration (a version)",
    openapi_extra={"parameters": [_VERSION_PARAMETER]},
)
async def get_model_config(request: Request, model_name: str) -> dict[str, Any]:
    _check_model(request)
    return model_config(dataplane_of(request))


@router.get("/v2/models/{model_name}/stats", summary="v2 model statistics (Triton's schema, nanoseconds)")
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/stats",
    summary="v2 model statistics (a version)",
    openapi_extra={"parameters": [_VERSION_PARAMETER]},
)
async def get_model_statistics(request: Request, model_name: str) -> dict[str, Any]:
    _check_model(request)
    return model_statistics(dataplane_of(request))


@router.post("/v2/repository/index", summary="v2 repository index: the one model, READY")
async def get_repository_index(request: Request) -> list[dict[str, str]]:
    with Intake(request) as intake:  # a FastAPI route: the body is copied out, and its admission released
        body = bytes(await intake.read(None, limit=1 << 16))
    ready = False
    if body.strip():
        document = parse_repository_request(body)
        ready = document.get("ready", False)
    return repository_index(ready)


def parse_repository_request(body: bytes) -> dict[str, Any]:
    """The repository index request: an optional JSON object ``{"repository_name": str, "ready": bool}``.

    Raises:
        MalformedRequest: (400) not such an object.
    """
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise MalformedRequest(f"the repository index request is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or set(document) - {"repository_name", "ready"}:
        raise MalformedRequest(
            "the repository index request must be a JSON object with only repository_name and ready",
            field="repository index",
        )
    if not isinstance(document.get("ready", False), bool):
        raise MalformedRequest(f"ready={document['ready']!r} must be true or false", field="ready")
    if not isinstance(document.get("repository_name", ""), str):
        raise MalformedRequest("repository_name must be a string", field="repository_name")
    return document


@router.get("/v2/models/{model_name}/ready", summary="v2 model readiness")
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/ready",
    summary="v2 model readiness (a version)",
    openapi_extra={"parameters": [_VERSION_PARAMETER]},
)
async def model_ready(request: Request, model_name: str) -> dict[str, Any]:
    _check_model(request)
    await dataplane_of(request).check_ready()
    return {"name": MODEL_NAME, "ready": True}


async def infer(request: Request, intake: Intake) -> Response:
    started = request.scope.get("state", {}).get("started", time.perf_counter())
    _check_model(request)
    dataplane, settings, metrics = dataplane_of(request), settings_of(request), metrics_of(request)
    timeout_s = request_timeout(request)
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding != "identity":
        raise MalformedRequest(
            f"Content-Encoding {coding!r} is not supported; send the body uncompressed", field="Content-Encoding"
        )
    header_length = request.headers.get(HEADER_LENGTH)
    # tritonclient sends no Content-Type; the binary tensor data is read in place 16-byte aligned (no copy).
    # The JSON part holds many times its bytes while it is parsed: all of a JSON-only body, else the header.
    json_bytes = None if header_length is None else byte_count(header_length)
    if json_bytes is not None:  # a header larger than the body is refused once read (400): count the body
        json_bytes = min(json_bytes, byte_count(request.headers.get("content-length", "")) or 0)
    json_extra = JSON_HOLD_PER_BODY_BYTE - MemoryBudget.HOLD_PER_BODY_BYTE
    body = await intake.read(
        None,
        lead=binary_lead(header_length),
        hold_per_byte=JSON_HOLD_PER_BODY_BYTE if json_bytes is None else None,
        extra_bytes=0 if json_bytes is None else json_bytes * json_extra,
    )
    metrics.bytes_in.inc(len(body))
    decode = partial(
        decode_infer_request,
        body,
        header_length,
        max_elements=settings.max_elements,
        default_order=dataplane.default_order,
    )
    decoded = await off_loop(decode) if len(body) > INLINE_JSON_BYTES else decode()
    if decoded.timeout_s is not None:
        timeout_s = min(timeout_s, decoded.timeout_s)
    intake.cover(call_peak, decoded.call, reply="buffers" if decoded.binary_output else "json")
    outcome = await dataplane.infer(
        decoded.call,
        timeout_s=timeout_s,
        disconnected=partial(disconnected, request),
        received_s=started,
        lender=intake.admission,
        tenant=tenant_of(request.scope),
    )
    encode = partial(encode_infer_response, outcome.grad_x, decoded, _reply_parameters(outcome))
    response = await off_loop(encode) if outcome.grad_x.size > INLINE_ENCODE_ELEMENTS else encode()
    metrics.bytes_out.inc(response.length if isinstance(response, PartsResponse) else len(response.body))
    metrics.succeeded(request.scope["route"].path, started)
    return response


def _reply_parameters(outcome: GradOutcome) -> dict[str, Any]:
    parameters: dict[str, Any] = {
        "backend": outcome.backend,
        "order": outcome.order,
        "queue_ms": outcome.timings.queue_s * 1e3,
        "compute_ms": outcome.timings.compute_s * 1e3,
    }
    if outcome.device is not None:
        parameters["device"] = outcome.device
    return parameters


def _infer_operation(path: str) -> dict[str, Any]:
    versioned = "{model_version}" in path
    return {
        "summary": "v2 inference (a version)"
        if versioned
        else "v2 inference: grad_x[i] = sum_t grad_expanded_x[expanded_row_idx[i*K+t]]",
        "parameters": [_MODEL_PARAMETER, *([_VERSION_PARAMETER] if versioned else [])],
        "description": "The body is the inference request: JSON, or JSON followed by binary tensor data whose "
        f"JSON part's length is in {HEADER_LENGTH} (docs/protocol.md, Protocol v2).",
        "responses": {
            "200": {
                "description": "the inference response",
                "content": {"application/json": {}, "application/octet-stream": {}},
            }
        },
    }


routes = [EndpointRoute(path, infer, operation=_infer_operation(path)) for path in INFER_PATHS]


@router.api_route("/v2/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
async def not_found(request: Request, path: str) -> Response:
    raise NotFound(f"no v2 route {request.method} /v2/{path}")
