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
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from moegrad import (
    CompareResult,
    Explanation,
    GradResult,
    InvalidArgument,
    MalformedRequest,
    MoegradError,
    MoeInitRoutingV2GradCall,
    __version__,
    identify,
    moe_init_routing_v2_grad,
)
from moegrad.accuracy import (
    PLOT_MISSING,
    ComparisonReport,
    compare,
    console_text,
    context_call,
    format_report,
    load_case,
    report_context,
    with_context,
    with_explanation,
    with_profiles,
    with_row_errors,
    write_csv_report,
    write_json_report,
    write_markdown_report,
)
from moegrad.cli._candidate_commands import run_determinism, run_order_free, run_probe_order, run_shrink
from moegrad.cli._explain import cmd_explain, explain_compared, explanation_text, write_explanation
from moegrad.cli._html import check_html, write_case_page, write_sweep_page
from moegrad.cli._inputs import (
    TENSOR_FIELDS,
    call_fields,
    check_writable,
    load_npy,
    open_client,
    read_npy,
    save_npy,
    write_npy,
)
from moegrad.cli._parser import (
    EXIT_FAILURE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    UsageError,
    build_parser,
    default_urls,
    with_flags,
)
from moegrad.cli._sweep import run_cases, run_merge
from moegrad.wire import fields_document

__all__ = ["load_npy", "main", "save_npy"]


# The documentation's example (docs/operator.md, "The documentation's example"): the expected gradX
# is [[0.3, 0.3], [0.7, 0.7]]; in float32, 0.2 + 0.1 rounds to 0.3 and 0.4 + 0.3 to 0.70000005.
_EXAMPLE_GRAD_EXPANDED_X = [[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]]
_EXAMPLE_EXPANDED_ROW_IDX = [2, 0, 1, 3]
_EXAMPLE_TOP_K = 2
_EXAMPLE_EXPECTED = [[0.3, 0.3], [0.70000005, 0.70000005]]


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype.name} {list(array.shape)}"


def _duration(ms: float) -> str:
    return f"{ms:.3f} ms" if ms >= 1 else f"{ms * 1e3:.1f} µs"


def _server_summary(result: GradResult | CompareResult) -> str:
    timings = result.timings_ms
    parts = [  # a golden of 0 ms is not measured: the comparison computes it (docs/protocol.md)
        f"{name} {_duration(timings[name])}"
        for name in ("compute", "golden", "compare", "total")
        if isinstance(timings.get(name), (int, float)) and (timings[name] or name != "golden")
    ]
    timing = f"; on the server: {', '.join(parts)}" if parts else ""
    return console_text(f"backend {result.backend}, order {result.order}, device {result.device or '-'}{timing}")


def _call_document(fields: dict[str, Any]) -> dict[str, Any]:
    """The call as a wire document, which ``Client.run`` checks before sending it (by the server's
    profile when it names none); a tensor of a dtype the wire does not carry is refused here, as
    every profile refuses it (161002)."""
    try:
        return fields_document(fields)
    except TypeError:
        MoeInitRoutingV2GradCall(**fields)  # raises InvalidArgument, naming the tensor and its dtype
        raise


def _cmd_grad(args: argparse.Namespace) -> int:
    document = _call_document(call_fields(args))
    check_writable(args.output)
    with open_client(args) as client:
        result = client.run(document)
    write_npy(args.output, result.grad_x)
    print(f"wrote {args.output}: grad_x {_describe(result.grad_x)} ({_server_summary(result)})")
    return EXIT_OK


def _cmd_local(args: argparse.Namespace) -> int:
    call = MoeInitRoutingV2GradCall(**call_fields(args))
    check_writable(args.output)
    grad_x = moe_init_routing_v2_grad(call)
    write_npy(args.output, grad_x)
    print(f"wrote {args.output}: grad_x {_describe(grad_x)} (in-process, order {call.order})")
    return EXIT_OK


