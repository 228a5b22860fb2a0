"""The arguments of the commands that put a candidate's code on the bench: ``probe-order``, ``shrink``,
``determinism``, and ``compare --order-free``'s options (docs/accuracy.md, "The candidate on the bench").

What each does is :mod:`moegrad.cli._candidate_commands`'s; this module only says what they take, with
the help text and the exit statuses. :mod:`moegrad.cli._parser` calls :func:`add_candidate_commands`
and :func:`add_order_free_options`, and hands over its own builder of the call's flags.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from moegrad import GRAD_DTYPES, ORDER_FREE_LIMITS, PROBE_LIMITS
from moegrad.accuracy import DEFAULT_MAX_TESTS, LABELS
from moegrad.cli._bulk import int_at_least

__all__ = ["CANDIDATE_TOKEN_ENV", "add_candidate_commands", "add_order_free_options"]

#: The environment variable that gives ``--candidate-token`` its default.
CANDIDATE_TOKEN_ENV = "MOEGRAD_CANDIDATE_TOKEN"

_FAILED = (
    "  4  the candidate raised, or returned something other than grad_x [N, H], or its v2 server\n"
    "     answered an error, timed out or could not be reached\n"
)
_TAIL = (
    "  70  an internal error: a bug in moegrad (the message says how to report it)\n"
    "  130, 143  interrupted by SIGINT (Ctrl-C) / SIGTERM\n"
)
_CANDIDATE_NOTE = f"""
the candidate: --candidate package.module:function imports a callable fn(grad_expanded_x,
expanded_row_idx, top_k, *, drop_pad_mode, active_num) -> grad_x from the current folder or the
installed packages (NumPy arrays, or torch tensors: --accepts, --device); --candidate-url URL calls
a protocol v2 (KServe / Triton) server serving one (token: --candidate-token, ${CANDIDATE_TOKEN_ENV}).
"""
_EPILOGS = {
    "probe-order": "exit status:\n"
    "  0  the candidate's tree of adds was found (printed with the profiles that add that way)\n"
    "  1  no single tree of two-operand float32 adds explains its answers (the message says why)\n"
    "  2  usage error (bad arguments, a --candidate that cannot be imported, K or the dtype out of range)\n"
    + _FAILED
    + _TAIL
    + _CANDIDATE_NOTE,
    "shrink": "exit status:\n"
    "  0  the candidate gives the device's bits on this call: nothing to shrink\n"
    "  1  a fault was shrunk and its reproducer written; or the candidate gave other bits on a second\n"
    "     run of the smallest call (it is not deterministic: try `moegrad determinism`)\n"
    "  2  usage error (bad arguments, an unreadable .npy or case file, an --output that cannot be\n"
    "     written, a --label or --row that no differing row has, a --candidate that cannot be imported)\n"
    "  3  input rejected by the operator's constraints (the message names the field and the aclnn code)\n"
    + _FAILED
    + _TAIL
    + _CANDIDATE_NOTE,
    "determinism": "exit status:\n"
    "  0  the same bits in every run\n"
    "  1  some rows vary between runs, or some result lies outside the any-order bound (a fault)\n"
    "  2  usage error (bad arguments, an unreadable .npy or case file, a --candidate that cannot be imported)\n"
    "  3  input rejected by the operator's constraints (the message names the field and the aclnn code)\n"
    + _FAILED
    + _TAIL
    + _CANDIDATE_NOTE,
}


def _file_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} must be a plain file name: letters, digits, '_', '.', '-'")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0")
    return value


def _candidate_arguments(parser: argparse.ArgumentParser, *, spec: bool = True) -> None:
    """The candidate's flags; ``spec=False`` when the command has its own ``--candidate``."""
    group = parser.add_argument_group("the candidate (its code, or a v2 server serving it; give one)")
    if spec:
        group.add_argument(
            "--candidate",
            metavar="MODULE:FUNCTION",
            help="the callable to put on the bench, package.module:function (the current folder is searched first)",
        )
    group.add_argument(
        "--candidate-url",
        metavar="URL",
        help="a protocol v2 server serving the candidate: http(s)://host:port (the model "
        "moe_init_routing_v2_grad) or the full .../v2/models/<model>/infer URL",
    )
    group.add_argument(
        "--candidate-token",
        default=os.environ.get(CANDIDATE_TOKEN_ENV),
        metavar="TOKEN",
        help=f"bearer token for the v2 server (default: ${CANDIDATE_TOKEN_ENV})",
    )
    group.add_argument(
        "--candidate-parameter",
        action="append",
        metavar="KEY=VALUE",
        help="an extra v2 request parameter, repeatable (VALUE read as JSON when it parses, else a string), "
        "e.g. order=ascend950@9.1 for a moegrad service",
    )
    group.add_argument(
        "--accepts",
        choices=("auto", "numpy", "torch"),
        default="auto",
        help="how the callable takes its tensors: NumPy arrays or torch tensors; auto: torch for a "
        "torch.nn.Module or a first parameter annotated torch.Tensor, else NumPy (default: %(default)s)",
    )
    group.add_argument("--device", metavar="DEVICE", help="the torch device of the inputs (e.g. cuda; default: cpu)")
    group.add_argument(
        "--candidate-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="the longest one v2 request may take (default: %(default)s)",
    )


