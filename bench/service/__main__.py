"""``python -m bench.service``: the command line (see the package docstring for the usage)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench._results import machine, write_section
from support.launch import stop_on_sigterm

from . import __doc__ as _PACKAGE_DOC
from .common import CONCURRENCY
from .load import load_async, load_threads
from .payloads import PAYLOADS
from .report import wire_section
from .run import main
from .wire import wire_speed


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=_PACKAGE_DOC.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    wire = sub.add_parser("wire", help="large calls vs the loopback floor (S2, SL), memory per call, batches")
    wire.add_argument("--s2-rounds", type=int, default=5)
    wire.add_argument("--sl-rounds", type=int, default=2, help="0 skips SL (~2 GB of RAM per process)")
    wire.add_argument("--batch-rounds", type=int, default=3, help="0 skips the batch table")
    wire.add_argument("--mixed-rounds", type=int, default=3,
                      help="batches of 10,000 calls of distinct shapes before the last idle RSS (0 skips them)")
    wire.add_argument("--write", action="store_true", help="also write the tables to bench/RESULTS.md (section 'wire')")
    load = sub.add_parser("load", help="(internal) the load-generating process")
    load.add_argument("--client", choices=["moegrad", "moegrad-threads", "raw", "triton"], required=True)
    load.add_argument("--url", required=True)
    load.add_argument("--payload", choices=sorted(PAYLOADS), default="s1")
    load.add_argument("--concurrency", type=int, default=CONCURRENCY)
    load.add_argument("--duration-s", type=float, default=3.0)
    load.add_argument("--warmup-s", type=float, default=0.5)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    parser.add_argument("--server-pythonpath", metavar="DIR",
                        help="run the moegrad server from DIR/client, DIR/service")
    args = parser.parse_args(argv)
    if args.command == "load":
        if not args.url.startswith("http://127.0.0.1:"):
            parser.error("the load process only targets http://127.0.0.1:PORT")
        payload = PAYLOADS[args.payload]()
        if args.client == "moegrad-threads":
            load_threads(args.url, payload, args.concurrency, args.duration_s, args.warmup_s)
        else:
            asyncio.run(load_async(args.client, args.url, payload, args.concurrency, args.duration_s,
                                    args.warmup_s))
        return 0
    if args.command == "wire":
        rounds = {"s2_rounds": args.s2_rounds, "sl_rounds": args.sl_rounds, "batch_rounds": args.batch_rounds,
                  "mixed_rounds": args.mixed_rounds}
        tables = wire_speed(**rounds, server_pythonpath=args.server_pythonpath)
        print(tables)
        if args.write:
            command = (f"`python -m bench.service wire --s2-rounds {args.s2_rounds} --sl-rounds {args.sl_rounds} "
                       f"--batch-rounds {args.batch_rounds} --mixed-rounds {args.mixed_rounds} --write`")
            write_section("wire", wire_section(tables, rounds, machine(), command))
        return 0
    sections = main(quick=args.quick, write=True, server_pythonpath=args.server_pythonpath)
    for body in sections.values():
        print(body, end="\n\n")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(_cli())
