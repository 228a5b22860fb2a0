"""One attack's outcome and its judgement against the five rules (support.attacks), and the helpers
every attack runs through: :func:`watched` around the attack, :func:`tally` of its answers.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..launch import ServerProcess
from .probes import Probes, p99, reset_peak, rss_bytes
from .wire import MIB, Answer

__all__ = ["ATTACKER_NICE", "LIVE_P99_S", "RSS_MARGIN_BYTES", "VALID_WITHIN_S", "Outcome", "parallel", "summary",
           "tally", "watched"]

LIVE_P99_S = 0.100
VALID_WITHIN_S = 1.0
RSS_MARGIN_BYTES = 256 * MIB


@dataclass
class Outcome:
    """One attack's figure and its judgement against the five rules (module docstring)."""

    name: str
    item: int
    before: str
    now: str = ""
    statuses: Counter = field(default_factory=Counter)
    resets: int = 0
    live_p99_s: float = float("nan")
    valid_max_s: float = float("nan")
    valid_failures: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    rss_limit_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    probe_may_get_503: bool = False
    figures: dict[str, float] = field(default_factory=dict)  #: the figure's numbers, by name (seconds, MiB)
    probed: bool = True  #: False where the probes do not apply (no server, or one going away)

    def judge(self) -> None:
        if not self.live_p99_s <= LIVE_P99_S:
            self.problems.append(f"/health/live p99 {self.live_p99_s * 1e3:.0f} ms > {LIVE_P99_S * 1e3:.0f} ms")
        failures = [f for f in self.valid_failures if not (self.probe_may_get_503 and f in ("503", "live 503"))]
        if failures:
            self.problems.append(f"example call failed: {Counter(failures).most_common(3)}")
        if not self.valid_max_s <= VALID_WITHIN_S and not (self.probe_may_get_503 and self.valid_failures):
            self.problems.append(f"example call took {self.valid_max_s:.2f} s > {VALID_WITHIN_S} s")
        if self.peak_rss_bytes > self.rss_limit_bytes:
            self.problems.append(f"peak RSS {self.peak_rss_bytes / MIB:.0f} MiB > {self.rss_limit_bytes / MIB:.0f} MiB")
        bad = {s: n for s, n in self.statuses.items() if isinstance(s, int) and s >= 500 and s not in (503, 504)}
        if bad:
            self.problems.append(f"5xx answers: {bad}")
        if self.resets:
            self.problems.append(f"{self.resets} requests reset or closed unanswered")

    @property
    def passed(self) -> bool:
        return not self.problems

    def row(self) -> str:
        watched = (f"; live p99 {self.live_p99_s * 1e3:.0f} ms, call max {self.valid_max_s:.2f} s, peak RSS "
                   f"{self.peak_rss_bytes / MIB:.0f} MiB") if self.probed else ""
        return (f"| {self.item} | {self.name} | {self.before} | {self.now}{watched} "
                f"| {'pass' if self.passed else 'FAIL: ' + '; '.join(self.problems)} |")


def tally(outcome: Outcome, answers: list[Answer], *, closed_is_fine: bool = False) -> Counter:
    """Count the answers' statuses into ``outcome`` (resets and unanswered closes as resets)."""
    for answer in answers:
        if answer.status is not None:
            outcome.statuses[answer.status] += 1
        elif answer.error == "closed" and closed_is_fine:
            outcome.statuses["closed"] += 1
        elif answer.error in ("reset", "closed"):
            outcome.resets += 1
            outcome.statuses[answer.error] += 1
        else:
            outcome.statuses[answer.error] += 1
    return outcome.statuses


@contextlib.contextmanager
def watched(server: ServerProcess, probes: Probes, outcome: Outcome, budget_bytes: int) -> Iterator[None]:
    """Run the block as an attack: its probes' window, the peak RSS reset before and read after, then judged."""
    reset_peak(server.pid)
    outcome.rss_limit_bytes = budget_bytes + RSS_MARGIN_BYTES
    start = time.monotonic()
    time.sleep(0.1)
    yield
    time.sleep(0.2)
    live_s, live_failures, valid_s, valid_failures = probes.window(start, time.monotonic())
    outcome.live_p99_s, outcome.valid_max_s = p99(live_s), max(valid_s, default=float("nan"))
    outcome.valid_failures = valid_failures + [f"live {f}" for f in live_failures]
    outcome.peak_rss_bytes = rss_bytes(server.pid, "VmHWM")
    outcome.judge()


#: The attack's own sending threads run at this nice level: attacker, server and probes share this
#: machine's cores, and a remote attacker would not take the server's CPU to send.
ATTACKER_NICE = 10


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ATTACKER_NICE)  # this thread only (Linux)


def parallel(count: int, job: Callable[[int], Answer]) -> list[Answer]:
    """``job(0)`` .. ``job(count - 1)`` on up to 64 threads at :data:`ATTACKER_NICE`; their answers in order."""
    with ThreadPoolExecutor(min(count, 64), initializer=_lower_priority) as pool:
        return list(pool.map(job, range(count)))


def summary(statuses: Counter) -> str:
    """``"2x 200, 3x 503"``: the statuses, sorted by name."""
    return ", ".join(f"{n}x {s}" for s, n in sorted(statuses.items(), key=lambda kv: str(kv[0])))
