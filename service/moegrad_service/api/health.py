"""Liveness, readiness and metrics. Live never touches the backend; ready needs a healthy one."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from moegrad import DeviceBusy, DeviceFault
from moegrad_service.api.auth import AuthenticatedRoute
from moegrad_service.api.inputs import metrics_of, pool_of
from moegrad_service.engine import StreamPool

__all__ = ["router"]

router = APIRouter(route_class=AuthenticatedRoute)
#: Longest a readiness probe waits for the backend's health check, in seconds.
HEALTH_CHECK_TIMEOUT_S = 5.0


@router.get("/health/live", summary="The process is up (never touches the device)")
async def live() -> dict[str, str]:
    return {"status": "live"}


@router.get("/health/ready", summary="The backend is healthy and the pool admits calls",
            responses={503: {"description": "not ready (problem+json)"}})
async def ready(request: Request) -> dict[str, str | None]:
    pool = pool_of(request)
    await check_ready(pool)
    return {"status": "ready", "backend": pool.backend.name, "device": pool.backend.device}


async def check_ready(pool: StreamPool) -> None:
    """Return when the pool admits calls and the backend's health check passes.

    Raises:
        DeviceBusy: (503) not admitting, the check failed, or it took over HEALTH_CHECK_TIMEOUT_S.
    """
    if not pool.ready:
        raise DeviceBusy("the service is starting or shutting down", retry_after_s=pool.retry_after_s)
    try:
        await asyncio.wait_for(run_in_threadpool(pool.backend.check_health), HEALTH_CHECK_TIMEOUT_S)
    except TimeoutError:
        raise DeviceBusy(f"the backend's health check took over {HEALTH_CHECK_TIMEOUT_S} s",
                         retry_after_s=pool.retry_after_s) from None
    except DeviceFault as exc:
        raise DeviceBusy(f"the backend is unhealthy: {exc}", retry_after_s=pool.retry_after_s) from None


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(metrics_of(request).registry), media_type=CONTENT_TYPE_LATEST)