def _refuse_sweep_flags_out_of_place(args: argparse.Namespace) -> None:
    """UsageError: a sweep's flags without ``--cases DIR``, ``--plots`` without ``--reports``, or
    ``--exit-zero-on-findings`` with ``--merge``."""
    sweep_only = [
        flag
        for flag, value in (
            ("--shard", args.shard),
            ("--output", args.output),
            ("--max-concurrency", args.max_concurrency),
            ("--exit-zero-on-findings", args.exit_zero_on_findings),
        )
        if value
    ]
    if sweep_only and not args.cases:
        raise UsageError(f"{', '.join(sweep_only)} need --cases DIR")
    if args.plots and not args.reports:
        raise UsageError(f"--plots {args.plots} needs --reports OUT (the folder each case's report and plot go to)")
    if args.merge and args.exit_zero_on_findings:
        raise UsageError(
            "--exit-zero-on-findings is for a sweep's runs, not --merge: its exit status is the sweep's verdict"
        )


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.order_free or args.candidate_url:  # the candidate's code on order-free inputs, in-process
        return run_order_free(args)
    _refuse_sweep_flags_out_of_place(args)
    check_html(args)
    if args.merge:
        return run_merge(args, on_results=write_sweep_page(args))
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
        raise UsageError(f"compare needs {', '.join(missing)} (or --cases DIR)")
    fields = call_fields(args)
    candidate = read_npy(args.candidate, "--candidate")
    args.explain = args.explain or bool(args.html)  # the page shows the labels
    report, call, source, device_result = _judged(args, fields, candidate)
    explanation = explain_compared(call, candidate, device_result) if args.explain else None
    if explanation is not None:
        report = with_explanation(report, explanation)
    report = with_row_errors(report, call, candidate, device_result=device_result)  # where the error lives
    if args.profiles:
        report = with_profiles(report, call, candidate)
    paths = (args.report, args.report_json, args.report_csv)
    png = _write_reports(*paths, report, call, candidate, source, device_result, explanation)
    if args.html:
        write_case_page(args.html, report, call, candidate, device_result, explanation)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_report(report, source=source), end="")
        if explanation is not None:
            print("\n" + explanation_text(explanation), end="")
        if args.report:
            drawn = f" and {png}" if png is not None else f" (histogram skipped: {PLOT_MISSING})"
            print(f"\nwrote {args.report}{drawn}")
        if args.html:
            print(f"wrote {args.html}")
    return EXIT_OK if report.passed else EXIT_MISMATCH


def _judged(
    args: argparse.Namespace, fields: dict[str, Any], candidate: np.ndarray
) -> tuple[ComparisonReport, MoeInitRoutingV2GradCall, str, np.ndarray | None]:
    """One call's comparison, in-process or on the service: the report with its context, the call
    on the profile that judged it, where the device result came from, and the service's device
    result (for the report's row errors, the markdown's plot and the explanation; None in-process)."""
    if args.local:
        call = MoeInitRoutingV2GradCall(**fields)
        report: ComparisonReport = compare(call, candidate, standards=args.standards, require_exact=args.require_exact)
        return (
            with_context(report, report_context(call, candidate)),
            call,
            f"in-process emulation, order {call.order}",
            None,
        )
    with open_client(args) as client:
        result = client.compare(
            **fields,
            candidate=candidate,
            standards=args.standards,
            require_exact=args.require_exact,
            return_grad_x=True,  # the report's row errors, the markdown's plot and the explanation read it
        )
    call = context_call(fields, result.order)  # the Client checked it already, on the profile that answered
    context = report_context(
        call,
        candidate,
        backend=result.backend,
        device=result.device,
        server_url=result.server_url or args.url[0],
        order=result.order,
    )
    return with_context(result.report, context), call, _server_summary(result), result.grad_x


def _write_reports(
    markdown: str | None,
    json_path: str | None,
    csv_path: str | None,
    report: ComparisonReport,
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    source: str | None,
    device_result: np.ndarray | None,
    explanation: Explanation | None = None,
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
                raise UsageError(f"cannot write {flag} {path}: {exc}") from None
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
            raise UsageError(f"cannot write --report {markdown}: {exc}") from None
    if explanation is not None:
        write_explanation(markdown, json_path, explanation)
    return png


def _cmd_compare_cases(args: argparse.Namespace) -> int:
    """``compare --cases DIR``: the sweep, its summary, its reports (:func:`moegrad.cli._sweep.run_cases`) and,
    with ``--html``, its page."""
    where = "in-process emulation" if args.local else ", ".join(args.url)
    return run_cases(args, open_client=lambda: open_client(args), where=where, on_results=write_sweep_page(args))


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
    with open_client(args) as client:
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


def _cmd_identify(args: argparse.Namespace) -> int:
    call_flags = {
        "--grad-expanded-x": args.grad_expanded_x,
        "--expanded-row-idx": args.expanded_row_idx,
        "--top-k": args.top_k,
        "--grad-x": args.grad_x,
    }
    if args.case:
        given = [flag for flag, value in call_flags.items() if value is not None]
        if given:
            raise UsageError(f"--case FILE holds the call and grad_x: leave out {', '.join(given)}")
        try:
            fields, grad_x = load_case(args.case)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read --case {args.case}: {exc}") from None
        fields.pop("order", None)  # every profile is asked
    else:
        missing = [flag for flag, value in call_flags.items() if value is None]
        if missing:
            raise UsageError(f"identify needs {', '.join(missing)} (or --case FILE)")
        fields = {name: read_npy(getattr(args, name), f"--{name.replace('_', '-')}") for name in TENSOR_FIELDS}
        fields.update(
            top_k=args.top_k,
            drop_pad_mode=args.drop_pad_mode,
            active_num=args.active_num,
            allow_duplicate_indices=args.allow_duplicate_indices,
        )
        grad_x = read_npy(args.grad_x, "--grad-x")
    result = identify(fields, grad_x, profiles=args.profiles)
    print(json.dumps(result.to_dict(), indent=2) if args.json else str(result), end="\n" if args.json else "")
    if result.matching:
        return EXIT_OK
    return EXIT_REJECTED if len(result.refusing) == len(result.profiles) else EXIT_MISMATCH


def _note_profiles(orders: dict[str, Any]) -> None:
    """A line on stderr when the replicas run different device profiles (their ``/v1/info`` ``order``)."""
    known = {url: order for url, order in orders.items() if order is not None}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"{url} {order}" for url, order in known.items())
        print(f"moegrad: the replicas run different device profiles: {listed}", file=sys.stderr)


