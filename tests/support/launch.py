"""Server processes for tests and benchmarks: start one on a free loopback port, wait until ready, stop it.

The one launcher that tests/e2e, tests/deploy and bench/ share. It imports only the standard
library and httpx (nothing of moegrad), so a test or benchmark that uses it loads nothing else.

- :class:`ServerProcess` runs any server command in its own process group, polls
  ``GET <url><ready_path>`` until it answers 200, and stops it with SIGTERM (then SIGKILL to the
  whole group, so nothing the server started outlives it). Use it as a context manager, or call
  :meth:`~ServerProcess.start` and :meth:`~ServerProcess.stop`.
- :func:`moegrad_server` starts ``moegrad-service serve`` (or a launcher that takes its flags) on
  127.0.0.1 (or another loopback address), with the caller's settings only: every inherited
  ``MOEGRAD_*`` variable is dropped. A port taken between choosing it and binding it is retried on
  a fresh port, unless the caller chose the port.
- :func:`stop_on_sigterm` makes SIGTERM unwind like Ctrl-C, so ``finally`` blocks stop the servers.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "LOOPBACK",
    "REFERENCE_FLAGS",
    "SERVE_COMMAND",
    "ServerNotReady",
    "ServerProcess",
    "free_port",
    "moegrad_server",
    "stop_on_sigterm",
]

LOOPBACK = "127.0.0.1"
#: ``moegrad-service serve``, run by the current interpreter (so a venv or PYTHONPATH carries over).
SERVE_COMMAND = (sys.executable, "-m", "moegrad_service", "serve")
#: The flags every test and benchmark server starts with: the NumPy backend, quiet logs.
REFERENCE_FLAGS = ("--backend", "reference", "--log-level", "warning")
_POLL_S = 0.05
_PORT_ATTEMPTS = 3


class ServerNotReady(RuntimeError):
    """The server exited, or did not answer its readiness route with 200 in time (the log's tail is in the text)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int | None = 40) -> str:
    """The last ``lines`` lines of a log file (None: all of it), or ``(no log)``."""
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace")
        return text if lines is None else "\n".join(text.splitlines()[-lines:])
    return "(no log)"


class ServerProcess:
    """A server subprocess, ready once ``GET url + ready_path`` answers 200.

    Args:
        argv: the command.
        url: the server's root URL (``http://127.0.0.1:PORT`` or ``https://...``).
        log_path: where its stdout and stderr go (the directory is created).
        ready_path: the readiness route.
        env: its whole environment (default: this process's).
        cwd: its working directory.
        ready_within_s: how long :meth:`start` waits for readiness, in seconds.
        stop_within_s: how long :meth:`stop` waits after SIGTERM before SIGKILL, in seconds.
        verify: TLS verification for the readiness poll (a CA bundle path for a test CA).
        name: what errors call it.
    """

    def __init__(self, argv: Sequence[str], *, url: str, log_path: Path, ready_path: str = "/health/ready",
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, ready_within_s: float = 60.0,
                 stop_within_s: float = 30.0, verify: bool | str = True, name: str = "server") -> None:
        self.argv, self.url, self.log_path, self.ready_path = list(argv), url, Path(log_path), ready_path
        self.env = dict(os.environ if env is None else env)
        self.cwd, self.ready_within_s, self.stop_within_s = cwd, ready_within_s, stop_within_s
        self.verify, self.name = verify, name
        self.process: subprocess.Popen | None = None
        self.startup_s = math.nan  #: seconds from start to the first 200 on the readiness route

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.name} is not started")
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def log(self, lines: int | None = 40) -> str:
        """The last ``lines`` lines of the server's log (None: all of it)."""
        return log_tail(self.log_path, lines)

    def start(self) -> ServerProcess:
        """Start the process and wait until it is ready.

        Raises:
            ServerNotReady: it exited first, or was not ready within ``ready_within_s`` (it is
                stopped before this is raised).
        """
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, cwd=self.cwd, start_new_session=True)
        verify = ssl.create_default_context(cafile=self.verify) if isinstance(self.verify, str) else self.verify
        try:
            with httpx.Client(timeout=2.0, verify=verify) as http:
                while time.monotonic() < started + self.ready_within_s:
                    if self.process.poll() is not None:
                        raise ServerNotReady(f"{self.name} exited with {self.process.returncode} before it was "
                                             f"ready; log {self.log_path}:\n{self.log()}")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(self.url + self.ready_path).status_code == 200:
                            self.startup_s = time.monotonic() - started
                            return self
                    time.sleep(_POLL_S)
            raise ServerNotReady(f"{self.name} was not ready at {self.url} within {self.ready_within_s:.0f} s; "
                                 f"log {self.log_path}:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> int | None:
        """SIGTERM, wait up to ``stop_within_s``, then SIGKILL; then clear its process group.

        Returns the exit code (negative: the signal that ended it), or None if it never started.
        """
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_within_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        _clear_group(process.pid)
        return process.returncode

    def __enter__(self) -> ServerProcess:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _clear_group(pgid: int) -> None:
    """Stop what is left in a process group (PyTriton's tritonserver, say): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):  # up to 5 s for the group to empty
            time.sleep(0.1)
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return


def moegrad_server(log_dir: Path, *, flags: Sequence[str] = REFERENCE_FLAGS,
                   settings: Mapping[str, object] | None = None, command: Sequence[str] = SERVE_COMMAND,
                   env: Mapping[str, str] | None = None, tls_ca: Path | None = None, cwd: Path | None = None,
                   ready_within_s: float = 60.0, stop_within_s: float = 30.0, name: str = "moegrad",
                   host: str = LOOPBACK, port: int | None = None) -> ServerProcess:
    """Start ``command --host HOST --port PORT *flags`` on a free port and wait until it is ready.

    Args:
        log_dir: where ``<name>-<port>.log`` is written.
        flags: the serve flags after host and port.
        settings: further settings as ``MOEGRAD_<NAME>`` environment variables (``max_body_bytes=4096``);
            ``shutdown_drain_s`` is 0 unless given here or in ``flags``.
        command: the command before the flags (a test launcher that forwards them, say).
        env: the base environment (default: this process's); its ``MOEGRAD_*`` variables are dropped.
        tls_ca: the CA bundle that signed the server's certificate: the URL is then ``https://``.
        host: the address to bind and call: 127.0.0.1, or any 127.x.y.z (on Linux all of
            127.0.0.0/8 is loopback), so that servers on several addresses share one port.
        port: the port; None: a free one.

    Returns the started server; the caller stops it (``with`` or :meth:`ServerProcess.stop`).

    Raises:
        ServerNotReady: as :meth:`ServerProcess.start`, after the port attempts (one when ``port`` is given).
    """
    base = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("MOEGRAD_")}
    base["MOEGRAD_SHUTDOWN_DRAIN_S"] = "0"  # stopped at once (no load balancer to drain from), unless asked for
    base.update({f"MOEGRAD_{key.upper()}": str(value) for key, value in (settings or {}).items()})
    scheme = "https" if tls_ca else "http"
    attempts = _PORT_ATTEMPTS if port is None else 1
    for attempt in range(1, attempts + 1):
        bound = free_port(host) if port is None else port
        server = ServerProcess([*command, "--host", host, "--port", str(bound), *flags],
                               url=f"{scheme}://{host}:{bound}", log_path=Path(log_dir) / f"{name}-{bound}.log",
                               env=base, cwd=cwd, ready_within_s=ready_within_s, stop_within_s=stop_within_s,
                               verify=str(tls_ca) if tls_ca else True, name=name)
        try:
            return server.start()
        except ServerNotReady:
            if attempt == attempts or "address already in use" not in server.log().lower():
                raise  # not a port race: another port will not help
    raise AssertionError("unreachable")


def stop_on_sigterm() -> None:
    """Let SIGTERM (``timeout``, a CI runner) unwind like Ctrl-C, so ``finally`` blocks stop every
    server and load process that was started instead of leaving them running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
