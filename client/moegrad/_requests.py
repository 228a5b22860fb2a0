"""Request building: the documents, bodies and httpx requests of every endpoint, with no I/O (docs/protocol.md).

One builder for the sync and the async client: a call's wire document (validated first when the
client's ``validate`` is on, so a bad call raises before it is sent), a comparison's, a batch's
items, and :class:`RequestBuilder`, which makes each attempt's ``httpx.Request`` (URL, headers, the
body in slices of the buffer it views, the attempt's timeouts).

A call that names no device profile (no ``order``) is run by the server with its own (a device's,
or ``MOEGRAD_ORDER``), so the client checks it by that profile too: such a call is an
:class:`Unnamed` until :func:`prepare` is given the replicas' profile. When the client does not know
it yet, :func:`prepare` checks the call by one profile of each set of rules (:data:`RULE_SETS`):
when all accept it, or all refuse it with the same status, field and message, that is the answer
whatever the server's profile; otherwise it is undecided, and the core asks the replicas' profile
(``GET /v1/info``) or, when they do not agree, sends the call unchecked for the server to judge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

import httpx
import numpy as np

from moegrad._config import ClientConfig
from moegrad._errors import InvalidArgument, MoegradError
from moegrad._frames import FRAMES_MEDIA_TYPE
from moegrad._profiles import PROFILE_NAMES, PROFILES
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
    "RULE_SETS",
    "BatchCompare",
    "Body",
    "Prepared",
    "RequestBuilder",
    "Sent",
    "Unnamed",
    "batch_compares",
    "batch_items",
    "call_document",
    "compare_body",
    "compare_call",
    "fields_document",
    "grad_body",
    "grad_call",
    "prepare",
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
        call: the operator call: a :class:`~moegrad.MoeInitRoutingV2GradCall`, or a wire document
            (docs/protocol.md; checked first when the client's ``validate`` is on, by the replicas'
            profile when it names none).
        candidate: [N, H] grad_x of the implementation under test, in the call's dtype or float32.
        standards: names from :data:`moegrad.STANDARDS` (one or several); None: all.
        return_grad_x: also return the device's grad_x.
    """

    call: MoeInitRoutingV2GradCall | Mapping[str, Any] | Unnamed
    candidate: Any
    standards: Iterable[str] | str | None = None
    return_grad_x: bool = False


class Sent(NamedTuple):
    """What a batch item's answer is checked against: the operation, the validated call (None for a
    raw document) and whether grad_x was asked for; and whether it named no profile (its answer's
    ``order`` is then its replica's profile)."""

    op: Literal["grad", "compare"]
    call: MoeInitRoutingV2GradCall | None
    return_grad_x: bool
    unnamed: bool = False


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
        headers["Accept-Encoding"] = "identity"  # no content coding: a compressed reply could inflate past its bound
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
# Calls that name no profile
# --------------------------------------------------------------------------------------------------


def _rules_of(name: str) -> tuple[Any, ...]:
    """What of a profile decides phase one's answer (every field but its name, chip, release,
    order of adds and source): profiles that agree here answer every call alike, but for the
    profile's name in a message."""
    profile = dataclasses.asdict(PROFILES[name])
    return tuple(value for key, value in profile.items() if key not in ("name", "chip", "release", "order", "source"))


def _rule_sets() -> tuple[str, ...]:
    first: dict[tuple[Any, ...], str] = {}
    for name in PROFILES:
        first.setdefault(_rules_of(name), name)
    return tuple(first.values())


#: One profile of each set of phase-one rules (the first of :data:`moegrad.PROFILES` with it): a
#: call they all accept, or all refuse alike, gets that answer on every profile.
RULE_SETS: tuple[str, ...] = _rule_sets()


@dataclasses.dataclass(frozen=True, eq=False)
class Unnamed:
    """A call that names no device profile, before it is checked by the replicas' (:func:`prepare`).

    Attributes:
        build: the call checked on a profile (raises as :class:`MoeInitRoutingV2GradCall` does).
        document: its wire document, as it is sent unchecked.
        given: it is a wire document the caller gave: sent exactly as given, whatever checks it.
    """

    build: Callable[[str], MoeInitRoutingV2GradCall]
    document: Callable[[], dict[str, Any]]
    given: bool

    @classmethod
    def of_fields(cls, fields: Mapping[str, Any]) -> Unnamed:
        """The keyword arguments of :class:`MoeInitRoutingV2GradCall`, without ``order`` (arrays, not tensor maps)."""
        fields = dict(fields)
        return cls(
            lambda order: MoeInitRoutingV2GradCall(**fields, order=order), lambda: fields_document(fields), False
        )

    @classmethod
    def of_document(cls, document: Mapping[str, Any]) -> Unnamed:
        """A wire document whose ``order`` is absent or nil.

        Raises:
            TypeError: it cannot be packed as msgpack.
        """
        decoded = _decoded(document)
        return cls(
            lambda order: MoeInitRoutingV2GradCall.from_wire(decoded, default_order=order), lambda: dict(document), True
        )


