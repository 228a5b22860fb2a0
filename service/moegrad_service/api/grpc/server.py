"""Protocol v2 over gRPC, the server: a ``grpc.aio`` server in the service's own event loop.

:class:`GrpcServer` serves, on ``grpc_port``, the inference service (api/grpc/servicer.py) and the
standard health service ``grpc.health.v1.Health`` (grpcio-health-checking), with the HTTP side's
settings: the same bearer tokens (metadata ``authorization: Bearer <token>``, one interceptor before
every RPC, checked by the same :class:`~moegrad_service.api.auth.Authenticator`), the same TLS
certificate and key, ``max_body_bytes`` as the largest message it receives and ``max_connections``
as the most RPCs it serves at once. The app's lifespan
starts it after the pool and stops it before the pool closes; :meth:`GrpcServer.drain` (on SIGTERM,
with the HTTP side) turns the health service NOT_SERVING while admitted calls finish.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moegrad import DeviceBusy, Unauthorized
from moegrad_service.api.auth import Authenticator
from moegrad_service.api.grpc.servicer import SERVICE, InferenceServicer, grpc_status, method_handlers
from moegrad_service.dataplane import DataPlane
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = ["GRPC_MAX_MESSAGE_BYTES", "OPEN_METHODS", "GrpcServer"]

log = logging.getLogger("moegrad_service")
#: The largest message gRPC can take (its lengths are signed 32-bit); max_body_bytes is capped to it.
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
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
        authorization = next(
            (
                value
                for key, value in details.invocation_metadata or ()
                if key == "authorization" and isinstance(value, str)
            ),
            "",
        )
        try:
            self._authenticator.check(OPEN_METHODS.get(details.method, details.method), authorization)
        except Unauthorized as exc:
            return _refusal(exc, details.method)
        return await continuation(details)


def _refusal(exc: BaseException, method: str) -> grpc.RpcMethodHandler:
    code, details, trailers = grpc_status(exc)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(trailers)
        await context.abort(code, details)

    if method in _STREAMING_RESPONSES:
        return (
            grpc.stream_stream_rpc_method_handler(refuse)
            if "Stream" in method
            else grpc.unary_stream_rpc_method_handler(refuse)
        )
    return grpc.unary_unary_rpc_method_handler(refuse)


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
        limit = min(settings.max_body_bytes, GRPC_MAX_MESSAGE_BYTES)
        server = grpc.aio.server(
            interceptors=[_TokenInterceptor(authenticator)] if authenticator.enabled else [],
            maximum_concurrent_rpcs=settings.max_connections,  # beyond it: RESOURCE_EXHAUSTED at once
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
            ],  # a port in use is an error, not a second listener
        )
        server.add_generic_rpc_handlers((method_handlers(InferenceServicer(dataplane, metrics)),))
        health_servicer = _ReadinessHealth(dataplane)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
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
