"""The inference routes' route class: plain Starlette routes in the app's own router.

A small inference call spends most of the server's CPU in the framework, not in the operator, so
the POST routes that carry tensors (v1's grad and compare, v2's infer) are :class:`EndpointRoute`\\ s:
Starlette routes whose handler is ``async (request, intake) -> Response`` with no FastAPI
request/response layer (no dependency solving, no response model). The route owns the request's
:class:`~moegrad_service.api.intake.Intake` (its body and its admission): it hands it to the handler
and releases it once the answer is sent. They sit in the same router as every other route
and are reached the same way: through the middleware stack (access log, :class:`AuthMiddleware`,
exception middleware) and the router's matching. A handler's error is answered by
:func:`~moegrad_service.api.errors.error_response`, the renderer of every other route.

FastAPI describes only its own routes in ``/openapi.json``; :func:`openapi_with_endpoints` adds
each EndpointRoute's operation (written beside the route) to that document.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from moegrad_service.api.errors import error_response
from moegrad_service.api.intake import Intake

__all__ = ["EndpointRoute", "msgpack_operation", "openapi_with_endpoints"]

Handler = Callable[[Request, Intake], Awaitable[Response]]
MSGPACK = "application/msgpack"


class _Endpoint:
    """The ASGI app of one route (a class, so that Starlette does not wrap it as a function endpoint).

    It owns the request's :class:`~moegrad_service.api.intake.Intake`: made before the handler runs,
    handed to it, and left once the answer is sent, which releases the request's admission on every
    path (an answer, an error, a send that failed)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        with Intake(request) as intake:  # the answer is sent inside: the request's bytes and buffers go back after
            try:
                response = await self.handler(request, intake)
            except Exception as exc:  # every error is answered by the one renderer
                response = error_response(request, exc)
                if intake.unread:  # answered before the body was read: the server closes the
                    response.headers["connection"] = "close"  # connection lingering (connections/_protocol.py)
            await response(scope, receive, send)


class EndpointRoute(Route):
    """A POST route served by ``handler``, described in OpenAPI by ``operation``.

    Args:
        path: the path template (Starlette syntax: ``/v2/models/{model_name}/infer``).
        handler: ``async (request, intake) -> Response`` (the request's :class:`Intake`); what it
            raises is answered by ``error_response``.
        operation: the route's OpenAPI operation object (summary, parameters, request body, replies).
    """

    def __init__(self, path: str, handler: Handler, *, operation: dict[str, Any]) -> None:
        super().__init__(path, _Endpoint(handler), methods=["POST"], name=handler.__name__)
        self.operation = operation

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self  # the metrics label the route's path, as FastAPI's routes do
        return match, child


def msgpack_operation(summary: str, request: str, reply: str) -> dict[str, Any]:
    """An OpenAPI operation whose body and 200 reply are msgpack maps (described in words)."""
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "description": request,
            "content": {MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
        },
        "responses": {"200": {"content": {MSGPACK: {}}, "description": reply}},
    }


def openapi_with_endpoints(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` that adds the app's EndpointRoutes to FastAPI's own document (built once)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for route in app.routes:
                if isinstance(route, EndpointRoute):
                    schema["paths"].setdefault(route.path, {})["post"] = route.operation
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