def _decoded(document: Mapping[str, Any]) -> dict[str, Any]:
    """A wire document as the server reads it (packed, then unpacked).

    Raises:
        TypeError: it cannot be packed as msgpack.
    """
    try:
        return decode_body(encode_body_view(document))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None


def fields_document(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A call's keyword arguments as a wire document: each array a tensor map (no copy of a
    C-contiguous little-endian array), an absent tensor left out (the wire's null tensor).

    Raises:
        TypeError: an array of a dtype the wire does not carry.
    """
    return {
        name: encode_tensor(np.asarray(value)) if name in ("grad_expanded_x", "expanded_row_idx") else value
        for name, value in fields.items()
        if value is not None or name not in ("grad_expanded_x", "expanded_row_idx")
    }


def _unnamed(call: MoeInitRoutingV2GradCall) -> MoeInitRoutingV2GradCall:
    """``call`` (checked on a profile) as a call that names none: its document leaves ``order`` out."""
    return MoeInitRoutingV2GradCall.model_construct(_fields_set=call.model_fields_set - {"order"}, **dict(call))


def _same(first: InvalidArgument, other: InvalidArgument) -> bool:
    return (first.aclnn_status, first.field, first.message) == (other.aclnn_status, other.field, other.message)


def _judged(unnamed: Unnamed, profile: str | None) -> MoeInitRoutingV2GradCall | None:
    """``unnamed`` checked on ``profile``; with None, on every set of rules: the call when all accept
    it, their refusal when all refuse it alike (raised), None when they disagree.

    Raises:
        InvalidArgument, MalformedRequest: as :class:`MoeInitRoutingV2GradCall`.
    """
    if profile is not None:
        return unnamed.build(profile)
    accepted: MoeInitRoutingV2GradCall | None = None
    refused: InvalidArgument | None = None
    for name in RULE_SETS:
        try:
            call = unnamed.build(name)
        except InvalidArgument as exc:
            if accepted is not None or (refused is not None and not _same(refused, exc)):
                return None
            refused = exc
            continue
        if refused is not None:
            return None
        accepted = accepted or call
    if refused is not None:
        raise refused
    return accepted


#: A call ready to send: a validated call or a wire document; the validated call its answer is
#: checked against (None: not checked); whether it names no profile.
Prepared = tuple[MoeInitRoutingV2GradCall | dict[str, Any], MoeInitRoutingV2GradCall | None, bool]


def prepare(call: Any, *, validate: bool, profile: str | None, last: bool = False) -> Prepared | None:
    """A call as it is sent: checked locally when ``validate`` is on.

    Args:
        call: a :class:`MoeInitRoutingV2GradCall` (sent as it is), an :class:`Unnamed`, or a wire
            document (checked with ``from_wire`` when ``validate``; one that names no profile as an
            :class:`Unnamed`).
        validate: the client's ``validate``.
        profile: the profile of the replicas (:meth:`ReplicaSet.profile`), or None when unknown.
        last: no profile will be known: an undecided call is sent unchecked, for the server to judge.

    Returns:
        What to send, or None when the call names no profile and the profiles' rules disagree about
        it (the caller learns the replicas' profile and asks again, or asks with ``last``).

    Raises:
        InvalidArgument, MalformedRequest: the call broke a rule (the replicas' profile's, or every
            profile's alike). TypeError: a call of another type, or a wire document holding arrays.
    """
    if profile is not None and profile not in PROFILE_NAMES:
        profile = None  # a profile this client does not know: the server judges what the others disagree on
    if isinstance(call, MoeInitRoutingV2GradCall):
        return call, call, "order" not in call.model_fields_set
    if isinstance(call, Mapping):
        _check_no_arrays(call)
        if not validate:
            return dict(call), None, call.get("order") is None
        if call.get("order") is not None:
            return dict(call), MoeInitRoutingV2GradCall.from_wire(_decoded(call)), False
        call = Unnamed.of_document(call)
    if not isinstance(call, Unnamed):
        raise TypeError(
            f"call must be a MoeInitRoutingV2GradCall or a wire document mapping, got {type(call).__name__}"
        )
    if last and profile is None:
        return call.document(), None, True
    checked = _judged(call, profile)
    if checked is None:
        return None
    return (call.document() if call.given else _unnamed(checked)), checked, True


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
) -> MoeInitRoutingV2GradCall | Unnamed | dict[str, Any]:
    """The keyword API's arguments as a validated call (``validate=True``; an :class:`Unnamed`, to be
    checked by the replicas' profile, when ``order`` is None) or a raw wire document."""
    fields: dict[str, Any] = {
        "grad_expanded_x": grad_expanded_x,
        "expanded_row_idx": expanded_row_idx,
        "top_k": top_k,
        "drop_pad_mode": drop_pad_mode,
        "active_num": active_num,
        "allow_duplicate_indices": allow_duplicate_indices,
    }
    if not validate:
        return fields_document({**fields, "order": order} if order is not None else fields)
    if order is None:
        return Unnamed.of_fields(fields)
    return MoeInitRoutingV2GradCall(**fields, order=order)


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
) -> MoeInitRoutingV2GradCall | Unnamed | dict[str, Any]:
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


def grad_body(call: MoeInitRoutingV2GradCall | Mapping[str, Any]) -> memoryview:
    """The msgpack body of a prepared call (:func:`prepare`): a :class:`MoeInitRoutingV2GradCall`'s
    document (its ``order`` only when it was set explicitly, else the server's profile applies), or
    a wire document exactly as given.

    Raises:
        TypeError: a document that cannot be packed as msgpack.
    """
    if isinstance(call, MoeInitRoutingV2GradCall):
        return encode_body_view(call_document(call))
    try:
        return encode_body_view(call)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the request document cannot be packed as msgpack: {exc}") from None


def compare_body(
    call: MoeInitRoutingV2GradCall | Mapping[str, Any],
    checked: MoeInitRoutingV2GradCall | None,
    candidate: Any,
    standards: Any,
    return_grad_x: Any,
) -> memoryview:
    """The msgpack body of a comparison: a prepared call's fields (:func:`prepare`) plus
    ``candidate``, ``standards``, ``return_grad_x``.

    The candidate and standards of a ``checked`` call are checked by
    :func:`moegrad.check_compare_arguments` first, so a bad one raises InvalidArgument before any
    I/O; those of a call not checked are sent as given.
    """
    if not isinstance(return_grad_x, bool):
        raise TypeError(f"return_grad_x must be a bool, got {type(return_grad_x).__name__}")
    document = call_document(call) if isinstance(call, MoeInitRoutingV2GradCall) else dict(call)
    _add_comparison(document, checked, candidate, standards, return_grad_x)
    try:
        return encode_body_view(document)
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


def batch_calls(items: list[Any]) -> list[Any]:
    """Each batch item's call (a :class:`BatchCompare`'s ``call``), for :func:`prepare`.

    Raises:
        TypeError: an item of another type, or a BatchCompare whose ``return_grad_x`` is not a bool.
    """
    calls = []
    for item in items:
        if isinstance(item, BatchCompare):
            if not isinstance(item.return_grad_x, bool):
                raise TypeError(f"return_grad_x must be a bool, got {type(item.return_grad_x).__name__}")
            calls.append(item.call)
        elif isinstance(item, (MoeInitRoutingV2GradCall, Mapping, Unnamed)):
            calls.append(item)
        else:
            raise TypeError(
                f"a batch item must be a MoeInitRoutingV2GradCall, a wire document mapping or a "
                f"BatchCompare, got {type(item).__name__}"
            )
    return calls


def batch_items(
    items: list[Any], prepared: list[Prepared | MoegradError]
) -> tuple[list[dict[str, Any] | MoegradError], list[Sent]]:
    """Each batch item's wire document (or the error it raised locally), and what its answer is
    checked against; ``prepared``: each item's call from :func:`prepare` (or the error it raised)."""
    documents: list[dict[str, Any] | MoegradError] = []
    sent: list[Sent] = []
    for item, ready in zip(items, prepared, strict=True):
        if isinstance(ready, MoegradError):  # refused locally: its own answer, not sent
            documents.append(ready)
            sent.append(Sent("grad", None, False))
            continue
        call, checked, unnamed = ready
        document = call_document(call) if isinstance(call, MoeInitRoutingV2GradCall) else dict(call)
        try:
            if isinstance(item, BatchCompare):
                document["op"] = "compare"
                _add_comparison(document, checked, item.candidate, item.standards, item.return_grad_x)
                sent.append(Sent("compare", checked, item.return_grad_x, unnamed))
            else:
                sent.append(Sent("grad", checked, True, unnamed))
            documents.append(document)
        except MoegradError as exc:  # a candidate or standard refused locally
            # without its traceback: through ``documents`` it would be a cycle holding every item's arrays
            documents.append(exc.with_traceback(None))
            sent.append(Sent("grad", None, False))
    return documents, sent


def batch_compares(
    pairs: Iterable[tuple[MoeInitRoutingV2GradCall | Mapping[str, Any], Any]], standards: Any
) -> list[BatchCompare]:
    """A sweep's ``(call, candidate)`` pairs as batch items; a call given as keyword arguments
    (a case that names no profile) is an :class:`Unnamed`, checked by the replicas' profile."""
    items = []
    for call, candidate in pairs:
        sent = call if isinstance(call, MoeInitRoutingV2GradCall) else Unnamed.of_fields(call)
        items.append(BatchCompare(sent, candidate, standards))
    return items
