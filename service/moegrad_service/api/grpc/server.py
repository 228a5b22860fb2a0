"""Protocol v2 over gRPC, the server: a ``grpc.aio`` server in the service's own event loop.

:class:`GrpcServer` serves, on ``grpc_port``, the inference service (api/grpc/servicer.py) and the
standard health service ``grpc.health.v1.Health`` (grpcio-health-checking), with the HTTP side's
settings: the same bearer tokens (metadata ``authorization: Bearer <token>``, one interceptor before
every RPC, checked by the same :class:`~moegrad_service.api.auth.Authenticator` from the metadata,
before a byte of the message is read; a ModelInfer then runs in its token's turn, as an HTTP call
does), the same TLS certificate and key, and the same in-flight budget: every request message is
read only once the budget holds room for the largest message gRPC lets through, and a decoded
ModelInfer then holds what its call does (api/grpc/admission.py), and ``max_connections`` RPCs are
served at once (beyond it: RESOURCE_EXHAUSTED, before the message is read). The app's lifespan starts it after the pool
and stops it before the pool closes; :meth:`GrpcServer.drain` (on SIGTERM, with the HTTP side)
turns the health service NOT_SERVING while admitted calls finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2

from moegrad import DeviceBusy, MoegradError, Unauthorized
from moegrad_service.api.auth import Authenticator
from moegrad_service.api.grpc.admission import GRPC_MAX_MESSAGE_BYTES, LOOKAHEAD_BYTES, MessageGate, max_message_bytes
from moegrad_service.api.grpc.servicer import (
    SERVICE,
    InferenceServicer,
    authorization_of,
    grpc_status,
    method_handlers,
    parse_request,
)
from moegrad_service.dataplane import DataPlane
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = ["GRPC_MAX_MESSAGE_BYTES", "OPEN_METHODS", "GrpcServer"]

log = logging.getLogger("moegrad_service")
#: RPCs that grpc's core holds for the server before the server takes them (grpc/grpc
#: src/core/server/server.h: by default it drops some beyond 1,000 and all beyond 3,000, and the
#: client sees CANCELLED): as many as it can count, so that every RPC reaches the limit of
#: ``max_connections``, whose answer is RESOURCE_EXHAUSTED.
_PENDING_RPCS = 2**31 - 1
_HEALTH = "grpc.health.v1.Health"
#: Methods open without a token, each as the HTTP path of the same operation (OPEN_PATHS in api/auth.py):
#: liveness, readiness and the health service (which Kubernetes' gRPC probes call without one).
OPEN_METHODS = {
    f"/{SERVICE}/ServerLive": "/v2/health/live",
    f"/{SERVICE}/ServerReady": "/v2/health/ready",
    f"/{_HEALTH}/Check": "/v2/health/ready",
    f"/{_HEALTH}/Watch": "/v2/health/ready",
}
_STREAMING_RESPONSES = {f"/{SERVICE}/ModelStreamInfer", f"/{_HEALTH}/Watch"}


class _ReadinessHealth(health.aio.HealthServicer):
    """The standard health service whose ``Check`` of a SERVING service also asks the dataplane: it
    answers NOT_SERVING while the pool does not admit calls or the backend's health check fails."""

    def __init__(self, dataplane: DataPlane) -> None:
        super().__init__()
        self._dataplane = dataplane

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        answer = await super().Check(request, context)
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            try:
                await self._dataplane.check_ready()
            except DeviceBusy:
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return answer


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses an RPC without an accepted token with UNAUTHENTICATED before its handler runs."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        authorization = authorization_of(details.invocation_metadata)
        try:
            self._authenticator.check(OPEN_METHODS.get(details.method, details.method), authorization)
        except Unauthorized as exc:
            return _refusal(exc, details.method)
        return await continuation(details)


