"""Client: call a moegrad service over HTTP (wire protocol v1, docs/protocol.md), blocking.

Client and :class:`~moegrad.AsyncClient` (:mod:`moegrad.http._async_client`, the same methods
awaited) are thin shells over one sans-I/O core (:class:`~moegrad.http._core.ClientCore`), with what
they share in :mod:`moegrad.http._client_base`: each method asks the core for a *flow* and drives
it, and ``_drive`` is the same dozen lines in each client, differing by ``await``. What is built where:

- configuration, checked before any I/O: :mod:`moegrad.http._config`;
- requests: their documents and bodies, :mod:`moegrad.http._documents`; each attempt's headers,
  URL and timeouts, :mod:`moegrad.http._requests`; the check of a call that names no profile,
  :mod:`moegrad.http._unnamed`;
- replies (one parser for every endpoint): :mod:`moegrad.http._replies`;
- each HTTP status and network failure -> the exception raised: :mod:`moegrad.http._status`, whose
  docstring holds the table (the exception tree is drawn in ``moegrad._errors``);
- the flows, the retries and the deadline: :mod:`moegrad.http._core`;
- the default transports and the frames readers: :mod:`moegrad.http._transport` (a frames reply's
  tensors are copied once, into arrays of their own; the sync client receives a large one's
  straight from the socket);
- the bounds of a reply: the call's deadline over every wait (:mod:`moegrad.http._deadline`), at most
  the bytes the call can produce (:mod:`moegrad.http._reply_bounds`);
- the replicas, the choice of each attempt's and what each served: :mod:`moegrad.http._replicas`;
- many case files judged in batches over every replica, and their results file
  (:meth:`Client.compare_many`): the sweep adapter, :mod:`moegrad.http._accuracy` (the one module
  of the client that imports :mod:`moegrad.accuracy`).

Misuse (a wrong type, a negative count) raises ``TypeError`` / ``ValueError`` before any I/O; a call
that breaks a documented constraint raises ``InvalidArgument`` before it is sent (``validate=True``;
one that names no profile may first ask the replicas' ``/v1/info``: docs/protocol.md, "Errors").
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import httpx
import numpy as np

from moegrad._errors import MoegradError
from moegrad._tensors import to_numpy, to_torch
from moegrad.http._accuracy import (
    CaseResult,
    SentCall,
    SweepFile,
    compare_batch_on,
    compare_cases,
    explaining_batch,
    sweep,
)
from moegrad.http._answers import CompareResult, ExplainResult, GradResult
from moegrad.http._client_base import LIVE_PATH, READY_PATH, ClientBase, T
from moegrad.http._config import CLIENT_DOC, USE_CLIENT_DEFAULT, _UseClientDefault
from moegrad.http._core import Flow
from moegrad.http._deadline import attempt_deadline
from moegrad.http._documents import BatchCompare, batch_compares, compare_call, grad_call
from moegrad.http._replicas import Resolve
from moegrad.http._replies import frames_reader
from moegrad.http._reply_bounds import bound_reply
from moegrad.http._transport import PerReplica, http_transport, read_frames
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["USE_CLIENT_DEFAULT", "Client"]


class Client(ClientBase):
    __doc__ = CLIENT_DOC.format(kind="A blocking", transport="BaseTransport")

    def __init__(
        self,
        base_url: str | httpx.URL | Sequence[str | httpx.URL] = "http://127.0.0.1:8000",
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
        verify = self._verify
        self._http = PerReplica(
            lambda: httpx.Client(transport=http_transport(verify)),
            None if transport is None else httpx.Client(transport=transport),
            () if self._core.config.dns else self._core.config.replicas,
        )

    def _drive(self, flow: Flow[T]) -> T:
        outcome: Any = None
        with contextlib.closing(flow):  # an interrupted call gives its replica back (the flow's finally)
            while True:
                try:
                    step = flow.send(outcome)
                except StopIteration as stop:
                    return stop.value
                if isinstance(step, httpx.Request):
                    try:
                        with attempt_deadline(step):  # every wait of the attempt ends by the call's deadline
                            outcome = self._http(step.url).send(step, stream=True)
                            try:
                                bound_reply(outcome)  # at most what the call can produce is read
                                reader = frames_reader(outcome)
                                if reader is None:
                                    outcome.read()
                                else:
                                    read_frames(outcome, reader)
                            finally:
                                outcome.close()
                    except httpx.HTTPError as exc:
                        outcome = exc
                elif isinstance(step, Resolve):
                    try:
                        outcome = socket.getaddrinfo(step.host, step.port, type=socket.SOCK_STREAM)
                    except OSError as exc:
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
            order: the device profile, a name of :data:`moegrad.ORDERS` (``"ascend950@9.0"``...);
                None: the server's (a device's own, else its ``MOEGRAD_ORDER``), and checked locally
                by it (docs/protocol.md, "Errors": asked of ``/v1/info`` when the call needs it).
            allow_duplicate_indices: accept repeated indices, which the documentation forbids.
            timeout_s: this call's deadline in seconds (None: none); not passed: the client's.

        Returns:
            grad_x, [N, H], the dtype of grad_expanded_x, a writable array owned by the caller; a
            ``torch.Tensor`` on grad_expanded_x's device when grad_expanded_x is one.

        Raises:
            InvalidArgument: a documented constraint is broken (161001 / 161002 / the profile's
                561002 or 561103), locally (``validate=True``) before the call is sent, or by the
                server's check: the same answer either way.
            MalformedRequest, PayloadTooLarge, Unauthorized, DeviceBusy, DeadlineExceeded,
            DeviceFault, ServiceError, TransportError: see the table in ``moegrad.http._status``.
        """
        x, idx, fields = to_numpy(grad_expanded_x), to_numpy(expanded_row_idx), (top_k, drop_pad_mode, active_num)
        call = grad_call(x, idx, *fields, order, allow_duplicate_indices, validate=self._core.config.validate)
        return to_torch(self._drive(self._core.grad_flow(call, timeout_s)).grad_x, grad_expanded_x)

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
                ``validate=True``, by the replicas' profile when it names none; sent as given).
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
                call (docs/accuracy.md, "Cost").

        Returns:
            A :class:`CompareResult`; ``.passed`` is False only when a standard failed.

        Raises:
            InvalidArgument: a documented constraint of the call (161001 / 161002 / 561002 or
                561103, as in :meth:`moe_init_routing_v2_grad`), a missing candidate (161001), a
                candidate of the wrong dtype or shape or an unknown standard (161002; fields
                ``"candidate"``, ``"standards"``): locally before it is sent when ``validate=True``,
                else from the server.
            TypeError: ``return_grad_x`` or ``require_exact`` is not a bool, the request cannot be
                packed, or a call is passed with other call arguments.
            MalformedRequest, PayloadTooLarge, Unauthorized, DeviceBusy, DeadlineExceeded,
            DeviceFault, ServiceError, TransportError: see the table in ``moegrad.http._status``.
        """
        fields = (grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices)
        call = compare_call(*fields, validate=self._core.config.validate)
        return self._drive(self._core.compare_flow(call, candidate, standards, return_grad_x, timeout_s, require_exact))

    def explain(
        self,
        grad_expanded_x: np.ndarray | MoeInitRoutingV2GradCall,
        expanded_row_idx: np.ndarray | None = None,
        top_k: int | None = None,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        candidate: np.ndarray,
        order: str | None = None,
        allow_duplicate_indices: bool = False,
        timeout_s: float | _UseClientDefault | None = USE_CLIENT_DEFAULT,
    ) -> ExplainResult:
        """Explain each row of a candidate grad_x that differs from the service's device result.

        ``POST /v1/moe_init_routing_v2_grad/explain`` (docs/protocol.md): the service runs the call
        and answers :func:`moegrad.explain` of the candidate against its result (docs/accuracy.md,
        "Explaining a mismatch"). The call's arguments are :meth:`compare`'s; ``candidate``: [N, H]
        grad_x of the implementation under test, in the call's dtype (explain compares bits).

        Returns:
            An :class:`ExplainResult`: ``.explanation`` lists the rows that differ, each labelled.

        Raises:
            InvalidArgument: the call's constraints (as :meth:`moe_init_routing_v2_grad`), a missing
                candidate (161001), one of another dtype or shape (161002, field ``"candidate"``):
                before it is sent when ``validate=True``, else from the server.
            TypeError, MalformedRequest, PayloadTooLarge, Unauthorized, DeviceBusy, DeadlineExceeded,
            DeviceFault, ServiceError, TransportError: as :meth:`compare`.
        """
        fields = (grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices)
        call = compare_call(*fields, validate=self._core.config.validate)
        return self._drive(self._core.explain_flow(call, candidate, timeout_s))

    def compare_many(
        self,
        cases: Iterable[str | os.PathLike[str] | tuple[str, Mapping[str, Any], np.ndarray]],
        *,
        standards: Iterable[str] | str | None = None,
        require_exact: bool = False,
        order: str | None = None,
        progress: bool | None = None,
        on_result: Callable[[CaseResult], None] | None = None,
        concurrency: int | None = None,
        output: str | os.PathLike[str] | SweepFile | None = None,
        explain: bool = False,
        on_judged: Callable[[CaseResult, Mapping[str, Any], np.ndarray], None] | None = None,
    ) -> list[CaseResult]:
        """Judge many candidates over every replica, several requests at a time, and never stop on a bad one.

        docs/accuracy.md, "Bulk checking" and "Sweeps". The cases travel in batches; a batch whose
        replica fails is retried on another, so a sweep that loses a replica judges every case once.
        Before anything is sent, every replica is asked its profile (``GET /v1/info``'s ``order``).

        Args:
            cases: case files (``.npz``, :func:`moegrad.accuracy.save_case`) or
                ``(name, fields, candidate)`` tuples, ``fields`` the call's keyword arguments.
            standards, require_exact: as :meth:`compare`, for every case.
            order: the device profile of the cases that name none; None: their replica's own, checked
                locally by it (the replicas must then run one profile).
            progress: a progress line on stderr (cases done/total, cases/s, failed, invalid, errors); None:
                when stderr is a terminal.
            on_result: called with each :class:`~moegrad.accuracy.CaseResult` as it is known, one at
                a time, from the sweep's threads.
            concurrency: requests in flight at once; default 2 per replica named, at least 4.
            output: a results file (JSON lines, docs/accuracy.md "Sweeps"): each judged case is
                written as it is known, and a case already in it with the same name and file digest
                is skipped, its recorded result returned (``output.skipped`` counts them when
                ``output`` is a :class:`~moegrad.accuracy.SweepFile`).
            explain: also explain each case whose candidate is not bit-exact, in this process
                against the emulation of the profile that judged it, and record the label counts in
                its report (:attr:`~moegrad.ComparisonReport.explained`; docs/accuracy.md, "Sweeps").
            on_judged: called as ``on_judged(result, fields, candidate)`` after ``on_result`` for each
                case judged, with its inputs as read (:func:`moegrad.accuracy.compare_cases`): work
                that needs them again reads no file twice.

        Returns:
            One :class:`~moegrad.accuracy.CaseResult` per case, in the order given; each report
            carries its :class:`~moegrad.accuracy.ReportContext` (the inputs' SHA-256, the replica
            that answered, the profile that judged it, the time). A file that cannot be read or a
            call the operator rejects is ``"invalid"``; a service failure is ``"error"`` (not
            written to ``output``, so a later run judges it); neither stops the run.
            :func:`moegrad.accuracy.write_summary` writes them real failures first.

        Raises:
            KeyboardInterrupt: the sweep was interrupted; the cases written to ``output`` are whole.
            ProfilesDiffer (a ValueError): the replicas' profiles differ, ``order`` is None and a
                case names none (nothing was sent; the message names each replica's profile).
            SweepFileBusy, SweepFileError, OSError: ``output`` cannot be used.
        """

        def send(pairs: list[tuple[SentCall, np.ndarray]]) -> list[CompareResult | MoegradError]:
            return cast(list[CompareResult | MoegradError], self.batch(batch_compares(pairs, standards)))

        judged = compare_batch_on(send, require_exact=require_exact, server_url=str(self.base_url), order=order)
        judged = explaining_batch(judged) if explain else judged
        items, orders = list(cases), self._drive(self._core.replica_orders_flow())
        replicas = len(self._core.config.replicas)
        with sweep(items, orders, order, replicas, standards, require_exact, output, concurrency) as options:
            return compare_cases(
                compare_batch=judged, progress=progress, on_result=on_result, on_judged=on_judged, **options
            )

    def info(self) -> dict[str, Any]:
        """``GET /v1/info`` of every replica: the first answer (version, backend, device, order, streams,
        max_queue, the limits) plus ``orders``, each replica's root URL -> its ``order`` (None: no
        answer; two profiles: the replicas differ). Raises the first error when none answers."""
        return self._drive(self._core.replicas_info_flow())

    def ready(self) -> bool:
        """``GET /health/ready``: False when unreachable, not ready (503) or too slow; no retries."""
        return self._drive(self._core.probe_flow(READY_PATH))

    def live(self) -> bool:
        """``GET /health/live``: False when unreachable, 503 or too slow; no retries."""
        return self._drive(self._core.probe_flow(LIVE_PATH))

    def close(self) -> None:
        """Close the connection pools (and the transport)."""
        for http in self._http.clients():
            http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
