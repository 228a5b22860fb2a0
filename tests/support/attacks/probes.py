"""The probes that watch an attacked server, and its memory as /proc reports it.

:class:`Probes` runs this module as a separate process (``python -m support.attacks.probes PORT
FILE MAX_S TOKEN``), so that the attack's own threads (and their GIL) do not slow the probes down:
``GET /health/live`` every 20 ms and the documentation's example call every 200 ms, each on a fresh
connection, each answer a line in FILE.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..launch import LOOPBACK
from .wire import Answer, example_call, exchange, request_head

__all__ = ["Probes", "p99", "probe_main", "reset_peak", "rss_bytes", "settled_rss"]

#: The folder that holds the ``support`` package (tests/): the probe process imports it from there.
_SUPPORT_ROOT = Path(__file__).resolve().parents[2]


def rss_bytes(pid: int, key: str = "VmRSS") -> int:
    """A ``kB`` line of /proc/<pid>/status (VmRSS, VmHWM, ...) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def settled_rss(pid: int, within_s: float = 5.0) -> int:
    """The process's RSS once it has stopped moving (by less than 1 MiB in 0.5 s), in bytes; the last
    reading when it is still moving after ``within_s`` seconds."""
    end, last = time.monotonic() + within_s, rss_bytes(pid)
    while time.monotonic() < end:
        time.sleep(0.5)
        now = rss_bytes(pid)
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh from the current RSS (Linux's clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Probes:
    """A probe process: GET /health/live every 20 ms and the example call every 200 ms, each on a fresh
    connection, each answer a line ``<monotonic time> live|valid <seconds> <status or error>`` in a file.

    A separate process, so that the attack's own threads (and their GIL) do not slow the probes
    down; :meth:`window` reads the lines between two ``time.monotonic()`` readings (one clock for
    every process on Linux). Stops at :meth:`stop` or after ``max_s`` seconds.
    """

    def __init__(self, port: int, log_dir: Path, *, max_s: float = 900.0, token: str = "") -> None:
        self.path = Path(log_dir) / f"probes-{port}.txt"
        pythonpath = os.pathsep.join(p for p in (str(_SUPPORT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "support.attacks.probes", str(port), str(self.path),
                                         str(max_s), token], env={**os.environ, "PYTHONPATH": pythonpath})
        end = time.monotonic() + 30
        while not (self.path.exists() and self.path.stat().st_size) and time.monotonic() < end:
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)

    def __enter__(self) -> Probes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def window(self, start: float, end: float) -> tuple[list[float], list[str], list[float], list[str]]:
        """(live latencies, live failures, call latencies, call failures) of the probes sent in [start, end]."""
        live_s, live_failures, valid_s, valid_failures = [], [], [], []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 4 or not start <= float(parts[0]) <= end:
                continue
            latency, status = float(parts[2]), parts[3]
            if parts[1] == "live":
                live_s.append(latency)
                if status != "200":
                    live_failures.append(status)
            else:
                valid_s.append(latency)
                if status != "200":
                    valid_failures.append(status)
        return live_s, live_failures, valid_s, valid_failures


def probe_main(port: int, path: Path, max_s: float, token: str) -> None:
    """The probe process: probe 127.0.0.1:``port`` until SIGTERM or ``max_s`` seconds, a line per answer in ``path``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    end = time.monotonic() + max_s
    with open(path, "a", buffering=1) as out:
        next_valid = 0.0
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                with socket.create_connection((LOOPBACK, port), timeout=5.0) as sock:
                    connected = time.monotonic()
                    answer = exchange(port, request_head("GET", "/health/live"), timeout_s=5.0, sock=sock)
                total = time.monotonic() - sent
            except OSError as exc:
                answer, total = Answer(None, error=type(exc).__name__), 5.0
                connected = sent
            out.write(f"{sent:.4f} live {total:.4f} {answer.status or answer.error} {connected - sent:.4f}\n")
            if sent >= next_valid:
                next_valid = sent + 0.2
                sent = time.monotonic()
                answer = example_call(port, token=token or None)
                out.write(f"{sent:.4f} valid {answer.elapsed_s:.4f} {answer.status or answer.error}\n")
            time.sleep(max(0.0, sent + 0.02 - time.monotonic()))


def p99(values: list[float]) -> float:
    """The 99th percentile (inclusive method); the one value of a list of one, NaN of none."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


if __name__ == "__main__":
    probe_main(int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
