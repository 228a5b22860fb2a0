"""The ``moegrad`` command: aclnnMoeInitRoutingV2Grad on .npy files, through a service or in-process.

Every remote command goes through :class:`moegrad.Client`; ``local`` calls
:func:`moegrad.moe_init_routing_v2_grad` and ``compare --local`` calls :func:`moegrad.compare`.
There is no third code path; reports are rendered by :mod:`moegrad.accuracy` in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from moegrad._client import Client
from moegrad._errors import InvalidArgument, MalformedRequest, MoegradError
from moegrad._reference import moe_init_routing_v2_grad
from moegrad._results import CompareResult, GradResult
from moegrad._spec import ORDERS, MoeInitRoutingV2GradCall
from moegrad._version import __version__
from moegrad.accuracy import (
    DEFAULT_STANDARDS,
    STANDARDS,
    CaseResult,
    ComparisonReport,
    compare,
    compare_cases,
    compare_in_process,
    find_cases,
    format_report,
    load_case,
    report_context,
    with_context,
    write_csv_report,
    write_json_report,
    write_markdown_report,
    write_summary,
)

__all__ = ["load_npy", "main", "save_npy"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_REJECTED = 3
EXIT_FAILURE = 4

_DEFAULT_URL = "http://127.0.0.1:8000"

# The documentation's example (docs/operator.md, "The documentation's example"): the expected gradX
# is [[0.3, 0.3], [0.7, 0.7]]; in float32, 0.2 + 0.1 rounds to 0.3 and 0.4 + 0.3 to 0.70000005.
_EXAMPLE_GRAD_EXPANDED_X = [[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]]
_EXAMPLE_EXPANDED_ROW_IDX = [2, 0, 1, 3]
_EXAMPLE_TOP_K = 2
_EXAMPLE_EXPECTED = [[0.3, 0.3], [0.70000005, 0.70000005]]

_DESCRIPTION = """\
aclnnMoeInitRoutingV2Grad, the backward of MoE token routing:
    grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]
computed by a moegrad service (the NPU, or its bit-exact emulation) or in-process.
"""

_EPILOG = """\
exit status:
  0  success (`compare`: the candidate passed; a warning passes)
  1  `example`: the result differs from the documentation's bit for bit; `compare`: a standard failed
     (or, with --require-exact, the candidate is not bit-exact; with --cases, any case failed or was invalid)
  2  usage error (bad arguments, an input .npy that cannot be read, an output that cannot be written)
  3  input rejected by the operator's constraints (the message names the field and the aclnn code)
  4  the server failed, was busy past all retries, timed out, or could not be reached

.npy files: tensors are read with numpy.load (no pickles) and written with numpy.save. numpy has no
bfloat16, so numpy.save writes an ml_dtypes.bfloat16 array as the raw 2-byte type '|V2'; moegrad
reads any '|V2' array back as ml_dtypes.bfloat16 and writes a bfloat16 grad_x the same way (load it
with numpy.load(path).view(ml_dtypes.bfloat16)).

