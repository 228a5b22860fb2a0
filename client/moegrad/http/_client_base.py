"""What :class:`~moegrad.Client` and :class:`~moegrad.AsyncClient` share: the configuration, checked
before any I/O (:mod:`moegrad.http._config`), the sans-I/O core whose flows each client drives
(:mod:`moegrad.http._core`), the replicas' counters and the health routes' paths.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from typing import TypeVar

import httpx

from moegrad.http._config import ClientConfig, ssl_verify
from moegrad.http._core import ClientCore
from moegrad.http._replicas import ReplicaStats

__all__ = ["LIVE_PATH", "READY_PATH", "ClientBase", "T"]

T = TypeVar("T")
READY_PATH, LIVE_PATH = "/health/ready", "/health/live"


class ClientBase:
    """What both clients share: the configuration and the core (a client builds its own transports)."""

    _ASYNC = False  # whether the httpx client under it is an httpx.AsyncClient

    def __init__(
        self,
        base_url: str | httpx.URL | Sequence[str | httpx.URL],
        *,
        timeout_s: float | None,
        connect_timeout_s: float | None,
        retries: int,
        token: str | None,
        verify: bool | str | os.PathLike[str] | ssl.SSLContext,
        validate: bool,
        headers: Mapping[str, str] | None,
        wire: str = "auto",
    ) -> None:
        config = ClientConfig.from_arguments(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retries=retries,
            token=token,
            validate=validate,
            headers=headers,
            wire=wire,
        )
        self._core = ClientCore(config, async_body=self._ASYNC)
        self._verify = ssl_verify(verify)

    @property
    def base_url(self) -> httpx.URL:
        """The service's root URL (of several replicas, the first; of a ``dns+`` URL, the name's)."""
        return self._core.config.base_url

    @property
    def stats(self) -> tuple[ReplicaStats, ...]:
        """Per replica, the calls it served, its failures, its calls in flight and until when it is set aside."""
        return self._core.replicas.stats()

    def __repr__(self) -> str:
        config = self._core.config
        urls = [str(url) for url in config.replicas]
        shown = f"dns+{config.base_url}" if config.dns else urls[0] if len(urls) == 1 else urls
        return f"{type(self).__name__}(base_url={shown!r})"
