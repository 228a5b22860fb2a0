"""Client and AsyncClient: call a moegrad service over HTTP (wire protocol v1, docs/protocol.md).

Both clients share one sans-I/O core, :class:`_ClientCore`. For each call the core runs a *flow*: a
generator that yields what it wants done and is sent back what happened:

- it yields an ``httpx.Request`` and is sent the ``httpx.Response`` (body read) or the
  ``httpx.HTTPError`` the transport raised;
- it yields a ``float`` (seconds to wait before a retry) and is sent ``None``;
- it returns the call's result, or raises the mapped :class:`~moegrad.MoegradError`.

The core builds every request (URL, headers, body, per-attempt timeouts), maps every response and
every network error to a result or an exception, and decides every retry. :class:`Client` and
:class:`AsyncClient` only drive flows: ``_drive`` is the same dozen lines in each, differing by
``await``. A new endpoint is one flow in the core plus one short method in each client: the
operator call (``grad_flow``; msgpack, or frames for large calls when the server offers them), many
calls in one request (``batch_flow``), the accuracy comparison (``compare_flow``, docs/accuracy.md),
the service's info and health probes. A frames reply is streamed by the driver into a
:class:`~moegrad._wire.FramesReader` (each tensor's bytes copied once, into an array of its own;
the sync client receives a large one's tensors from the socket straight into those arrays).

Errors a call raises (the tree is drawn in ``moegrad._errors``):

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

Misuse (a wrong type, a negative count, a call that breaks a documented constraint while
``validate=True``) raises ``TypeError`` / ``ValueError`` / ``InvalidArgument`` before any I/O.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import math
import os
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import httpx
import numpy as np

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
from moegrad._frames import FRAMES_MEDIA_TYPE, FramesReader, encode_frames
from moegrad._limits import MAX_BATCH_CALLS
from moegrad._results import CompareResult, GradResult
from moegrad._spec import MoeInitRoutingV2GradCall
from moegrad._tensors import to_numpy, to_torch
from moegrad._transport import async_http_transport, http_transport, raw_socket, receive_into
from moegrad._version import __version__
from moegrad._wire import decode_body, decode_tensor, dtype_name, encode_batch, encode_body_view, encode_tensor
from moegrad.accuracy import (
    CaseResult,
    ComparisonReport,
    check_compare_arguments,
    compare_cases,
    rejudge,
    report_context,
    with_context,
)

__all__ = ["AsyncClient", "BatchCompare", "Client"]

T = TypeVar("T")
#: What a flow yields (a request to send, or seconds to sleep), is sent, and returns.
Flow = Generator["httpx.Request | float", "httpx.Response | httpx.HTTPError | None", T]

_GRAD_PATH = "/v1/moe_init_routing_v2_grad"
_BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
_COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
_MSGPACK = "application/msgpack"
_FRAMES_ACCEPT = f"{FRAMES_MEDIA_TYPE}, {_MSGPACK};q=0.5"
#: A call whose tensors hold at least this many bytes travels as frames (``wire="auto"``), when the
#: server offers them; smaller calls are cheaper as one msgpack document.
FRAMES_MIN_BYTES = 1 << 16
_WIRES = ("auto", "msgpack", "frames")
_FRAMES_READER = "moegrad.frames"  # the httpx response extension a driver puts a frames reply's reader under
#: The sync client receives the rest of a frames reply straight from the socket once this much is left.
DIRECT_READ_MIN_BYTES = 1 << 20
_JSON = "application/json"
_MAX_RETRY_DELAY_S = 30.0  # the longest a single Retry-After is honoured
_BACKOFF_BASE_S = 0.05  # connection-error backoff: 0.05, 0.1, 0.2, ... s
_BACKOFF_MAX_S = 2.0
_MIN_ATTEMPT_S = 0.001  # less time than this left: the deadline has passed
_DEFAULT_RETRY_AFTER_S = 1.0
# Connection failures after which the request cannot have been processed, or the computation is
# simply repeated (a call is a pure function of its body, so repeating it is safe).
_RETRYABLE_NETWORK = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_CONNECT_HINT = (
    "; is a moegrad server running there? Start one (`moegrad-service serve`, or `make serve` in a "
    "checkout; its first start compiles the kernel for one to two minutes before it listens), or point "
    "the client at the right one (base_url; the CLI's --url or MOEGRAD_URL)"
)


class _UseClientDefault:
    """The type of :data:`USE_CLIENT_DEFAULT`: "not passed", as opposed to ``timeout_s=None``."""

    _instance: _UseClientDefault | None = None

    def __new__(cls) -> _UseClientDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"


#: A call's ``timeout_s`` when not passed: the client's ``timeout_s`` applies.
USE_CLIENT_DEFAULT = _UseClientDefault()


@dataclasses.dataclass(frozen=True)
class BatchCompare:
    """A comparison to send in a batch (:meth:`Client.batch`), answered as a :class:`CompareResult`.

    Attributes:
        call: the operator call (a :class:`~moegrad.MoeInitRoutingV2GradCall`, or a wire document
            when the client's ``validate`` is False).
        candidate: [N, H] grad_x of the implementation under test, in the call's dtype or float32.
        standards: names from :data:`moegrad.STANDARDS` (one or several); None: all.
        return_grad_x: also return the device's grad_x.
    """

    call: MoeInitRoutingV2GradCall | Mapping[str, Any]
    candidate: Any
    standards: Iterable[str] | str | None = None
    return_grad_x: bool = False


# --------------------------------------------------------------------------------------------------
# Argument checks (before any I/O)
# --------------------------------------------------------------------------------------------------


def _seconds(name: str, value: Any, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number of seconds or None" if allow_none else "a number of seconds"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{name}={value} must be a finite number of seconds > 0" + (" (or None)" if allow_none else "")
        )
    return value


def _base_url(value: Any) -> httpx.URL:
    if not isinstance(value, (str, httpx.URL)):
        raise TypeError(f"base_url must be a str or httpx.URL, got {type(value).__name__}")
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url={str(value)!r} is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"base_url={str(value)!r} must be an absolute http:// or https:// URL")
    if url.query or url.fragment:
        raise ValueError(f"base_url={str(value)!r} must not have a query or fragment")
    return url


def _verify(value: Any) -> bool | ssl.SSLContext:
    if isinstance(value, (bool, ssl.SSLContext)):
        return value
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.exists(path):
            raise ValueError(f"verify={path!r}: no such CA bundle file or directory")
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        return ssl.create_default_context(cafile=path)
    raise TypeError(f"verify must be a bool, a CA bundle path or an ssl.SSLContext, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------------
# Response -> exception: one table
# --------------------------------------------------------------------------------------------------


def _problem(response: httpx.Response) -> dict[str, Any] | None:
    """The RFC 9457 problem document of an error response, or None when the body is not one."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("application/problem+json", _JSON):
        return None
    try:
        document = json.loads(response.content)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def _text_snippet(response: httpx.Response, limit: int = 200) -> str:
    """A short, single-line text of a non-problem error body (a proxy's HTML page, say)."""
    text = response.content.decode("utf-8", errors="replace")
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", text, flags=re.S | re.I)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]*>", " ", text)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _retry_after_s(response: httpx.Response) -> float:
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


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


_ErrorFactory = Callable[[str, dict[str, Any], httpx.Response], MoegradError]

