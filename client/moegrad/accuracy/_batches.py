"""A sweep's cases judged in batches on a service, through the send function the client passes.

:func:`compare_batch_on` (and :func:`acompare_batch_on`) give :func:`~moegrad.accuracy.compare_cases`
its ``compare_batch``: each case's call is checked here first (one the operator refuses is that
case's outcome and is not sent), the batch is sent (``Client.compare_many`` passes its batch
endpoint), and each answer becomes the case's report with its :class:`ReportContext` (the inputs'
SHA-256, the replica that answered, the profile that judged it, the time).

A case that names no device profile (no ``order``) is run by its replica on the replica's own
profile: it is sent as its keyword arguments, for the client to check by the replicas' profile
(``moegrad.http._unnamed.prepare``), and :func:`refuse_mixed_profiles` stops a sweep of such cases over
replicas whose profiles differ before anything is sent (docs/accuracy.md, "Sweeps").
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from moegrad._errors import InvalidArgument, MalformedRequest, MoegradError
from moegrad.accuracy._cases import case_names_order
from moegrad.accuracy._compare import rejudge
from moegrad.accuracy._context import report_context, with_context
from moegrad.accuracy._results import ComparisonReport
from moegrad.operator._call import MoeInitRoutingV2GradCall, names_profile

__all__ = [
    "AsyncCompareBatch",
    "AsyncSendCompares",
    "Case",
    "CompareAnswer",
    "CompareBatch",
    "ProfilesDiffer",
    "SendCompares",
    "SentCall",
    "acompare_batch_on",
    "compare_batch_on",
    "context_call",
    "fields_with_order",
    "refuse_mixed_profiles",
]


class CompareAnswer(Protocol):
    """What a batch's comparison answers (``moegrad.CompareResult`` is one): read here, never built."""

    @property
    def report(self) -> ComparisonReport: ...
    @property
    def backend(self) -> str: ...
    @property
    def order(self) -> str: ...
    @property
    def device(self) -> str | None: ...
    @property
    def server_url(self) -> str | None: ...


#: A case: a case file, or ``(name, fields, candidate)`` (``fields``: the call's keyword arguments).
Case = str | os.PathLike[str] | tuple[str, Mapping[str, Any], np.ndarray]
#: compare_batch([(name, fields, candidate), ...]) -> per case, its report or the exception it raised.
CompareBatch = Callable[[list[tuple[str, Mapping[str, Any], np.ndarray]]], list["ComparisonReport | Exception"]]
#: As CompareBatch, awaited.
AsyncCompareBatch = Callable[
    [list[tuple[str, Mapping[str, Any], np.ndarray]]], Awaitable[list["ComparisonReport | Exception"]]
]


def fields_with_order(fields: Mapping[str, Any], order: str | None) -> Mapping[str, Any]:
    """A case's fields, ``order`` given to it when it names none; an ``order`` of None left out."""
    if names_profile(fields):
        return fields
    rest = {name: value for name, value in fields.items() if name != "order"}
    return rest if order is None else {**rest, "order": order}


#: A case's call on its way to a service: validated, or (a case that names no profile) its keyword
#: arguments, which the client checks by the replicas' profile.
SentCall = MoeInitRoutingV2GradCall | Mapping[str, Any]
#: send([(call, candidate), ...]) -> per pair, in order, the service's answer or the exception that case earned.
SendCompares = Callable[[list[tuple[SentCall, np.ndarray]]], Sequence[CompareAnswer | MoegradError]]
#: As SendCompares, awaited.
AsyncSendCompares = Callable[[list[tuple[SentCall, np.ndarray]]], Awaitable[Sequence[CompareAnswer | MoegradError]]]


class ProfilesDiffer(ValueError):
    """A sweep of cases that name no profile over replicas whose profiles differ (nothing was sent)."""


def refuse_mixed_profiles(orders: Mapping[str, str | None], cases: Iterable[Case], order: str | None) -> None:
    """Refuse a sweep whose cases would be judged on different profiles without saying so.

    Args:
        orders: each replica's root URL -> its profile (its ``/v1/info``'s ``order``; None: unknown).
        cases: the sweep's cases; a case file's names are read, not its arrays.
        order: the profile given to the cases that name none, or None.

    Raises:
        ProfilesDiffer: the known profiles differ, ``order`` is None and some case names no profile
            (the message names each replica and its profile, and what to do).
    """
    known = {url: profile for url, profile in orders.items() if profile is not None}
    if order is not None or len(set(known.values())) < 2:
        return
    unnamed = next((case for case in cases if not case_names_order(case)), None)
    if unnamed is None:
        return
    name = unnamed[0] if isinstance(unnamed, tuple) else os.fspath(unnamed)
    raise ProfilesDiffer(
        "the replicas run different device profiles ("
        + ", ".join(f"{url} {profile}" for url, profile in known.items())
        + f") and case {name} (and maybe others) names none, so each case would be judged on whichever "
        "replica's profile answered it: pass --order PROFILE (Client.compare_many(order=...)) or sweep "
        "one profile's replicas at a time"
    )


