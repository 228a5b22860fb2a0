"""Replies sent from the buffers they are made of, without joining them into one.

A reply of a header and a large tensor (v1 frames, v2 binary) is a list of parts; joining them into
one ``bytes`` would copy the tensor once more into a fresh allocation (page faults on every call).
:class:`PartsResponse` sends each part as it is, in slices of at most :data:`SEND_SLICE_BYTES`, so
the transport's own buffer holds at most one slice of what the socket did not take at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["SEND_SLICE_BYTES", "PartsResponse"]

#: The largest piece of a part handed to the server at once, in bytes.
SEND_SLICE_BYTES = 1 << 20


class PartsResponse(Response):
    """A 200 (or ``status_code``) reply whose body is ``parts`` sent in order, none copied.

    Args:
        parts: the body's pieces (bytes or C-contiguous byte memoryviews); they must stay unchanged
            until the reply is sent.
        media_type: the Content-Type.
        headers: more headers (Content-Length is set from the parts).
    """

    def __init__(
        self,
        parts: Sequence[bytes | memoryview],
        media_type: str,
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.parts = [
            memoryview(part).cast("B") if isinstance(part, memoryview) and part.format != "B" else part
            for part in parts
        ]
        self.length = sum(len(part) for part in self.parts)
        super().__init__(
            b"",
            status_code=status_code,
            media_type=media_type,
            headers={**(headers or {}), "content-length": str(self.length)},
        )
        self.body = b""  # what is sent is self.parts; nothing reads a joined body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pieces = [
            part[start : start + SEND_SLICE_BYTES]
            for part in self.parts
            if len(part)
            for start in range(0, len(part), SEND_SLICE_BYTES)
        ]
        for index, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": index + 1 < len(pieces)})
        if not pieces:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
