"""The status table: what a call raises for each HTTP answer and network failure (tree: ``moegrad._errors``).

=======================================  ===============================================
HTTP answer or failure                   exception
=======================================  ===============================================
400 malformed body / unknown field       MalformedRequest (``field``)
413 body or tensor too large             PayloadTooLarge (``field``)
415 wrong content type                   MalformedRequest
422 a documented constraint              InvalidArgument (``aclnn_status``, ``field``)
401 missing or wrong bearer token        Unauthorized
503 busy or not ready (+ Retry-After)    DeviceBusy (``retry_after_s``), retried first
504 deadline passed on the server        DeadlineExceeded
500 the backend failed                   DeviceFault (``aclnn_status``, ``device_message``)
any other status                         ServiceError (``status_code``, ``problem``)
no connection / connection broke         TransportError, retried first
the call's deadline passed on the client DeadlineExceeded
=======================================  ===============================================

A failed batch item's problem document maps through the same table (:func:`error_from_problem`).
A server's text (``detail``, ``title``, ``device_message``, ``field``) is cut to
:data:`~moegrad.http._reply_bounds.MAX_TEXT_CHARS` characters, and an error body is read up to
:data:`~moegrad.http._reply_bounds.ERROR_BODY_BYTES` (:mod:`moegrad.http._reply_bounds`).
Misuse (a wrong type, a negative count, a call that breaks a documented constraint while
``validate=True``) raises ``TypeError`` / ``ValueError`` / ``InvalidArgument`` before any I/O.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from moegrad._errors import (
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MalformedRequest,
    MoegradError,
    PayloadTooLarge,
    ServiceError,
    TransportError,
    Unauthorized,
)
from moegrad.http._reply_bounds import CUT_EXTENSION, ERROR_BODY_BYTES, cut

__all__ = [
    "STATUS_ERRORS",
    "error_from_problem",
    "error_from_response",
    "error_from_transport",
    "int_or_none",
    "retry_after_s",
    "str_or_none",
]

_DEFAULT_RETRY_AFTER_S = 1.0
# Connection failures after which the request cannot have been processed, or the computation is
# simply repeated (a call is a pure function of its body, so repeating it is safe).
_RETRYABLE_NETWORK = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_CONNECT_HINT = (
    "; is a moegrad server running there? Start one (`moegrad-service serve`, or `make serve` in a "
    "checkout; its first start compiles the kernel for one to two minutes before it listens), or point "
    "the client at the right one (base_url; the CLI's --url or MOEGRAD_URL)"
)


def int_or_none(value: Any) -> int | None:
    """``value`` when it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def str_or_none(value: Any) -> str | None:
    """``value`` when it is a str, else None."""
    return value if isinstance(value, str) else None


