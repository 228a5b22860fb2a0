"""Stopping long host work whose caller has gone: a :class:`threading.Event` looked at between blocks.

A service runs :func:`moegrad.compare` and :func:`moegrad.explain` on threads of its own and sets
their ``stop`` event once nobody wants the result (the client hung up, the deadline passed); the
work looks at it before each block of rows and gives up with DeadlineExceeded, freeing what it held.
"""

from __future__ import annotations

import threading

from moegrad._errors import DeadlineExceeded

__all__ = ["check_stop"]


def check_stop(stop: threading.Event | None, work: str = "the comparison") -> None:
    """Raise DeadlineExceeded when ``stop`` is set (None: never).

    Args:
        stop: the work's stop event, set from another thread.
        work: what is stopped, in words, for the message ("the comparison", "the explanation").

    Raises:
        DeadlineExceeded: ``stop`` is set.
    """
    if stop is not None and stop.is_set():
        raise DeadlineExceeded(f"{work} was stopped: its caller gave up on it")
