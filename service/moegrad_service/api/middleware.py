"""Request ids and the access log: one structured line per request (pure ASGI, no body buffering)."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moegrad_service.api.intake import admission_of

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

        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            if log.isEnabledFor(logging.INFO):
                admission = admission_of(scope)  # a body read in place is not seen by receive()
                log.info(
                    "request_id=%s method=%s path=%s status=%d bytes_in=%d bytes_out=%d duration_ms=%.3f",
                    request_id,
                    scope["method"],
                    scope["path"],
                    seen["status"] or 500,
                    seen["in"] + (admission.read_in_place if admission is not None else 0),
                    seen["out"],
                    (time.perf_counter() - start) * 1e3,
                )
