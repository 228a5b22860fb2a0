"""Reply parsing, one copy for every endpoint: an answer's document -> GradResult / CompareResult /
ExplainResult.

A single call's reply, a comparison's and each item of a batch's are read by :func:`answer`: the
same fields (docs/protocol.md, "The reply"), the same checks against the call that was sent (grad_x
of its shape [N, H] and dtype, a report about grad_x of that shape), the same ServiceError for a
reply that is not valid (the server's reply is broken, not the caller's request). A frames reply is
read into a :class:`~moegrad.wire._frames.FramesReader` by the driver (:func:`frames_reader`) and its
document taken from there; every other reply is one msgpack map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import httpx
import numpy as np

from moegrad._dtypes import dtype_name
from moegrad._errors import MalformedRequest, MoegradError, ServiceError
from moegrad.http._accuracy import ComparisonReport, Explanation
from moegrad.http._answers import CompareResult, ExplainResult, GradResult
from moegrad.http._reply_bounds import REPLY_BYTES_EXTENSION, explain_shape
from moegrad.http._status import error_from_problem, str_or_none
from moegrad.operator._call import MoeInitRoutingV2GradCall
from moegrad.wire._bodies import decode_body
from moegrad.wire._codec import decode_tensor
from moegrad.wire._frames import FRAMES_MEDIA_TYPE, FramesReader
from moegrad.wire._limits import REPLY_LIMITS, batch_reply_limits, explain_reply_limits

__all__ = [
    "REPLICA_EXTENSION",
    "answer",
    "batch_answer",
    "frames_reader",
    "parse_batch",
    "parse_explain",
    "parse_json",
    "parse_reply",
    "reply_document",
]

_FRAMES_READER = "moegrad.frames"  # the httpx response extension a driver puts a frames reply's reader under
#: The httpx response extension the core puts the answering replica's root URL under.
REPLICA_EXTENSION = "moegrad.replica"


def frames_reader(response: httpx.Response) -> FramesReader | None:
    """A reader for a successful frames reply (the driver streams the body into it), else None."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (response.is_success and kind == FRAMES_MEDIA_TYPE):
        return None
    declared = response.headers.get("content-length")
    reader = FramesReader(
        int(declared) if declared is not None and declared.isdigit() else None,
        max_bytes=response.request.extensions.get(REPLY_BYTES_EXTENSION),
        limits=REPLY_LIMITS,
    )
    response.extensions[_FRAMES_READER] = reader
    return reader


def reply_document(response: httpx.Response) -> dict[str, Any]:
    """A reply's document: a frames reply's (its tensors already owned arrays), else the msgpack map;
    decoded within :data:`~moegrad.wire._limits.REPLY_LIMITS`.

    Raises:
        MalformedRequest: the body is not a valid document, or its structure is over the limits.
    """
    reader = response.extensions.get(_FRAMES_READER)
    if reader is None:
        return decode_body(response.content, REPLY_LIMITS)
    if reader.error is not None:
        raise reader.error
    return reader.document()


def answer(
    document: dict[str, Any],
    *,
    op: Literal["grad", "compare"],
    call: MoeInitRoutingV2GradCall | None,
    return_grad_x: bool,
    request_id: str | None,
    status_code: int,
    what: str = "reply",
    server_url: str | None = None,
) -> GradResult | CompareResult:
    """One answer's document as its result.

    Args:
        document: the reply's map (or a batch item's); grad_x a tensor map or an owned array.
        op: ``"grad"`` (a GradResult) or ``"compare"`` (a CompareResult, its report read from ``"report"``).
        call: the validated call that was sent (None for a raw wire document: nothing to check against).
        return_grad_x: a comparison's grad_x was asked for (a grad answer always carries one).
        request_id: the ``X-Request-Id`` of the request that carried it.
        status_code: the reply's HTTP status (carried by a ServiceError).
        what: how a ServiceError names the answer (``"reply"``, ``"answer to a batch item"``).
        server_url: the root URL of the replica that answered.

    Returns:
        The result: grad_x owned and writable, the fields every answer carries (backend, order,
        device, timings_ms) and ``request_id``.

    Raises:
        ServiceError: grad_x or the report missing or not valid, grad_x not of the call's shape
            [N, H] and dtype, or a report about grad_x of another shape.
    """
    noun = "result" if op == "grad" else "comparison"
    try:
        grad_x = _owned_grad_x(document.get("grad_x")) if op == "grad" or return_grad_x else None
        report = ComparisonReport.from_dict(_mapping(document.get("report"), "report")) if op == "compare" else None
    except MalformedRequest as exc:
        raise ServiceError(
            f"the server's {what} is not a valid {noun}: {exc.message}", status_code=status_code
        ) from None
    except ValueError as exc:
        raise ServiceError(f"the server's {what} is not a valid {noun}: {exc}", status_code=status_code) from None
    if call is not None:
        want = (call.num_tokens, call.hidden_size)
        if grad_x is not None and (grad_x.shape != want or dtype_name(grad_x.dtype) != call.dtype_name):
            raise ServiceError(
                f"the server replied grad_x {grad_x.dtype}{list(grad_x.shape)}, expected {call.dtype_name}{list(want)}",
                status_code=status_code,
            )
        if report is not None and report.shape != want:
            raise ServiceError(
                f"the server's report is about grad_x {list(report.shape)}, expected {list(want)}",
                status_code=status_code,
            )
    fields = _served(document, request_id, server_url)
    if report is None:
        assert grad_x is not None  # read above whenever op == "grad"
        return GradResult(grad_x=grad_x, **fields)
    return CompareResult(report=report, grad_x=grad_x, **fields)


