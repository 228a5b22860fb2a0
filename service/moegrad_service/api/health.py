"""Liveness, readiness and metrics. Live never touches the backend; ready needs a healthy one."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from moegrad_service.api.inputs import dataplane_of, metrics_of

__all__ = ["router"]

router = APIRouter()


@router.get("/health/live", summary="The process is up (never touches the device)")
async def live() -> dict[str, str]:
    return {"status": "live"}


@router.get(
    "/health/ready",
    summary="The backend is healthy and the pool admits calls",
    responses={503: {"description": "not ready (problem+json)"}},
)
async def ready(request: Request) -> dict[str, str | None]:
    dataplane = dataplane_of(request)
    await dataplane.check_ready()
    return {"status": "ready", "backend": dataplane.backend_name, "device": dataplane.device}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(metrics_of(request).registry), media_type=CONTENT_TYPE_LATEST)