def context_call(fields: Mapping[str, Any], order: str) -> MoeInitRoutingV2GradCall:
    """The call a service's answer judged, for its report's context: a call's keyword arguments on
    ``order``, the profile that answered (one this client does not know: the fields as they are)."""
    try:
        return MoeInitRoutingV2GradCall(**{**fields, "order": order})
    except (MoegradError, TypeError, ValueError):
        return MoeInitRoutingV2GradCall.model_construct(**{k: v for k, v in fields.items() if k != "order"})


class _Batch:
    """One batch of cases on its way to a service: each case's call validated here first (one the
    operator refuses is that case's outcome and is not sent; one that names no profile is checked
    by the client, by the replicas' profile), the others' answers then judged."""

    def __init__(self, chunk: list[tuple[str, Mapping[str, Any], np.ndarray]], order: str | None) -> None:
        self.chunk = chunk
        self.outcomes: list[ComparisonReport | Exception | None] = [None] * len(chunk)
        self.pairs: list[tuple[SentCall, np.ndarray]] = []
        self.sent: list[int] = []
        for index, (_, given, candidate) in enumerate(chunk):
            fields = fields_with_order(given, order)
            if not names_profile(fields):
                self.pairs.append((fields, candidate))
                self.sent.append(index)
                continue
            try:
                call = MoeInitRoutingV2GradCall(**fields)
            except (InvalidArgument, MalformedRequest, TypeError, ValueError) as exc:
                self.outcomes[index] = exc.with_traceback(None)  # a cycle through ``outcomes`` otherwise
                continue
            self.pairs.append((call, candidate))
            self.sent.append(index)

    def judged(
        self, answers: Sequence[CompareAnswer | MoegradError], *, require_exact: bool, server_url: str
    ) -> list[ComparisonReport | Exception]:
        for index, (sent, _), answer in zip(self.sent, self.pairs, answers, strict=True):
            if isinstance(answer, Exception):
                self.outcomes[index] = answer
                continue
            name, _, candidate = self.chunk[index]
            call = sent if isinstance(sent, MoeInitRoutingV2GradCall) else context_call(sent, answer.order)
            report = rejudge(answer.report, require_exact=True) if require_exact else answer.report
            context = report_context(
                call,
                candidate,
                backend=answer.backend,
                device=answer.device,
                server_url=answer.server_url or server_url,
                order=answer.order,
                case=name,
            )
            self.outcomes[index] = with_context(report, context)
        assert all(outcome is not None for outcome in self.outcomes)
        return self.outcomes  # type: ignore[return-value]  # every slot filled above


def compare_batch_on(
    send: SendCompares, *, require_exact: bool, server_url: str, order: str | None = None
) -> CompareBatch:
    """A ``compare_batch`` for :func:`compare_cases` that judges each batch of cases with one call of ``send``.

    ``Client.compare_many`` passes a ``send`` that asks its service's batch endpoint
    (``Client.batch`` with a ``BatchCompare`` per case). Each case's call is validated here first:
    one the operator refuses (InvalidArgument, MalformedRequest, TypeError, ValueError) is that
    case's outcome and is not sent. A case that names no profile (and is not given ``order``) is
    passed to ``send`` as its keyword arguments, for the client to check by its replicas' profile.

    Args:
        send: judges calls with their candidates on the service, one answer per pair, in order.
        require_exact: each verdict fails unless the candidate is bit-exact (:func:`rejudge`).
        server_url: the service's root URL, recorded in each report's context when the answer does
            not name the replica that gave it.
        order: the profile of the cases that name none (None: each replica's own).

    Returns:
        ``compare_batch(chunk)``: per case, its report (with its :class:`ReportContext`: the inputs'
        SHA-256, the server, the time) or the exception it earned.

    Raises:
        TypeError: ``require_exact`` is not a bool (``"false"`` would read as true).
    """
    _check_bool(require_exact)

    def judged(chunk: list[tuple[str, Mapping[str, Any], np.ndarray]]) -> list[ComparisonReport | Exception]:
        batch = _Batch(chunk, order)
        answers = send(batch.pairs) if batch.pairs else []
        return batch.judged(answers, require_exact=require_exact, server_url=server_url)

    return judged


def acompare_batch_on(
    send: AsyncSendCompares, *, require_exact: bool, server_url: str, order: str | None = None
) -> AsyncCompareBatch:
    """:func:`compare_batch_on` with an awaited ``send`` (``AsyncClient.compare_many``)."""
    _check_bool(require_exact)

    async def judged(chunk: list[tuple[str, Mapping[str, Any], np.ndarray]]) -> list[ComparisonReport | Exception]:
        batch = _Batch(chunk, order)
        answers = await send(batch.pairs) if batch.pairs else []
        return batch.judged(answers, require_exact=require_exact, server_url=server_url)

    return judged


def _check_bool(require_exact: Any) -> None:
    if not isinstance(require_exact, bool):
        raise TypeError(f"require_exact must be a bool, got {type(require_exact).__name__}")
