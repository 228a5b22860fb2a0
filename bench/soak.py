"""Soak: 16 concurrent clients against one moegrad server on loopback, for a fixed time.

Usage::

    .venv/bin/python -m bench.soak --duration 60          # the soak; writes bench/RESULTS.md's soak section
    .venv/bin/python -m bench.soak --duration 10 --no-write

Without ``--url`` it starts ``python -m moegrad_service serve --host 127.0.0.1 --port <free>
--backend reference --streams 2 --max-queue 8 --log-level warning`` and stops it with SIGTERM at the
end (its exit code is recorded). The workload, its checks and the RSS samples are
tests/support/soak.py's (the test-support package, which tests/e2e/test_reliability.py runs for 10 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._results import machine, write_section
from support.launch import REFERENCE_FLAGS, moegrad_server, stop_on_sigterm
from support.soak import Workload, run_soak

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
SERVER_FLAGS = (*REFERENCE_FLAGS, "--streams", "2", "--max-queue", "8")
#: How long the server may take to drain and exit after SIGTERM, in seconds.
STOP_WITHIN_S = 60.0


def main(argv: list[str] | None = None, *, duration_s: float | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client threads (default 16)")
    parser.add_argument("--big-calls", type=int, default=3, help="big calls in the run (default 3)")
    parser.add_argument("--big-mib", type=float, default=64.0, help="MiB of grad per big call (default 64)")
    parser.add_argument("--url", help="soak this running server instead of starting one (no RSS then)")
    parser.add_argument("--no-write", dest="write", action="store_false", help="do not update bench/RESULTS.md")
    args = parser.parse_args([] if argv is None and duration_s is not None else argv)
    if duration_s is not None:
        args.duration = duration_s
    print(f"bench.soak: preparing the workload ({args.big_calls} big calls of {args.big_mib:.0f} MiB)", flush=True)
    workload = Workload.build(big_calls=args.big_calls, big_mib=args.big_mib)
    server = None if args.url else moegrad_server(ROOT / "bench" / "_out" / "logs", flags=SERVER_FLAGS,
                                                  stop_within_s=STOP_WITHIN_S, name="soak-server")
    url = args.url or server.url
    machine_line = machine()
    print(f"bench.soak: {args.clients} clients for {args.duration:.0f} s against {url}", flush=True)
    try:
        report = run_soak(url, workload, duration_s=args.duration, clients=args.clients,
                          server_pid=server.pid if server else None)
    finally:
        if server is not None:
            exit_code = server.stop()
    if server is not None:
        report.server_exit_code = exit_code
        if exit_code != 0:
            report.fail(f"the server exited with {exit_code} after SIGTERM")
    command = "python -m bench.soak " + " ".join(argv if argv is not None else [f"--duration {args.duration:.0f}"])
    server_text = " ".join(["python -m moegrad_service serve --host 127.0.0.1 --port PORT", *SERVER_FLAGS]) \
        if server else url
    text = report.markdown(command=command.strip(), machine=machine_line, server=server_text)
    print(text, flush=True)
    if args.write:
        write_section("soak", text)
        print("bench.soak: wrote the soak section of bench/RESULTS.md", flush=True)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
