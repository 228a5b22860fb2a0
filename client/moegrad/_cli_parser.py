"""The ``moegrad`` command's arguments: the parser of its subcommands (grad, local, compare, example, info).

What each subcommand does is :mod:`moegrad._cli`'s; this module only says what it takes, with the
help text, the exit statuses and the environment it reads for defaults (MOEGRAD_URL, MOEGRAD_TOKEN).
"""

from __future__ import annotations

import argparse
import os

from moegrad._spec import ORDERS
from moegrad._version import __version__
from moegrad.accuracy import DEFAULT_STANDARDS, STANDARDS

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "default_urls",
    "shard",
]

_DEFAULT_URL = "http://127.0.0.1:8000"

_DESCRIPTION = """\
aclnnMoeInitRoutingV2Grad, the backward of MoE token routing:
    grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]
computed by a moegrad service (the NPU, or its bit-exact emulation) or in-process.
"""

_EPILOG = """\
exit status:
  0  success (`compare`: the candidate passed; a warning passes)
  1  `example`: the result differs from the documentation's bit for bit; `compare`: a standard failed
     (or, with --require-exact, the candidate is not bit-exact)
  2  usage error (bad arguments, an input .npy that cannot be read, an output that cannot be written)
  3  input rejected by the operator's constraints (the message names the field and the aclnn code)
  4  the server failed, was busy past all retries, timed out, or could not be reached
  70  an internal error: a bug in moegrad (the message says how to report it)
  130, 143  interrupted by SIGINT (Ctrl-C) / SIGTERM
`compare --cases` and `--merge`, over all the cases (of the shard), the first that applies: 4 a case
  is not judged (or, --merge, missing; or --output is locked by another run), 3 a case is invalid
  (unreadable, or the server answered 400/413/415/422), 1 a case failed, 0 every case passed.

.npy files: tensors are read with numpy.load (no pickles) and written with numpy.save. numpy has no
bfloat16, so numpy.save writes an ml_dtypes.bfloat16 array as the raw 2-byte type '|V2'; moegrad
reads any '|V2' array back as ml_dtypes.bfloat16 and writes a bfloat16 grad_x the same way (load it
with numpy.load(path).view(ml_dtypes.bfloat16)).

environment:
  MOEGRAD_URL    default for --url, several separated by commas (else http://127.0.0.1:8000)
  MOEGRAD_TOKEN  default for --token
"""


# --------------------------------------------------------------------------------------------------


#: The exit statuses (the epilog's table).
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_REJECTED, EXIT_FAILURE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h: an internal software error


class UsageError(Exception):
    """A bad combination of arguments, or a file named on the command line that cannot be read or
    written (exit 2)."""


def default_urls() -> list[str]:
    """``--url`` when not given: $MOEGRAD_URL's URLs (separated by commas), else the default."""
    urls = [url.strip() for url in os.environ.get("MOEGRAD_URL", "").split(",") if url.strip()]
    return urls or [_DEFAULT_URL]


def shard(text: str) -> tuple[int, int]:
    """``--shard I/N``: 0 <= I < N."""
    index, _, count = text.partition("/")
    try:
        value = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 2/8)") from None
    if not (value[1] >= 1 and 0 <= value[0] < value[1]):
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= I < N")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _positive_seconds(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0 (or 'none')")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help="the service's root URL; repeat it for each replica, or give dns+http://NAME:PORT for "
        "the addresses of NAME (a headless Service), resolved again every 30 s (default: $MOEGRAD_URL, "
        f"else {_DEFAULT_URL}; now {', '.join(default_urls())})",
    )
    group.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="deadline of the whole call including retries, in seconds; 'none' for no deadline "
        "(default: %(default)s; the server may cap it)",
    )
    group.add_argument(
        "--token",
        default=os.environ.get("MOEGRAD_TOKEN"),
        metavar="TOKEN",
        help="bearer token for a server that requires one (default: $MOEGRAD_TOKEN)",
    )
    group.add_argument(
        "--retries",
        type=_non_negative_int,
        default=3,
        metavar="N",
        help="retries after a connection error or a busy (503) answer (default: %(default)s)",
    )
    group.add_argument(
        "--cacert", metavar="PATH", help="CA bundle (PEM) to verify an https:// server with (default: the system's CAs)"
    )