def _refusal(exc: BaseException, method: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``exc`` without reading the request message: request-streaming (its
    handler runs before the message is asked for; a unary call is one message on the wire either way)."""
    code, details, trailers = grpc_status(exc)

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(trailers)
        await context.abort(code, details)

    if method in _STREAMING_RESPONSES:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _health_handlers(servicer: _ReadinessHealth, gate: MessageGate) -> grpc.GenericRpcHandler:
    """The health service's two RPCs, their request read through ``gate`` like every other (the
    servicer of grpcio-health-checking behind them)."""
    request_type, reply = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse.SerializeToString

    async def receive(context: grpc.aio.ServicerContext) -> Any:
        raw, reservation = await gate.receive(context, time.perf_counter())
        try:
            return await parse_request(request_type, raw)
        finally:
            reservation.release()

    async def check(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = await receive(context)
        except MoegradError as exc:
            await _abort(context, exc)
        return await servicer.Check(request, context)

    async def watch(requests: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            request = await receive(context)
        except MoegradError as exc:
            await _abort(context, exc)
        await servicer.Watch(request, context)

    return grpc.method_handlers_generic_handler(
        _HEALTH,
        {
            "Check": grpc.stream_unary_rpc_method_handler(check, response_serializer=reply),
            "Watch": grpc.stream_stream_rpc_method_handler(watch, response_serializer=reply),
        },
    )


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    code, details, trailers = grpc_status(exc)
    context.set_trailing_metadata(trailers)
    await context.abort(code, details)
    raise AssertionError("context.abort raises")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcServer:
    """The started gRPC server (:meth:`start`), its bound ``port``, and its drain and stop."""

    def __init__(self, server: grpc.aio.Server, health_servicer: _ReadinessHealth, port: int) -> None:
        self._server = server
        self._health = health_servicer
        self._loop = asyncio.get_running_loop()
        self._draining: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task
        self.port = port

    @classmethod
    async def start(
        cls, settings: Settings, dataplane: DataPlane, metrics: Metrics, authenticator: Authenticator
    ) -> GrpcServer:
        """Bind ``settings.host``:``settings.grpc_port`` (0: a free port) and start serving.

        Raises:
            RuntimeError: the port cannot be bound (in use, or no such interface).
            OSError: the TLS certificate or key cannot be read.
        """
        assert settings.grpc_port is not None
        budget = dataplane.memory.budget
        limit = max_message_bytes(settings, budget)
        gate = MessageGate(
            budget, max_message_bytes=limit, timeout_s=settings.body_timeout_s, retry_after_s=settings.retry_after_s
        )
        server = grpc.aio.server(
            interceptors=[_TokenInterceptor(authenticator)] if authenticator.enabled else [],
            maximum_concurrent_rpcs=settings.max_connections,  # beyond it: RESOURCE_EXHAUSTED at once
            options=[
                ("grpc.max_receive_message_length", limit),  # longer: refused from its length prefix
                ("grpc.max_send_message_length", -1),
                ("grpc.http2.bdp_probe", 0),  # a stream's window stays LOOKAHEAD_BYTES until its message is read
                ("grpc.http2.lookahead_bytes", LOOKAHEAD_BYTES),
                ("grpc.server.max_pending_requests", _PENDING_RPCS),
                ("grpc.server.max_pending_requests_hard_limit", _PENDING_RPCS),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
            ],
        )
        server.add_generic_rpc_handlers((method_handlers(InferenceServicer(dataplane, metrics, gate, authenticator)),))
        health_servicer = _ReadinessHealth(dataplane)
        server.add_generic_rpc_handlers((_health_handlers(health_servicer, gate),))
        address = _address(settings.host, settings.grpc_port)
        if settings.tls_certfile is not None and settings.tls_keyfile is not None:
            credentials = grpc.ssl_server_credentials(
                [(settings.tls_keyfile.read_bytes(), settings.tls_certfile.read_bytes())]
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:  # older grpcio report a failed bind so
            raise RuntimeError(f"cannot bind the gRPC port {address}")
        await server.start()
        for service in ("", SERVICE):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "gRPC (%s) listening on %s", "TLS" if settings.tls_certfile else "plaintext", _address(settings.host, port)
        )
        return cls(server, health_servicer, port)

    def drain(self) -> None:
        """Turn every health status NOT_SERVING (callable from a signal handler); new calls are
        refused by the dataplane (UNAVAILABLE) while admitted ones finish."""

        def start_draining() -> None:
            if self._draining is None:
                self._draining = self._loop.create_task(self._health.enter_graceful_shutdown())

        self._loop.call_soon_threadsafe(start_draining)

    async def stop(self, grace_s: float) -> None:
        """Refuse new RPCs and let those in flight finish within ``grace_s`` seconds, then close."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
