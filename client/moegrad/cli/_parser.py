"""The ``moegrad`` command's arguments: the parser of its subcommands (grad, local, compare, explain,
example, info, identify; probe-order, shrink, determinism and compare --order-free come from
:mod:`moegrad.cli._candidate_parser`).

What each subcommand does is :mod:`moegrad.cli._main`'s; this module only says what it takes, with the
help text, the exit statuses and the environment it reads for defaults (MOEGRAD_URL, MOEGRAD_TOKEN).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from moegrad import ORDERS, __version__
from moegrad.accuracy import DEFAULT_STANDARDS, STANDARDS
from moegrad.cli._bulk import MAX_SHARDS, add_bulk_options, int_at_least, shard
from moegrad.cli._candidate_parser import add_candidate_commands, add_order_free_options
from moegrad.operator import ALIASES, DEFAULT_PROFILE, PROFILES

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "MAX_SHARDS",
    "UsageError",
    "build_parser",
    "default_urls",
    "index_as_int32",
    "shard",
    "with_flags",
]

_DEFAULT_URL = "http://127.0.0.1:8000"

_DESCRIPTION = """\
aclnnMoeInitRoutingV2Grad, the backward of MoE token routing:
    grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]
computed by a moegrad service (the NPU, or its bit-exact emulation) or in-process.
"""

# The epilogs: each command gets the lines that apply to it (the top level gets them all).
_EXIT_HEAD = "exit status:\n"
_EXIT_OK = "  0  success\n"
_EXIT_COMPARE = """\
  0  the candidate passed (a warning passes); --order-free: clean
  1  a standard failed (or, with --require-exact, the candidate is not bit-exact); --order-free: a fault
"""
_EXIT_EXAMPLE = "  1  the result differs from the documentation's bit for bit\n"
_EXIT_EXPLAIN = """\
  0  every row of the candidate is bit-identical to the device's
  1  rows differ (each one explained)
"""
_EXIT_USAGE_FILES = (
    "  2  usage error (bad arguments, an input .npy that cannot be read, an output that cannot be written)\n"
)
_EXIT_USAGE_ARGS = "  2  usage error (bad arguments, a --url that is not an http(s) URL)\n"
_EXIT_REJECTED = "  3  input rejected by the operator's constraints (the message names the field and the aclnn code)\n"
_EXIT_SERVER = "  4  the server failed, was busy past all retries, timed out, or could not be reached\n"
_EXIT_INTERNAL = "  70  an internal error: a bug in moegrad (the message says how to report it)\n"
_EXIT_SIGNALS = "  130, 143  interrupted by SIGINT (Ctrl-C) / SIGTERM\n"
_EXIT_CASES = """\
`compare --cases` and `--merge`, over all the cases (of the shard), the first that applies: 4 a case
  is not judged (or, --merge, missing; or --output is locked by another run), 3 a case is invalid
  (unreadable, over MOEGRAD_MAX_CASE_BYTES, or the server answered 400/413/415/422), 1 a case failed,
  0 every case passed. With --exit-zero-on-findings a sweep that judged every case exits 0 instead
  of 3 or 1.