#: HTTP status -> the exception the client raises (problem fields carried over). Any other
#: status is a ServiceError.
_STATUS_ERRORS: Mapping[int, _ErrorFactory] = {
    400: lambda msg, p, r: MalformedRequest(msg, field=_str_or_none(p.get("field"))),
    401: lambda msg, p, r: Unauthorized(msg, status_code=r.status_code, problem=p),
    413: lambda msg, p, r: PayloadTooLarge(msg, field=_str_or_none(p.get("field"))),
    415: lambda msg, p, r: MalformedRequest(msg, field=_str_or_none(p.get("field"))),
    # A 422 always carries an aclnn code from a moegrad server; one without it (another server) is
    # still a rejected input, but no code is invented for it.
    422: lambda msg, p, r: (
        InvalidArgument(msg, aclnn_status=p["aclnn_status"], field=_str_or_none(p.get("field")))
        if _int_or_none(p.get("aclnn_status")) is not None
        else MalformedRequest(msg, field=_str_or_none(p.get("field")))
    ),
    500: lambda msg, p, r: DeviceFault(
        msg, aclnn_status=_int_or_none(p.get("aclnn_status")), device_message=_str_or_none(p.get("device_message"))
    ),
    503: lambda msg, p, r: DeviceBusy(msg, retry_after_s=_retry_after_s(r)),
    504: lambda msg, p, r: DeadlineExceeded(msg),
}


def _error_from_response(response: httpx.Response) -> MoegradError:
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
    if status == 404:  # name the URL actually requested: a wrong base_url shows in it
        request = response.request
        if str(request.url) not in message:
            message += f" ({request.method} {request.url})"
        if "/v1/v1/" in request.url.path:
            message += "; base_url must be the service's root (e.g. http://127.0.0.1:8000), without the /v1"
    factory = _STATUS_ERRORS.get(status)
    if factory is None:
        return ServiceError(message, status_code=status, problem=problem)
    return factory(message, problem or {}, response)


def _error_from_problem(problem: dict[str, Any], response: httpx.Response) -> MoegradError:
    """The exception for one failed batch item's problem document (the same table as a reply's status)."""
    status = _int_or_none(problem.get("status")) or 500
    message = problem.get("detail") or problem.get("title")
    message = message if isinstance(message, str) else f"a batch item failed with status {status}"
    factory = _STATUS_ERRORS.get(status)
    if factory is None:
        return ServiceError(message, status_code=status, problem=problem)
    return factory(message, problem, response)


# --------------------------------------------------------------------------------------------------
# The sans-I/O core
# --------------------------------------------------------------------------------------------------


#: Size of the slices a request body is sent in (see :func:`_body_slices`).
BODY_SLICE_BYTES = 1 << 20


def _check_no_arrays(document: Mapping[str, Any]) -> None:
    """A TypeError saying what to do when a wire document holds an array where a tensor map belongs."""
    for key, value in document.items():
        if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
            raise TypeError(
                f"{key} is an array: a wire document carries each tensor as a {{dtype, shape, data}} map "
                f"(moegrad.encode_tensor(array) makes one); or pass MoeInitRoutingV2GradCall("
                f"grad_expanded_x=..., expanded_row_idx=..., top_k=...), which takes the arrays"
            )


def _body_slices(body: memoryview | list[memoryview | bytes]) -> Iterator[memoryview | bytes]:
    """A request body as slices of the buffer it views.

    Given ``bytes``, httpx copies the body into one more buffer of its size on its way to the
    socket; slices keep that copy to one slice at a time (measured on S2, a 32 MiB body: 265 ->
    211 ms per call on bench/RESULTS.md's machine). The Content-Length is set by the caller, so
    httpx does not fall back to chunked encoding. One generator per attempt: a retry sends it all.
    A list is a frames body's parts (:func:`moegrad.encode_frames`), each sliced in turn.
    """
    for part in body if isinstance(body, list) else [body]:
        for start in range(0, len(part), BODY_SLICE_BYTES):
            yield part[start : start + BODY_SLICE_BYTES]


async def _abody_slices(body: memoryview | list[memoryview | bytes]) -> AsyncIterator[memoryview | bytes]:
    """:func:`_body_slices` for httpx.AsyncClient, which takes only async iterables."""
    for part in _body_slices(body):
        yield part


