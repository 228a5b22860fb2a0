"""Request ids and the access log: one structured line per request (pure ASGI, no body buffering).

A body's bytes are counted at both doors it comes through: ``receive()``'s messages, and the
connection's :data:`~moegrad_service.connections.BODY_INTO` extension, which reads a body straight
into the handler's buffer, past ``receive()``.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moegrad_service.connections import BODY_INTO

__all__ = ["RequestLogMiddleware"]

log = logging.getLogger("moegrad_service.access")
_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class RequestLogMiddleware:
    """Gives each HTTP request an id (the client's ``X-Request-Id`` when well formed), echoes it as a
    response header, and logs ``request_id method path status bytes_in bytes_out duration_ms``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        offered = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        request_id = offered if _ID.fullmatch(offered) else uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})
        state["request_id"], state["started"] = request_id, start
        seen = {"status": 0, "in": 0, "out": 0}

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen["in"] += len(message.get("body", b""))
            return message

        async def tagging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                seen["out"] += len(message.get("body", b""))
            await send(message)

        _count_in_place(scope, seen)
        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "request_id=%s method=%s path=%s status=%d bytes_in=%d bytes_out=%d duration_ms=%.3f",
                    request_id,
                    scope["method"],
                    scope["path"],
                    seen["status"] or 500,
                    seen["in"],
                    seen["out"],
                    (time.perf_counter() - start) * 1e3,
                )


def _count_in_place(scope: Scope, seen: dict[str, int]) -> None:
    """Count in ``seen["in"]`` the bytes of a body read through the scope's BODY_INTO extension."""
    extensions = scope.get("extensions") or {}
    body_into = extensions.get(BODY_INTO)
    if body_into is None:
        return

    async def counting_body_into(scope: Scope, view: memoryview, received: Any = None) -> bool:
        read = await body_into(scope, view, received)
        if read:
            seen["in"] += len(view)
        return read

    scope["extensions"] = {**extensions, BODY_INTO: counting_body_into}
