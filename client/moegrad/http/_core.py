"""The clients' sans-I/O core: one *flow* per endpoint, with the retries and the deadline.

A flow is a generator that yields what it wants done and is sent back what happened:

- it yields an ``httpx.Request`` and is sent the ``httpx.Response`` (body read) or the
  ``httpx.HTTPError`` the transport raised;
- it yields a ``float`` (seconds to wait before a retry) and is sent ``None``;
- it yields a :class:`~moegrad.http._replicas.Resolve` (a ``dns+`` URL's name) and is sent
  ``socket.getaddrinfo``'s list, or the ``OSError`` it raised;
- it returns the call's result, or raises the mapped :class:`~moegrad.MoegradError`.

The core builds every request (:mod:`moegrad.http._documents`, :mod:`moegrad.http._requests`),
maps every response and every network error (:mod:`moegrad.http._status`,
:mod:`moegrad.http._replies`), picks each attempt's replica (:mod:`moegrad.http._replicas`) and
decides every retry; it does no I/O. It also keeps what it learns of
each replica's server, one record each (:class:`~moegrad.http._replicas.ServerInfo`: the profile
of its ``/v1/info`` and of its answers to calls that name none, by which such calls are checked
before they are sent (:func:`moegrad.http._unnamed.prepare`); its wire formats; its limits).
``Client`` and ``AsyncClient`` (:mod:`moegrad.http._client`, :mod:`moegrad.http._async_client`) only
drive flows, the same dozen lines in each, differing by ``await``. A new endpoint is one flow here plus
one short method in each client.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import httpx

from moegrad._errors import DeadlineExceeded, DeviceBusy, MoegradError, TransportError
from moegrad.http._accuracy import rejudge
from moegrad.http._answers import CompareResult, ExplainResult, GradResult
from moegrad.http._config import ClientConfig
from moegrad.http._deadline import REMAINING_EXTENSION
from moegrad.http._documents import (
    Sent,
    batch_calls,
    batch_items,
    call_document,
    compare_body,
    explain_document,
    grad_body,
)
from moegrad.http._replicas import Replica, ReplicaSet, Resolve
from moegrad.http._replies import REPLICA_EXTENSION, batch_answer, parse_batch, parse_explain, parse_json, parse_reply
from moegrad.http._reply_bounds import (
    INFO_REPLY_BYTES,
    REPLY_BYTES_EXTENSION,
    batch_reply_bytes,
    compare_reply_bytes,
    explain_reply_bytes,
    grad_reply_bytes,
)
from moegrad.http._requests import JSON, MSGPACK, Body, RequestBuilder
from moegrad.http._status import error_from_response, error_from_transport
from moegrad.http._unnamed import Prepared, prepare
from moegrad.operator._call import MoeInitRoutingV2GradCall
from moegrad.wire._codec import encode_batch, encode_body_view
from moegrad.wire._frames import FRAMES_MEDIA_TYPE, encode_frames
from moegrad.wire._limits import MAX_BATCH_CALLS
from moegrad.wire._v1 import BATCH_PATH, COMPARE_PATH, EXPLAIN_PATH, FRAMES_ACCEPT, GRAD_PATH, INFO_PATH

__all__ = ["FRAMES_MIN_BYTES", "ClientCore", "Flow"]

T = TypeVar("T")
#: What a flow yields (a request to send, seconds to sleep, a name to resolve), is sent, and returns.
Flow = Generator["httpx.Request | float | Resolve", "httpx.Response | httpx.HTTPError | Any", T]

#: A call whose tensors hold at least this many bytes travels as frames (``wire="auto"``), when the
#: server offers them; smaller calls are cheaper as one msgpack document.
FRAMES_MIN_BYTES = 1 << 16
_MIN_ATTEMPT_S = 0.001  # less time than this left: the deadline has passed


class ClientCore:
    """Request building, response parsing and retry decisions for one client: no I/O at all.

    Args:
        config: the client's configuration.
        clock: monotonic seconds (the deadline's and the replicas' clock).
        async_body: request bodies as async iterables (httpx.AsyncClient takes no others).
        rng: the replicas' random choice (:class:`~moegrad.http._replicas.ReplicaSet`).
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        async_body: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.requests = RequestBuilder(config, async_body=async_body)
        self.replicas = ReplicaSet(config.replicas, dns=config.dns, clock=clock, rng=rng)
        self._clock = clock

    def exchange(
        self,
        method: str,
        path: str,
        *,
        accept: str,
        timeout_s: float | None,
        retries: int,
        reply_bytes: int,
        body: Body | None = None,
        content_type: str = MSGPACK,
        tried: list[Replica] | None = None,
        started: float | None = None,
        only: Replica | None = None,
    ) -> Flow[httpx.Response]:
        """Send one logical request, retrying 503, 504 and connection errors; return its 2xx response.

        Each attempt goes to the replica :meth:`ReplicaSet.pick` chooses; a retry goes to another
        replica at once when one is left that neither failed this call nor is set aside, else
        after :meth:`Retries.delay_s` (a 503's Retry-After honoured). A 504 is retried only on
        another replica (the deadline that passed on one server has not on the next, whose cap
        may differ); 4xx and 500 never are. A replica that gives no reply before the deadline is
        set aside as a failing one is. The response's extension ``"moegrad.replica"`` is the
        root URL of the replica that answered.

        ``reply_bytes``: the most bytes a 2xx reply may take (:mod:`moegrad.http._reply_bounds`); each
        request carries it and the seconds left of the deadline, for the driver to read the reply within both.

        ``tried``: the replicas this call tried before (a batch's items sent again: not sent back
        there while another is ready); every attempt's replica is appended to it, the one that
        answered last. ``started``: the clock reading ``timeout_s`` counts from (default: now)."""
        request_id = uuid.uuid4().hex
        started = self._clock() if started is None else started
        deadline = None if timeout_s is None else started + timeout_s
        attempt = 0
        tried = [] if tried is None else tried
        while True:
            remaining_s = self._time_left_s(deadline, f"{method} {path}", timeout_s, attempt)
            resolve = None if only is not None else self.replicas.due()
            if resolve is not None:
                self.replicas.resolved((yield resolve))
            replica = self.replicas.pick(tried) if only is None else self.replicas.take(only)
            answered = failed = False
            retry_after_s: float | None = None
            try:
                request = self.requests.build(
                    method,
                    path,
                    accept=accept,
                    request_id=request_id,
                    remaining_s=remaining_s,
                    body=body,
                    content_type=content_type,
                    replica=replica,
                )
                request.extensions[REPLY_BYTES_EXTENSION] = reply_bytes
                request.extensions[REMAINING_EXTENSION] = None if deadline is None else deadline - self._clock()
                outcome = yield request
                if isinstance(outcome, httpx.Response) and outcome.is_success:
                    answered = True
                    outcome.extensions[REPLICA_EXTENSION] = str(replica.url)
                    tried.append(replica)
                    return outcome
                error, cause, retryable, failed, retry_after_s = self._failure(
                    outcome, request, [*tried, replica], only is None, deadline, timeout_s
                )
                answered = isinstance(outcome, httpx.Response) and not failed
            finally:  # also when the driver closes the flow (an interrupted call)
                self.replicas.done(replica, answered=answered, failed=failed, retry_after_s=retry_after_s)
            tried.append(replica)
            if retryable and attempt < retries:
                if only is None and self.replicas.has_other(tried):
                    attempt += 1
                    continue
                delay_s = self.config.retries.delay_s(attempt, retry_after_s)
                if deadline is None or self._clock() + delay_s + _MIN_ATTEMPT_S < deadline:
                    yield delay_s
                    attempt += 1
                    continue
            raise error from cause

    def _time_left_s(self, deadline: float | None, what: str, timeout_s: float | None, attempt: int) -> float | None:
        """The seconds left before ``deadline`` (None: no deadline) as attempt ``attempt`` starts.

        Raises:
            DeadlineExceeded: less than an attempt's minimum is left (``what``: the method and path).
        """
        remaining_s = None if deadline is None else deadline - self._clock()
        if remaining_s is not None and remaining_s < _MIN_ATTEMPT_S:
            raise DeadlineExceeded(
                f"{what}: the deadline of {timeout_s} s passed before a reply"
                + (f" ({attempt} attempts)" if attempt else "")
            )
        return remaining_s

    def _failure(
        self,
        outcome: Any,
        request: httpx.Request,
        tried: list[Replica],
        any_replica: bool,
        deadline: float | None,
        timeout_s: float | None,
    ) -> tuple[MoegradError, BaseException | None, bool, bool, float | None]:
        """What a failed attempt means: ``(error, cause, retryable, failed, retry_after_s)``;
        ``failed``: its replica is set aside (a 503 or 504, no connection, no reply in time).

        ``outcome`` is a response that is not a 2xx or the transport's ``httpx.HTTPError``;
        ``tried`` ends with this attempt's replica; ``any_replica``: the call may go to another."""
        if isinstance(outcome, httpx.Response):
            error = error_from_response(outcome)
            status = outcome.status_code
            retryable = status == 503 or (status == 504 and any_replica and self.replicas.has_other(tried))
            retry_after_s = error.retry_after_s if isinstance(error, DeviceBusy) else None
            return error, None, retryable, status in (503, 504), retry_after_s
        if isinstance(outcome, httpx.HTTPError):
            passed = deadline is not None and self._clock() >= deadline
            error, retryable = error_from_transport(outcome, request, timeout_s, passed)
            # no reply in time (a hung replica) sets it aside too, though the call is over
            return error, outcome, retryable, retryable or isinstance(error, DeadlineExceeded), None
        raise TypeError(f"a flow was sent {type(outcome).__name__}")  # pragma: no cover - a driver bug

    def grad_flow(self, call: Any, timeout_s: Any) -> Flow[GradResult]:
        """One call (``POST /v1/moe_init_routing_v2_grad``): msgpack, or frames when :meth:`frames_for` says so.

        ``call``: a :class:`MoeInitRoutingV2GradCall`, a wire document or an :class:`Unnamed`
        (:func:`moegrad.http._unnamed.prepare`, checked by the replicas' profile when it names none)."""
        timeout_s = self.config.call_timeout_s(timeout_s)
        retries = self.config.retries.count
        ready = (yield from self.prepared_flow([call], raise_refusals=True))[0]
        assert not isinstance(ready, MoegradError)  # raised above
        sendable, checked, unnamed = ready
        reply_bytes = grad_reply_bytes(checked if checked is not None else sendable)
        if isinstance(sendable, MoeInitRoutingV2GradCall) and (yield from self.frames_for(sendable)):
            parts, _ = encode_frames(call_document(sendable))
            response = yield from self.exchange(
                "POST",
                GRAD_PATH,
                accept=FRAMES_ACCEPT,
                timeout_s=timeout_s,
                retries=retries,
                reply_bytes=reply_bytes,
                body=parts,
                content_type=FRAMES_MEDIA_TYPE,
            )
        else:
            response = yield from self.exchange(
                "POST",
                GRAD_PATH,
                accept=MSGPACK,
                timeout_s=timeout_s,
                retries=retries,
                reply_bytes=reply_bytes,
                body=grad_body(sendable),
            )
        result = parse_reply(response, checked, op="grad")
        assert isinstance(result, GradResult)
        if unnamed:  # run on its replica's own profile: the answer names it
            self.replicas.learn(result.server_url, result.order)
        return result

    def prepared_flow(self, calls: list[Any], *, raise_refusals: bool = False) -> Flow[list[Prepared | MoegradError]]:
        """Each call as :func:`moegrad.http._unnamed.prepare` makes it ready to send (or the MoegradError it
        raised locally), those that name no profile checked by the replicas' profile.

        When that profile is not known and the profiles' rules disagree about a call, the replicas
        whose profile is unknown are asked for it first (``GET /v1/info``, once each); when they
        still do not name one profile, such a call is sent unchecked and the server judges it.

        Raises:
            TypeError: as :func:`prepare`; with ``raise_refusals``, the MoegradError of a refused call.
        """
        validate = self.config.validate
        profile = self.replicas.profile()
        ready: list[Prepared | MoegradError | None] = []
        for call in calls:
            try:
                ready.append(prepare(call, validate=validate, profile=profile))
            except MoegradError as exc:
                if raise_refusals:
                    raise
                ready.append(exc.with_traceback(None))  # no cycle through ``ready`` holding the arrays
        if any(item is None for item in ready):
            yield from self.ask_info_flow()
            profile = self.replicas.profile()
            for index, item in enumerate(ready):
                if item is None:
                    try:
                        ready[index] = prepare(calls[index], validate=validate, profile=profile, last=True)
                    except MoegradError as exc:
                        if raise_refusals:
                            raise
                        ready[index] = exc.with_traceback(None)
        return ready  # type: ignore[return-value]  # every None replaced above

    def ask_info_flow(self, *, profile_known_too: bool = False) -> Flow[None]:
        """Ask each replica not asked yet for its ``/v1/info`` (once, no retry), into its record
        (:class:`~moegrad.http._replicas.ServerInfo`): for the profile, those whose profile is
        unknown; with ``profile_known_too`` (for the wire formats), those too. A replica that does
        not answer is recorded as asked, knowing nothing."""
        resolve = self.replicas.due()
        if resolve is not None:
            try:
                self.replicas.resolved((yield resolve))
            except MoegradError:
                return
        for replica in self.replicas.unasked(profile_known_too=profile_known_too):
            try:
                yield from self.info_flow(replica, retries=0)
            except MoegradError:
                self.replicas.learn_info(str(replica.url), None)

    def orders_flow(self) -> Flow[tuple[dict[str, Any], dict[str, str | None]]]:
        """``GET /v1/info`` of every replica (each asked once, with the retries when it is the only one).

        Returns:
            The first answer's document, and each replica's root URL -> its ``order`` (None: no answer).

        Raises:
            the first replica's error when none answers.
        """
        resolve = self.replicas.due()
        if resolve is not None:
            self.replicas.resolved((yield resolve))
        replicas = self.replicas.replicas
        retries = self.config.retries.count if len(replicas) == 1 else 0
        first: dict[str, Any] | None = None
        error: MoegradError | None = None
        orders: dict[str, str | None] = {}
        for replica in replicas:
            try:
                info = yield from self.info_flow(replica, retries=retries)
            except MoegradError as exc:
                self.replicas.learn_info(str(replica.url), None)
                orders[str(replica.url)], error = None, error or exc
                continue
            order = info.get("order")
            orders[str(replica.url)] = order if isinstance(order, str) else None
            first = info if first is None else first
        if first is None:
            assert error is not None  # a replica set is never empty here: resolved() raised otherwise
            raise error
        return first, orders

    def replicas_info_flow(self) -> Flow[dict[str, Any]]:
        """``Client.info()``: the first replica's ``/v1/info`` answer plus ``orders`` (:meth:`orders_flow`)."""
        info, orders = yield from self.orders_flow()
        return {**info, "orders": orders}

    def replica_orders_flow(self) -> Flow[dict[str, str | None]]:
        """Each replica's profile, asked now (:meth:`orders_flow`): every one None when none answers
        (a sweep goes on, and reports its cases unjudged)."""
        try:
            _, orders = yield from self.orders_flow()
        except MoegradError:
            return {str(replica.url): None for replica in self.replicas.replicas}
        return orders

    def frames_for(self, call: MoeInitRoutingV2GradCall) -> Flow[bool]:
        """Whether ``call`` travels as frames: ``wire="frames"`` always; ``"auto"`` when its tensors
        hold FRAMES_MIN_BYTES or more and every replica asked lists ``"frames"`` in its
        ``/v1/info``'s ``wire_formats`` (each replica's record is asked once, with its profile; a
        server that cannot say gets msgpack)."""
        if self.config.wire != "auto":
            return self.config.wire == "frames"
        if call.grad_expanded_x.nbytes + call.expanded_row_idx.nbytes < FRAMES_MIN_BYTES:
            return False
        formats = self.replicas.wire_formats()
        if formats is None:
            yield from self.ask_info_flow(profile_known_too=True)
            formats = self.replicas.wire_formats() or frozenset()
        return "frames" in formats

    def batch_flow(self, items: Iterable[Any], timeout_s: Any) -> Flow[list[GradResult | CompareResult | MoegradError]]:
        """Send the items in batches of at most MAX_BATCH_CALLS; one answer (or exception) per item, in order.

        Each batch has ``timeout_s`` and the client's retries (:meth:`_batch_flow`)."""
        timeout_s = self.config.call_timeout_s(timeout_s)
        items = list(items)
        prepared = yield from self.prepared_flow(batch_calls(items))
        documents, sent = batch_items(items, prepared)
        answers: list[GradResult | CompareResult | MoegradError | None] = [
            document if isinstance(document, MoegradError) else None for document in documents
        ]
        indices = [index for index, document in enumerate(documents) if not isinstance(document, MoegradError)]
        for start in range(0, len(indices), MAX_BATCH_CALLS):
            chunk = indices[start : start + MAX_BATCH_CALLS]
            yield from self._batch_flow(chunk, documents, sent, answers, timeout_s)
        return answers  # type: ignore[return-value]

    def _batch_flow(
        self,
        chunk: list[int],
        documents: list[dict[str, Any] | MoegradError],
        sent: list[Sent],
        answers: list[GradResult | CompareResult | MoegradError | None],
        timeout_s: float | None,
    ) -> Flow[None]:
        """One batch (the items ``chunk`` indexes): each answer into ``answers``; the items that a
        replica answered 503 (busy, or shutting down: a replica draining after SIGTERM answers its
        batches so) or 504 are sent again, alone, to another replica.

        The whole batch is retried as :meth:`exchange` retries a request. Items sent again share
        its budget (each sending after the first is one of the ``retries``) and its deadline; they
        go to a replica the batch has not tried while one is ready, else, 503s only, after
        :meth:`Retries.delay_s` (the items' largest ``retry_after_s`` honoured); the replica that
        answered them is set aside as a failing one (:meth:`ReplicaSet.set_aside`). A 4xx item is
        its own answer, never sent again (the operator is pure: the next answer is the same). An
        item left unanswered when the budget, the deadline or the replicas run out keeps its error
        (or, when sending it again failed as a whole, that failure's).

        Raises:
            the errors of :meth:`exchange` and ServiceError for a malformed batch reply, for the
            batch's first sending; TypeError: items that cannot be packed.
        """
        started, retries = self._clock(), self.config.retries.count
        tried: list[Replica] = []
        pending = chunk
        while True:
            try:
                body = encode_batch([documents[index] for index in pending])  # type: ignore[misc]
            except (TypeError, ValueError) as exc:
                raise TypeError(f"the batch cannot be packed as msgpack: {exc}") from None
            calls = [
                (sent[i].op, documents[i] if sent[i].call is None else sent[i].call, sent[i].return_grad_x)
                for i in pending
            ]
            try:
                response = yield from self.exchange(
                    "POST",
                    BATCH_PATH,
                    accept=MSGPACK,
                    timeout_s=timeout_s,
                    retries=retries - len(tried),
                    reply_bytes=batch_reply_bytes(calls),  # type: ignore[arg-type]  # no MoegradError is pending
                    body=body,
                    tried=tried,
                    started=started,
                )
                results = parse_batch(response, len(pending))
            except MoegradError as exc:
                if pending is chunk:  # the batch's first sending: the whole batch failed
                    raise
                for index in pending:  # sent again and failed as a whole: that is why they have no answer
                    answers[index] = exc
                return
            request_id = response.headers.get("x-request-id")  # once: a header lookup costs more than a small answer
            again: list[int] = []
            retry_after_s: float | None = None
            for index, result in zip(pending, results, strict=True):
                answers[index] = answer = batch_answer(response, result, *sent[index][:3], request_id)
                if sent[index].unnamed and isinstance(answer, (GradResult, CompareResult)):
                    self.replicas.learn(answer.server_url, answer.order)
                if isinstance(answer, (DeviceBusy, DeadlineExceeded)):  # an item's 503 or 504
                    again.append(index)
                    if isinstance(answer, DeviceBusy):
                        retry_after_s = max(retry_after_s or 0.0, answer.retry_after_s)
            if not again:
                return
            self.replicas.set_aside(tried[-1], retry_after_s=retry_after_s)
            if len(tried) > retries:
                return
            if not self.replicas.has_other(tried):  # no replica left to try: 503s only, after the wait
                again = [index for index in again if isinstance(answers[index], DeviceBusy)]
                delay_s = self.config.retries.delay_s(len(tried) - 1, retry_after_s)
                deadline = None if timeout_s is None else started + timeout_s
                if not again or (deadline is not None and self._clock() + delay_s + _MIN_ATTEMPT_S >= deadline):
                    return
                yield delay_s
            pending = again

    def compare_flow(
        self,
        call: Any,
        candidate: Any,
        standards: Any,
        return_grad_x: Any,
        timeout_s: Any,
        require_exact: Any = False,
    ) -> Flow[CompareResult]:
        """One comparison (``POST /v1/moe_init_routing_v2_grad/compare``, docs/accuracy.md)."""
        if not isinstance(require_exact, bool):
            raise TypeError(f"require_exact must be a bool, got {type(require_exact).__name__}")
        timeout_s = self.config.call_timeout_s(timeout_s)
        ready = (yield from self.prepared_flow([call], raise_refusals=True))[0]
        assert not isinstance(ready, MoegradError)  # raised above
        sendable, checked, unnamed = ready
        body = compare_body(sendable, checked, candidate, standards, return_grad_x)
        response = yield from self.exchange(
            "POST",
            COMPARE_PATH,
            accept=MSGPACK,
            timeout_s=timeout_s,
            retries=self.config.retries.count,
            reply_bytes=compare_reply_bytes(checked if checked is not None else sendable, return_grad_x is True),
            body=body,
        )
        result = parse_reply(response, checked, op="compare", return_grad_x=return_grad_x)
        assert isinstance(result, CompareResult)
        if unnamed:
            self.replicas.learn(result.server_url, result.order)
        if require_exact:  # the report states exactness either way; requiring it only changes the verdict
            result = dataclasses.replace(result, report=rejudge(result.report, require_exact=True))
        return result

    def explain_flow(self, call: Any, candidate: Any, timeout_s: Any) -> Flow[ExplainResult]:
        """One explanation (``POST /v1/moe_init_routing_v2_grad/explain``, docs/accuracy.md): msgpack,
        or frames when :meth:`frames_for` says so of the call (the reply is msgpack either way)."""
        timeout_s = self.config.call_timeout_s(timeout_s)
        ready = (yield from self.prepared_flow([call], raise_refusals=True))[0]
        assert not isinstance(ready, MoegradError)  # raised above
        sendable, checked, unnamed = ready
        document = explain_document(sendable, checked, candidate)
        frames = isinstance(sendable, MoeInitRoutingV2GradCall) and (yield from self.frames_for(sendable))
        try:
            body = encode_frames(document)[0] if frames else encode_body_view(document)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the explanation's request cannot be packed: {exc}") from None
        response = yield from self.exchange(
            "POST",
            EXPLAIN_PATH,
            accept=MSGPACK,
            timeout_s=timeout_s,
            retries=self.config.retries.count,
            reply_bytes=explain_reply_bytes(checked if checked is not None else sendable),
            body=body,
            content_type=FRAMES_MEDIA_TYPE if frames else MSGPACK,
        )
        result = parse_explain(response, sendable, checked)
        if unnamed:
            self.replicas.learn(result.server_url, result.order)
        return result

    def info_flow(self, replica: Replica | None = None, *, retries: int | None = None) -> Flow[dict[str, Any]]:
        """``GET /v1/info`` (of ``replica``, else of any): the service's JSON object, recorded as the
        answering replica's :class:`~moegrad.http._replicas.ServerInfo` (its profile, wire formats, limits)."""
        response = yield from self.exchange(
            "GET",
            INFO_PATH,
            accept=JSON,
            timeout_s=self.config.timeouts.call_s,
            retries=self.config.retries.count if retries is None else retries,
            reply_bytes=INFO_REPLY_BYTES,
            only=replica,
        )
        info = parse_json(response)
        self.replicas.learn_info(response.extensions.get(REPLICA_EXTENSION), info)
        return info

    def probe_flow(self, path: str) -> Flow[bool]:
        """A health probe: True on 2xx, False when unreachable, busy (503) or out of time; no retries."""
        try:
            yield from self.exchange(
                "GET", path, accept=JSON, timeout_s=self.config.timeouts.call_s, retries=0, reply_bytes=INFO_REPLY_BYTES
            )
        except (TransportError, DeviceBusy, DeadlineExceeded):
            return False
        return True