class _ClientCore:
    """Configuration, request building, response parsing and retry decisions: no I/O at all."""

    def __init__(
        self,
        base_url: str | httpx.URL,
        *,
        timeout_s: float | None,
        connect_timeout_s: float | None,
        retries: int,
        token: str | None,
        validate: bool,
        headers: Mapping[str, str] | None,
        clock: Callable[[], float] = time.monotonic,
        async_body: bool = False,
        wire: str = "auto",
    ) -> None:
        self.base_url = _base_url(base_url)
        if wire not in _WIRES:
            raise ValueError(f"wire={wire!r} must be one of {list(_WIRES)}")
        self.wire = wire
        self._server_frames: bool | None = None  # whether the server offers frames (learnt from /v1/info)
        self._async_body = async_body  # request bodies as async iterables (httpx.AsyncClient takes no others)
        self._urls: dict[str, httpx.URL] = {}  # path -> absolute URL: parsing one costs more than a small call's codec
        self.timeout_s = _seconds("timeout_s", timeout_s, allow_none=True)
        self.connect_timeout_s = _seconds("connect_timeout_s", connect_timeout_s, allow_none=True)
        if isinstance(retries, bool) or not isinstance(retries, int):
            raise TypeError(f"retries must be an int, got {type(retries).__name__}")
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        self.retries = retries
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str or None, got {type(token).__name__}")
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise ValueError("token must be a non-empty single-line string")
        self._token = token
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        self.validate = validate
        if headers is not None and not isinstance(headers, Mapping):
            raise TypeError(f"headers must be a mapping of str to str, got {type(headers).__name__}")
        self._headers = {"User-Agent": f"moegrad/{__version__} httpx/{httpx.__version__}", **dict(headers or {})}
        self._clock = clock

    def call_timeout_s(self, timeout_s: Any) -> float | None:
        """A call's deadline in seconds: the client's when not passed, None for no deadline."""
        if timeout_s is USE_CLIENT_DEFAULT:
            return self.timeout_s
        return _seconds("timeout_s", timeout_s, allow_none=True)

    # ---- requests --------------------------------------------------------------------------------

    def build_request(
        self,
        method: str,
        path: str,
        *,
        accept: str,
        request_id: str,
        remaining_s: float | None,
        body: memoryview | list[memoryview | bytes] | None = None,
        content_type: str = _MSGPACK,
    ) -> httpx.Request:
        """One attempt's request; ``remaining_s`` (None: no deadline) sets X-Request-Timeout and httpx's timeouts.

        ``body`` is sent from the buffer it views, in slices (:func:`_body_slices`): no copy of it
        is made for the request, and a fresh generator per attempt lets a retry send it again."""
        headers = dict(self._headers)
        headers["Accept"] = accept
        headers["X-Request-Id"] = request_id
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        if body is not None:
            headers["Content-Type"] = content_type
            headers["Content-Length"] = str(sum(map(len, body)) if isinstance(body, list) else len(body))
        if remaining_s is not None:
            headers["X-Request-Timeout"] = f"{remaining_s:.3f}"
        connect = self.connect_timeout_s
        if remaining_s is not None:
            connect = remaining_s if connect is None else min(connect, remaining_s)
        timeout = httpx.Timeout(remaining_s, connect=connect)
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(str(self.base_url).rstrip("/") + path)
        content = None if body is None else (_abody_slices(body) if self._async_body else _body_slices(body))
        # httpx annotates content chunks as bytes; it sends any bytes-like chunk, and these are memoryviews
        return httpx.Request(
            method,
            url,
            headers=headers,
            content=content,  # type: ignore[arg-type]
            extensions={"timeout": timeout.as_dict()},
        )

    def grad_body(
        self,
        call: MoeInitRoutingV2GradCall | Mapping[str, Any],
    ) -> tuple[memoryview, MoeInitRoutingV2GradCall | None]:
        """The msgpack body of a call, and the validated call when there is one (to check the reply against).

        A :class:`MoeInitRoutingV2GradCall` is sent as it is (its ``order`` only when it was set
        explicitly, else the server's default applies). A mapping is a wire document (docs/protocol.md,
        "The call"): it is validated with :meth:`MoeInitRoutingV2GradCall.from_wire` when
        ``validate`` is on, and sent as given either way.
        """
        if isinstance(call, MoeInitRoutingV2GradCall):
            return encode_body_view(self.call_document(call)), call
        if isinstance(call, Mapping):
            _check_no_arrays(call)
            try:
                body = encode_body_view(call)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None
            checked = MoeInitRoutingV2GradCall.from_wire(decode_body(body)) if self.validate else None
            return body, checked
        raise TypeError(
            f"call must be a MoeInitRoutingV2GradCall or a wire document mapping, got {type(call).__name__}"
        )

    @staticmethod
    def call_document(call: MoeInitRoutingV2GradCall) -> dict[str, Any]:
        """The wire document of a validated call; its ``order`` only when it was set explicitly."""
        document = call.to_wire()
        if "order" not in call.model_fields_set:
            del document["order"]
        return document

    def compare_body(
        self,
        call: MoeInitRoutingV2GradCall | dict[str, Any],
        candidate: Any,
        standards: Any,
        return_grad_x: Any,
    ) -> tuple[memoryview, MoeInitRoutingV2GradCall | None]:
        """The msgpack body of a comparison: the call's fields plus ``candidate``, ``standards``, ``return_grad_x``.

        ``call`` comes from :meth:`grad_call`. A validated call (``validate=True``) has its candidate
        and standards checked by :func:`moegrad.check_compare_arguments` first, so a bad one raises
        InvalidArgument before any I/O; a raw document (``validate=False``) is sent as given.
        """
        if not isinstance(return_grad_x, bool):
            raise TypeError(f"return_grad_x must be a bool, got {type(return_grad_x).__name__}")
        if isinstance(call, MoeInitRoutingV2GradCall):
            names: tuple[Any, ...] | None = check_compare_arguments(call, candidate, standards)
            document, checked = self.call_document(call), call
        else:
            names = (standards,) if isinstance(standards, str) else standards
            document, checked = dict(call), None
        if candidate is not None:  # an absent candidate is the wire's null tensor
            document["candidate"] = encode_tensor(np.asarray(candidate))
        if standards is not None and names is not None:
            document["standards"] = list(names)
        if return_grad_x:
            document["return_grad_x"] = True
        try:
            return encode_body_view(document), checked
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the comparison cannot be packed as msgpack: {exc}") from None

    def compare_call(
        self,
        grad_expanded_x: Any,
        expanded_row_idx: Any,
        top_k: Any,
        drop_pad_mode: Any,
        active_num: Any,
        order: str | None,
        allow_duplicate_indices: bool,
    ) -> MoeInitRoutingV2GradCall | dict[str, Any]:
        """:meth:`grad_call`, or a :class:`MoeInitRoutingV2GradCall` passed as the first argument
        with no other call argument (as :func:`moegrad.compare` and :class:`BatchCompare` take it)."""
        if not isinstance(grad_expanded_x, MoeInitRoutingV2GradCall):
            return self.grad_call(
                grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices
            )
        given = any(value is not None for value in (expanded_row_idx, top_k, order))
        if given or (drop_pad_mode, active_num, allow_duplicate_indices) != (0, 0, False):
            raise TypeError(
                "compare(call, candidate=...) takes a MoeInitRoutingV2GradCall alone: pass the candidate "
                "(and standards, return_grad_x, ...) by keyword, and no other call argument"
            )
        return grad_expanded_x

    def grad_call(
        self,
        grad_expanded_x: Any,
        expanded_row_idx: Any,
        top_k: Any,
        drop_pad_mode: Any,
        active_num: Any,
        order: str | None,
        allow_duplicate_indices: bool,
    ) -> MoeInitRoutingV2GradCall | dict[str, Any]:
        """The keyword API's arguments as a validated call (``validate=True``) or a raw wire document."""
        fields: dict[str, Any] = {
            "grad_expanded_x": grad_expanded_x,
            "expanded_row_idx": expanded_row_idx,
            "top_k": top_k,
            "drop_pad_mode": drop_pad_mode,
            "active_num": active_num,
            "allow_duplicate_indices": allow_duplicate_indices,
        }
        if order is not None:
            fields["order"] = order
        if self.validate:
            return MoeInitRoutingV2GradCall(**fields)
        document = {}
        for name, value in fields.items():
            if name in ("grad_expanded_x", "expanded_row_idx"):
                if value is not None:  # an absent tensor is the wire's null tensor
                    document[name] = encode_tensor(np.asarray(value))
            else:
                document[name] = value
        return document

    # ---- responses -------------------------------------------------------------------------------

    @staticmethod
    def parse_grad(response: httpx.Response, call: MoeInitRoutingV2GradCall | None) -> GradResult:
        """A 200 reply of the grad endpoint as a GradResult; a reply that is not one is a ServiceError."""
        try:
            document = _ClientCore.reply_document(response)
            grad_x = _ClientCore.reply_grad_x(document.get("grad_x"))
        except MalformedRequest as exc:  # the server's reply is broken, not the caller's request
            raise ServiceError(
                f"the server's reply is not a valid result: {exc.message}", status_code=response.status_code
            ) from None
        _ClientCore.check_grad_x(response, grad_x, call)
        return GradResult(grad_x=grad_x, **_ClientCore.answer_fields(response, document))

    @staticmethod
    def parse_compare(
        response: httpx.Response, call: MoeInitRoutingV2GradCall | None, return_grad_x: bool
    ) -> CompareResult:
        """A 200 reply of the compare endpoint as a CompareResult; a reply that is not one is a ServiceError."""
        try:
            document = decode_body(response.content)
            grad_x = decode_tensor(document.get("grad_x"), "grad_x").copy() if return_grad_x else None
        except MalformedRequest as exc:
            raise ServiceError(
                f"the server's reply is not a valid comparison: {exc.message}", status_code=response.status_code
            ) from None
        try:
            report = ComparisonReport.from_dict(_mapping(document.get("report"), "report"))
        except ValueError as exc:
            raise ServiceError(f"the server's report is not valid: {exc}", status_code=response.status_code) from None
        if grad_x is not None:
            _ClientCore.check_grad_x(response, grad_x, call)
        if call is not None and report.shape != (call.num_tokens, call.hidden_size):
            raise ServiceError(
                f"the server's report is about grad_x {list(report.shape)}, expected "
                f"{[call.num_tokens, call.hidden_size]}",
                status_code=response.status_code,
            )
        return CompareResult(report=report, grad_x=grad_x, **_ClientCore.answer_fields(response, document))

    @staticmethod
    def check_grad_x(response: httpx.Response, grad_x: np.ndarray, call: MoeInitRoutingV2GradCall | None) -> None:
        """A ServiceError unless a replied grad_x has the call's shape [N, H] and dtype."""
        if call is not None:
            want = (call.num_tokens, call.hidden_size)
            if grad_x.shape != want or dtype_name(grad_x.dtype) != call.dtype_name:
                raise ServiceError(
                    f"the server replied grad_x {grad_x.dtype}{list(grad_x.shape)}, expected "
                    f"{call.dtype_name}{list(want)}",
                    status_code=response.status_code,
                )

    @staticmethod
    def answer_fields(response: httpx.Response, document: dict[str, Any]) -> dict[str, Any]:
        """The fields every answer carries: backend, order, device, timings_ms, request_id."""
        timings = document.get("timings_ms")
        return {
            "backend": str(document.get("backend", "")),
            "order": str(document.get("order", "")),
            "device": _str_or_none(document.get("device")),
            "timings_ms": dict(timings) if isinstance(timings, dict) else {},
            "request_id": response.headers.get("x-request-id"),
        }

    @staticmethod
    def parse_json(response: httpx.Response) -> dict[str, Any]:
        try:
            document = response.json()
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise ServiceError(f"{response.request.url} did not answer a JSON object", status_code=response.status_code)
        return document

    # ---- errors and retries ----------------------------------------------------------------------

    @staticmethod
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

    @staticmethod
    def retry_delay_s(attempt: int, error: MoegradError) -> float:
        """Seconds to wait before retry number ``attempt + 1``.

        A 503's Retry-After is honoured (capped at 30 s); a connection error backs off
        exponentially from 0.05 s (capped at 2 s). The caller drops a retry that would end after
        the call's deadline.
        """
        backoff_s = min(_BACKOFF_BASE_S * 2**attempt, _BACKOFF_MAX_S)
        if isinstance(error, DeviceBusy):
            return min(max(error.retry_after_s, backoff_s), _MAX_RETRY_DELAY_S)
        return backoff_s

    # ---- flows -----------------------------------------------------------------------------------

    def exchange(
        self,
        method: str,
        path: str,
        *,
        accept: str,
        timeout_s: float | None,
        retries: int,
        body: memoryview | list[memoryview | bytes] | None = None,
        content_type: str = _MSGPACK,
    ) -> Flow[httpx.Response]:
        """Send one logical request, retrying 503 and connection errors; return its 2xx response."""
        request_id = uuid.uuid4().hex
        deadline = None if timeout_s is None else self._clock() + timeout_s
        attempt = 0
        while True:
            remaining_s = None if deadline is None else deadline - self._clock()
            if remaining_s is not None and remaining_s < _MIN_ATTEMPT_S:
                raise DeadlineExceeded(
                    f"{method} {path}: the deadline of {timeout_s} s passed before a reply"
                    + (f" ({attempt} attempts)" if attempt else "")
                )
            request = self.build_request(
                method,
                path,
                accept=accept,
                request_id=request_id,
                remaining_s=remaining_s,
                body=body,
                content_type=content_type,
            )
            outcome = yield request
            if isinstance(outcome, httpx.Response):
                if outcome.is_success:
                    return outcome
                error, retryable, cause = _error_from_response(outcome), outcome.status_code == 503, None
            elif isinstance(outcome, httpx.HTTPError):
                passed = deadline is not None and self._clock() >= deadline
                error, retryable = self.error_from_transport(outcome, request, timeout_s, passed)
                cause = outcome
            else:  # pragma: no cover - a driver bug
                raise TypeError(f"a flow was sent {type(outcome).__name__}")
            if retryable and attempt < retries:
                delay_s = self.retry_delay_s(attempt, error)
                if deadline is None or self._clock() + delay_s + _MIN_ATTEMPT_S < deadline:
                    yield delay_s
                    attempt += 1
                    continue
            raise error from cause

    def grad_flow(self, call: MoeInitRoutingV2GradCall | Mapping[str, Any], timeout_s: Any) -> Flow[GradResult]:
        timeout_s = self.call_timeout_s(timeout_s)
        if isinstance(call, MoeInitRoutingV2GradCall) and (yield from self.frames_for(call)):
            parts, _ = encode_frames(self.call_document(call))
            response = yield from self.exchange(
                "POST",
                _GRAD_PATH,
                accept=_FRAMES_ACCEPT,
                timeout_s=timeout_s,
                retries=self.retries,
                body=parts,
                content_type=FRAMES_MEDIA_TYPE,
            )
            return self.parse_grad(response, call)
        body, checked = self.grad_body(call)
        response = yield from self.exchange(
            "POST", _GRAD_PATH, accept=_MSGPACK, timeout_s=timeout_s, retries=self.retries, body=body
        )
        return self.parse_grad(response, checked)

    def frames_for(self, call: MoeInitRoutingV2GradCall) -> Flow[bool]:
        """Whether ``call`` travels as frames: ``wire="frames"`` always; ``"auto"`` when its tensors
        hold FRAMES_MIN_BYTES or more and the server's ``/v1/info`` lists ``"frames"`` in
        ``wire_formats`` (asked once per client; a server that cannot say gets msgpack)."""
        if self.wire != "auto":
            return self.wire == "frames"
        if call.grad_expanded_x.nbytes + call.expanded_row_idx.nbytes < FRAMES_MIN_BYTES:
            return False
        if self._server_frames is None:
            try:
                info = yield from self.info_flow()
            except MoegradError:
                info = {}
            formats = info.get("wire_formats")
            self._server_frames = isinstance(formats, list) and "frames" in formats
        return self._server_frames

    @staticmethod
    def frames_reader(response: httpx.Response) -> FramesReader | None:
        """A reader for a successful frames reply (the driver streams the body into it), else None."""
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (response.is_success and kind == FRAMES_MEDIA_TYPE):
            return None
        declared = response.headers.get("content-length")
        reader = FramesReader(int(declared) if declared is not None and declared.isdigit() else None)
        response.extensions[_FRAMES_READER] = reader
        return reader

    @staticmethod
    def reply_document(response: httpx.Response) -> dict[str, Any]:
        """A reply's document: a frames reply's (its tensors already owned arrays), else the msgpack map.

        Raises:
            MalformedRequest: the body is not a valid document.
        """
        reader = response.extensions.get(_FRAMES_READER)
        if reader is None:
            return decode_body(response.content)
        if reader.error is not None:
            raise reader.error
        return reader.document()

    @staticmethod
    def reply_grad_x(value: Any) -> np.ndarray:
        """grad_x of a reply document as an owned, writable array: a frames reply's array as it is,
        a msgpack tensor map's bytes copied out once."""
        if isinstance(value, np.ndarray):
            return value
        return decode_tensor(value, "grad_x").copy()

    # ---- batches ---------------------------------------------------------------------------------

    def batch_items(
        self, items: Iterable[Any]
    ) -> tuple[list[dict[str, Any] | MoegradError], list[tuple[str, MoeInitRoutingV2GradCall | None, bool]]]:
        """Each batch item's wire document (or the error it raised locally), and what its answer is
        checked against: (``"grad"`` or ``"compare"``, the validated call or None, return_grad_x)."""
        documents: list[dict[str, Any] | MoegradError] = []
        kinds: list[tuple[str, MoeInitRoutingV2GradCall | None, bool]] = []
        for item in items:
            try:
                if isinstance(item, BatchCompare):
                    document, checked = self.batch_compare_document(item)
                    kinds.append(("compare", checked, item.return_grad_x))
                else:
                    document, checked = self.batch_grad_document(item)
                    kinds.append(("grad", checked, True))
                documents.append(document)
            except MoegradError as exc:  # a call refused locally (InvalidArgument, MalformedRequest): its own answer
                # without its traceback: through ``documents`` it would be a cycle holding every item's arrays
                documents.append(exc.with_traceback(None))
                kinds.append(("grad", None, False))
        return documents, kinds

    def batch_grad_document(self, call: Any) -> tuple[dict[str, Any], MoeInitRoutingV2GradCall | None]:
        if isinstance(call, MoeInitRoutingV2GradCall):
            return self.call_document(call), call
        if isinstance(call, Mapping):
            _check_no_arrays(call)
            document = dict(call)
            checked = None
            if self.validate:
                checked = MoeInitRoutingV2GradCall.from_wire(decode_body(encode_body_view(document)))
            return document, checked
        raise TypeError(
            f"a batch item must be a MoeInitRoutingV2GradCall, a wire document mapping or a "
            f"BatchCompare, got {type(call).__name__}"
        )

    def batch_compare_document(self, item: BatchCompare) -> tuple[dict[str, Any], MoeInitRoutingV2GradCall | None]:
        if not isinstance(item.return_grad_x, bool):
            raise TypeError(f"return_grad_x must be a bool, got {type(item.return_grad_x).__name__}")
        document, checked = self.batch_grad_document(item.call)
        standards = item.standards
        names: Any = (standards,) if isinstance(standards, str) else standards
        if checked is not None:
            names = check_compare_arguments(checked, item.candidate, standards)
        document["op"] = "compare"
        if item.candidate is not None:
            document["candidate"] = encode_tensor(np.asarray(item.candidate))
        if standards is not None:
            document["standards"] = list(names)
        if item.return_grad_x:
            document["return_grad_x"] = True
        return document, checked

    def batch_flow(self, items: Iterable[Any], timeout_s: Any) -> Flow[list[GradResult | CompareResult | MoegradError]]:
        """Send the items in batches of at most MAX_BATCH_CALLS; one answer (or exception) per item, in order."""
        timeout_s = self.call_timeout_s(timeout_s)
        documents, kinds = self.batch_items(items)
        answers: list[GradResult | CompareResult | MoegradError | None] = [
            document if isinstance(document, MoegradError) else None for document in documents
        ]
        sent = [index for index, document in enumerate(documents) if not isinstance(document, MoegradError)]
        for start in range(0, len(sent), MAX_BATCH_CALLS):
            chunk = sent[start : start + MAX_BATCH_CALLS]
            try:
                body = encode_batch([documents[index] for index in chunk])  # type: ignore[misc]
            except (TypeError, ValueError) as exc:
                raise TypeError(f"the batch cannot be packed as msgpack: {exc}") from None
            response = yield from self.exchange(
                "POST", _BATCH_PATH, accept=_MSGPACK, timeout_s=timeout_s, retries=self.retries, body=body
            )
            results = self.parse_batch(response, len(chunk))
            request_id = response.headers.get("x-request-id")  # once: a header lookup costs more than a small answer
            for index, result in zip(chunk, results, strict=True):
                answers[index] = self.batch_answer(response, result, kinds[index], request_id)
        return answers  # type: ignore[return-value]

    @staticmethod
    def parse_batch(response: httpx.Response, count: int) -> list[Any]:
        try:
            document = decode_body(response.content)
        except MalformedRequest as exc:
            raise ServiceError(
                f"the server's batch reply is not valid: {exc.message}", status_code=response.status_code
            ) from None
        results = document.get("results")
        if not isinstance(results, list) or len(results) != count:
            raise ServiceError(
                f"the server answered {len(results) if isinstance(results, list) else 'no'} "
                f"results for a batch of {count}",
                status_code=response.status_code,
            )
        return results

    @staticmethod
    def batch_answer(
        response: httpx.Response,
        result: Any,
        kind: tuple[str, MoeInitRoutingV2GradCall | None, bool],
        request_id: str | None,
    ) -> GradResult | CompareResult | MoegradError:
        """One item's answer: its result (the fields :meth:`answer_fields` gives a single call's, the
        batch's ``request_id``), or the exception its problem document maps to (the table of the
        single-call endpoints); a result that is not valid is a ServiceError in its place."""
        op, call, return_grad_x = kind
        if not isinstance(result, dict):
            return ServiceError(
                "the server's batch reply holds an item that is not a map", status_code=response.status_code
            )
        problem = result.get("problem")
        if isinstance(problem, dict):
            return _error_from_problem(problem, response)
        try:
            grad_x = None
            if op == "grad" or return_grad_x:
                grad_x = decode_tensor(result.get("grad_x"), "grad_x").copy()
                _ClientCore.check_grad_x(response, grad_x, call)
            timings = result.get("timings_ms")
            fields: dict[str, Any] = {
                "backend": str(result.get("backend", "")),
                "order": str(result.get("order", "")),
                "device": _str_or_none(result.get("device")),
                "timings_ms": dict(timings) if isinstance(timings, dict) else {},
                "request_id": request_id,
            }
            if op == "grad":
                assert grad_x is not None  # decoded above whenever op == "grad"
                return GradResult(grad_x=grad_x, **fields)
            report = ComparisonReport.from_dict(_mapping(result.get("report"), "report"))
            return CompareResult(report=report, grad_x=grad_x, **fields)
        except (MalformedRequest, ValueError) as exc:
            return ServiceError(
                f"the server's answer to a batch item is not valid: {exc}", status_code=response.status_code
            )
        except ServiceError as exc:
            return exc

    def compare_flow(
        self,
        call: MoeInitRoutingV2GradCall | dict[str, Any],
        candidate: Any,
        standards: Any,
        return_grad_x: Any,
        timeout_s: Any,
        require_exact: Any = False,
    ) -> Flow[CompareResult]:
        if not isinstance(require_exact, bool):
            raise TypeError(f"require_exact must be a bool, got {type(require_exact).__name__}")
        timeout_s = self.call_timeout_s(timeout_s)
        body, checked = self.compare_body(call, candidate, standards, return_grad_x)
        response = yield from self.exchange(
            "POST", _COMPARE_PATH, accept=_MSGPACK, timeout_s=timeout_s, retries=self.retries, body=body
        )
        result = self.parse_compare(response, checked, return_grad_x)
        if require_exact:  # the report states exactness either way; requiring it only changes the verdict
            result = dataclasses.replace(result, report=rejudge(result.report, require_exact=True))
        return result

    def info_flow(self) -> Flow[dict[str, Any]]:
        response = yield from self.exchange(
            "GET", "/v1/info", accept=_JSON, timeout_s=self.timeout_s, retries=self.retries
        )
        return self.parse_json(response)

    def probe_flow(self, path: str) -> Flow[bool]:
        """A health probe: True on 2xx, False when unreachable, busy (503) or out of time; no retries."""
        try:
            yield from self.exchange("GET", path, accept=_JSON, timeout_s=self.timeout_s, retries=0)
        except (TransportError, DeviceBusy, DeadlineExceeded):
            return False
        return True


