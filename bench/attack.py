"""Attacks on a real ``moegrad-service``, each watched by probes: ``python -m bench.attack [--quick]``.

The attacks, their probes and the five rules each is judged on are the test-support package's
(tests/support/attacks: tests/e2e/test_attacks_e2e.py runs them at their quick size). This command
runs every one in turn -- on one server, then with authentication, then SIGTERM under load, then
the hung kernels of tests/ascend on the CANN simulator -- and prints a table row per attack.

``--quick`` runs each attack at a size for the tests; without it, at the size of the original
finding. Every loop is bounded in count and in time, and all traffic stays on the loopback interface.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from support.attacks import (
    ATTACK_SETTINGS,
    AUTH_TOKEN,
    SERVER_ATTACKS,
    Outcome,
    Probes,
    auth_fails_closed,
    auth_server,
    connection_cap,
    example_call,
    probe_main,
    sigterm_under_load,
    unauthenticated_probing,
)
from support.launch import moegrad_server

__all__ = ["hung_kernels", "main", "run_all"]


def hung_kernels() -> Outcome:
    """Item 7 runs on the CANN simulator in tests/ascend (it needs a C compiler to build)."""
    outcome = Outcome("hung kernels (ascend, on the simulator)", 7,
                      "1 stream, 4 hung: 100% of calls fail, ready 200; CANN calls after aclFinalize")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "client"), str(root / "service"),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/ascend/test_service.py", "-k", "lost_capacity or hung_kernel"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    outcome.live_p99_s = outcome.valid_max_s = 0.0
    outcome.probed = False
    if done.returncode != 0:
        outcome.problems.append(last)
    outcome.now = f"ready 503 and calls 503 with none left, ready again once they finish, 0 violations ({last})"
    return outcome


# --- the run ---------------------------------------------------------------------------------------------

def run_all(quick: bool, log_dir: Path, *, include_ascend: bool = True,
            report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Every attack in turn (``report`` is called with each outcome as it comes); the outcomes."""
    settings = dict(ATTACK_SETTINGS)
    budget = int(settings["max_inflight_bytes"])
    outcomes = []

    def done(outcome: Outcome) -> None:
        outcomes.append(outcome)
        report(outcome)

    with moegrad_server(log_dir, settings=settings, name="attack") as server, Probes(server.port, log_dir) as probes:
        example_call(server.port, timeout_s=120)  # compile the kernel before anything is timed
        for attack in SERVER_ATTACKS:
            done(attack(server, probes, quick, budget))
        done(connection_cap(server, probes, quick, budget, int(settings["max_connections"])))
    done(auth_fails_closed(log_dir))
    with auth_server(log_dir, settings) as server, Probes(server.port, log_dir, token=AUTH_TOKEN) as probes:
        example_call(server.port, timeout_s=120, token=AUTH_TOKEN)
        done(unauthenticated_probing(server, probes, quick, budget))
    done(sigterm_under_load(log_dir, quick, settings))
    if include_ascend:
        done(hung_kernels())
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' sizes instead of the original finding's")
    parser.add_argument("--no-ascend", action="store_true", help="skip the simulator's hung-kernel run")
    parser.add_argument("--probe", nargs=4, metavar=("PORT", "FILE", "MAX_S", "TOKEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        port, path, max_s, token = args.probe
        probe_main(int(port), Path(path), float(max_s), token)
        return 0
    print("| # | attack | before | now | result |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="moegrad-attack-") as log_dir:
        outcomes = run_all(args.quick, Path(log_dir), include_ascend=not args.no_ascend,
                           report=lambda outcome: print(outcome.row(), flush=True))
    failed = [o.name for o in outcomes if not o.passed]
    verdict = f"; failed: {failed}" if failed else ""
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} attacks pass{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
