"""What a reply may take: at most the bytes its call can produce, read by the deadline; errors' text cut short.

A reply is read through httpx's own streaming (``Response.read`` over ``Response.stream``), with
:func:`bound_reply` putting a running byte count in front of the stream before a byte is read:

- a success reply (2xx) may take the bytes the core allows its call (:data:`REPLY_BYTES_EXTENSION`,
  set per endpoint from the call: :func:`grad_reply_bytes`, :func:`compare_reply_bytes`,
  :func:`explain_reply_bytes`, :func:`batch_reply_bytes`, :data:`INFO_REPLY_BYTES`); one that
  declares more (Content-Length), or sends more, is refused at once (:class:`ReplyRefused`, a
  ServiceError to the caller) and its connection closed, so memory never holds more than the call
  could produce;
- an error reply's body is read up to :data:`ERROR_BODY_BYTES`, the rest left unread (the status
  still maps to its exception: a 503 is still retried), and its text is cut to
  :data:`MAX_TEXT_CHARS` (:func:`cut`);
- a reply in a content coding (gzip, ...) is refused: the client asks for ``identity``, and a
  compressed reply could inflate past any bound while httpx decodes one chunk;
- between two chunks the call's deadline is checked (:mod:`moegrad.http._deadline`).

The sync and the async client share this one implementation: one stream wrapper, iterated as
the stream under it is, and :class:`_Count`, which decides.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import httpx

from moegrad._dtypes import DTYPES
from moegrad.http._deadline import check_deadline
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = [
    "CUT_EXTENSION",
    "ERROR_BODY_BYTES",
    "EXPLAIN_ROW_BYTES",
    "EXPLAIN_SLOT_BYTES",
    "INFO_REPLY_BYTES",
    "ITEM_ALLOWANCE_BYTES",
    "MAX_TEXT_CHARS",
    "REPLY_ALLOWANCE_BYTES",
    "REPLY_BYTES_EXTENSION",
    "REPORT_ALLOWANCE_BYTES",
    "ReplyRefused",
    "batch_reply_bytes",
    "bound_reply",
    "compare_reply_bytes",
    "cut",
    "explain_reply_bytes",
    "explain_shape",
    "grad_reply_bytes",
    "grad_x_nbytes",
]

#: The httpx request extension the core puts the most bytes a success reply may take under.
REPLY_BYTES_EXTENSION = "moegrad.reply_bytes"
#: The httpx response extension set (True) when an error reply's body was cut at ERROR_BODY_BYTES.
CUT_EXTENSION = "moegrad.cut"
#: A reply's bytes besides grad_x: the map's keys, backend, order, device and timings_ms (a few
#: hundred bytes), a frames reply's header and padding.
REPLY_ALLOWANCE_BYTES = 64 << 10
#: A comparison's report: about 6 KiB with every standard and the call's context.
REPORT_ALLOWANCE_BYTES = 64 << 10
#: One batch item's bytes besides its grad_x or report: its keys and fields, or its problem document.
ITEM_ALLOWANCE_BYTES = 8 << 10
#: One row of an explanation besides its slots: its label, evidence (a sentence, the schedules'
#: names, up to 16 candidates) and up to 8 listed elements of ten fields (about 2 KiB).
EXPLAIN_ROW_BYTES = 8 << 10
#: One slot of an explained row: six fields of at most 9 bytes each and their share of the keys.
EXPLAIN_SLOT_BYTES = 64
#: A ``GET /v1/info`` reply (a few hundred bytes of JSON).
INFO_REPLY_BYTES = 1 << 20
#: The most bytes of an error reply's body read (a problem document is a few hundred).
ERROR_BODY_BYTES = 64 << 10
#: The most characters of a server's text an exception carries (``detail``, ``device_message`` ...).
MAX_TEXT_CHARS = 4096


class ReplyRefused(httpx.HTTPError):
    """A success reply that is more than its call can produce, or in a content coding: refused
    unread (the core maps it to a ServiceError; the connection is closed, not reused)."""


def cut(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` when it has at most ``limit`` characters; else its first ones and how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _dims(value: Any) -> list[int] | None:
    """A tensor map's shape when it is a list of non-negative ints, else None."""
    shape = value.get("shape") if isinstance(value, Mapping) else None
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
        return None
    return list(shape)


