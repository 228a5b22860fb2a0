"""AsyncClient: call a moegrad service over HTTP (wire protocol v1, docs/protocol.md) from asyncio.

The same methods as :class:`~moegrad.Client` (:mod:`moegrad.http._client`, whose docstring says what
is built where), each awaited: both drive the flows of one sans-I/O core
(:class:`~moegrad.http._core.ClientCore`), this one with httpx's ``AsyncClient`` and asyncio's
resolver and sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
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
    acompare_batch_on,
    acompare_cases,
    aexplaining_batch,
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
from moegrad.http._transport import PerReplica, aread_frames, async_http_transport
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["AsyncClient"]


class AsyncClient(ClientBase):
    __doc__ = CLIENT_DOC.format(kind="An asyncio", transport="AsyncBaseTransport")
    _ASYNC = True

    def __init__(
        self,
        base_url: str | httpx.URL | Sequence[str | httpx.URL] = "http://127.0.0.1:8000",
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
        verify = self._verify
        self._http = PerReplica(
            lambda: httpx.AsyncClient(transport=async_http_transport(verify)),
            None if transport is None else httpx.AsyncClient(transport=transport),
            () if self._core.config.dns else self._core.config.replicas,
        )

    async def _drive(self, flow: Flow[T]) -> T:
        outcome: Any = None
        with contextlib.closing(flow):  # a cancelled call gives its replica back (the flow's finally)
            while True:
                try:
                    step = flow.send(outcome)
                except StopIteration as stop:
                    return stop.value
                if isinstance(step, httpx.Request):
                    try:
                        with attempt_deadline(step):  # every wait of the attempt ends by the call's deadline
                            outcome = await self._http(step.url).send(step, stream=True)
                            try:
                                bound_reply(outcome)  # at most what the call can produce is read
                                reader = frames_reader(outcome)
                                if reader is None:
                                    await outcome.aread()
                                else:
                                    await aread_frames(outcome, reader)
                            finally:
                                await outcome.aclose()
                    except httpx.HTTPError as exc:
                        outcome = exc
                elif isinstance(step, Resolve):
                    try:
                        outcome = await asyncio.get_running_loop().getaddrinfo(
                            step.host, step.port, type=socket.SOCK_STREAM
                        )
                    except OSError as exc:
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
        x, idx, fields = to_numpy(grad_expanded_x), to_numpy(expanded_row_idx), (top_k, drop_pad_mode, active_num)
        call = grad_call(x, idx, *fields, order, allow_duplicate_indices, validate=self._core.config.validate)
        return to_torch((await self._drive(self._core.grad_flow(call, timeout_s))).grad_x, grad_expanded_x)

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
        fields = (grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices)
        call = compare_call(*fields, validate=self._core.config.validate)
        return await self._drive(
            self._core.compare_flow(call, candidate, standards, return_grad_x, timeout_s, require_exact)
        )

    async def explain(
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
        """As :meth:`Client.explain`, awaited."""
        fields = (grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices)
        call = compare_call(*fields, validate=self._core.config.validate)
        return await self._drive(self._core.explain_flow(call, candidate, timeout_s))

    async def compare_many(
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
        """As :meth:`Client.compare_many`, awaited: ``concurrency`` tasks send the batches (the cases
        are read in a thread); cancelled, the cases written to ``output`` are whole."""

        async def send(pairs: list[tuple[SentCall, np.ndarray]]) -> list[CompareResult | MoegradError]:
            return cast(list[CompareResult | MoegradError], await self.batch(batch_compares(pairs, standards)))

        judged = acompare_batch_on(send, require_exact=require_exact, server_url=str(self.base_url), order=order)
        judged = aexplaining_batch(judged) if explain else judged
        items, orders = list(cases), await self._drive(self._core.replica_orders_flow())
        replicas = len(self._core.config.replicas)
        with sweep(items, orders, order, replicas, standards, require_exact, output, concurrency) as options:
            return await acompare_cases(
                compare_batch=judged, progress=progress, on_result=on_result, on_judged=on_judged, **options
            )

    async def info(self) -> dict[str, Any]:
        """As :meth:`Client.info`, awaited."""
        return await self._drive(self._core.replicas_info_flow())

    async def ready(self) -> bool:
        """As :meth:`Client.ready`, awaited."""
        return await self._drive(self._core.probe_flow(READY_PATH))

    async def live(self) -> bool:
        """As :meth:`Client.live`, awaited."""
        return await self._drive(self._core.probe_flow(LIVE_PATH))

    async def aclose(self) -> None:
        """Close the connection pools (and the transport)."""
        for http in self._http.clients():
            await http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