def _add_call_arguments(
    parser: argparse.ArgumentParser, *, order_default: str, output: bool = True, required: bool = True
) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("the operator call")
    group.add_argument(
        "--grad-expanded-x",
        required=required,
        metavar="PATH",
        help="gradExpandedX .npy: [N*K, H] (dropless), [A, H] (active) or [E, C, H] (drop/pad); "
        "float16, bfloat16 or float32",
    )
    group.add_argument(
        "--expanded-row-idx",
        required=required,
        metavar="PATH",
        help="expandedRowIdx .npy: [N*K] int32 (-1 marks a dropped slot in drop/pad mode)",
    )
    group.add_argument("--top-k", required=required, type=int, metavar="K", help="K, experts per token (> 0)")
    group.add_argument(
        "--drop-pad-mode", type=int, default=0, metavar="M", help="0 dropless/active, 1 drop/pad (default: %(default)s)"
    )
    group.add_argument(
        "--active-num",
        type=int,
        default=0,
        metavar="A",
        help="A, rows of grad_expanded_x in active mode; 0 dropless (default: %(default)s)",
    )
    group.add_argument(
        "--order",
        choices=ORDERS,
        default=None,
        help=f"accumulation order: ascend910b (the Atlas A2/A3 device), ascend950 (the Ascend "
        f"950PR/950DT device; ascend950@2025-12 an earlier kernel revision) or sequential "
        f"(Huawei's golden) (default: {order_default})",
    )
    group.add_argument(
        "--allow-duplicate-indices",
        action="store_true",
        help="accept repeated indices, which the documentation forbids",
    )
    if output:
        group.add_argument(
            "-o",
            "--output",
            required=True,
            metavar="PATH",
            help="where to write grad_x, [N, H] in the input's dtype (.npy, written to exactly this path)",
        )
    return group


