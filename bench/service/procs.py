"""The processes a run measures: moegrad and PyTriton servers, and their CPU time and memory from /proc."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from support import launch
from support.launch import REFERENCE_FLAGS, ServerProcess, free_port

from .common import MODEL, OUT_DIR, ROOT

__all__ = ["cpu_s", "descendants", "idle_rss_mib", "moegrad_command", "moegrad_server", "pytriton_server",
           "reset_peak_rss", "status_kib"]


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (those still alive)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(pid)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status (VmRSS, VmHWM, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def moegrad_server(*, streams: int = 2, pythonpath: str | None = None) -> ServerProcess:
    """A moegrad server (reference backend, ``streams`` streams) on a free loopback port, ready.

    ``pythonpath``: run it from another source tree (its client/ and service/ first on PYTHONPATH).
    """
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([f"{pythonpath}/client", f"{pythonpath}/service"])
    return launch.moegrad_server(OUT_DIR / "logs", flags=(*REFERENCE_FLAGS, "--streams", str(streams)), env=env,
                                 cwd=ROOT)


def moegrad_command(streams: int = 2) -> str:
    return " ".join(["python -m moegrad_service serve --host 127.0.0.1 --port PORT", *REFERENCE_FLAGS,
                     "--streams", str(streams)])


def pytriton_server(venv: Any) -> ServerProcess:
    """The PyTriton peer on a free loopback port, ready."""
    port = free_port()
    argv = [str(venv.python), str(ROOT / "bench" / "pytriton_peer" / "server.py"), "--port", str(port),
            "--workspace", str(OUT_DIR / f"pytriton-workspace-{port}")]
    return ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=OUT_DIR / "logs" / f"pytriton-{port}.log",
                         ready_path=f"/v2/models/{MODEL}/ready", env=venv.env(), cwd=ROOT, ready_within_s=240.0,
                         name="pytriton").start()


def idle_rss_mib(pid: int) -> float:
    """The server's RSS (MiB) once it has been idle long enough to give up its kept receive buffers
    (receive_keep_s, the default, and a second and a half)."""
    from moegrad_service.settings import Settings

    time.sleep(Settings.model_fields["receive_keep_s"].default + 1.5)
    return status_kib(pid, "VmRSS") / 1024
