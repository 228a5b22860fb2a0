"""S1 server CPU per request, two trees side by side: a baseline checkout's server and this tree's.

    python -m bench.s1_ab --baseline DIR [--rounds 8 --block 500]

Each tree serves on its own loopback port (reference backend, 2 streams); one plain-socket
connection per server sends the prebuilt v1 request of S1 (the documentation's example), the two
taking turns in blocks, every reply checked bitwise. Server CPU comes from /proc (user + system of
the server process), so the client's cost is not in it. Prints a markdown table and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

from bench.service.clients import RawCaller
from bench.service.payloads import check, s1
from bench.service.procs import cpu_s, moegrad_server

ROOT = Path(__file__).resolve().parents[1]


def measure(baseline: Path, rounds: int, block: int) -> dict[str, list[float]]:
    """Per tree, the server CPU per request (seconds) of each round."""
    payload = s1()
    per_round: dict[str, list[float]] = {"baseline": [], "this tree": []}
    with moegrad_server(pythonpath=str(baseline)) as base, moegrad_server(pythonpath=str(ROOT)) as this:
        servers = {"baseline": base, "this tree": this}
        with contextlib.ExitStack() as stack:
            callers = {name: stack.enter_context(contextlib.closing(RawCaller(server.url, payload)))
                       for name, server in servers.items()}
            for name, caller in callers.items():  # warm-up: first-call paths, caches
                for _ in range(block):
                    check(caller(), payload, name)
            for _ in range(rounds):
                for name, caller in callers.items():
                    pid = servers[name].pid
                    before = cpu_s([pid])
                    for _ in range(block):
                        check(caller(), payload, name)
                    per_round[name].append((cpu_s([pid]) - before) / block)
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline commit")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=500)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = measure(args.baseline, args.rounds, args.block)
    base, this = (statistics.median(results[name]) for name in ("baseline", "this tree"))
    print(f"S1 server CPU per v1 request, {args.rounds} alternating rounds of {args.block} plain-socket calls "
          f"({started})\n")
    print("| server | median ms | rounds, ms |\n|---|---:|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {', '.join(f'{v * 1e3:.3f}' for v in values)} |")
    print(f"\nthis tree / baseline: {this / base:.3f}")


if __name__ == "__main__":
    main()
