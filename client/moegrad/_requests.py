"""Request building: the documents, bodies and httpx requests of every endpoint, with no I/O (docs/protocol.md).

One builder for the sync and the async client: a call's wire document (validated first when the
client's ``validate`` is on, so a bad call raises before any I/O), a comparison's, a batch's items,
and :class:`RequestBuilder`, which makes each attempt's ``httpx.Request`` (URL, headers, the body in
slices of the buffer it views, the attempt's timeouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

import httpx
import numpy as np

from moegrad._config import ClientConfig
from moegrad._errors import MoegradError
from moegrad._frames import FRAMES_MEDIA_TYPE
from moegrad._replicas import Replica
from moegrad._spec import MoeInitRoutingV2GradCall
from moegrad._wire import decode_body, encode_body_view, encode_tensor
from moegrad.accuracy import check_compare_arguments

__all__ = [
    "BATCH_PATH",
    "BODY_SLICE_BYTES",
    "COMPARE_PATH",
    "FRAMES_ACCEPT",
    "GRAD_PATH",
    "INFO_PATH",
    "JSON",
    "MSGPACK",
    "BatchCompare",
    "Body",
    "RequestBuilder",
    "Sent",
    "batch_items",
    "call_document",
    "compare_body",
    "compare_call",
    "grad_body",
    "grad_call",
]

GRAD_PATH = "/v1/moe_init_routing_v2_grad"
BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
INFO_PATH = "/v1/info"
MSGPACK = "application/msgpack"
JSON = "application/json"
FRAMES_ACCEPT = f"{FRAMES_MEDIA_TYPE}, {MSGPACK};q=0.5"
#: Size of the slices a request body is sent in (see :func:`_body_slices`).
BODY_SLICE_BYTES = 1 << 20

#: A request body: one buffer, or a frames body's parts (:func:`moegrad.encode_frames`).
Body = memoryview | list[memoryview | bytes]


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


class Sent(NamedTuple):
    """What a batch item's answer is checked against: the operation, the validated call (None for a
    raw document) and whether grad_x was asked for."""

    op: Literal["grad", "compare"]
    call: MoeInitRoutingV2GradCall | None
    return_grad_x: bool


def _check_no_arrays(document: Mapping[str, Any]) -> None:
    """A TypeError saying what to do when a wire document holds an array where a tensor map belongs."""
    for key, value in document.items():
        if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
            raise TypeError(
                f"{key} is an array: a wire document carries each tensor as a {{dtype, shape, data}} map "
                f"(moegrad.encode_tensor(array) makes one); or pass MoeInitRoutingV2GradCall("
                f"grad_expanded_x=..., expanded_row_idx=..., top_k=...), which takes the arrays"
            )


def _body_slices(body: Body) -> Iterator[memoryview | bytes]:
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


async def _abody_slices(body: Body) -> AsyncIterator[memoryview | bytes]:
    """:func:`_body_slices` for httpx.AsyncClient, which takes only async iterables."""
    for part in _body_slices(body):
        yield part


class RequestBuilder:
    """Each attempt's ``httpx.Request`` for a client's configuration.

    Args:
        config: the client's configuration (URL, token, headers, connection timeout).
        async_body: request bodies as async iterables (httpx.AsyncClient takes no others).
    """

    def __init__(self, config: ClientConfig, *, async_body: bool) -> None:
        self._config = config
        self._async_body = async_body
        # (root, path) -> absolute URL: parsing one costs more than a small call's codec
        self._urls: dict[tuple[httpx.URL, str], httpx.URL] = {}

    def build(
        self,
        method: str,
        path: str,
        *,
        accept: str,
        request_id: str,
        remaining_s: float | None,
        body: Body | None = None,
        content_type: str = MSGPACK,
        replica: Replica | None = None,
    ) -> httpx.Request:
        """One attempt's request; ``remaining_s`` (None: no deadline) sets X-Request-Timeout and httpx's timeouts.

        ``body`` is sent from the buffer it views, in slices (:func:`_body_slices`): no copy of it
        is made for the request, and a fresh generator per attempt lets a retry send it again.
        ``replica`` is the server it goes to (default: the configuration's ``base_url``); an address
        of a ``dns+`` name gets the name as its ``Host`` and TLS server name."""
        config = self._config
        headers = dict(config.headers)
        extensions: dict[str, Any] = {}
        base = config.base_url if replica is None else replica.url
        if replica is not None and replica.host_header is not None:
            headers["Host"] = replica.host_header
            if base.scheme == "https" and replica.sni is not None:
                extensions["sni_hostname"] = replica.sni
        headers["Accept"] = accept
        headers["X-Request-Id"] = request_id
        if config.token is not None:
            headers["Authorization"] = f"Bearer {config.token}"
        if body is not None:
            headers["Content-Type"] = content_type
            headers["Content-Length"] = str(sum(map(len, body)) if isinstance(body, list) else len(body))
        if remaining_s is not None:
            headers["X-Request-Timeout"] = f"{remaining_s:.3f}"
        connect = config.timeouts.connect_s
        if remaining_s is not None:
            connect = remaining_s if connect is None else min(connect, remaining_s)
        extensions["timeout"] = httpx.Timeout(remaining_s, connect=connect).as_dict()
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[base, path] = httpx.URL(str(base).rstrip("/") + path)
        content = None if body is None else (_abody_slices(body) if self._async_body else _body_slices(body))
        # httpx annotates content chunks as bytes; it sends any bytes-like chunk, and these are memoryviews
        return httpx.Request(
            method,
            url,
            headers=headers,
            content=content,  # type: ignore[arg-type]
            extensions=extensions,
        )


# --------------------------------------------------------------------------------------------------
# Documents and bodies
# --------------------------------------------------------------------------------------------------


def call_document(call: MoeInitRoutingV2GradCall) -> dict[str, Any]:
    """The wire document of a validated call; its ``order`` only when it was set explicitly."""
    document = call.to_wire()
    if "order" not in call.model_fields_set:
        del document["order"]
    return document


def grad_call(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: Any,
    drop_pad_mode: Any,
    active_num: Any,
    order: str | None,
    allow_duplicate_indices: bool,
    *,
    validate: bool,
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
    if validate:
        return MoeInitRoutingV2GradCall(**fields)
    document = {}
    for name, value in fields.items():
        if name in ("grad_expanded_x", "expanded_row_idx"):
            if value is not None:  # an absent tensor is the wire's null tensor
                document[name] = encode_tensor(np.asarray(value))
        else:
            document[name] = value
    return document


def compare_call(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: Any,
    drop_pad_mode: Any,
    active_num: Any,
    order: str | None,
    allow_duplicate_indices: bool,
    *,
    validate: bool,
) -> MoeInitRoutingV2GradCall | dict[str, Any]:
    """:func:`grad_call`, or a :class:`MoeInitRoutingV2GradCall` passed as the first argument
    with no other call argument (as :func:`moegrad.compare` and :class:`BatchCompare` take it)."""
    if not isinstance(grad_expanded_x, MoeInitRoutingV2GradCall):
        return grad_call(
            grad_expanded_x,
            expanded_row_idx,
            top_k,
            drop_pad_mode,
            active_num,
            order,
            allow_duplicate_indices,
            validate=validate,
        )
    given = any(value is not None for value in (expanded_row_idx, top_k, order))
    if given or (drop_pad_mode, active_num, allow_duplicate_indices) != (0, 0, False):
        raise TypeError(
            "compare(call, candidate=...) takes a MoeInitRoutingV2GradCall alone: pass the candidate "
            "(and standards, return_grad_x, ...) by keyword, and no other call argument"
        )
    return grad_expanded_x


def grad_body(
    call: MoeInitRoutingV2GradCall | Mapping[str, Any], *, validate: bool
) -> tuple[memoryview, MoeInitRoutingV2GradCall | None]:
    """The msgpack body of a call, and the validated call when there is one (to check the reply against).

    A :class:`MoeInitRoutingV2GradCall` is sent as it is (its ``order`` only when it was set
    explicitly, else the server's default applies). A mapping is a wire document (docs/protocol.md,
    "The call"): it is validated with :meth:`MoeInitRoutingV2GradCall.from_wire` when ``validate``
    is on, and sent as given either way.
    """
    if isinstance(call, MoeInitRoutingV2GradCall):
        return encode_body_view(call_document(call)), call
    if isinstance(call, Mapping):
        _check_no_arrays(call)
        try:
            body = encode_body_view(call)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None
        checked = MoeInitRoutingV2GradCall.from_wire(decode_body(body)) if validate else None
        return body, checked
    raise TypeError(f"call must be a MoeInitRoutingV2GradCall or a wire document mapping, got {type(call).__name__}")


def compare_body(
    call: MoeInitRoutingV2GradCall | dict[str, Any], candidate: Any, standards: Any, return_grad_x: Any
) -> tuple[memoryview, MoeInitRoutingV2GradCall | None]:
    """The msgpack body of a comparison: the call's fields plus ``candidate``, ``standards``, ``return_grad_x``.

    ``call`` comes from :func:`compare_call`. A validated call has its candidate and standards
    checked by :func:`moegrad.check_compare_arguments` first, so a bad one raises InvalidArgument
    before any I/O; a raw document (``validate=False``) is sent as given.
    """
    if not isinstance(return_grad_x, bool):
        raise TypeError(f"return_grad_x must be a bool, got {type(return_grad_x).__name__}")
    if isinstance(call, MoeInitRoutingV2GradCall):
        document, checked = call_document(call), call
    else:
        document, checked = dict(call), None
    _add_comparison(document, checked, candidate, standards, return_grad_x)
    try:
        return encode_body_view(document), checked
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the comparison cannot be packed as msgpack: {exc}") from None


def _add_comparison(
    document: dict[str, Any],
    checked: MoeInitRoutingV2GradCall | None,
    candidate: Any,
    standards: Any,
    return_grad_x: bool,
) -> None:
    """A comparison's fields added to its call's document: ``candidate`` (absent: the wire's null
    tensor), ``standards``, ``return_grad_x``; checked first (:func:`moegrad.check_compare_arguments`)
    against a validated call, so a bad candidate or standard raises InvalidArgument before any I/O."""
    if checked is not None:
        names: Any = check_compare_arguments(checked, candidate, standards)
    else:
        names = (standards,) if isinstance(standards, str) else standards
    if candidate is not None:
        document["candidate"] = encode_tensor(np.asarray(candidate))
    if standards is not None:
        document["standards"] = list(names)
    if return_grad_x:
        document["return_grad_x"] = True


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


def batch_items(items: Iterable[Any], *, validate: bool) -> tuple[list[dict[str, Any] | MoegradError], list[Sent]]:
    """Each batch item's wire document (or the error it raised locally), and what its answer is checked against."""
    documents: list[dict[str, Any] | MoegradError] = []
    sent: list[Sent] = []
    for item in items:
        try:
            if isinstance(item, BatchCompare):
                document, checked = _batch_compare_document(item, validate=validate)
                sent.append(Sent("compare", checked, item.return_grad_x))
            else:
                document, checked = _batch_grad_document(item, validate=validate)
                sent.append(Sent("grad", checked, True))
            documents.append(document)
        except MoegradError as exc:  # a call refused locally (InvalidArgument, MalformedRequest): its own answer
            # without its traceback: through ``documents`` it would be a cycle holding every item's arrays
            documents.append(exc.with_traceback(None))
            sent.append(Sent("grad", None, False))
    return documents, sent


def _batch_grad_document(call: Any, *, validate: bool) -> tuple[dict[str, Any], MoeInitRoutingV2GradCall | None]:
    if isinstance(call, MoeInitRoutingV2GradCall):
        return call_document(call), call
    if isinstance(call, Mapping):
        _check_no_arrays(call)
        document = dict(call)
        checked = None
        if validate:
            checked = MoeInitRoutingV2GradCall.from_wire(decode_body(encode_body_view(document)))
        return document, checked
    raise TypeError(
        f"a batch item must be a MoeInitRoutingV2GradCall, a wire document mapping or a "
        f"BatchCompare, got {type(call).__name__}"
    )


def _batch_compare_document(
    item: BatchCompare, *, validate: bool
) -> tuple[dict[str, Any], MoeInitRoutingV2GradCall | None]:
    if not isinstance(item.return_grad_x, bool):
        raise TypeError(f"return_grad_x must be a bool, got {type(item.return_grad_x).__name__}")
    document, checked = _batch_grad_document(item.call, validate=validate)
    document["op"] = "compare"
    _add_comparison(document, checked, item.candidate, item.standards, item.return_grad_x)
    return document, checked