def _served(document: dict[str, Any], request_id: str | None, server_url: str | None) -> dict[str, Any]:
    """The fields every answer carries about who served it: backend, order, device, timings_ms,
    and the request's id and replica."""
    timings = document.get("timings_ms")
    return {
        "backend": str(document.get("backend", "")),
        "order": str(document.get("order", "")),
        "device": str_or_none(document.get("device")),
        "timings_ms": dict(timings) if isinstance(timings, dict) else {},
        "request_id": request_id,
        "server_url": server_url,
    }


def parse_explain(
    response: httpx.Response, sent: MoeInitRoutingV2GradCall | Mapping[str, Any], call: MoeInitRoutingV2GradCall | None
) -> ExplainResult:
    """A 200 reply of the explain endpoint as an ExplainResult; ``sent``: the call or document sent
    (its N and K bound the reply's structure), ``call``: the validated call (None: not checked).

    Raises:
        ServiceError: the body is not a valid explanation, or one of grad_x of another shape.
    """
    status = response.status_code
    try:
        document = decode_body(response.content, explain_reply_limits(*explain_shape(sent)))
        explanation = Explanation.from_dict(_mapping(document.get("explanation"), "explanation"))
    except MalformedRequest as exc:
        raise ServiceError(
            f"the server's reply is not a valid explanation: {exc.message}", status_code=status
        ) from None
    except ValueError as exc:
        raise ServiceError(f"the server's reply is not a valid explanation: {exc}", status_code=status) from None
    if call is not None and explanation.shape != (call.num_tokens, call.hidden_size):
        raise ServiceError(
            f"the server's explanation is about grad_x {list(explanation.shape)}, expected "
            f"{[call.num_tokens, call.hidden_size]}",
            status_code=status,
        )
    served = _served(document, response.headers.get("x-request-id"), response.extensions.get(REPLICA_EXTENSION))
    return ExplainResult(explanation=explanation, **served)


def parse_reply(
    response: httpx.Response,
    call: MoeInitRoutingV2GradCall | None,
    *,
    op: Literal["grad", "compare"],
    return_grad_x: bool = True,
) -> GradResult | CompareResult:
    """A 200 reply of the grad endpoint (msgpack or frames; ``op="grad"``) as a GradResult, or of
    the compare endpoint (``op="compare"``) as a CompareResult.

    Raises:
        ServiceError: a reply that is not one (see :func:`answer`).
    """
    try:
        document = reply_document(response)
    except MalformedRequest as exc:  # the server's reply is broken, not the caller's request
        what = "result" if op == "grad" else "comparison"
        raise ServiceError(
            f"the server's reply is not a valid {what}: {exc.message}", status_code=response.status_code
        ) from None
    return answer(
        document,
        op=op,
        call=call,
        return_grad_x=return_grad_x,
        request_id=response.headers.get("x-request-id"),
        status_code=response.status_code,
        server_url=response.extensions.get(REPLICA_EXTENSION),
    )


def parse_batch(response: httpx.Response, count: int) -> list[Any]:
    """A 200 reply of the batch endpoint: its ``results``, one per item sent, each not yet read.

    Raises:
        ServiceError: the body is not a valid document (:func:`~moegrad.wire._limits.batch_reply_limits`
            bound its structure), or does not hold ``count`` results.
    """
    try:
        document = decode_body(response.content, batch_reply_limits(count))
    except MalformedRequest as exc:
        raise ServiceError(
            f"the server's batch reply is not valid: {exc.message}", status_code=response.status_code
        ) from None
    results = document.get("results")
    if not isinstance(results, list) or len(results) != count:
        raise ServiceError(
            f"the server answered {len(results) if isinstance(results, list) else 'no'} results for a batch of {count}",
            status_code=response.status_code,
        )
    return results


def batch_answer(
    response: httpx.Response,
    result: Any,
    op: Literal["grad", "compare"],
    call: MoeInitRoutingV2GradCall | None,
    return_grad_x: bool,
    request_id: str | None,
) -> GradResult | CompareResult | MoegradError:
    """One batch item's answer: its result (:func:`answer`, with the batch's ``request_id``), or
    the exception its problem document maps to (the table of the single-call endpoints); a result
    that is not valid is a ServiceError in its place."""
    if not isinstance(result, dict):
        return ServiceError(
            "the server's batch reply holds an item that is not a map", status_code=response.status_code
        )
    problem = result.get("problem")
    if isinstance(problem, dict):
        return error_from_problem(problem, response)
    try:
        return answer(
            result,
            op=op,
            call=call,
            return_grad_x=return_grad_x,
            request_id=request_id,
            status_code=response.status_code,
            what="answer to a batch item",
            server_url=response.extensions.get(REPLICA_EXTENSION),
        )
    except ServiceError as exc:
        return exc


def parse_json(response: httpx.Response) -> dict[str, Any]:
    """A 200 JSON reply (``/v1/info``) as its object.

    Raises:
        ServiceError: the body is not a JSON object.
    """
    try:
        document = response.json()
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the interpreter's limit
        document = None
    if not isinstance(document, dict):
        raise ServiceError(f"{response.request.url} did not answer a JSON object", status_code=response.status_code)
    return document


def _owned_grad_x(value: Any) -> np.ndarray:
    """grad_x of a reply document as an owned, writable array: a frames reply's array as it is,
    a msgpack tensor map's bytes copied out once.

    Raises:
        MalformedRequest: not a valid tensor map.
    """
    if isinstance(value, np.ndarray):
        return value
    return decode_tensor(value, "grad_x").copy()


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` when it is a map; else the ValueError a report of another type gets."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a map, got {type(value).__name__}")
    return value