def _case_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        metavar="FILE",
        help='a case .npz holding the call instead of the .npy files (docs/accuracy.md, "Bulk checking"; '
        "its candidate grad_x is not used)",
    )


def add_candidate_commands(commands: Any, formatter: type[argparse.HelpFormatter], call_arguments: Any) -> None:
    """Add ``probe-order``, ``shrink`` and ``determinism`` to ``commands``.

    ``call_arguments(parser, order_default=..., output=False, required=False)`` adds the call's
    flags (:mod:`moegrad.cli._parser`'s own builder).
    """
    _add_probe_order(commands, formatter)
    _add_shrink(commands, formatter, call_arguments)
    _add_determinism(commands, formatter, call_arguments)


def _add_probe_order(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    probe = commands.add_parser(
        "probe-order",
        help="reveal a candidate's order of adds for K slots (FPRev), and the profiles that add that way",
        formatter_class=formatter,
        epilog=_EPILOGS["probe-order"],
        description="Call the candidate on FPRev's probes (a +M and a -M that cancel where they meet,\n"
        "units elsewhere) and rebuild its tree of adds over K slots: printed as an expression\n"
        "(slot t is vt, every add in parentheses), with the device profiles whose order is that\n"
        'tree (docs/accuracy.md, "Its order of adds"). A candidate whose answers fit no single\n'
        "tree (an order that changes between runs, rows or values; a narrow or exact accumulator)\n"
        "is refused with the reason, never given a guessed tree.",
    )
    probe.add_argument("--top-k", type=int_at_least(1), required=True, metavar="K", help="K, the slots per token")
    probe.add_argument(
        "--dtype",
        choices=GRAD_DTYPES,
        default="float32",
        help="the probes' dtype (largest K: " + ", ".join(f"{d} {k}" for d, k in PROBE_LIMITS.items()) + ")",
    )
    probe.add_argument(
        "--tokens", type=int_at_least(1), metavar="N", help="N of every probe call (default: just enough for all pairs)"
    )
    probe.add_argument("--hidden", type=int_at_least(1), metavar="H", help="H of every probe call (default: 64)")
    probe.add_argument(
        "--ub-size-bytes",
        type=int_at_least(1),
        default=253952,
        metavar="B",
        help="the Ascend 950's UB size its tiling uses",
    )
    probe.add_argument(
        "--vector-core-count", type=int_at_least(1), default=64, metavar="C", help="the Ascend 950's vector cores"
    )
    probe.add_argument("--seed", type=int_at_least(0), default=0, help="the random check inputs' seed (default: 0)")
    probe.add_argument("--json", action="store_true", help="print the result as JSON")
    _candidate_arguments(probe)


def _add_shrink(commands: Any, formatter: type[argparse.HelpFormatter], call_arguments: Any) -> None:
    shrink = commands.add_parser(
        "shrink",
        help="shrink a call on which a candidate fails to the smallest that keeps the same fault, with a reproducer",
        formatter_class=formatter,
        epilog=_EPILOGS["shrink"],
        description="Explain the candidate's grad_x on the call (moegrad.explain), take one fault (a\n"
        "label, and for a summand fault its slot), and remove tokens, then columns, then slots,\n"
        "then simplify values toward small integers, then (drop/pad) experts and capacity, by\n"
        "delta debugging, keeping each smaller call only while the candidate fails on it with\n"
        "the same fault. Writes a reproducer to --output: NAME.npz (a case file) and NAME.py, a\n"
        "script that replays it and exits 1 while the fault reproduces, 0 once the candidate\n"
        'gives the device\'s bits (docs/accuracy.md, "The smallest failing call").',
    )
    call_arguments(shrink, order_default="the case's, else ascend910b@9.1", output=False, required=False)
    _case_argument(shrink)
    chosen = shrink.add_argument_group("the fault and the reproducer")
    chosen.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DIR",
        help="the folder to write the reproducer to (created if missing)",
    )
    chosen.add_argument(
        "--name",
        type=_file_name,
        default="reproducer",
        help="the reproducer's files: NAME.npz and NAME.py (default: %(default)s)",
    )
    chosen.add_argument(
        "--label",
        choices=LABELS,
        metavar="LABEL",
        help=f"the fault to shrink, by its label: {', '.join(LABELS)} (default: the first row with a "
        "definite fault, else the first that differs)",
    )
    chosen.add_argument("--row", type=int_at_least(0), metavar="I", help="the fault of this row of grad_x instead")
    chosen.add_argument(
        "--max-tests",
        type=int_at_least(1),
        default=DEFAULT_MAX_TESTS,
        metavar="N",
        help="the most candidate calls to make (default: %(default)s)",
    )
    chosen.add_argument("--json", action="store_true", help="print the result as JSON")
    _candidate_arguments(shrink)


