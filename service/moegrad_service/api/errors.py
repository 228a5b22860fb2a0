"""Domain errors -> answers, for every protocol: one table, one set of headers, one renderer.

v1 (and every path that is not under ``/v2``) answers ``application/problem+json`` (RFC 9457) with
``type``, ``title``, ``status``, ``detail``, ``field``, ``aclnn_status``, ``aclnn_name``,
``request_id`` and, for device faults, ``device_message``. v2 answers ``{"error": message}`` as the
Open Inference Protocol has it, the message naming the field and the aclnn code. Both take their
status, the metrics reason and the shared headers (Retry-After, WWW-Authenticate) from
:data:`ERRORS`. A client's mistake is never a 500.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope

from moegrad import (
    AclnnStatus,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MalformedRequest,
    MoegradError,
    PayloadTooLarge,
    Unauthorized,
)
from moegrad_service.dataplane import ClientDisconnected

__all__ = [
    "ERRORS",
    "FIELD_LIMIT",
    "MESSAGE_LIMIT",
    "ErrorAnswer",
    "NotFound",
    "RequestTimeout",
    "UnsupportedMediaType",
    "answer_for",
    "bounded",
    "detail_of",
    "error_response",
    "field_of",
    "install_error_handlers",
    "message_of",
    "protocol_of",
    "shared_headers",
]

log = logging.getLogger("moegrad_service.api")
PROBLEM_JSON = "application/problem+json"


class UnsupportedMediaType(MalformedRequest):
    """The request's Content-Type is not one this endpoint reads."""


class RequestTimeout(MalformedRequest):
    """The request's body did not arrive within ``body_timeout_s``."""


class NotFound(MoegradError):
    """A model, model version or v2 path this server does not have."""


