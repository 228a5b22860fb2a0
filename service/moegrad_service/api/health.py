"""Liveness, readiness and metrics. Live never touches the backend; ready needs a healthy one."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from moegrad import DeviceBusy, DeviceFault
from moegrad_service.api.deps import MetricsDep, PoolDep

__all__ = ["router"]

router = APIRouter()
#: Longest a readiness probe waits for the backend's health check, in seconds.
HEALTH_CHECK_TIMEOUT_S = 5.0


@router.get("/health/live", summary="The process is up (never touches the device)")
async def live() -> dict[str, str]:
    return {"status": "live"}


@router.get("/health/ready", summary="The backend is healthy and the pool admits calls",
            responses={503: {"description": "not ready (problem+json)"}})
async def ready(pool: PoolDep) -> dict[str, str | None]:
    if not pool.ready:
        raise DeviceBusy("the service is starting or shutting down", retry_after_s=pool.retry_after_s)
    try:
        await asyncio.wait_for(run_in_threadpool(pool.backend.check_health), HEALTH_CHECK_TIMEOUT_S)
    except TimeoutError:
        raise DeviceBusy(f"the backend's health check took over {HEALTH_CHECK_TIMEOUT_S} s",
                         retry_after_s=pool.retry_after_s) from None
    except DeviceFault as exc:
        raise DeviceBusy(f"the backend is unhealthy: {exc}", retry_after_s=pool.retry_after_s) from None
    return {"status": "ready", "backend": pool.backend.name, "device": pool.backend.device}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
