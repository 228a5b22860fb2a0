"""End-to-end fixtures: a real ``moegrad-service`` (uvicorn) in a subprocess on a free loopback port.

``server_url`` is one reference-backend server for the whole session; ``server_factory(**settings)``
starts further servers with custom settings (passed as ``MOEGRAD_<NAME>`` environment variables) and
stops them when the test ends. Servers are started by :func:`support.launch.moegrad_server`, the
launcher the benchmarks use too; a server that fails to start raises with the tail of its log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from support.launch import ServerProcess, moegrad_server

READY_WITHIN_S = 60.0  # startup budget: importing numpy/fastapi and binding, on a slow CI runner
STOP_WITHIN_S = 15.0


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The root URL of a reference-backend server shared by the session (default settings)."""
    with moegrad_server(tmp_path_factory.mktemp("moegrad-service"), ready_within_s=READY_WITHIN_S,
                        stop_within_s=STOP_WITHIN_S) as server:
        yield server.url


@pytest.fixture
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """``start(**settings) -> url``: a fresh server with the given settings (e.g. ``max_body_bytes=4096``)."""
    servers: list[ServerProcess] = []

    def start(**settings: object) -> str:
        server = moegrad_server(tmp_path_factory.mktemp("moegrad-service"), settings=settings,
                                ready_within_s=READY_WITHIN_S, stop_within_s=STOP_WITHIN_S)
        servers.append(server)
        return server.url

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