def grad_x_nbytes(call: MoeInitRoutingV2GradCall | Mapping[str, Any] | None) -> int:
    """The bytes of the grad_x a call produces: N * H * itemsize (N = len(expanded_row_idx) // top_k,
    H the last dimension of grad_expanded_x; docs/protocol.md, "The reply").

    ``call``: a validated call, or a wire document (read as the server reads it; 0 when its shapes,
    dtype or top_k are not valid, for the server answers such a call with a problem, not a grad_x).
    """
    if isinstance(call, MoeInitRoutingV2GradCall):
        return call.num_tokens * call.hidden_size * call.grad_expanded_x.dtype.itemsize
    if not isinstance(call, Mapping):
        return 0
    grad, idx, top_k = call.get("grad_expanded_x"), call.get("expanded_row_idx"), call.get("top_k")
    grad_shape, idx_shape = _dims(grad), _dims(idx)
    dtype = DTYPES.get(grad.get("dtype")) if isinstance(grad, Mapping) else None  # type: ignore[arg-type]
    if not grad_shape or not idx_shape or dtype is None or type(top_k) is not int or top_k <= 0:
        return 0
    return idx_shape[0] // top_k * grad_shape[-1] * dtype.itemsize


def grad_reply_bytes(call: MoeInitRoutingV2GradCall | Mapping[str, Any] | None) -> int:
    """The most bytes a reply to one call may take: its grad_x and REPLY_ALLOWANCE_BYTES."""
    return grad_x_nbytes(call) + REPLY_ALLOWANCE_BYTES


def compare_reply_bytes(call: MoeInitRoutingV2GradCall | Mapping[str, Any] | None, return_grad_x: bool) -> int:
    """The most bytes a comparison's reply may take: the report's allowance, the grad_x asked for."""
    grad_x = grad_x_nbytes(call) if return_grad_x else 0
    return grad_x + REPORT_ALLOWANCE_BYTES + REPLY_ALLOWANCE_BYTES


def explain_shape(call: MoeInitRoutingV2GradCall | Mapping[str, Any] | None) -> tuple[int, int]:
    """(N, K) of a call, or of a wire document read as the server reads it ((0, 0) when its shapes
    or top_k are not valid, for the server answers such a call with a problem)."""
    if isinstance(call, MoeInitRoutingV2GradCall):
        return call.num_tokens, call.top_k
    if not isinstance(call, Mapping):
        return 0, 0
    idx, top_k = _dims(call.get("expanded_row_idx")), call.get("top_k")
    if not idx or type(top_k) is not int or top_k <= 0:
        return 0, 0
    return idx[0] // top_k, top_k


def explain_reply_bytes(call: MoeInitRoutingV2GradCall | Mapping[str, Any] | None) -> int:
    """The most bytes an explanation's reply may take: every row differing, each with its K slots."""
    rows, top_k = explain_shape(call)
    return rows * (EXPLAIN_ROW_BYTES + top_k * EXPLAIN_SLOT_BYTES) + REPORT_ALLOWANCE_BYTES + REPLY_ALLOWANCE_BYTES


def batch_reply_bytes(items: Iterable[tuple[str, MoeInitRoutingV2GradCall | Mapping[str, Any] | None, bool]]) -> int:
    """The most bytes a batch reply may take: per item ``(op, call, return_grad_x)``, its grad_x
    (a call's, or a comparison's asked for), a comparison's report allowance and ITEM_ALLOWANCE_BYTES."""
    total = REPLY_ALLOWANCE_BYTES
    for op, call, return_grad_x in items:
        total += ITEM_ALLOWANCE_BYTES
        if op == "compare":
            total += REPORT_ALLOWANCE_BYTES
        if op != "compare" or return_grad_x:
            total += grad_x_nbytes(call)
    return total