"""
_NPY = """
.npy files: tensors are read with numpy.load (no pickles) and written with numpy.save. numpy has no
bfloat16, so numpy.save writes an ml_dtypes.bfloat16 array as the raw 2-byte type '|V2'; moegrad
reads any '|V2' array back as ml_dtypes.bfloat16 and writes a bfloat16 grad_x the same way (load it
with numpy.load(path).view(ml_dtypes.bfloat16)). An int64 --expanded-row-idx (numpy's default
integer) is read as int32 when every value fits, with a note on stderr.
"""
_ENVIRONMENT = """
environment:
  MOEGRAD_URL    default for --url, several separated by commas (else http://127.0.0.1:8000)
  MOEGRAD_TOKEN  default for --token
"""
_CASE_ENVIRONMENT = """\
  MOEGRAD_MAX_CASE_BYTES  the most bytes a case file's arrays may take once read, together
                          (default 2147483648, 2 GiB; a larger case is invalid)
"""
_EPILOG = (
    _EXIT_HEAD
    + "  0  success (`compare`: the candidate passed; a warning passes)\n"
    + "  1  `example`: the result differs from the documentation's bit for bit; `compare`: a standard failed\n"
    + "     (or, with --require-exact, the candidate is not bit-exact); `explain`: rows differ from the device's;\n"
    + "     `compare --order-free`: a fault; `probe-order`: no single tree of adds; `shrink`: a fault shrunk;\n"
    + "     `determinism`: rows vary\n"
    + _EXIT_USAGE_FILES
    + _EXIT_REJECTED
    + _EXIT_SERVER
    + _EXIT_INTERNAL
    + _EXIT_SIGNALS
    + _EXIT_CASES
    + _NPY
    + _ENVIRONMENT
    + _CASE_ENVIRONMENT
)
_EPILOGS = {
    "grad": _EXIT_HEAD
    + _EXIT_OK
    + _EXIT_USAGE_FILES
    + _EXIT_REJECTED
    + _EXIT_SERVER
    + _EXIT_INTERNAL
    + _EXIT_SIGNALS
    + _NPY
    + _ENVIRONMENT,
    "local": _EXIT_HEAD + _EXIT_OK + _EXIT_USAGE_FILES + _EXIT_REJECTED + _EXIT_INTERNAL + _EXIT_SIGNALS + _NPY,
    "compare": _EXIT_HEAD
    + _EXIT_COMPARE
    + _EXIT_USAGE_FILES
    + _EXIT_REJECTED
    + _EXIT_SERVER.replace("reached", "reached (not with --local)")
    + _EXIT_INTERNAL
    + _EXIT_SIGNALS
    + _EXIT_CASES
    + _NPY
    + _ENVIRONMENT
    + _CASE_ENVIRONMENT,
    "explain": _EXIT_HEAD
    + _EXIT_EXPLAIN
    + _EXIT_USAGE_FILES
    + _EXIT_REJECTED
    + _EXIT_SERVER.replace("reached", "reached (not with --local)")
    + _EXIT_INTERNAL
    + _EXIT_SIGNALS
    + _NPY
    + _ENVIRONMENT,
    "example": _EXIT_HEAD
    + _EXIT_OK
    + _EXIT_EXAMPLE
    + _EXIT_USAGE_ARGS
    + _EXIT_SERVER
    + _EXIT_INTERNAL
    + _EXIT_SIGNALS
    + _ENVIRONMENT,
    "info": _EXIT_HEAD + _EXIT_OK + _EXIT_USAGE_ARGS + _EXIT_SERVER + _EXIT_INTERNAL + _EXIT_SIGNALS + _ENVIRONMENT,
}

#: The call's fields (and the client's settings) the command takes as flags: its messages name the
#: flag the user typed, then the field.
_FLAGS = {
    "top_k": "--top-k",
    "drop_pad_mode": "--drop-pad-mode",
    "active_num": "--active-num",
    "order": "--order",
    "allow_duplicate_indices": "--allow-duplicate-indices",
    "base_url": "--url",
    "verify": "--cacert",
}
#: A field's name, not within ``[field F]`` nor part of another name, with ``=value`` if it has one.
_FIELD = re.compile(r"(?<![\w.\[-])(?<!field )" + rf"({'|'.join(_FLAGS)})(?:=('[^']*'|[^\s,;:()\[\]]+)|(?![\w=]))")


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


def with_flags(message: str) -> str:
    """A message about the call's fields as the command line's user reads it: a field the command
    takes as a flag is named by the flag, then the field (``top_k=0`` -> ``--top-k 0 (top_k)``,
    ``allow_duplicate_indices`` -> ``--allow-duplicate-indices (allow_duplicate_indices)``); the
    message's ``[field F]`` is kept as it is."""
    return _FIELD.sub(lambda m: " ".join(filter(None, (_FLAGS[m.group(1)], m.group(2)))) + f" ({m.group(1)})", message)


def index_as_int32(array: np.ndarray, flag: str, path: str) -> np.ndarray:
    """An index read from a .npy file for ``flag``: int64 (NumPy's and torch's default integer) is
    read as int32 when every value fits, saying so on stderr; anything else is returned as it is,
    for the operator's rules to judge (its dtype rule: int32 only, aclnn 161002)."""
    if array.dtype.kind != "i" or array.dtype.itemsize != 8:
        return array
    limits = np.iinfo(np.int32)
    if array.size and (int(array.min()) < limits.min or int(array.max()) > limits.max):
        return array
    print(f"moegrad: note: {flag} {path} is int64; read as int32 (every value fits)", file=sys.stderr)
    return array.astype(np.int32)


class _Parser(argparse.ArgumentParser):
    """argparse, with ``--shard -1/4`` read as ``--shard=-1/4`` (argparse takes a word that starts
    with "-" for a flag, and would say only "expected one argument")."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]  # typeshed overloads it
        words = list(sys.argv[1:] if args is None else args)
        for position in range(len(words) - 1, 0, -1):
            if words[position - 1] == "--shard" and re.match(r"-\d", words[position]):
                words[position - 1 : position + 1] = [f"--shard={words[position]}"]
        return super().parse_known_args(words, namespace)


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
        type=int_at_least(0),
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
        metavar="PROFILE",
        help="device profile, CHIP@RELEASE: ascend910b / ascend910_93 (Atlas A2/A3), ascend950 "
        "(Ascend 950PR/950DT) at 8.5, 9.0 or 9.1; or sequential (Huawei's golden); aliases: "
        f"{', '.join(f'{a} = {p}' for a, p in ALIASES.items())} (profiles: {', '.join(PROFILES)}; "
        f"default: {order_default})",
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
    """The ``moegrad`` argument parser (commands grad, local, compare, explain, example, info, identify,
    probe-order, shrink, determinism)."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="moegrad", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"moegrad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    grad = commands.add_parser(
        "grad",
        help="compute grad_x on a moegrad service",
        formatter_class=formatter,
        description="Send a call to a moegrad service and write its grad_x.",
        epilog=_EPILOGS["grad"],
    )
    _add_call_arguments(grad, order_default="the server's")
    _add_server_arguments(grad)

    local = commands.add_parser(
        "local",
        help="compute grad_x in-process (no server)",
        formatter_class=formatter,
        description="Compute grad_x in this process with the NumPy emulation of the "
        "device profile --order names (bit-exact for each chip at each CANN release).",
        epilog=_EPILOGS["local"],
    )
    _add_call_arguments(local, order_default=DEFAULT_PROFILE)

    _add_compare_parser(commands, formatter)
    _add_explain_parser(commands, formatter)

    example = commands.add_parser(
        "example",
        help="run the documentation's example on a service",
        formatter_class=formatter,
        epilog=_EPILOGS["example"],
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
        description="Print the service's version, backend, device, order and limits (GET /v1/info) as\n"
        "JSON. With --url given more than once, a JSON object of each URL's info (or the error that\n"
        "replica gave), exit 4 when any failed; a dns+ URL's info is one replica's, named on stderr.",
        epilog=_EPILOGS["info"],
    )
    _add_server_arguments(info)
    _add_identify_parser(commands, formatter)
    add_candidate_commands(commands, formatter, _add_call_arguments)
    return parser


def _add_compare_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """``moegrad compare``: one call and a candidate, or a folder of cases (docs/accuracy.md)."""
    comparison = commands.add_parser(
        "compare",
        help="judge a candidate grad_x against the device and a float64 golden",
        formatter_class=formatter,
        epilog=_EPILOGS["compare"],
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
        comparison, order_default=f"the server's; with --local {DEFAULT_PROFILE}", output=False, required=False
    )
    group.add_argument(
        "--candidate",
        metavar="PATH",
        help="the candidate grad_x .npy: [N, H], the dtype of grad_expanded_x or float32 (required unless --cases); "
        "with --order-free, the candidate's code instead: package.module:function",
    )
    _add_comparison_options(comparison)
    add_bulk_options(comparison)
    add_order_free_options(comparison)
    _add_server_arguments(comparison)


def _add_explain_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """``moegrad explain``: why each row of a candidate differs from the device's (docs/accuracy.md)."""
    explaining = commands.add_parser(
        "explain",
        help="explain why each row of a candidate grad_x differs from the device's",
        formatter_class=formatter,
        epilog=_EPILOGS["explain"],
        description="Send a call and a candidate grad_x to a moegrad service (or, with --local,\n"
        "compute in-process) and print, for each row whose bits differ from the device's,\n"
        "one label and its evidence: order (another schedule of the same adds), missing,\n"
        "duplicated, replaced or extra (one wrong summand: its slot and row), precision\n"
        "(a narrower accumulator), nonfinite, unexplained or ambiguous\n"
        '(docs/accuracy.md, "Explaining a mismatch"). Give the call\'s .npy files and\n'
        "--candidate, or one case file (--case).",
    )
    group = _add_call_arguments(
        explaining, order_default=f"the server's; with --local {DEFAULT_PROFILE}", output=False, required=False
    )
    group.add_argument("--candidate", metavar="PATH", help="the candidate grad_x .npy: [N, H], the call's dtype")
    group.add_argument("--case", metavar="FILE", help='a case .npz instead (docs/accuracy.md, "Bulk checking")')
    shown = explaining.add_argument_group("the explanation")
    shown.add_argument("--json", action="store_true", help="print the explanation as JSON (Explanation.to_dict())")
    shown.add_argument("-o", "--output", metavar="PATH", help="also write the explanation as JSON to PATH")
    shown.add_argument(
        "--local",
        action="store_true",
        help="explain in-process against the NumPy emulation of the device; no server (--url is ignored)",
    )
    _add_server_arguments(explaining)


def _add_comparison_options(comparison: argparse.ArgumentParser) -> None:
    """``moegrad compare``'s options that choose and write the comparison."""
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
        "--profiles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one call: also emulate every device profile in this process and report those bit-identical "
        "to the candidate (profiles_matching; up to four emulations; default: on; not with --cases)",
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
        "--explain",
        action="store_true",
        help="also explain each row that differs from the device's (moegrad explain): the label counts in the "
        "report (and a sweep's results and summary), the rows after the table, in --report and beside "
        "--report-json as PATH.explain.json (with --cases, each case's in --reports DIR)",
    )
    choose.add_argument(
        "--report-csv",
        metavar="PATH",
        help="also write the report as CSV to PATH (msprobe's accuracy-checking column names)",
    )
    choose.add_argument(
        "--html",
        metavar="FILE",
        help="also write one self-contained HTML page to FILE (no script, nothing fetched; plots need "
        "matplotlib, extra 'plot'): where the error lives, an error map, the error by slot, the label "
        "counts, the worst rows with their slots (one call: explained, as --explain). With --cases or "
        "--merge: which factor makes cases fail, every case worst first, each of the 100 worst that "
        "differ linking to its section",
    )
    choose.add_argument(
        "--local",
        action="store_true",
        help="compare in-process with the NumPy emulation of the device; no server (--url is ignored)",
    )


