"""Test-only launcher: ``moegrad-service serve`` with a reference backend whose fault hook is set from argv.

It runs :func:`moegrad_service.__main__.serve` itself -- the same uvicorn server, SIGTERM drain and
exit code as the real command -- with ``backend=ReferenceBackend(fault_hook=...)``::

    python tests/e2e/slow_server.py [hook flags] -- [moegrad-service serve flags]

Hook flags (each call runs them in this order, on the worker thread, before computing):

- ``--calls-file PATH``: append one line per call that reaches the backend
  (``H=<hidden size> timeout_s=<seconds left before its deadline>``); the line count is the number
  of backend calls;
- ``--gate-file PATH``: wait until PATH exists (at most 30 s) -- a gate a test opens by creating it;
- ``--delay-s S``: sleep S seconds;
- ``--raise-on-hidden H --raise-text TEXT``: raise ``RuntimeError(TEXT)`` for calls of hidden size H;
- ``--hang-on-hidden H --hang-s S``: sleep S seconds for calls of hidden size H (a hung device);
- ``--abandon-grace-s S``: how long the pool waits past a deadline before writing off a hung worker.

Not part of the product: nothing imports it but tests/e2e/test_reliability.py (and bench/soak.py
takes the plain command).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from moegrad_service.__main__ import build_parser, serve
from moegrad_service.engine import ReferenceBackend
from moegrad_service.engine import pool as pool_module
from moegrad_service.settings import Settings

GATE_WAIT_S = 30.0


def make_hook(args: argparse.Namespace):
    lock = threading.Lock()

    def hook(call, timeout_s) -> None:
        hidden = call.hidden_size
        if args.calls_file is not None:
            with lock, open(args.calls_file, "a", encoding="utf-8") as calls:
                calls.write(f"H={hidden} timeout_s={timeout_s}\n")
        if args.gate_file is not None:
            end = time.monotonic() + GATE_WAIT_S
            while not args.gate_file.exists() and time.monotonic() < end:
                time.sleep(0.01)
        if args.delay_s:
            time.sleep(args.delay_s)
        if args.raise_on_hidden == hidden:
            raise RuntimeError(args.raise_text)
        if args.hang_on_hidden == hidden:
            time.sleep(args.hang_s)

    return hook


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="slow_server")
    parser.add_argument("--calls-file", type=Path)
    parser.add_argument("--gate-file", type=Path)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--raise-on-hidden", type=int)
    parser.add_argument("--raise-text", default="injected fault")
    parser.add_argument("--hang-on-hidden", type=int)
    parser.add_argument("--hang-s", type=float, default=10.0)
    parser.add_argument("--abandon-grace-s", type=float)
    args = parser.parse_args(own)
    if args.abandon_grace_s is not None:
        pool_module.ABANDON_GRACE_S = args.abandon_grace_s
    flags = vars(build_parser().parse_args(["serve", *rest]))
    flags.pop("command")
    try:
        settings = Settings(**flags)
    except ValidationError as exc:
        print(f"slow_server: invalid settings: {exc}", file=sys.stderr)
        return 2
    return serve(settings, backend=ReferenceBackend(fault_hook=make_hook(args)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