class _Count:
    """The running byte count of one reply's body (shared by both stream wrappers).

    Args:
        response: the reply, headers read and body not.
        limit: the most bytes it may take (None: no bound).
        refuse: over ``limit``, raise ReplyRefused (a success reply); else stop reading (an error's).
    """

    def __init__(self, response: httpx.Response, limit: int | None, refuse: bool) -> None:
        self.response, self.limit, self.refuse = response, limit, refuse
        self.received = 0

    def take(self, chunk: bytes) -> bytes | None:
        """The part of ``chunk`` to keep; None once the body is over its bound and not refused (stop reading).

        Raises:
            ReplyRefused: a success reply over its bound.
            httpx.ReadTimeout: the call's deadline has passed.
        """
        check_deadline(self.response.request)
        self.received += len(chunk)
        if self.limit is None or self.received <= self.limit:
            return chunk
        if self.refuse:
            raise ReplyRefused(_too_large(self.limit, "is longer"))
        self.response.extensions[CUT_EXTENSION] = True
        keep = len(chunk) - (self.received - self.limit)
        return chunk[:keep] if keep > 0 else None


class _Bounded(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response's stream behind its :class:`_Count`; iterated as the stream under it is (sync or async)."""

    def __init__(self, stream: httpx.SyncByteStream | httpx.AsyncByteStream, count: _Count) -> None:
        self._stream, self._count = stream, count

    def __iter__(self) -> Iterator[bytes]:
        assert isinstance(self._stream, httpx.SyncByteStream)
        for chunk in self._stream:
            kept = self._count.take(chunk)
            if kept is not None:
                yield kept
            if kept is None or len(kept) < len(chunk):
                return

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._stream, httpx.AsyncByteStream)
        async for chunk in self._stream:
            kept = self._count.take(chunk)
            if kept is not None:
                yield kept
            if kept is None or len(kept) < len(chunk):
                return

    def close(self) -> None:
        assert isinstance(self._stream, httpx.SyncByteStream)
        self._stream.close()

    async def aclose(self) -> None:
        assert isinstance(self._stream, httpx.AsyncByteStream)
        await self._stream.aclose()


def _too_large(limit: int, what: str) -> str:
    return (
        f'this request can be answered with at most {limit} bytes (docs/protocol.md, "Reply bounds") '
        f"and the server's reply {what}: refused; is the URL a moegrad service?"
    )


def bound_reply(response: httpx.Response) -> None:
    """Put the byte count (and the deadline's check) in front of ``response``'s body, before it is read.

    A success reply may take its request's :data:`REPLY_BYTES_EXTENSION` bytes; an error reply's
    body is read up to ERROR_BODY_BYTES (the response's :data:`CUT_EXTENSION` says when it was cut).
    A response already read (a mock transport's, built with its content) is only measured.

    Raises:
        ReplyRefused: a success reply whose Content-Length (or content, when already read) is over
            its bound, or that is in a content coding.
    """
    success = response.is_success
    limit = response.request.extensions.get(REPLY_BYTES_EXTENSION) if success else ERROR_BODY_BYTES
    if response.is_stream_consumed:  # built with its content (a mock transport): already in memory
        if success and limit is not None and len(response.content) > limit:
            raise ReplyRefused(_too_large(limit, f"holds {len(response.content)}"))
        return
    coding = response.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        if success:
            raise ReplyRefused(
                f"the server's reply is in content coding {cut(coding, 64)!r}; moegrad asks for identity "
                "(Accept-Encoding: identity): refused unread"
            )
        limit = 0  # a compressed error body could inflate while it is decoded: not read at all
        response.extensions[CUT_EXTENSION] = True
    declared = response.headers.get("content-length", "")
    if success and limit is not None and declared.isdigit() and int(declared) > limit:
        raise ReplyRefused(_too_large(limit, f"declares {int(declared)} (Content-Length)"))
    response.stream = _Bounded(response.stream, _Count(response, limit, refuse=success))