def build_parser() -> argparse.ArgumentParser:
    """The ``moegrad`` argument parser (commands grad, local, compare, example, info)."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="moegrad", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"moegrad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    grad = commands.add_parser(
        "grad",
        help="compute grad_x on a moegrad service",
        formatter_class=formatter,
        description="Send a call to a moegrad service and write its grad_x.",
        epilog=_EPILOG,
    )
    _add_call_arguments(grad, order_default="the server's")
    _add_server_arguments(grad)

    local = commands.add_parser(
        "local",
        help="compute grad_x in-process (no server)",
        formatter_class=formatter,
        description="Compute grad_x in this process with the NumPy emulation of the "
        "device (bit-exact for Atlas A2/A3).",
        epilog=_EPILOG,
    )
    _add_call_arguments(local, order_default="ascend910b")

    comparison = commands.add_parser(
        "compare",
        help="judge a candidate grad_x against the device and a float64 golden",
        formatter_class=formatter,
        epilog=_EPILOG,
        description="Send a call and a candidate grad_x to a moegrad service (or, with --local,\n"
        "compute in-process) and print the accuracy verdicts: per standard its status,\n"
        "the device's own status and the numbers that decided it, whether the candidate\n"
        "is bit-exact to the device, the key metrics of candidate vs golden, device vs\n"
        "golden and candidate vs device, and the worst elements (docs/accuracy.md).\n"
        "The verdict comes from the tolerance standards; exactness decides only with\n"
        "--require-exact. Exit status 0 when the candidate passed (a warning passes),\n"
        "1 when it failed. With --cases DIR, every .npz case in DIR is judged (one file\n"
        'per case: docs/accuracy.md, "Bulk checking" and "Sweeps"), spread over every\n'
        "--url, and a summary is written; the run never stops on a bad case, can be\n"
        "split (--shard), written as it goes and resumed (--output), and merged (--merge).",
    )
    group = _add_call_arguments(
        comparison, order_default="the server's; with --local ascend910b", output=False, required=False
    )
    group.add_argument(
        "--candidate",
        metavar="PATH",
        help="the candidate grad_x .npy: [N, H], the dtype of grad_expanded_x or float32 (required unless --cases)",
    )
    choose = comparison.add_argument_group("the comparison")
    choose.add_argument(
        "--standard",
        action="append",
        choices=STANDARDS,
        metavar="S",
        dest="standards",
        help=f"a standard to apply, repeatable: {', '.join(STANDARDS)} "
        f"(default: {', '.join(DEFAULT_STANDARDS)}; bitwise only when named)",
    )
    choose.add_argument(
        "--require-exact",
        action="store_true",
        help="fail unless the candidate is bit-exact to the device's result (exactness is reported either way)",
    )
    choose.add_argument(
        "--json", action="store_true", help="print the report as JSON (report.to_dict()) instead of tables"
    )
    choose.add_argument(
        "--report",
        metavar="PATH",
        help="also write a markdown report to PATH and, when matplotlib is installed (extra 'plot'), "
        "a PNG of the candidate's and the device's error distributions and the error balance "
        "beside it (out.md -> out.png); the plot's float64 golden is computed in this process",
    )
    choose.add_argument("--report-json", metavar="PATH", help="also write the report as JSON to PATH")
    choose.add_argument(
        "--report-csv",
        metavar="PATH",
        help="also write the report as CSV to PATH (msprobe's accuracy-checking column names)",
    )
    choose.add_argument(
        "--local",
        action="store_true",
        help="compare in-process with the NumPy emulation of the device; no server (--url is ignored)",
    )
    bulk = comparison.add_argument_group("bulk checking")
    bulk.add_argument("--cases", metavar="DIR", help="judge every *.npz case file in DIR instead of one call")
    bulk.add_argument(
        "--summary",
        metavar="PREFIX",
        help="write the summary to PREFIX.csv and PREFIX.md, worst first (default: DIR/summary)",
    )
    bulk.add_argument(
        "--reports",
        metavar="DIR",
        help="also write each case's report to DIR/<case>.md (with its plot), .json and .csv",
    )
    bulk.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress line on stderr: cases done/total, cases/s, failed, invalid, errors (default: when "
        "stderr is a terminal)",
    )
    bulk.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="list every case after a sweep (default: the failed, invalid and not judged ones, and a count "
        "of the rest)",
    )
    bulk.add_argument(
        "--shard",
        type=shard,
        metavar="I/N",
        help="judge only shard I of N: the cases whose name's SHA-256 (its first 8 bytes) modulo N is I",
    )
    bulk.add_argument(
        "--output",
        metavar="FILE",
        help="write each judged case to FILE as a JSON line as it is judged; run again with the same "
        "FILE to skip the cases it records (same name and file digest). With it, no summary is "
        "written unless --summary is given",
    )
    bulk.add_argument(
        "--max-concurrency",
        "--concurrency",
        type=_positive_int,
        dest="max_concurrency",
        metavar="K",
        help="requests in flight at once over all replicas, each a batch of cases (default: 2 per --url, at least 4)",
    )
    bulk.add_argument(
        "--merge",
        nargs="+",
        metavar="PATH",
        help="no calls: join shard files (or folders of shard-*.jsonl) into one summary (--summary, "
        "default: the first PATH's folder/summary); with --cases DIR, check that every case is in them",
    )
    _add_server_arguments(comparison)

    example = commands.add_parser(
        "example",
        help="run the documentation's example on a service",
        formatter_class=formatter,
        epilog=_EPILOG,
        description="Send the operator documentation's example (grad_expanded_x "
        "[[.1,.1],[.3,.3],[.2,.2],[.4,.4]] float32, expanded_row_idx "
        "[2,0,1,3], K=2) and compare the result bit for bit with "
        "[[0.3,0.3],[0.70000005,0.70000005]].",
    )
    _add_server_arguments(example)

    info = commands.add_parser(
        "info",
        help="print the service's /v1/info as JSON",
        formatter_class=formatter,
        description="Print the service's version, backend, device, order and limits.",
        epilog=_EPILOG,
    )
    _add_server_arguments(info)
    return parser