def _cmd_info(args: argparse.Namespace) -> int:
    if len(args.url) == 1:
        with open_client(args) as client:
            info = client.info()
            served = [stats.url for stats in client.stats if stats.served]
        orders = info.pop("orders", {})  # printed: the server's own document
        print(json.dumps(info, indent=2, sort_keys=True))
        if args.url[0].lower().startswith("dns+") and served:
            print(f"moegrad: info of {served[0]}, one of the replicas of {args.url[0]}", file=sys.stderr)
        _note_profiles(orders)
        return EXIT_OK
    infos: dict[str, Any] = {}  # each replica's, in the order given
    for url in args.url:
        try:
            with open_client(argparse.Namespace(**{**vars(args), "url": [url]})) as client:
                infos[url] = client.info()
                infos[url].pop("orders", None)
        except MoegradError as exc:
            infos[url] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"moegrad: failed: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(json.dumps(infos, indent=2, sort_keys=False))
    _note_profiles({url: info.get("order") for url, info in infos.items()})
    return EXIT_FAILURE if any("error" in info for info in infos.values()) else EXIT_OK


def _cmd_probe_order(args: argparse.Namespace) -> int:
    return run_probe_order(args)


def _cmd_shrink(args: argparse.Namespace) -> int:
    return run_shrink(args, read_npy)


def _cmd_determinism(args: argparse.Namespace) -> int:
    return run_determinism(args, read_npy)


_COMMANDS = {
    "grad": _cmd_grad,
    "local": _cmd_local,
    "compare": _cmd_compare,
    "explain": cmd_explain,
    "example": _cmd_example,
    "info": _cmd_info,
    "identify": _cmd_identify,
    "probe-order": _cmd_probe_order,
    "shrink": _cmd_shrink,
    "determinism": _cmd_determinism,
}


def _rejection(exc: InvalidArgument | MalformedRequest) -> str:
    if isinstance(exc, InvalidArgument):
        return with_flags(str(exc))  # message [field F] (ACLNN_NAME code), with the flags typed
    where = f" [field {exc.field}]" if exc.field else ""
    return f"{exc.message}{where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``moegrad`` command; returns the exit status (argparse exits with 2 on usage errors).

    A reader that leaves early (``moegrad ... | head``) does not change the status: what is left to
    print goes to ``os.devnull`` (:class:`_Stdout`). A warning (:class:`moegrad.ReplicaWarning`) is
    one line on stderr. Ctrl-C is 130 without a traceback; an exception
    that is not one of moegrad's is a bug: one line saying so, and :data:`EXIT_INTERNAL` (70).
    """
    args = build_parser().parse_args(argv)
    if getattr(args, "url", False) is None:
        args.url = default_urls()
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)
    try:
        with warnings.catch_warnings():  # put back as it was when the command ends
            warnings.showwarning = _show_warning
            return _run(args)
    finally:
        sys.stdout.flush()  # here, not at exit: a closed pipe then costs nothing (exit 120 otherwise)
        sys.stdout = stdout


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    """A warning as the command's other lines read (``moegrad: warning: ...`` on stderr), not as
    Python shows one (its file, line and source); which warnings show is Python's filters' choice."""
    print(f"moegrad: warning: {console_text(str(message))}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"moegrad: error: {console_text(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidArgument, MalformedRequest) as exc:  # PayloadTooLarge is a MalformedRequest
        print(f"moegrad: rejected input: {type(exc).__name__}: {console_text(_rejection(exc))}", file=sys.stderr)
        return EXIT_REJECTED
    except MoegradError as exc:
        print(f"moegrad: failed: {type(exc).__name__}: {console_text(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("\nmoegrad: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: say so in one line, with the exit status no verdict uses
        if sys.flags.dev_mode:  # python -X dev -m moegrad ...: the traceback, for the report
            raise
        print(
            f"moegrad: internal error: {type(exc).__name__}: {console_text(str(exc))}. "
            f"This is a bug in moegrad {__version__}: "
            "please report it with the command line; `python -X dev -m moegrad ...` prints the traceback",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


class _Stdout:
    """``sys.stdout`` while a command runs. Once the reader has gone (``moegrad ... | head``: a
    write raises BrokenPipeError), the rest goes to ``os.devnull``, as the Python documentation
    advises for SIGPIPE ("Note on SIGPIPE", the signal module), and the command runs on to its own
    exit status: a verdict does not depend on who reads it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