_IDENTIFY_EPILOG = """\
exit status:
  0  at least one profile's emulation is bit-identical to grad_x
  1  none is (every profile accepting the call gives other bits)
  2  usage error (bad arguments, a file that cannot be read)
  3  input rejected: every profile refuses the call, or grad_x is not the call's dtype or [N, H]
"""


def _add_identify_parser(commands: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """``moegrad identify``: which device profile's emulation is bit-identical to a grad_x (no server)."""
    identify = commands.add_parser(
        "identify",
        help="tell which device profile (chip and CANN release) made a grad_x, in-process",
        formatter_class=formatter,
        epilog=_IDENTIFY_EPILOG,
        description="Emulate the call on every device profile (each chip at each CANN release, and\n"
        "Huawei's sequential golden) and compare each result with grad_x bit for bit: print\n"
        "which profiles are bit-identical, how many elements differ for the others, and\n"
        "which refuse the call (with the status code). Give the call's .npy files and\n"
        "--grad-x, or one case file (--case: its candidate is the grad_x).",
    )
    call = identify.add_argument_group("the operator call and its result")
    call.add_argument("--grad-expanded-x", metavar="PATH", help="gradExpandedX .npy (as for `local`)")
    call.add_argument("--expanded-row-idx", metavar="PATH", help="expandedRowIdx .npy, [N*K] int32")
    call.add_argument("--top-k", type=int, metavar="K", help="K, experts per token (> 0)")
    call.add_argument("--drop-pad-mode", type=int, default=0, metavar="M", help="0 dropless/active, 1 drop/pad")
    call.add_argument("--active-num", type=int, default=0, metavar="A", help="A in active mode; 0 dropless")
    call.add_argument("--allow-duplicate-indices", action="store_true", help="accept repeated indices")
    call.add_argument("--grad-x", metavar="PATH", help="the grad_x to identify, .npy [N, H] in the call's dtype")
    call.add_argument("--case", metavar="FILE", help='a case .npz instead (docs/accuracy.md, "Bulk checking")')
    shown = identify.add_argument_group("what to ask and print")
    shown.add_argument(
        "--profile",
        action="append",
        dest="profiles",
        choices=ORDERS,
        metavar="P",
        help="a profile to ask about, repeatable (default: every profile)",
    )
    shown.add_argument("--json", action="store_true", help="print the result as JSON (Identification.to_dict())")
