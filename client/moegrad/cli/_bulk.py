"""``moegrad compare``'s bulk checking options: ``--cases DIR`` and what goes with it (docs/accuracy.md,
"Bulk checking" and "Sweeps"); what they do is :mod:`moegrad.cli._sweep`'s.

Every file a sweep writes (``--summary``, ``--reports``, ``--output``) is written where it is named,
its folder created when missing; a folder that cannot be created is a usage error (exit 2) before
any case is judged.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

__all__ = ["MAX_SHARDS", "PLOTS", "add_bulk_options", "int_at_least", "shard"]

#: The most shards ``--shard I/N`` may name (more than any sweep has cases).
MAX_SHARDS = 1_000_000
#: ``--plots``: which cases' reports get their plot (``--reports DIR``): none, the failed ones, every one.
PLOTS = ("none", "failing", "all")


def shard(text: str) -> tuple[int, int]:
    """``--shard I/N``: shard I of N, counted from 0 (0 <= I < N, 1 <= N <= :data:`MAX_SHARDS`).

    Raises:
        argparse.ArgumentTypeError: not I/N, or out of range (argparse's usage error, exit 2).
    """
    match = re.fullmatch(r"\s*([+-]?\d+)\s*/\s*([+-]?\d+)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 2/8: shard 2 of 8, counted from 0)")
    index, count = int(match.group(1)), int(match.group(2))
    if not 1 <= count <= MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"{text!r}: N={count} must be between 1 and {MAX_SHARDS}")
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: I={index} must be between 0 and N-1={count - 1} (shards are counted from 0)"
        )
    return index, count


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: the integer ``text`` names, refused with a message when below ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


def add_bulk_options(comparison: argparse.ArgumentParser) -> None:
    """``moegrad compare``'s bulk checking options (``--cases`` and what goes with it)."""
    bulk = comparison.add_argument_group("bulk checking")
    bulk.add_argument("--cases", metavar="DIR", help="judge every *.npz case file in DIR instead of one call")
    bulk.add_argument(
        "--summary",
        metavar="PREFIX",
        help="write the summary to PREFIX.csv and PREFIX.md (folders created), real failures first; every "
        "sweep writes one (default: DIR/summary; with --output FILE, FILE without its extension + "
        "'.summary', beside it; with --merge, the first PATH's folder/summary)",
    )
    bulk.add_argument(
        "--reports",
        metavar="OUT",
        help="also write each case's report to OUT/<case>.md, .json and .csv (OUT created) while the sweep "
        "goes on, and the plots (OUT/<case>.png) that --plots asks for",
    )
    bulk.add_argument(
        "--plots",
        choices=PLOTS,
        help="with --reports: which cases get a plot, none, the failed ones or all (default: none); plots "
        "are drawn in worker processes while the sweep goes on, each costing a hundred times the rest of "
        "its case's report, and each worker a second to start",
    )
    bulk.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress line on stderr: cases done/total, cases/s, failed, invalid, errors, the cases a "
        "resumed run skips counted too (default: when stderr is a terminal)",
    )
    bulk.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="list every case after a sweep (default: the failed, invalid and not judged ones, and a count "
        "of the rest), then each replica's counters (served, failures, calls moved to another)",
    )
    bulk.add_argument(
        "--shard",
        type=shard,
        metavar="I/N",
        help=f"judge only shard I of N, I counted from 0 (0 <= I < N; N at most {MAX_SHARDS}): the cases whose "
        "name's SHA-256 (its first 8 bytes, big-endian) modulo N is I",
    )
    bulk.add_argument(
        "--output",
        metavar="FILE",
        help="write each judged case to FILE as a JSON line as it is judged (folders created); run again "
        "with the same FILE to skip the cases it records (same name and file digest); the summary "
        "then goes beside FILE unless --summary says where",
    )
    bulk.add_argument(
        "--max-concurrency",
        "--concurrency",
        type=int_at_least(1),
        dest="max_concurrency",
        metavar="K",
        help="requests in flight at once over all replicas, each a batch of cases (default: 2 per --url, at least 4)",
    )
    bulk.add_argument(
        "--exit-zero-on-findings",
        action="store_true",
        help="exit 0 when every case was judged, even if some are invalid (3) or failed (1): for a batch "
        "system that counts a run with findings as done, as deploy/sweep's Job does; 4, 2, 70, 130 and "
        "143 are unchanged, and --merge (which refuses this flag) reports the findings with 3 or 1",
    )
    bulk.add_argument(
        "--merge",
        nargs="+",
        metavar="PATH",
        help="no calls: join shard files (or folders of shard-*.jsonl) into one summary (--summary, "
        "default: the first PATH's folder/summary), what is missing said first; with --cases DIR, "
        "check that every case is in them",
    )
