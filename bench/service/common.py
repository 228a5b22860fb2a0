"""What every part of the service benchmark shares: paths, run sizes (quick and full), statistics, progress."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONCURRENCY", "FULL", "MIB", "MODEL", "OUT_DIR", "QUICK", "ROOT", "Mode", "log", "ms", "percentile",
           "restart_clock", "verdict"]

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "bench" / "_out"
MODEL = "moe_init_routing_v2_grad"
CONCURRENCY = 16
MIB = float(1 << 20)


@dataclass(frozen=True)
class Mode:
    """How much of each measurement a run makes (quick: ``make bench``'s default)."""

    name: str
    s1_calls: int  # S1 calls with the sync Client (and as many GET /health/live, interleaved)...
    s1_max_s: float  # ... or fewer: blocks of 100 of each stop starting after this many seconds
    s1_rounds: int  # concurrency rounds: each server gets one window per round, in turn
    s1_window_s: float  # the measured window of one round, after a 0.5 s warm-up
    peer_s1_calls: int  # sequential S1 calls per v2 server with sync tritonclient...
    peer_s1_max_s: float  # ... or fewer: blocks of 50 stop starting after this many seconds
    s2_calls: int  # S2 calls per path (in-process, v1 Client, tritonclient x2, raw loopback)
    memory_s: float  # how long the memory run serves S2 again and again
    venv_limit_s: float  # how long building the PyTriton venv may take before the peer is skipped


QUICK = Mode("quick", s1_calls=1000, s1_max_s=12.0, s1_rounds=2, s1_window_s=2.5, peer_s1_calls=300,
             peer_s1_max_s=5.0, s2_calls=7, memory_s=15.0, venv_limit_s=150.0)
FULL = Mode("full", s1_calls=5000, s1_max_s=120.0, s1_rounds=5, s1_window_s=5.0, peer_s1_calls=1000,
            peer_s1_max_s=30.0, s2_calls=15, memory_s=60.0, venv_limit_s=900.0)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**pass**" if ok else "**MISS**")


_STARTED = time.monotonic()


def restart_clock() -> None:
    """Count :func:`log`'s seconds from now (a run's start)."""
    global _STARTED
    _STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress on stdout, with the seconds since this module was imported (or :func:`restart_clock`)."""
    print(f"bench.service [{time.monotonic() - _STARTED:5.0f} s]: {message}", flush=True)
