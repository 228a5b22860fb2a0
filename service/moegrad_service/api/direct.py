"""Direct dispatch of the inference routes: the same handlers, without FastAPI's routing layers.

A small S1 call spends most of the server's CPU in the framework, not in the operator: cProfile
and py-spy of one uvicorn worker under 16 connections put the layers between uvicorn and the
handler (exception middleware, exit stack, router, included routers, route, request-response
wrapper, endpoint runner, and the send wrappers of each) at about a third of the event loop's
samples. :class:`DirectRoutes` sits inside the access log and serves ``POST`` on the exact paths of
the inference routes itself: it finds the route once, checks the token (the route class's
:class:`~moegrad_service.api.auth.Authenticator`), runs the route's own endpoint and answers an
error through the route's own error table (v1's problem documents, v2's ``{"error"}``). Every
other request, and these paths under another method or prefix, goes through FastAPI as before, so
a miss here is only slower, never different (tests/service/test_direct.py compares both paths
answer for answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["DirectRoute", "DirectRoutes", "route_of"]


@dataclass(frozen=True)
class DirectRoute:
    """One route served directly.

    Attributes:
        route: the FastAPI route (its ``path`` labels the metrics, as when routed).
        endpoint: the route's handler, ``async (request) -> Response``.
        on_error: the route's error answer, ``(request, exc) -> Response``.
        path_params: what the router would have matched from the path (v2's model name and version).
    """

    route: APIRoute
    endpoint: Callable[[Request], Awaitable[Response]]
    on_error: Callable[[Request, Exception], Response]
    path_params: Mapping[str, str]


class DirectRoutes:
    """Pure ASGI: ``POST`` to a path in ``routes`` is served by that route's endpoint; the rest goes to ``app``.

    Args:
        app: the FastAPI stack inside the access log.
        routes: exact request path -> the route that serves it.
    """

    def __init__(self, app: ASGIApp, routes: Mapping[str, DirectRoute]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if direct is None or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        scope["route"], scope["path_params"] = direct.route, dict(direct.path_params)
        request = Request(scope, receive)
        try:
            request.state.authenticator.check(request)
            response = await direct.endpoint(request)
        except Exception as exc:  # noqa: BLE001 - every error is answered through the route's table
            response = direct.on_error(request, exc)
        await response(scope, receive, send)


def route_of(routes: Any, path: str, method: str = "POST") -> APIRoute:
    """The APIRoute among ``routes`` (a router's ``routes``) with this path template and method."""
    for route in routes:
        if isinstance(route, APIRoute) and route.path == path and method in route.methods:
            return route
    raise LookupError(f"no {method} route {path}")
