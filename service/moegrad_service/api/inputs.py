"""What a handler reads from its request: the app's services, its media type, the deadline, the
client gone; and work moved off the event loop. The body is taken in by api/intake.py.

Plain functions that the handlers call, not FastAPI dependencies: FastAPI re-solves a route's whole
dependency graph on every request, which costs more server CPU than a small call's compute.

The app's lifespan puts ``settings``, ``dataplane`` and ``metrics`` in every request's state
(``create_app``); the accessors below only give them their types.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from moegrad import MalformedRequest, MoegradError
from moegrad_service.dataplane import DataPlane
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

__all__ = [
    "INLINE_DECODE_BYTES",
    "dataplane_of",
    "disconnected",
    "media_type_of",
    "metrics_of",
    "off_loop",
    "request_timeout",
    "settings_of",
]

T = TypeVar("T")


async def off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` on a worker thread (Starlette's ``run_in_threadpool``): decoding,
    validating and encoding that would otherwise hold the event loop.

    A MoegradError (the client's mistake) is raised again from here without the frames it came back
    through: anyio keeps the exception in a future that its own frame holds, so its traceback makes
    a reference cycle, which would keep the request's body and tensors alive until the garbage
    collector next runs (bench/RESULTS.md, "Attacks"). Any other exception is a bug and keeps its
    whole traceback for the log.
    """
    try:
        return await run_in_threadpool(function, *args, **kwargs)
    except MoegradError as exc:
        raise exc.with_traceback(None)  # noqa: B904 - the same exception, re-raised from here


#: Bodies larger than this are decoded and validated on a worker thread, not on the event loop.
INLINE_DECODE_BYTES = 1 << 20


def settings_of(request: Request) -> Settings:
    return request.state.settings


def dataplane_of(request: Request) -> DataPlane:
    return request.state.dataplane


async def disconnected(request: Request) -> None:
    """Return once the client has gone: for a handler whose body is already read, only
    ``http.disconnect`` is left to receive."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def metrics_of(request: Request) -> Metrics:
    return request.state.metrics


def media_type_of(request: Request) -> str:
    """The request's Content-Type without parameters, lower-cased ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def request_timeout(request: Request) -> float:
    """Seconds the call may take: ``X-Request-Timeout`` (seconds) capped by ``request_timeout_s``.

    Raises:
        MalformedRequest: (400) the header is not a positive, finite number.
    """
    settings = settings_of(request)
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return settings.request_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise MalformedRequest(
            f"X-Request-Timeout {raw!r} must be a positive number of seconds", field="X-Request-Timeout"
        )
    return min(value, settings.request_timeout_s)
