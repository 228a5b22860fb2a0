"""End-to-end fixtures: a real ``moegrad-service`` (uvicorn) in a subprocess on a free loopback port.

``server_url`` is one reference-backend server for the whole session; ``server_factory(**settings)``
starts further servers with custom settings (passed as ``MOEGRAD_<NAME>`` environment variables) and
stops them when the test ends. Each server's log is written to a file whose tail is shown if it
fails to start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

READY_WITHIN_S = 60.0  # startup budget: importing numpy/fastapi and binding, on a slow CI runner
STOP_WITHIN_S = 15.0
_PORT_ATTEMPTS = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Server:
    """One ``python -m moegrad_service serve`` subprocess."""

    def __init__(self, log_dir: Path, settings: dict[str, object]) -> None:
        self.log_dir = log_dir
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.log_path = log_dir / "server.log"

    def start(self) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGRAD_")}  # only what the test asks for
        env.update({f"MOEGRAD_{name.upper()}": str(value) for name, value in self.settings.items()})
        for attempt in range(_PORT_ATTEMPTS):
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.log_path = self.log_dir / f"server-{port}.log"
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "moegrad_service", "serve", "--host", "127.0.0.1", "--port", str(port),
                     "--backend", "reference", "--log-level", "warning"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                )
            if self._wait_ready():
                return self.url
            self.stop()
            if "address already in use" not in _log_tail(self.log_path).lower():
                break  # not a port race: retrying will not help
        raise RuntimeError(f"moegrad-service did not become ready at {self.url} within {READY_WITHIN_S} s "
                           f"(attempts {attempt + 1}); log:\n{_log_tail(self.log_path)}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_WITHIN_S
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.url + "/health/ready").status_code == 200:
                        return True
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_WITHIN_S)


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The root URL of a reference-backend server shared by the session (default settings)."""
    server = _Server(tmp_path_factory.mktemp("moegrad-service"), {})
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """``start(**settings) -> url``: a fresh server with the given settings (e.g. ``max_body_bytes=4096``)."""
    servers: list[_Server] = []

    def start(**settings: object) -> str:
        server = _Server(tmp_path_factory.mktemp("moegrad-service"), settings)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
