"""Service configuration: the only module that reads the environment (prefix ``MOEGRAD_``).

Every field can be set as ``MOEGRAD_<NAME>`` (``MOEGRAD_STREAMS=4``), as a ``moegrad-service serve``
flag (``--streams 4``), or passed to ``Settings(...)`` directly (tests do). Constraints fail at
startup, not at the first request. Each field's description (below) is also its ``--help`` text.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from moegrad.numerics import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad.operator import ALIASES, DEFAULT_PROFILE, PROFILES, resolve_profile

__all__ = ["Settings"]


class Settings(BaseSettings):
    """moegrad service settings (see each field's description; units are in the names)."""

    model_config = SettingsConfigDict(env_prefix="MOEGRAD_", extra="ignore")

    host: str = Field("127.0.0.1", description="interface to bind (0.0.0.0 in a container)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="TCP port of protocol v2 over gRPC (on host, with the same tokens and TLS); "
        "unset: no gRPC; 0: a free port",
    )
    backend: Literal["auto", "reference", "ascend"] = Field(
        "auto", description="auto: ascend when CANN and a device are present, else reference (the NumPy emulation)"
    )
    device_id: int = Field(0, ge=0, description="the NPU to use, an index among ASCEND_RT_VISIBLE_DEVICES")
    streams: int = Field(2, ge=1, le=64, description="worker threads, each owning one device stream (or CPU slot)")
    express_max_adds: int = Field(
        1 << 20,
        ge=0,
        description="calls of at most this many adds (N*K*H, or grad_expanded_x's elements when more; all of a "
        "batch's calls together) may also run on one more worker kept for them, so that a small call never waits "
        "behind large ones; 0: no such worker",
    )
    max_queue: int = Field(
        64,
        ge=1,
        description="calls waiting for a worker beyond which new calls get 503; with bearer tokens, each "
        "token's own calls (the queue is shared out fairly between tokens)",
    )
    judge_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="threads that judge comparisons (compare, batch compare items): the judging waits "
        "for one in a queue of its own, shared out fairly between tokens",
    )
    max_body_bytes: int = Field(
        2 << 30, ge=1024, description="largest request body in bytes, checked before it is read"
    )
    grpc_max_message_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest gRPC message in bytes, refused by gRPC from its length prefix before it is read; "
        "each message being read reserves 4 times this of max_inflight_bytes, its size being unknown until "
        "it is read (default: the smallest of max_body_bytes, 2 GiB - 1 and a sixteenth of the seven eighths "
        "of max_inflight_bytes that one call may take: four reads of the largest message fit at once)",
    )
    max_elements: int = Field(1 << 31, ge=1, description="largest element count of one tensor")
    max_inflight_bytes: int = Field(
        default_factory=lambda: memory_limit_bytes() // 4,
        ge=1024,
        description="bytes that admitted requests may hold at once (being read, queued, running or answered): "
        "twice each body's size before it is read (five times a batch's), then what its decoded shapes hold "
        "(a comparison's per-row sums, every grad_x, a batch's items); a request that does not fit now is "
        "answered 503 + Retry-After "
        "(default: a quarter of the memory limit, the container's (cgroup v2 or v1) or the machine's)",
    )
    receive_keep_s: float = Field(
        10.0,
        ge=0,
        description="how long the buffer a large body (1 MiB or more) was read into is kept, unused, for "
        "the next body of its size, in seconds; kept buffers count against max_inflight_bytes and are "
        "given up when a request needs the room (0: never kept)",
    )
    idle_timeout_s: int = Field(
        5, ge=1, description="how long an idle keep-alive connection stays open, in whole seconds"
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="connections and requests served at once; beyond it new "
        "requests are answered 503 (uvicorn's limit_concurrency)",
    )
    max_header_bytes: int = Field(
        64 << 10,
        ge=1024,
        description="longest request head (request line and headers) in bytes; a longer one is answered 431",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest a request head may take to arrive, in "
        "seconds; then 408 (a connection that sends nothing "
        "is closed)",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="longest a request body may take to arrive, in seconds; then 408"
    )
    body_min_bytes_per_s: int = Field(
        128 << 10,
        ge=0,
        description="slowest pace a request body may arrive at, in bytes per second, once body_grace_s has "
        "passed: a body further behind than that is answered 408 and its reserved bytes given back, so a "
        "stalled upload cannot hold the in-flight budget until body_timeout_s (0: no floor)",
    )
    body_grace_s: float = Field(
        5.0,
        ge=0,
        description="how long a request body may take before body_min_bytes_per_s applies, in seconds",
    )
    request_timeout_s: float = Field(
        60.0, gt=0, description="longest a call may wait and run, in seconds; X-Request-Timeout may only shorten it"
    )
    order: str = Field(
        DEFAULT_PROFILE,
        description="device profile of calls that name none, on the reference backend (a device "
        "computes its own): "
        f"{', '.join(PROFILES)}; or an alias ({', '.join(f'{a} = {p}' for a, p in ALIASES.items())}), "
        "kept as the profile it names",
    )
    ascend950_ub_size_bytes: int = Field(
        UB_SIZE_BYTES,
        ge=32,
        description="unified-buffer size in bytes the reference backend's ascend950 profiles "
        "tile for (Ascend 950PR/950DT: 253952); it decides the order of adds",
    )
    ascend950_vector_core_count: int = Field(
        VECTOR_CORE_COUNT,
        ge=1,
        description="vector (AIV) core count the reference backend's ascend950 profiles "
        "tile for (Ascend 950PR/950DT: 64); it decides the order of adds",
    )
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After that a 503 advertises, in seconds")
    shutdown_grace_s: float = Field(30.0, ge=0, description="how long shutdown waits for admitted calls, in seconds")
    shutdown_drain_s: float = Field(
        5.0,
        ge=0,
        description="after SIGTERM, how long the server keeps its port open answering every new call "
        "503 + Connection: close (readiness 503) before it stops listening, in seconds",
    )
    auth_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="accepted bearer tokens, comma separated; none = no authentication"
    )
    auth_tokens_file: Path | None = Field(None, description="file with one accepted bearer token per line")
    metrics_public: bool = Field(False, description="serve /metrics without a token even when authentication is on")
    tls_certfile: Path | None = Field(None, description="PEM certificate; with tls_keyfile, serve HTTPS")
    tls_keyfile: Path | None = Field(None, description="PEM private key of tls_certfile")
    warm_up: bool = Field(
        True,
        description="compile the reference kernel before reporting ready (one to two minutes with a cold numba "
        "cache); off: the first call of each dtype waits for it instead",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    ascend_home_path: Path | None = Field(
        None,
        validation_alias=AliasChoices("ascend_home_path", "MOEGRAD_ASCEND_HOME_PATH", "ASCEND_HOME_PATH"),
        description="CANN install whose lib64 holds the libraries "
        "(default: CANN's ASCEND_HOME_PATH, else the loader path)",
    )

    @field_validator("auth_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            tokens = [token.strip() for token in value.split(",") if token.strip()]
            if value.strip() and not tokens:  # e.g. "," : configured, yet no token -> fail closed
                raise ValueError(
                    "auth_tokens is set but holds no token; give at least one, or unset it "
                    "to run without authentication"
                )
            return tokens
        return value

    @field_validator("order")
    @classmethod
    def _canonical_order(cls, value: str) -> str:
        return resolve_profile(value).name  # ValueError (listing the names) at startup

    @model_validator(mode="after")
    def _check_tls(self) -> Settings:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile must be set together")
        return self

    @model_validator(mode="after")
    def _check_grpc_port(self) -> Settings:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port and port must differ (both are {self.port})")
        return self


#: Where the kernel mounts the cgroup hierarchies (v2: one, unified; v1: one per controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup in each hierarchy (``hierarchy-ID:controllers:path`` lines).
PROC_CGROUP = Path("/proc/self/cgroup")


def memory_limit_bytes(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The memory this process may use, in bytes: the smallest memory limit of its cgroup and the
    cgroups above it, on cgroup v2 (``memory.max``) or v1 (``memory/memory.limit_in_bytes``),
    else the machine's physical memory (``os.sysconf``).

    A container sees its own cgroup at the root of the mount (a cgroup namespace, or Docker's
    bind-mount on v1); a process without one finds its cgroup's path in ``proc_cgroup`` and its
    limits below the mount, each ancestor's included. "max" (v2) and v1's "unlimited" (a huge
    number, 2^63 rounded down to a page) are no limit. Linux's cgroup-v2.rst and cgroup-v1/memory.rst
    (torvalds/linux, Documentation/admin-guide/cgroup-v2.rst, Documentation/admin-guide/cgroup-v1/memory.rst).

    Args:
        cgroup_root: where the hierarchies are mounted (a test passes a fake one).
        proc_cgroup: the file that lists this process's cgroups.
    """
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical]
    for hierarchy, file_name, path in _cgroup_memory_files(proc_cgroup):
        mount = cgroup_root / hierarchy if hierarchy else cgroup_root
        paths = [PurePosixPath("/")] if path is None else [*reversed(PurePosixPath(path).parents), PurePosixPath(path)]
        for each in paths:
            try:
                text = (mount / each.relative_to("/") / file_name).read_text().strip()
            except (OSError, ValueError):
                continue
            if text.isdigit():
                limits.append(int(text))
    return min(limits)


def _cgroup_memory_files(proc_cgroup: Path) -> list[tuple[str, str, str | None]]:
    """(hierarchy below the mount, limit file, this process's cgroup path or None) for v2 and v1:
    the mount's root always (a container's own cgroup), and the process's path where it names one."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    files: list[tuple[str, str, str | None]] = [("", "memory.max", None), ("memory", "memory.limit_in_bytes", None)]
    if paths.get("v2", "/") != "/":
        files.append(("", "memory.max", paths["v2"]))
    if paths.get("v1", "/") != "/":
        files.append(("memory", "memory.limit_in_bytes", paths["v1"]))
    return files