environment:
  MOEGRAD_URL    default for --url (else http://127.0.0.1:8000)
  MOEGRAD_TOKEN  default for --token
"""


# --------------------------------------------------------------------------------------------------
# .npy in and out
# --------------------------------------------------------------------------------------------------


def load_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an array saved with ``numpy.save``; a raw 2-byte ``|V2`` array is read as bfloat16.

    ``numpy.save`` of an ``ml_dtypes.bfloat16`` array writes the dtype descriptor ``'<V2'`` (NumPy
    does not know the type), so ``numpy.load`` gives back untyped 2-byte words; they are viewed as
    ``ml_dtypes.bfloat16`` here, which restores the array bit for bit.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a single-array .npy file (pickled objects are refused).
    """
    array = np.load(os.fspath(path), allow_pickle=False)
    if not isinstance(array, np.ndarray):  # an .npz archive
        array.close()
        raise ValueError(f"{os.fspath(path)} is an .npz archive; save one array with numpy.save")
    if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.fields is None:
        array = array.view(ml_dtypes.bfloat16)
    return array


def save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` to exactly ``path`` with ``numpy.save`` (bfloat16 is stored as ``|V2``, see :func:`load_npy`)."""
    with open(os.fspath(path), "wb") as file:
        np.save(file, array, allow_pickle=False)


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


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
        default=os.environ.get("MOEGRAD_URL") or _DEFAULT_URL,
        help=f"the service's root URL (default: $MOEGRAD_URL, else {_DEFAULT_URL}; now %(default)s)",
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
        'per case: docs/accuracy.md, "Bulk checking") and a summary is written; exit 1\n'
        "when any case failed or was invalid, and the run never stops on a bad case.",
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
        help="a progress bar on stderr (default: when stderr is a terminal)",
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


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


class _UsageError(Exception):
    """A file named on the command line cannot be read or written (exit 2)."""


def _client(args: argparse.Namespace) -> Client:
    try:
        return Client(
            args.url,
            timeout_s=args.timeout,
            retries=args.retries,
            token=args.token,
            verify=args.cacert if args.cacert else True,
        )
    except (TypeError, ValueError) as exc:  # e.g. a --url that is not an http(s) URL
        raise _UsageError(str(exc)) from None


def _load(path: str, flag: str) -> np.ndarray:
    try:
        return load_npy(path)
    except (OSError, ValueError) as exc:
        raise _UsageError(f"cannot read {flag} {path}: {exc}") from None


def _call_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in ("grad_expanded_x", "expanded_row_idx"):
        fields[name] = _load(getattr(args, name), f"--{name.replace('_', '-')}")
    fields.update(
        top_k=args.top_k,
        drop_pad_mode=args.drop_pad_mode,
        active_num=args.active_num,
        allow_duplicate_indices=args.allow_duplicate_indices,
    )
    if args.order is not None:
        fields["order"] = args.order
    return fields


def _check_writable(path: str) -> None:
    """Refuse an output path whose folder does not exist, before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _UsageError(f"cannot write -o {path}: the folder {folder} does not exist")


def _write(path: str, grad_x: np.ndarray) -> None:
    try:
        save_npy(path, grad_x)
    except OSError as exc:
        raise _UsageError(f"cannot write -o {path}: {exc}") from None


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype.name} {list(array.shape)}"


def _server_summary(result: GradResult | CompareResult) -> str:
    timings = result.timings_ms
    parts = [
        f"{name} {timings[name]:.3f} ms"
        for name in ("compute", "golden", "compare", "total")
        if isinstance(timings.get(name), (int, float))
    ]
    timing = f"; on the server: {', '.join(parts)}" if parts else ""
    return f"backend {result.backend}, order {result.order}, device {result.device or '-'}{timing}"


def _cmd_grad(args: argparse.Namespace) -> int:
    call = MoeInitRoutingV2GradCall(**_call_fields(args))  # the Client's own local check, before connecting
    _check_writable(args.output)
    with _client(args) as client:
        result = client.run(call)
    _write(args.output, result.grad_x)
    print(f"wrote {args.output}: grad_x {_describe(result.grad_x)} ({_server_summary(result)})")
    return EXIT_OK


def _cmd_local(args: argparse.Namespace) -> int:
    fields = _call_fields(args)
    _check_writable(args.output)
    grad_x = moe_init_routing_v2_grad(**fields)
    _write(args.output, grad_x)
    print(f"wrote {args.output}: grad_x {_describe(grad_x)} (in-process, order {args.order or 'ascend910b'})")
    return EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.cases:
        return _cmd_compare_cases(args)
    missing = [
        flag
        for flag, value in (
            ("--grad-expanded-x", args.grad_expanded_x),
            ("--expanded-row-idx", args.expanded_row_idx),
            ("--top-k", args.top_k),
            ("--candidate", args.candidate),
        )
        if value is None
    ]
    if missing:
        raise _UsageError(f"compare needs {', '.join(missing)} (or --cases DIR)")
    fields = _call_fields(args)
    candidate = _load(args.candidate, "--candidate")
    device_result = None
    if args.local:
        call = MoeInitRoutingV2GradCall(**fields)
        report: ComparisonReport = compare(call, candidate, standards=args.standards, require_exact=args.require_exact)
        source = f"in-process emulation, order {call.order}"
        context = report_context(call, candidate)
    else:
        with _client(args) as client:
            result = client.compare(
                **fields,
                candidate=candidate,
                standards=args.standards,
                require_exact=args.require_exact,
                return_grad_x=bool(args.report),
            )
        report, source, device_result = result.report, _server_summary(result), result.grad_x
        call = MoeInitRoutingV2GradCall(**fields)  # the Client checked it already
        context = report_context(
            call, candidate, backend=result.backend, device=result.device, server_url=args.url, order=result.order
        )
    report = with_context(report, context)
    png = _write_reports(
        args.report,
        args.report_json,
        args.report_csv,
        report,
        call,
        candidate,
        source,
        device_result if not args.local else None,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_report(report, source=source), end="")
        if args.report:
            drawn = f" and {png}" if png is not None else " (histogram skipped: matplotlib is not installed)"
            print(f"\nwrote {args.report}{drawn}")
    return EXIT_OK if report.passed else EXIT_MISMATCH


def _write_reports(
    markdown: str | None,
    json_path: str | None,
    csv_path: str | None,
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    source: str | None,
    device_result: np.ndarray | None,
) -> Any:
    png = None
    for flag, path, write in (
        ("--report-json", json_path, lambda p: write_json_report(p, report)),
        ("--report-csv", csv_path, lambda p: write_csv_report(p, report)),
    ):
        if path:
            try:
                write(path)
            except OSError as exc:
                raise _UsageError(f"cannot write {flag} {path}: {exc}") from None
    if markdown:
        try:
            png = write_markdown_report(
                markdown,
                report,
                call,
                candidate,
                source=source,
                device_result=device_result
                if device_result is not None
                else (moe_init_routing_v2_grad(call) if call is not None else None),
            )
        except OSError as exc:
            raise _UsageError(f"cannot write --report {markdown}: {exc}") from None
    return png


def _cmd_compare_cases(args: argparse.Namespace) -> int:
    try:
        files = find_cases(args.cases)
    except OSError as exc:
        raise _UsageError(f"cannot read --cases {args.cases}: {exc}") from None
    prefix = args.summary or os.path.join(args.cases, "summary")
    _check_writable(prefix)
    if args.reports:
        try:
            os.makedirs(args.reports, exist_ok=True)
        except OSError as exc:
            raise _UsageError(f"cannot create --reports {args.reports}: {exc}") from None

    def save(result: CaseResult) -> None:
        if not args.reports or result.report is None or result.path is None:
            return
        fields, candidate = load_case(result.path)
        call = MoeInitRoutingV2GradCall(**fields)
        base = os.path.join(args.reports, result.name)
        device = moe_init_routing_v2_grad(call) if args.local else None
        _write_reports(base + ".md", base + ".json", base + ".csv", result.report, call, candidate, None, device)

    if args.local:
        results = compare_cases(
            files, compare_in_process(args.standards, args.require_exact), progress=args.progress, on_result=save
        )
        where = "in-process emulation"
    else:
        with _client(args) as client:
            results = client.compare_many(
                files,
                standards=args.standards,
                require_exact=args.require_exact,
                progress=args.progress,
                on_result=save,
            )
        where = args.url
    try:
        ordered = write_summary(results, prefix + ".csv", prefix + ".md")
    except OSError as exc:
        raise _UsageError(f"cannot write --summary {prefix}: {exc}") from None
    counts = {
        status: sum(1 for r in ordered if r.status == status)
        for status in ("pass", "warning", "fail", "invalid", "error")
    }
    print(f"{len(ordered)} cases against {where}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    for result in ordered:
        worst = None if result.report is None else result.report.candidate_vs_golden.worst  # None: error says why
        detail = result.error or (worst and f"worst row {worst.row}") or ""
        print(f"  {result.status:<8} {result.name}  {detail}")
    print(f"wrote {prefix}.csv and {prefix}.md" + (f"; reports in {args.reports}" if args.reports else ""))
    return EXIT_OK if all(r.status in ("pass", "warning") for r in ordered) else EXIT_MISMATCH


def _format(array: np.ndarray) -> str:
    """A small 2-D array with each element's shortest round-trip repr in its own dtype."""
    return "[" + ", ".join("[" + ", ".join(str(v) for v in row) + "]" for row in array) + "]"


def _cmd_example(args: argparse.Namespace) -> int:
    grad_expanded_x = np.array(_EXAMPLE_GRAD_EXPANDED_X, dtype=np.float32)
    expanded_row_idx = np.array(_EXAMPLE_EXPANDED_ROW_IDX, dtype=np.int32)
    expected = np.array(_EXAMPLE_EXPECTED, dtype=np.float32)
    call = MoeInitRoutingV2GradCall(
        grad_expanded_x=grad_expanded_x, expanded_row_idx=expanded_row_idx, top_k=_EXAMPLE_TOP_K
    )
    with _client(args) as client:
        result = client.run(call)
    got = result.grad_x
    same = (
        got.dtype == expected.dtype
        and got.shape == expected.shape
        and bool(np.array_equal(got.view(np.uint32), expected.view(np.uint32)))
    )
    print("the documentation's example of aclnnMoeInitRoutingV2Grad")
    print(f"  grad_expanded_x  {_format(grad_expanded_x)} float32")
    print(
        f"  expanded_row_idx {_EXAMPLE_EXPANDED_ROW_IDX} int32, top_k={_EXAMPLE_TOP_K}, drop_pad_mode=0, active_num=0"
    )
    print(f"  result           {_format(got)} {got.dtype.name}  ({_server_summary(result)})")
    print(f"  expected         {_format(expected)} float32  (documentation: [[0.3, 0.3], [0.7, 0.7]])")
    print(f"  bit-exact match: {'yes' if same else 'NO'}")
    return EXIT_OK if same else EXIT_MISMATCH


def _cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.info()
    print(json.dumps(info, indent=2, sort_keys=True))
    return EXIT_OK


_COMMANDS = {
    "grad": _cmd_grad,
    "local": _cmd_local,
    "compare": _cmd_compare,
    "example": _cmd_example,
    "info": _cmd_info,
}


def _rejection(exc: InvalidArgument | MalformedRequest) -> str:
    if isinstance(exc, InvalidArgument):
        return str(exc)  # message [field F] (ACLNN_NAME code)
    where = f" [field {exc.field}]" if exc.field else ""
    return f"{exc.message}{where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``moegrad`` command; returns the exit status (argparse exits with 2 on usage errors)."""
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:  # `moegrad ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except _UsageError as exc:
        print(f"moegrad: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidArgument, MalformedRequest) as exc:  # PayloadTooLarge is a MalformedRequest
        print(f"moegrad: rejected input: {type(exc).__name__}: {_rejection(exc)}", file=sys.stderr)
        return EXIT_REJECTED
    except MoegradError as exc:
        print(f"moegrad: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