def _add_determinism(commands: Any, formatter: type[argparse.HelpFormatter], call_arguments: Any) -> None:
    determinism = commands.add_parser(
        "determinism",
        help="run a candidate several times on one call: which rows vary, and is every result within the bound",
        formatter_class=formatter,
        epilog=_EPILOGS["determinism"],
        description="Run the candidate --runs times on the call and count the distinct results of each\n"
        "row (bits). Atomic accumulation varies on rows with three or more slots while every\n"
        "result stays within the any-order bound of the float64 golden; a result beyond it is a\n"
        'lost or repeated add (docs/accuracy.md, "Same bits twice").',
    )
    call_arguments(determinism, order_default="the case's, else ascend910b@9.1", output=False, required=False)
    _case_argument(determinism)
    determinism.add_argument(
        "--runs", type=int_at_least(2), default=10, metavar="R", help="runs (default: %(default)s)"
    )
    determinism.add_argument("--json", action="store_true", help="print the result as JSON")
    _candidate_arguments(determinism)


def add_order_free_options(comparison: argparse.ArgumentParser) -> None:
    """``compare --order-free``: a candidate's code run on order-free inputs, in-process."""
    group = comparison.add_argument_group(
        "order-free inputs (--order-free: bug or rounding, in one run)",
        "With --order-free, compare builds a valid call on which every order of float32 adds gives\n"
        "the golden's bits (moegrad.order_free_inputs), runs the candidate's code on it (--candidate\n"
        "MODULE:FUNCTION or --candidate-url URL) and prints 'clean' (exit 0) or 'fault' (exit 1),\n"
        "with the rows at fault explained. No server: --url is not used. --top-k, --drop-pad-mode,\n"
        "--active-num and --order (the profile whose rules check the call) apply.",
    )
    group.add_argument("--order-free", action="store_true", help="run the candidate's code on order-free inputs")
    group.add_argument("--tokens", type=int_at_least(1), default=64, metavar="N", help="N (default: %(default)s)")
    group.add_argument("--hidden", type=int_at_least(1), default=64, metavar="H", help="H (default: %(default)s)")
    group.add_argument(
        "--dtype",
        choices=GRAD_DTYPES,
        default="float32",
        help="the inputs' dtype (largest K: " + ", ".join(f"{d} {k}" for d, k in ORDER_FREE_LIMITS.items()) + ")",
    )
    group.add_argument(
        "--expert-num", type=int_at_least(1), metavar="E", help="E, the experts routed to (default: max(8, K))"
    )
    group.add_argument(
        "--expert-capacity", type=int_at_least(1), metavar="C", help="C in drop/pad mode (default: ceil(N*K / E))"
    )
    group.add_argument("--seed", type=int_at_least(0), default=0, help="the inputs' seed (default: %(default)s)")
    group.add_argument(
        "--save-case",
        metavar="FILE",
        help="on a fault, write the call and the candidate's grad_x as a case file (for `moegrad shrink --case`)",
    )
    _candidate_arguments(comparison, spec=False)