class HTTPProblem(MoegradError):
    """A routing-level refusal Starlette raised (404 no route, 405 wrong method), with its status."""

    def __init__(self, message: str, status: int, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.headers = message, status, dict(headers or {})


@dataclass(frozen=True)
class ErrorAnswer:
    """How one domain error is answered.

    Attributes:
        status: the v1 HTTP status.
        title: the RFC 9457 title of v1's problem document.
        reason: the ``reason`` label of the failure counter.
        v2_status: the v2 HTTP status.
        grpc_code: the ``grpc.StatusCode`` name of the v2 gRPC endpoint.
    """

    status: int
    title: str
    reason: str
    v2_status: int
    grpc_code: str


#: The one mapping from domain errors to answers. Looked up along the exception's MRO, most specific first.
ERRORS: dict[type[BaseException], ErrorAnswer] = {
    NotFound: ErrorAnswer(404, "Not found", "not_found", 404, "NOT_FOUND"),
    InvalidArgument: ErrorAnswer(422, "Invalid argument", "invalid_argument", 400, "INVALID_ARGUMENT"),
    UnsupportedMediaType: ErrorAnswer(415, "Unsupported media type", "unsupported_media_type", 415, "INVALID_ARGUMENT"),
    RequestTimeout: ErrorAnswer(408, "Request timeout", "body_timeout", 408, "DEADLINE_EXCEEDED"),
    PayloadTooLarge: ErrorAnswer(413, "Payload too large", "payload_too_large", 413, "RESOURCE_EXHAUSTED"),
    MalformedRequest: ErrorAnswer(400, "Malformed request", "malformed_request", 400, "INVALID_ARGUMENT"),
    Unauthorized: ErrorAnswer(401, "Unauthorized", "unauthorized", 401, "UNAUTHENTICATED"),
    DeviceBusy: ErrorAnswer(503, "Service unavailable", "busy", 503, "UNAVAILABLE"),
    DeadlineExceeded: ErrorAnswer(504, "Deadline exceeded", "deadline_exceeded", 504, "DEADLINE_EXCEEDED"),
    DeviceFault: ErrorAnswer(500, "Device fault", "device_fault", 500, "INTERNAL"),
    HTTPProblem: ErrorAnswer(404, "Not found", "not_routed", 404, "UNIMPLEMENTED"),
    ClientDisconnected: ErrorAnswer(499, "Client closed request", "client_disconnected", 499, "CANCELLED"),
    Exception: ErrorAnswer(500, "Internal error", "internal", 500, "INTERNAL"),
}


def answer_for(exc: BaseException) -> ErrorAnswer:
    """The table entry for ``exc`` (its class or nearest base)."""
    for cls in type(exc).__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return ERRORS[Exception]


def as_domain_error(exc: BaseException) -> BaseException:
    """Starlette's own exceptions as the domain errors they stand for; others unchanged."""
    if isinstance(exc, ClientDisconnect):  # the client hung up while its body was being read
        return ClientDisconnected("the client disconnected while sending its body")
    if isinstance(exc, StarletteHTTPException):
        return HTTPProblem(str(exc.detail), exc.status_code, exc.headers)
    return exc


def shared_headers(exc: BaseException) -> dict[str, str]:
    """The headers an error answer carries on every protocol: Retry-After (whole seconds) for
    DeviceBusy, ``WWW-Authenticate: Bearer`` for Unauthorized, and a routing refusal's own (405's Allow)."""
    headers: dict[str, str] = {}
    if isinstance(exc, DeviceBusy):
        headers["Retry-After"] = str(max(0, math.ceil(exc.retry_after_s)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="moegrad"'
    if isinstance(exc, HTTPProblem):
        headers.update(exc.headers)
    return headers


#: The longest message and field name an error answer carries, in characters: a client's string
#: echoed in a message (an unknown parameter, input or model name, a long ``order``) is cut to fit,
#: so every path answers alike and a gRPC status stays under the metadata limit (8 KiB soft).
MESSAGE_LIMIT, FIELD_LIMIT = 1024, 128


def bounded(text: str | None, limit: int = MESSAGE_LIMIT) -> str | None:
    """``text`` cut to at most about ``limit`` characters (its start and end kept, and how much was
    left out said), or as it is when shorter."""
    if text is None or len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 4
    return f"{text[:head]}... ({len(text) - head - tail} characters left out) ...{text[-tail:]}"


def message_of(exc: BaseException) -> str:
    """The human message of an error (at most about :data:`MESSAGE_LIMIT` characters): a domain
    error's own text (InvalidArgument's names the field and the aclnn code), a device fault with the
    device's message, an unexpected error's type."""
    if not isinstance(exc, MoegradError):
        return bounded(f"internal error ({type(exc).__name__}: {exc})") or ""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, DeviceFault) and exc.device_message:
        message = f"{message} (device: {exc.device_message})"
    return bounded(message) or ""


def detail_of(exc: BaseException) -> str:
    """A problem document's ``detail``: the error's message without the field and code (which the
    document carries apart), bounded as :func:`message_of`."""
    if not isinstance(exc, MoegradError):
        return message_of(exc)
    return bounded(getattr(exc, "message", None) or str(exc) or type(exc).__name__) or ""


def field_of(exc: BaseException) -> str | None:
    """A problem document's ``field``, at most about :data:`FIELD_LIMIT` characters."""
    return bounded(getattr(exc, "field", None), FIELD_LIMIT)


def protocol_of(scope: Scope) -> str:
    """``"v2"`` for a request under ``/v2`` (less the ``root_path`` it is served under), else ``"v1"``."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return "v2" if path == "/v2" or path.startswith("/v2/") else "v1"


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The answer to ``exc`` in the request's protocol; logs server faults and counts the failure
    (labelled with the matched route's path, when a route matched)."""
    exc = as_domain_error(exc)
    answer = answer_for(exc)
    request_id = request.scope.get("state", {}).get("request_id")
    if not isinstance(exc, MoegradError):
        log.error("request %s: unexpected error", request_id, exc_info=exc)
    elif answer.status >= 500 and not isinstance(exc, (DeviceBusy, DeadlineExceeded)):
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, message_of(exc))
    route = request.scope.get("route")
    metrics = request.scope.get("state", {}).get("metrics")
    if metrics is not None and route is not None:
        metrics.failure.labels(endpoint=route.path, reason=answer.reason).inc()
    headers = shared_headers(exc)
    if protocol_of(request.scope) == "v2":
        status = exc.status if isinstance(exc, HTTPProblem) else answer.v2_status
        return JSONResponse({"error": message_of(exc)}, status_code=status, headers=headers)
    status, title = answer.status, answer.title
    if isinstance(exc, HTTPProblem):
        status, title = exc.status, HTTPStatus(exc.status).phrase
    body = {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail_of(exc),
        "field": field_of(exc),
        "aclnn_status": getattr(exc, "aclnn_status", None),
        "aclnn_name": getattr(exc, "aclnn_name", None),
        "request_id": request_id,
    }
    if isinstance(exc, DeviceFault):
        body["device_message"] = exc.device_message
        if body["aclnn_status"] is not None:
            body["aclnn_name"] = AclnnStatus.name_of(body["aclnn_status"])
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app's FastAPI routes can raise through :func:`error_response`."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "header"))
        return error_response(
            request, MalformedRequest(f"{field or 'request'}: {first.get('msg')}", field=field or None)
        )

    for kind in (MoegradError, ClientDisconnect, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
