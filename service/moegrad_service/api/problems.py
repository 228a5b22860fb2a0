"""Domain errors -> RFC 9457 problem documents: one table, one handler.

Every error answer is ``application/problem+json`` with ``type``, ``title``, ``status``, ``detail``,
``field``, ``aclnn_status``, ``aclnn_name``, ``request_id`` and, for device faults,
``device_message``. A client's mistake is never a 500.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

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

__all__ = [
    "PROBLEMS",
    "ClientDisconnected",
    "Problem",
    "UnsupportedMediaType",
    "error_response",
    "install_problem_handlers",
    "problem_response",
]

log = logging.getLogger("moegrad_service.api")
PROBLEM_JSON = "application/problem+json"


class UnsupportedMediaType(MalformedRequest):
    """The request's Content-Type is not one this endpoint reads."""


class HTTPProblem(MoegradError):
    """A routing-level refusal Starlette raised (404 no route, 405 wrong method), with its status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class ClientDisconnected(MoegradError):
    """The client went away before its answer was ready (logged as 499; nobody reads the body)."""


@dataclass(frozen=True)
class Problem:
    """How one domain error is answered: HTTP status, RFC 9457 title, metrics reason label."""

    status: int
    title: str
    reason: str


#: The one mapping from domain errors to HTTP. Looked up along the exception's MRO, most specific first.
PROBLEMS: dict[type[BaseException], Problem] = {
    InvalidArgument: Problem(422, "Invalid argument", "invalid_argument"),
    UnsupportedMediaType: Problem(415, "Unsupported media type", "unsupported_media_type"),
    PayloadTooLarge: Problem(413, "Payload too large", "payload_too_large"),
    MalformedRequest: Problem(400, "Malformed request", "malformed_request"),
    Unauthorized: Problem(401, "Unauthorized", "unauthorized"),
    DeviceBusy: Problem(503, "Service unavailable", "busy"),
    DeadlineExceeded: Problem(504, "Deadline exceeded", "deadline_exceeded"),
    DeviceFault: Problem(500, "Device fault", "device_fault"),
    HTTPProblem: Problem(404, "Not found", "not_routed"),
    ClientDisconnected: Problem(499, "Client closed request", "client_disconnected"),
    Exception: Problem(500, "Internal error", "internal"),
}


def problem_for(exc: BaseException) -> Problem:
    """The table entry for ``exc`` (its class or nearest base)."""
    for cls in type(exc).__mro__:
        if cls in PROBLEMS:
            return PROBLEMS[cls]
    return PROBLEMS[Exception]


def problem_response(request: Request, exc: BaseException) -> JSONResponse:
    """The problem+json answer for ``exc``; also counts the failure in the app's metrics."""
    problem = problem_for(exc)
    status, title = problem.status, problem.title
    if isinstance(exc, HTTPProblem):
        status, title = exc.status, HTTPStatus(exc.status).phrase
    request_id = getattr(request.state, "request_id", None)
    body = {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": getattr(exc, "message", None) or str(exc) or type(exc).__name__,
        "field": getattr(exc, "field", None),
        "aclnn_status": getattr(exc, "aclnn_status", None),
        "aclnn_name": getattr(exc, "aclnn_name", None),
        "request_id": request_id,
    }
    if isinstance(exc, DeviceFault):
        body["device_message"] = exc.device_message
        if body["aclnn_status"] is not None:
            body["aclnn_name"] = AclnnStatus.name_of(body["aclnn_status"])
    headers = {}
    if isinstance(exc, DeviceBusy):
        headers["Retry-After"] = str(max(0, math.ceil(exc.retry_after_s)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="moegrad"'
    if status >= 500 and not isinstance(exc, (DeviceBusy, DeadlineExceeded)):
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, body["detail"])
    metrics = getattr(request.state, "metrics", None)
    if metrics is not None and request.scope.get("route") is not None:
        metrics.failure.labels(endpoint=request.scope["route"].path, reason=problem.reason).inc()
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def error_response(request: Request, exc: Exception) -> JSONResponse:
    """The answer to an error a v1 handler raised: the installed handlers' mapping, in one function
    (api/direct.py answers the routes it serves with it)."""
    if isinstance(exc, ClientDisconnect):  # the client hung up while its body was being read: a 499
        return problem_response(request, ClientDisconnected("the client disconnected while sending its body"))
    if isinstance(exc, StarletteHTTPException):
        response = problem_response(request, HTTPProblem(str(exc.detail), exc.status_code))
        response.headers.update(exc.headers or {})  # e.g. the Allow of a 405 (RFC 9110 requires it)
        return response
    if not isinstance(exc, MoegradError):
        log.error("unexpected error", exc_info=exc)
    return problem_response(request, exc)


def install_problem_handlers(app: FastAPI) -> None:
    """Route every error the app can raise through :func:`error_response`."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "header"))
        return problem_response(request, MalformedRequest(f"{field or 'request'}: {first.get('msg')}", field=field or None))

    for kind in (MoegradError, ClientDisconnect, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
