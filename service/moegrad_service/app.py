"""``create_app(settings)``: the FastAPI app, its lifespan (backend + pool), routes and error table."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI

from moegrad import __version__
from moegrad.accuracy import compare_cache, warm_up_compare
from moegrad_service.api import health, v1, v2
from moegrad_service.api.auth import Authenticator, AuthMiddleware
from moegrad_service.api.errors import install_error_handlers
from moegrad_service.api.middleware import RequestLogMiddleware
from moegrad_service.api.routing import openapi_with_endpoints
from moegrad_service.dataplane import DataPlane
from moegrad_service.engine import Backend, StreamPool, open_backend
from moegrad_service.engine.compiling import warm_up_logged
from moegrad_service.memory import Memory
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

if TYPE_CHECKING:
    from moegrad_service.api.grpc import GrpcServer

__all__ = ["create_app"]

log = logging.getLogger("moegrad_service")


def _drain(pool: StreamPool, grpc_server: GrpcServer | None) -> None:
    pool.stop_admitting()
    if grpc_server is not None:
        grpc_server.drain()


def _warm_up_compare() -> None:
    """Compile the accuracy comparison (or load it from numba's cache), saying when it starts and
    what numba's cache gave it."""
    waiting = "in the background: compiling takes up to 2 minutes, comparisons meanwhile wait for it"
    warm_up_logged(log, "the accuracy comparison", warm_up_compare, compare_cache, waiting=waiting)


def create_app(settings: Settings | None = None, *, backend: Backend | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: the configuration; ``Settings()`` (the environment) when None.
        backend: a backend to serve instead of the one ``settings.backend`` names (tests inject a
            slowed or faulty one); the app closes it on shutdown all the same.

    The lifespan opens the backend and a :class:`StreamPool` of ``settings.streams`` workers,
    builds the service's :class:`~moegrad_service.memory.Memory` (the in-flight budget of
    ``max_inflight_bytes``, the receive buffers kept ``receive_keep_s``, the heap trimmer) and the
    :class:`DataPlane` over both (with its judges: ``judge_workers`` threads), starts compiling the
    accuracy comparison in the background (:func:`moegrad.accuracy.warm_up_compare`, unless
    ``settings.warm_up`` or the backend's ``warm_up`` is False) so that the first comparison does
    not, yields them as request state (``settings``, ``dataplane``, ``metrics``) and, on shutdown,
    stops admitting, lets admitted calls finish (``shutdown_grace_s``), closes the backend and
    stops the judges.
    ``app.state.drain()`` stops admitting at once (new calls get 503, readiness turns 503) while
    admitted calls finish; ``moegrad-service serve`` calls it when SIGTERM arrives. With
    ``settings.grpc_port`` set, the lifespan also serves protocol v2 over gRPC on the same dataplane
    (:class:`moegrad_service.api.grpc.GrpcServer`, its bound port in ``app.state.grpc_port``): it
    drains with the HTTP side and stops, letting its calls in flight finish, before the pool closes.

    Raises:
        OSError: ``auth_tokens_file`` cannot be read.
    """
    settings = settings or Settings()
    metrics = Metrics()
    authenticate = Authenticator(settings)  # reads auth_tokens_file now: a bad path fails at startup

    app = FastAPI(
        title="moegrad",
        version=__version__,
        summary="aclnnMoeInitRoutingV2Grad (MoE routing backward) as a service",
        lifespan=partial(_lifespan, settings=settings, metrics=metrics, authenticate=authenticate, backend=backend),
    )
    install_error_handlers(app)
    # The tensor-carrying POST routes first (they are matched on every inference call), then the rest.
    app.router.routes[:0] = [*v1.routes, *v2.routes]
    for router in (health.router, v1.router, v2.router):
        app.include_router(router)
    app.openapi = openapi_with_endpoints(app)  # type: ignore[method-assign]
    app.add_middleware(AuthMiddleware, authenticator=authenticate)
    app.add_middleware(RequestLogMiddleware)
    return app


@asynccontextmanager
async def _lifespan(
    app: FastAPI, *, settings: Settings, metrics: Metrics, authenticate: Authenticator, backend: Backend | None
) -> AsyncIterator[dict]:
    """The app's lifespan (:func:`create_app`): the backend opened (``backend`` when given), its
    pool, the memory, the dataplane and the gRPC server started; the request state yielded; on
    shutdown, each stopped in turn."""
    opened = backend if backend is not None else await asyncio.to_thread(open_backend, settings)
    pool = StreamPool(
        opened,
        streams=settings.streams,
        max_queue=settings.max_queue,
        retry_after_s=settings.retry_after_s,
        express_max_adds=settings.express_max_adds,
    )
    await pool.start()
    if settings.warm_up and opened.warm_up:
        # in the background: readiness waits for the kernel, not for this (a cold numba cache
        # takes a while to compile it); a comparison arriving meanwhile waits for numba's lock
        threading.Thread(target=_warm_up_compare, name="moegrad-warm-up-compare", daemon=True).start()
    memory = Memory(
        settings.max_inflight_bytes,
        retry_after_s=settings.retry_after_s,
        keep_s=settings.receive_keep_s,
        loop=asyncio.get_running_loop(),
    )
    dataplane = DataPlane(settings, pool, metrics, memory)
    grpc_server = None
    if settings.grpc_port is not None:
        from moegrad_service.api.grpc import GrpcServer  # grpcio only when gRPC is on

        try:
            grpc_server = await GrpcServer.start(settings, dataplane, metrics, authenticate)
        except BaseException:
            await pool.close(grace_s=0)
            raise
        app.state.grpc_port = grpc_server.port
    app.state.drain = partial(_drain, pool, grpc_server)  # called on SIGTERM, before uvicorn stops serving
    metrics.bind(lambda: dataplane.queue_depth, lambda: dataplane.in_flight)
    metrics.bind_memory(lambda: memory.budget.held_bytes, lambda: memory.buffers.kept_bytes)
    log.info(
        "moegrad %s ready: backend=%s device=%s profile=%s streams=%d",
        __version__,
        opened.name,
        opened.device,
        opened.order
        or (f"{settings.order} (a call naming another gets it)" if opened.name == "reference" else "unknown"),
        settings.streams,
    )
    try:
        yield {"settings": settings, "dataplane": dataplane, "metrics": metrics}
    finally:
        if grpc_server is not None:  # gRPC calls in flight finish on the pool before it closes
            await grpc_server.stop(grace_s=settings.shutdown_grace_s)
        await pool.close(grace_s=settings.shutdown_grace_s)
        await dataplane.close()
        log.info("moegrad stopped")
