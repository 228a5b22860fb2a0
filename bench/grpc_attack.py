"""The gRPC attacks on a real ``moegrad-service``: ``python -m bench.grpc_attack [--quick] [--before DIR]``.

The attacks are the test-support package's (tests/support/attacks/rpc.py:
tests/e2e/test_grpc_attacks_e2e.py runs them at their quick size): large messages without a token,
large calls with one all at once, a message of typed contents, RPCs over ``max_connections``. Each
runs against one server (reference backend, gRPC beside HTTP, the HTTP probes watching) and prints
a row: its statuses, the server's peak RSS against the budget, liveness over HTTP and gRPC.

``--before DIR`` runs every attack a second time, first, against the ``client`` and ``service``
folders of DIR (a checkout of an earlier commit, e.g. ``git archive <commit> client service | tar
-x -C DIR``) and prints both rows side by side. ``--quick`` uses the tests' sizes; without it, the
original finding's (a 512 MiB budget, 112 MiB messages, 28 at once: the server needs about 1 GiB,
the client about 3 GiB). All traffic stays on the loopback interface.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from support.attacks import Outcome, Probes
from support.attacks.rpc import AUTH_TOKEN, GRPC_ATTACKS, GRPC_FULL_SETTINGS, GRPC_SETTINGS, grpc_server, warm_up
from support.launch import stop_on_sigterm

__all__ = ["main", "run_all"]


def run_all(quick: bool, log_dir: Path, source: Path | None = None, only: list[str] | None = None) -> list[Outcome]:
    """The gRPC attacks (``only`` those named) in turn against one server (run from ``source`` when
    given); the outcomes."""
    settings = GRPC_SETTINGS if quick else GRPC_FULL_SETTINGS
    outcomes = []
    with grpc_server(log_dir, settings, source=source) as target, \
            Probes(target.server.port, log_dir, token=AUTH_TOKEN) as probes:
        warm_up(target)
        for attack in GRPC_ATTACKS:
            if only and attack.__name__ not in only:
                continue
            outcome = attack(target, probes, quick)
            print(f"  {'before' if source else 'now'}: {outcome.row()}", file=sys.stderr, flush=True)
            outcomes.append(outcome)
    return outcomes


def _cell(outcome: Outcome) -> str:
    watched = (f"; peak RSS {outcome.peak_rss_bytes / 2**20:.0f} MiB, /health/live p99 "
               f"{outcome.live_p99_s * 1e3:.0f} ms")
    return outcome.now + watched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' sizes instead of the original finding's")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="also run every attack against DIR/client and DIR/service (an earlier commit)")
    parser.add_argument("--attack", action="append", choices=[a.__name__ for a in GRPC_ATTACKS],
                        help="run only this attack (repeatable)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    settings = GRPC_SETTINGS if args.quick else GRPC_FULL_SETTINGS
    print(f"budget (max_inflight_bytes) {settings['max_inflight_bytes'] >> 20} MiB, grpc_max_message_bytes "
          f"{settings['grpc_max_message_bytes'] >> 20} MiB, max_connections {settings['max_connections']}\n")
    with tempfile.TemporaryDirectory(prefix="moegrad-grpc-attack-") as log_dir:
        before = run_all(args.quick, Path(log_dir), args.before.resolve(), args.attack) if args.before else None
        now = run_all(args.quick, Path(log_dir), only=args.attack)
    if before is None:
        print("| # | attack | the issue's finding | now |\n|---|---|---|---|")
        for outcome in now:
            print(f"| {outcome.item} | {outcome.name} | {outcome.before} | {_cell(outcome)} |")
    else:
        print("| # | attack | before | now |\n|---|---|---|---|")
        for old, new in zip(before, now, strict=True):
            print(f"| {new.item} | {new.name} | {_cell(old)} | {_cell(new)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