# --------------------------------------------------------------------------------------------------
# The I/O shells
# --------------------------------------------------------------------------------------------------

_CLIENT_DOC = """{kind} client of a moegrad service (wire protocol v1, docs/protocol.md).

    Args:
        base_url: the service's root URL, e.g. ``"http://127.0.0.1:8000"`` (a path prefix is kept).
        timeout_s: each call's deadline in seconds, covering retries and waits; sent to the server as
            ``X-Request-Timeout`` (which the server may cap). None: no deadline.
        connect_timeout_s: the longest one connection attempt may take, in seconds (None: no limit).
        retries: how many times a call is retried after a connection error or a 503 (Retry-After
            honoured, at most 30 s a wait, never past the deadline). 4xx, 500 and 504 are never retried.
        token: a bearer token sent as ``Authorization: Bearer <token>``.
        verify: TLS verification: True (system/certifi CAs), False, a CA bundle path, or an
            ``ssl.SSLContext``.
        transport: an httpx {transport} (``httpx.MockTransport``, ``httpx.ASGITransport``, ...)
            used instead of the network.
        validate: check every call locally with :class:`~moegrad.MoeInitRoutingV2GradCall` before
            sending it (so a bad call raises InvalidArgument with no I/O). False sends calls as given.
        headers: extra headers sent with every request.
        wire: how a call's tensors travel: ``"auto"`` (frames for calls of FRAMES_MIN_BYTES or more
            when the server's ``/v1/info`` offers them, else msgpack), ``"msgpack"`` (always one
            msgpack document) or ``"frames"`` (always frames: the tensors' bytes unpacked after a
            msgpack header, docs/protocol.md).

    Raises:
        TypeError, ValueError: a configuration value of the wrong type or out of range (no I/O done).
    """


