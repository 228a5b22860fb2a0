"""Service configuration: the only module that reads the environment (prefix ``MOEGRAD_``).

Every field can be set as ``MOEGRAD_<NAME>`` (``MOEGRAD_STREAMS=4``), as a ``moegrad-service serve``
flag (``--streams 4``), or passed to ``Settings(...)`` directly (tests do). Constraints fail at
startup, not at the first request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """moegrad service settings.

    Attributes:
        host: interface to bind (``127.0.0.1``; ``0.0.0.0`` in a container).
        port: TCP port.
        backend: ``auto`` (ascend when CANN and a device are present, else reference),
            ``reference`` (the NumPy emulation) or ``ascend`` (fail at startup without a device).
        device_id: the NPU to use (an index among ``ASCEND_RT_VISIBLE_DEVICES``).
        streams: worker threads, each owning one device stream (or CPU slot).
        max_queue: calls admitted but not started before new ones get 503.
        max_body_bytes: the largest request body, in bytes (checked before reading it whole).
        max_elements: the largest element count of one tensor.
        request_timeout_s: the longest a call may wait and run, in seconds; a client's
            ``X-Request-Timeout`` header may only shorten it.
        order: the accumulation order used when a call names none.
        retry_after_s: the Retry-After a 503 advertises, in seconds.
        shutdown_grace_s: how long shutdown waits for admitted calls to finish, in seconds.
        auth_tokens: bearer tokens accepted (comma separated in the environment); empty = no auth.
        auth_tokens_file: a file with one token per line, read at startup.
        metrics_public: serve ``/metrics`` without a token even when auth is on.
        tls_certfile / tls_keyfile: PEM files; both set = HTTPS.
        log_level: uvicorn and moegrad log level.
        ascend_home_path: the CANN install whose ``lib64`` holds the libraries (``MOEGRAD_ASCEND_HOME_PATH``,
            else CANN's own ``ASCEND_HOME_PATH`` that ``set_env.sh`` exports); None = the loader path.
    """

    model_config = SettingsConfigDict(env_prefix="MOEGRAD_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    backend: Literal["auto", "reference", "ascend"] = "auto"
    device_id: int = Field(0, ge=0)
    streams: int = Field(2, ge=1, le=64)
    max_queue: int = Field(64, ge=0)
    max_body_bytes: int = Field(2 << 30, ge=1024)
    max_elements: int = Field(1 << 31, ge=1)
    request_timeout_s: float = Field(60.0, gt=0)
    order: Literal["ascend910b", "sequential"] = "ascend910b"
    retry_after_s: float = Field(1.0, ge=0)
    shutdown_grace_s: float = Field(30.0, ge=0)
    auth_tokens: list[SecretStr] = Field(default_factory=list)
    auth_tokens_file: Path | None = None
    metrics_public: bool = False
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    ascend_home_path: Path | None = Field(
        None, validation_alias=AliasChoices("MOEGRAD_ASCEND_HOME_PATH", "ASCEND_HOME_PATH")
    )

    @model_validator(mode="after")
    def _check_tls(self) -> Settings:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile must be set together")
        return self
