"""A call's deadline down at the network: every wait of an attempt ends by it, not only each one read.

httpx's timeouts bound each network operation (one connect, one read, one write), so a server that sends
a byte a little faster than the read timeout keeps a call going for ever. The drivers
(:mod:`moegrad.http._client`, :mod:`moegrad.http._async_client`) run each attempt inside
:func:`attempt_deadline`, which sets the attempt's deadline (the seconds the core left the call,
:data:`REMAINING_EXTENSION`, from now) in a context variable; the network streams of the client's own
transport (:mod:`moegrad.http._transport`) take :func:`time_left` as each operation's timeout, and the
reply readers (:mod:`moegrad.http._reply_bounds`) check it between chunks. A context variable is per
thread and per asyncio task, so one code path serves the sync and the async client, and concurrent calls
never see each other's deadline.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

import httpx

__all__ = ["REMAINING_EXTENSION", "attempt_deadline", "check_deadline", "time_left"]

#: The httpx request extension the core puts an attempt's seconds left under (None: no deadline).
REMAINING_EXTENSION = "moegrad.remaining_s"

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("moegrad_deadline", default=None)


@contextlib.contextmanager
def attempt_deadline(request: httpx.Request) -> Iterator[None]:
    """Within the block, :func:`time_left` counts down to ``request``'s deadline: its
    :data:`REMAINING_EXTENSION` seconds (monotonic clock) from now; no deadline without one."""
    remaining_s = request.extensions.get(REMAINING_EXTENSION)
    token = _DEADLINE.set(None if remaining_s is None else time.monotonic() + remaining_s)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def time_left(timeout_s: float | None) -> float | None:
    """``timeout_s`` (one network operation's timeout, None: none) cut to what is left of the
    attempt's deadline; 0.0 once it has passed (the caller raises its timeout then)."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout_s
    left = max(0.0, deadline - time.monotonic())
    return left if timeout_s is None else min(timeout_s, left)


def check_deadline(request: httpx.Request) -> None:
    """Raise when the attempt's deadline has passed (between two chunks of a reply).

    Raises:
        httpx.ReadTimeout: it has passed.
    """
    if time_left(None) == 0.0:
        raise httpx.ReadTimeout("the call's deadline passed while its reply was arriving", request=request)