def _problem(response: httpx.Response) -> dict[str, Any] | None:
    """The RFC 9457 problem document of an error response, or None when the body is not one."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("application/problem+json", "application/json"):
        return None
    if response.extensions.get(CUT_EXTENSION):
        return None  # its first ERROR_BODY_BYTES only: not a whole document
    try:
        document = json.loads(response.content)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the interpreter's limit
        return None
    if not isinstance(document, dict):
        return None
    return {key: cut(value) if isinstance(value, str) else value for key, value in document.items()}


def _text_snippet(response: httpx.Response, limit: int = 200) -> str:
    """A short, single-line text of a non-problem error body (a proxy's HTML page, say)."""
    text = response.content.decode("utf-8", errors="replace")
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", text, flags=re.S | re.I)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]*>", " ", text)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def retry_after_s(response: httpx.Response) -> float:
    """Retry-After in seconds (delta-seconds or an HTTP-date), 1.0 when absent or unreadable."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return _DEFAULT_RETRY_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return _DEFAULT_RETRY_AFTER_S
        if when.tzinfo is None:
            return _DEFAULT_RETRY_AFTER_S
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else _DEFAULT_RETRY_AFTER_S


def _busy_retry_after_s(problem: Mapping[str, Any], response: httpx.Response) -> float:
    """A 503's seconds to wait: its problem's ``retry_after_s`` (a batch item's, whose reply is a
    200) when it is a finite number >= 0, else the response's Retry-After (:func:`retry_after_s`)."""
    value = problem.get("retry_after_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return retry_after_s(response)


_ErrorFactory = Callable[[str, dict[str, Any], httpx.Response], MoegradError]

#: HTTP status -> the exception the client raises (problem fields carried over). Any other
#: status is a ServiceError.
STATUS_ERRORS: Mapping[int, _ErrorFactory] = {
    400: lambda msg, p, r: MalformedRequest(msg, field=str_or_none(p.get("field"))),
    401: lambda msg, p, r: Unauthorized(msg, status_code=r.status_code, problem=p),
    413: lambda msg, p, r: PayloadTooLarge(msg, field=str_or_none(p.get("field"))),
    415: lambda msg, p, r: MalformedRequest(msg, field=str_or_none(p.get("field"))),
    # A 422 always carries an aclnn code from a moegrad server; one without it (another server) is
    # still a rejected input, but no code is invented for it.
    422: lambda msg, p, r: (
        InvalidArgument(msg, aclnn_status=p["aclnn_status"], field=str_or_none(p.get("field")))
        if int_or_none(p.get("aclnn_status")) is not None
        else MalformedRequest(msg, field=str_or_none(p.get("field")))
    ),
    500: lambda msg, p, r: DeviceFault(
        msg, aclnn_status=int_or_none(p.get("aclnn_status")), device_message=str_or_none(p.get("device_message"))
    ),
    503: lambda msg, p, r: DeviceBusy(msg, retry_after_s=_busy_retry_after_s(p, r)),
    504: lambda msg, p, r: DeadlineExceeded(msg),
}


def error_from_response(response: httpx.Response) -> MoegradError:
    """The exception for a non-2xx response (problem+json, or any body at all, e.g. a proxy's HTML)."""
    status = response.status_code
    problem = _problem(response)
    headline = None if problem is None else problem.get("detail") or problem.get("title")
    if isinstance(headline, str):
        message = headline
    else:
        request = response.request
        message = f"HTTP {status} {response.reason_phrase} from {request.method} {request.url}"
        snippet = _text_snippet(response)
        if snippet:
            message += f": {snippet}"
        if response.extensions.get(CUT_EXTENSION):
            message += f" (its body was cut: an error's is read up to {ERROR_BODY_BYTES} bytes, never decompressed)"
    if status == 404:  # name the URL actually requested: a wrong base_url shows in it
        request = response.request
        if str(request.url) not in message:
            message += f" ({request.method} {request.url})"
        if "/v1/v1/" in request.url.path:
            message += "; base_url must be the service's root (e.g. http://127.0.0.1:8000), without the /v1"
    factory = STATUS_ERRORS.get(status)
    if factory is None:
        return ServiceError(message, status_code=status, problem=problem)
    return factory(message, problem or {}, response)


def error_from_problem(problem: dict[str, Any], response: httpx.Response) -> MoegradError:
    """The exception for one failed batch item's problem document (the same table as a reply's status)."""
    status = int_or_none(problem.get("status")) or 500
    problem = {key: cut(value) if isinstance(value, str) else value for key, value in problem.items()}
    message = problem.get("detail") or problem.get("title")
    message = message if isinstance(message, str) else f"a batch item failed with status {status}"
    factory = STATUS_ERRORS.get(status)
    if factory is None:
        return ServiceError(message, status_code=status, problem=problem)
    return factory(message, problem, response)


def error_from_transport(
    exc: httpx.HTTPError, request: httpx.Request, timeout_s: float | None, deadline_passed: bool
) -> tuple[MoegradError, bool]:
    """The one place network errors are translated: (exception, whether a retry may help)."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if deadline_passed or (isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)):
        return DeadlineExceeded(f"no reply from {request.url} within {timeout_s} s ({what})"), False
    if isinstance(exc, httpx.TransportError):
        hint = _CONNECT_HINT if isinstance(exc, httpx.ConnectError) else ""
        return TransportError(f"cannot reach {request.url}: {what}{hint}"), isinstance(exc, _RETRYABLE_NETWORK)
    return ServiceError(f"{request.method} {request.url} failed: {what}"), False
