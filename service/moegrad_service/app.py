"""``create_app(settings)``: the FastAPI app, its lifespan (backend + pool), routes and error table."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI

from moegrad import __version__
from moegrad_service.api import compare, health, v1, v2
from moegrad_service.api.auth import Authenticator
from moegrad_service.api.direct import DirectRoute, DirectRoutes, route_of
from moegrad_service.api.middleware import RequestLogMiddleware
from moegrad_service.api.problems import error_response, install_problem_handlers
from moegrad_service.engine import Backend, StreamPool, open_backend
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = ["create_app"]

log = logging.getLogger("moegrad_service")


def create_app(settings: Settings | None = None, *, backend: Backend | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: the configuration; ``Settings()`` (the environment) when None.
        backend: a backend to serve instead of the one ``settings.backend`` names (tests inject a
            slowed or faulty one); the app closes it on shutdown all the same.

    The lifespan opens the backend and a :class:`StreamPool` of ``settings.streams`` workers, yields
    them as request state (``settings``, ``pool``, ``metrics``, ``authenticator``) and, on shutdown,
    stops admitting, lets admitted calls finish (``shutdown_grace_s``) and closes the backend.
    ``app.state.drain()`` stops admitting at once (new calls get 503, readiness turns 503) while
    admitted calls finish; ``moegrad-service serve`` calls it when SIGTERM arrives.

    Raises:
        OSError: ``auth_tokens_file`` cannot be read.
    """
    settings = settings or Settings()
    metrics = Metrics()
    authenticate = Authenticator(settings)  # reads auth_tokens_file now: a bad path fails at startup

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict]:
        opened = backend if backend is not None else await asyncio.to_thread(open_backend, settings)
        pool = StreamPool(opened, streams=settings.streams, max_queue=settings.max_queue,
                          retry_after_s=settings.retry_after_s)
        await pool.start()
        app.state.drain = pool.stop_admitting  # called on SIGTERM, before uvicorn stops serving
        metrics.bind(lambda: pool.queue_depth, lambda: pool.in_flight)
        log.info("moegrad %s ready: backend=%s device=%s streams=%d", __version__, opened.name, opened.device,
                 settings.streams)
        try:
            yield {"settings": settings, "pool": pool, "metrics": metrics, "authenticator": authenticate}
        finally:
            await pool.close(grace_s=settings.shutdown_grace_s)
            log.info("moegrad stopped")

    app = FastAPI(
        title="moegrad",
        version=__version__,
        summary="aclnnMoeInitRoutingV2Grad (MoE routing backward) as a service",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    app.include_router(health.router)
    app.include_router(v1.router)
    app.include_router(compare.router)
    app.include_router(v2.router)
    app.add_middleware(DirectRoutes, routes=direct_routes())
    app.add_middleware(RequestLogMiddleware)
    return app


def direct_routes() -> dict[str, DirectRoute]:
    """The inference routes that :class:`DirectRoutes` serves, by exact path: v1's and v2's infer
    (the served model, unversioned and at its one version)."""
    grad = route_of(v1.router.routes, v1.GRAD_PATH)
    routes = {v1.GRAD_PATH: DirectRoute(grad, grad.endpoint, error_response, {})}
    for template, params in [("/v2/models/{model_name}/infer", {"model_name": v2.MODEL_NAME}),
                             ("/v2/models/{model_name}/versions/{model_version}/infer",
                              {"model_name": v2.MODEL_NAME, "model_version": v2.MODEL_VERSION})]:
        infer = route_of(v2.router.routes, template)
        routes[template.format(**params)] = DirectRoute(
            infer, partial(infer.endpoint, model_name=v2.MODEL_NAME),
            partial(v2.error_response, endpoint=infer.path), params)
    return routes