class _ClientBase:
    _ASYNC = False  # whether the httpx client under it is an httpx.AsyncClient

    def __init__(
        self,
        base_url: str | httpx.URL,
        *,
        timeout_s: float | None,
        connect_timeout_s: float | None,
        retries: int,
        token: str | None,
        verify: bool | str | os.PathLike[str] | ssl.SSLContext,
        validate: bool,
        headers: Mapping[str, str] | None,
        wire: str = "auto",
    ) -> None:
        self._core = _ClientCore(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retries=retries,
            token=token,
            validate=validate,
            headers=headers,
            async_body=self._ASYNC,
            wire=wire,
        )
        self._verify = _verify(verify)

    @property
    def base_url(self) -> httpx.URL:
        """The service's root URL."""
        return self._core.base_url

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={str(self._core.base_url)!r})"


class Client(_ClientBase):
    __doc__ = _CLIENT_DOC.format(kind="A blocking", transport="BaseTransport")

    def __init__(
        self,
        base_url: str | httpx.URL = "http://127.0.0.1:8000",
        *,
        timeout_s: float | None = 60.0,
        connect_timeout_s: float | None = 5.0,
        retries: int = 3,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] | ssl.SSLContext = True,
        transport: httpx.BaseTransport | None = None,
        validate: bool = True,
        headers: Mapping[str, str] | None = None,
        wire: str = "auto",
    ) -> None:
        super().__init__(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retries=retries,
            token=token,
            verify=verify,
            validate=validate,
            headers=headers,
            wire=wire,
        )
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise TypeError(f"transport must be an httpx.BaseTransport, got {type(transport).__name__}")
        self._http = httpx.Client(transport=transport or http_transport(self._verify))

    def _drive(self, flow: Flow[T]) -> T:
        outcome: httpx.Response | httpx.HTTPError | None = None
        while True:
            try:
                step = flow.send(outcome)
            except StopIteration as stop:
                return stop.value
            if isinstance(step, httpx.Request):
                try:
                    outcome = self._http.send(step, stream=True)
                    try:
                        reader = self._core.frames_reader(outcome)
                        if reader is None:
                            outcome.read()
                        else:
                            _read_frames(outcome, reader)
                    finally:
                        outcome.close()
                except httpx.HTTPError as exc:
                    outcome = exc
            else:
                time.sleep(step)
                outcome = None

    def moe_init_routing_v2_grad(
        self,
        grad_expanded_x: np.ndarray,
        expanded_row_idx: np.ndarray,
        top_k: int,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        order: str | None = None,
        allow_duplicate_indices: bool = False,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> np.ndarray:
        """gradX of aclnnMoeInitRoutingV2Grad, computed by the service.

        ``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]`` (documentation,
        "Function"; skip rules and order in docs/semantics.md).

        Args:
            grad_expanded_x: [N*K, H] (dropless), [A, H] (active) or [E, C, H] (drop/pad); float16,
                bfloat16 (``ml_dtypes.bfloat16``) or float32; any strides and byte order. A
                ``torch.Tensor`` on any device is accepted too (copied to host memory unless on the CPU).
            expanded_row_idx: [N*K] int32 (-1 marks a dropped slot in drop/pad mode); an array or a tensor.
            top_k: K > 0.
            drop_pad_mode: 0 dropless/active, 1 drop/pad.
            active_num: A; 0 dropless, > 0 active (ignored in drop/pad mode).
            order: ``"ascend910b"`` (the device's order) or ``"sequential"`` (Huawei's golden);
                None: the server's default.
            allow_duplicate_indices: accept repeated indices, which the documentation forbids.
            timeout_s: this call's deadline in seconds (None: none); not passed: the client's.

        Returns:
            grad_x, [N, H], the dtype of grad_expanded_x, a writable array owned by the caller; a
            ``torch.Tensor`` on grad_expanded_x's device when grad_expanded_x is one.

        Raises:
            InvalidArgument: a documented constraint is broken (161001 / 161002 / 561002), locally
                (``validate=True``) before any I/O, or by the server's check.
            MalformedRequest, PayloadTooLarge, Unauthorized, DeviceBusy, DeadlineExceeded,
            DeviceFault, ServiceError, TransportError: see the module docstring.
        """
        call = self._core.grad_call(
            to_numpy(grad_expanded_x),
            to_numpy(expanded_row_idx),
            top_k,
            drop_pad_mode,
            active_num,
            order,
            allow_duplicate_indices,
        )
        return to_torch(self.run(call, timeout_s=timeout_s).grad_x, grad_expanded_x)

    def run(
        self,
        call: MoeInitRoutingV2GradCall | Mapping[str, Any],
        *,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> GradResult:
        """Run one call and return the full answer (grad_x, backend, order, device, timings, request id).

        Args:
            call: a :class:`~moegrad.MoeInitRoutingV2GradCall` (its ``order`` is sent only when it
                was set explicitly), or a wire document (docs/protocol.md; validated first when
                ``validate=True``, always sent exactly as given).
            timeout_s: as in :meth:`moe_init_routing_v2_grad`.

        Raises:
            the errors of :meth:`moe_init_routing_v2_grad`; TypeError for a call of another type.
        """
        return self._drive(self._core.grad_flow(call, timeout_s))

    def batch(
        self,
        items: Iterable[MoeInitRoutingV2GradCall | Mapping[str, Any] | BatchCompare],
        *,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> list[GradResult | CompareResult | MoegradError]:
        """Run many independent calls (and comparisons) in one request each ``MAX_BATCH_CALLS`` items.

        ``POST /v1/moe_init_routing_v2_grad/batch`` (docs/protocol.md, "Batches"): the service
        answers every item on its own, in order; a failing item never fails its neighbours. For many
        small calls this costs one round trip instead of one per call.

        Args:
            items: each a :class:`~moegrad.MoeInitRoutingV2GradCall` (which takes numpy arrays),
                a wire document (as :meth:`run` takes: tensors as ``{dtype, shape, data}`` maps,
                :func:`moegrad.encode_tensor`), or a :class:`BatchCompare` (answered as
                :meth:`compare` is).
            timeout_s: the deadline of the whole batch in seconds (None: none); not passed: the client's.

        Returns:
            One entry per item, in order: a :class:`GradResult`, a :class:`CompareResult`, or the
            exception that item alone earned (InvalidArgument with its aclnn code, MalformedRequest,
            PayloadTooLarge, DeviceBusy, DeadlineExceeded, DeviceFault ...: the exception the single
            call would have raised). A call refused locally while ``validate=True`` (InvalidArgument,
            or MalformedRequest for a wire document with an unknown key) gets that without being sent.

        Raises:
            TypeError: an item of another type, one that cannot be packed, or a wire document
                holding an array where a tensor map belongs.
            The errors of :meth:`run` that concern the whole request (TransportError, Unauthorized,
            DeviceBusy after the retries, DeadlineExceeded, ServiceError, a malformed batch).
        """
        return self._drive(self._core.batch_flow(items, timeout_s))

    def compare(
        self,
        grad_expanded_x: np.ndarray | MoeInitRoutingV2GradCall,
        expanded_row_idx: np.ndarray | None = None,
        top_k: int | None = None,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        candidate: np.ndarray,
        standards: Iterable[str] | str | None = None,
        order: str | None = None,
        allow_duplicate_indices: bool = False,
        return_grad_x: bool = False,
        require_exact: bool = False,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> CompareResult:
        """Judge a candidate grad_x against the service's device result and a float64 golden.

        ``POST /v1/moe_init_routing_v2_grad/compare`` (docs/protocol.md): the service runs the call
        on its backend, computes the golden, and measures candidate vs golden, device vs golden and
        candidate vs device under the named standards (docs/accuracy.md).

        Args:
            grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order,
                allow_duplicate_indices: the operator call, as in :meth:`moe_init_routing_v2_grad`;
                or a :class:`~moegrad.MoeInitRoutingV2GradCall` alone as the first argument
                (``compare(call, candidate=...)``, as :func:`moegrad.compare` takes it).
            candidate: [N, H] grad_x of the implementation under test, in the dtype of
                grad_expanded_x or float32.
            standards: names from :data:`moegrad.STANDARDS` (one name, or several); None:
                :data:`moegrad.DEFAULT_STANDARDS`, the tolerance standards (docs/accuracy.md,
                "Verdict policy").
            return_grad_x: also return the device's grad_x.
            require_exact: the verdict fails unless the candidate is bit-exact to the device's
                result (``report.exact`` states exactness either way).
            timeout_s: this call's deadline in seconds (None: none); not passed: the client's. The
                server's golden and comparison run after the device and take longer than a plain
                call (about 2 s per million elements on a small CPU; docs/accuracy.md, "Cost").

        Returns:
            A :class:`CompareResult`; ``.passed`` is False only when a standard failed.

        Raises:
            InvalidArgument: a documented constraint of the call (161001 / 161002 / 561002), a missing
                candidate (161001), a candidate of the wrong dtype or shape or an unknown standard
                (161002; fields ``"candidate"``, ``"standards"``): locally before any I/O when
                ``validate=True``, else from the server.
            TypeError: ``return_grad_x`` or ``require_exact`` is not a bool, the request cannot be
                packed, or a call is passed with other call arguments.
            MalformedRequest, PayloadTooLarge, Unauthorized, DeviceBusy, DeadlineExceeded,
            DeviceFault, ServiceError, TransportError: see the module docstring.
        """
        call = self._core.compare_call(
            grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices
        )
        return self._drive(self._core.compare_flow(call, candidate, standards, return_grad_x, timeout_s, require_exact))

    def compare_many(
        self,
        cases: Iterable[str | os.PathLike[str] | tuple[str, Mapping[str, Any], np.ndarray]],
        *,
        standards: Iterable[str] | str | None = None,
        require_exact: bool = False,
        progress: bool | None = None,
        on_result: Callable[[CaseResult], None] | None = None,
    ) -> list[CaseResult]:
        """Judge many candidates, one case after another, and never stop on a bad one.

        See docs/accuracy.md, "Bulk checking".

        Args:
            cases: case files (``.npz``, :func:`moegrad.accuracy.save_case`) or
                ``(name, fields, candidate)`` tuples, ``fields`` the call's keyword arguments.
            standards, require_exact: as :meth:`compare`, for every case.
            progress: a progress bar on stderr; None: when stderr is a terminal.
            on_result: called with each :class:`~moegrad.accuracy.CaseResult` as it is known.

        Returns:
            One :class:`~moegrad.accuracy.CaseResult` per case, in the order given; each report
            carries its :class:`~moegrad.accuracy.ReportContext` (the inputs' SHA-256, the server,
            the time). A file that cannot be read or a call the operator rejects is ``"invalid"``;
            a service failure is ``"error"``; neither stops the run. :func:`moegrad.accuracy.write_summary`
            writes them worst first.
        """

        def judged(chunk: list[tuple[str, Mapping[str, Any], np.ndarray]]) -> list[ComparisonReport | Exception]:
            return self._compare_cases(chunk, standards, require_exact)

        return compare_cases(cases, compare_batch=judged, progress=progress, on_result=on_result)

    def _compare_cases(
        self, chunk: list[tuple[str, Mapping[str, Any], np.ndarray]], standards: Any, require_exact: bool
    ) -> list[ComparisonReport | Exception]:
        """The one place :meth:`compare_many` sends cases to the service: one batch request
        (:meth:`batch`) per chunk; each case's report carries its :class:`ReportContext`."""
        outcomes: list[ComparisonReport | Exception | None] = [None] * len(chunk)
        items, sent = [], []
        for index, (_, fields, candidate) in enumerate(chunk):
            try:
                call = MoeInitRoutingV2GradCall(**fields)
            except (InvalidArgument, MalformedRequest, TypeError, ValueError) as exc:
                outcomes[index] = exc.with_traceback(None)  # a cycle through ``outcomes`` otherwise
                continue
            items.append(BatchCompare(call, candidate, standards, False))
            sent.append((index, call))
        for (index, call), answer in zip(sent, self.batch(items), strict=True):
            if isinstance(answer, Exception):
                outcomes[index] = answer
                continue
            assert isinstance(answer, CompareResult)
            name, _, candidate = chunk[index]
            report = rejudge(answer.report, require_exact=True) if require_exact else answer.report
            context = report_context(
                call,
                candidate,
                backend=answer.backend,
                device=answer.device,
                server_url=str(self.base_url),
                order=answer.order,
                case=name,
            )
            outcomes[index] = with_context(report, context)
        assert all(outcome is not None for outcome in outcomes)
        return outcomes  # type: ignore[return-value]  # every slot filled above

    def info(self) -> dict[str, Any]:
        """``GET /v1/info``: version, backend, device, order, streams, max_queue and the limits."""
        return self._drive(self._core.info_flow())

    def ready(self) -> bool:
        """``GET /health/ready``: False when unreachable, not ready (503) or too slow; no retries."""
        return self._drive(self._core.probe_flow("/health/ready"))

    def live(self) -> bool:
        """``GET /health/live``: False when unreachable, 503 or too slow; no retries."""
        return self._drive(self._core.probe_flow("/health/live"))

    def close(self) -> None:
        """Close the connection pool (and the transport)."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_frames(response: httpx.Response, reader: FramesReader) -> None:
    """Stream a frames reply's body into ``reader``; a malformed body is kept as ``reader.error``.

    Through httpx, or, once the rest of a large body (DIRECT_READ_MIN_BYTES or more) is left to
    come on a plain TCP socket of the client's own transport, straight from the socket into the
    reply's arrays: on its way through h11 each byte is copied three more times. h11 then has not
    seen the body's end, so the connection is closed when the response is, not reused (a new
    connection costs far less than those copies of a large body).

    Raises:
        httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: as httpx raises them.
    """
    if response.is_stream_consumed:  # a response built with its content (a mock transport) is not a stream
        chunks: Iterable[bytes] = [response.content]
    else:
        chunks = response.iter_raw()
    sock = raw_socket(response)
    length = reader.length
    try:
        for chunk in chunks:
            reader.feed(chunk)
            if sock is not None and length is not None and length - reader.received >= DIRECT_READ_MIN_BYTES:
                break
        else:
            return
        assert sock is not None and length is not None  # only they break out of the loop
        timeout = response.request.extensions.get("timeout", {}).get("read")
        while reader.received < length:
            left = length - reader.received
            room = reader.room()
            if room is None:  # padding between tensors, or bytes past the last one: fed as they come
                piece = bytearray(min(left, 1 << 16))
                got = receive_into(sock, memoryview(piece), timeout, response.request)
                if got:
                    reader.feed(memoryview(piece)[:got])
            else:
                got = receive_into(sock, room[:left], timeout, response.request)
                reader.advance(got)
            if not got:
                raise httpx.RemoteProtocolError(
                    f"peer closed connection without sending complete message body (received "
                    f"{reader.received} bytes, expected {length})",
                    request=response.request,
                )
    except MalformedRequest as exc:
        reader.error = exc


class AsyncClient(_ClientBase):
    __doc__ = _CLIENT_DOC.format(kind="An asyncio", transport="AsyncBaseTransport")
    _ASYNC = True

    def __init__(
        self,
        base_url: str | httpx.URL = "http://127.0.0.1:8000",
        *,
        timeout_s: float | None = 60.0,
        connect_timeout_s: float | None = 5.0,
        retries: int = 3,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] | ssl.SSLContext = True,
        transport: httpx.AsyncBaseTransport | None = None,
        validate: bool = True,
        headers: Mapping[str, str] | None = None,
        wire: str = "auto",
    ) -> None:
        super().__init__(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retries=retries,
            token=token,
            verify=verify,
            validate=validate,
            headers=headers,
            wire=wire,
        )
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(f"transport must be an httpx.AsyncBaseTransport, got {type(transport).__name__}")
        self._http = httpx.AsyncClient(transport=transport or async_http_transport(self._verify))

    async def _drive(self, flow: Flow[T]) -> T:
        outcome: httpx.Response | httpx.HTTPError | None = None
        while True:
            try:
                step = flow.send(outcome)
            except StopIteration as stop:
                return stop.value
            if isinstance(step, httpx.Request):
                try:
                    outcome = await self._http.send(step, stream=True)
                    try:
                        reader = self._core.frames_reader(outcome)
                        if reader is None:
                            await outcome.aread()
                        else:
                            if outcome.is_stream_consumed:  # a response built with its content (a mock transport)
                                reader.feed(outcome.content)
                            else:
                                async for chunk in outcome.aiter_raw():
                                    try:
                                        reader.feed(chunk)
                                    except MalformedRequest as exc:
                                        reader.error = exc
                                        break
                    finally:
                        await outcome.aclose()
                except httpx.HTTPError as exc:
                    outcome = exc
            else:
                await asyncio.sleep(step)
                outcome = None

    async def moe_init_routing_v2_grad(
        self,
        grad_expanded_x: np.ndarray,
        expanded_row_idx: np.ndarray,
        top_k: int,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        order: str | None = None,
        allow_duplicate_indices: bool = False,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> np.ndarray:
        """As :meth:`Client.moe_init_routing_v2_grad`, awaited."""
        call = self._core.grad_call(
            to_numpy(grad_expanded_x),
            to_numpy(expanded_row_idx),
            top_k,
            drop_pad_mode,
            active_num,
            order,
            allow_duplicate_indices,
        )
        return to_torch((await self.run(call, timeout_s=timeout_s)).grad_x, grad_expanded_x)

    async def run(
        self,
        call: MoeInitRoutingV2GradCall | Mapping[str, Any],
        *,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> GradResult:
        """As :meth:`Client.run`, awaited."""
        return await self._drive(self._core.grad_flow(call, timeout_s))

    async def batch(
        self,
        items: Iterable[MoeInitRoutingV2GradCall | Mapping[str, Any] | BatchCompare],
        *,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> list[GradResult | CompareResult | MoegradError]:
        """As :meth:`Client.batch`, awaited."""
        return await self._drive(self._core.batch_flow(items, timeout_s))

    async def compare(
        self,
        grad_expanded_x: np.ndarray | MoeInitRoutingV2GradCall,
        expanded_row_idx: np.ndarray | None = None,
        top_k: int | None = None,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        candidate: np.ndarray,
        standards: Iterable[str] | str | None = None,
        order: str | None = None,
        allow_duplicate_indices: bool = False,
        return_grad_x: bool = False,
        require_exact: bool = False,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> CompareResult:
        """As :meth:`Client.compare`, awaited."""
        call = self._core.compare_call(
            grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices
        )
        return await self._drive(
            self._core.compare_flow(call, candidate, standards, return_grad_x, timeout_s, require_exact)
        )

    async def info(self) -> dict[str, Any]:
        """As :meth:`Client.info`, awaited."""
        return await self._drive(self._core.info_flow())

    async def ready(self) -> bool:
        """As :meth:`Client.ready`, awaited."""
        return await self._drive(self._core.probe_flow("/health/ready"))

    async def live(self) -> bool:
        """As :meth:`Client.live`, awaited."""
        return await self._drive(self._core.probe_flow("/health/live"))

    async def aclose(self) -> None:
        """Close the connection pool (and the transport)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` when it is a map; else the ValueError a report of another type gets."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a map, got {type(value).__name__}")
    return value
