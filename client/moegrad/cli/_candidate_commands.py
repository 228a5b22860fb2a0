"""The commands that put a candidate's code on the bench: ``probe-order``, ``shrink``, ``determinism``
and ``compare --order-free`` (docs/accuracy.md, "The candidate on the bench").

Each is a thin client of the library's public functions (:func:`moegrad.probe_order`,
:func:`moegrad.shrink`, :func:`moegrad.check_determinism`, :func:`moegrad.order_free_inputs` with
:func:`moegrad.explain`); :mod:`moegrad.cli._main` dispatches to them and hands over its reader of
.npy files, and turns the exceptions they let through into exit statuses (a
:class:`~moegrad.CandidateError` is 4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import moegrad
from moegrad import Candidate, MoeInitRoutingV2GradCall, NothingToShrink, OrderProbeError, ShrinkError
from moegrad.accuracy import load_case, save_case
from moegrad.cli._parser import EXIT_MISMATCH, EXIT_OK, UsageError, index_as_int32

__all__ = ["run_determinism", "run_order_free", "run_probe_order", "run_shrink"]

ReadNpy = Callable[[str, str], np.ndarray]


def _parameters(items: list[str] | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    for item in items or []:
        key, equals, text = item.partition("=")
        if not equals or not key:
            raise UsageError(f"--candidate-parameter {item!r}: write it as KEY=VALUE")
        try:
            parameters[key] = json.loads(text)
        except ValueError:
            parameters[key] = text
    return parameters


def open_candidate(args: argparse.Namespace) -> Candidate:
    """The candidate that ``--candidate`` or ``--candidate-url`` names (exactly one of them).

    Raises:
        UsageError: neither or both; a URL that is not http(s); flags of the other kind; a
            candidate that does not import (any exception its module raises is reported).
    """
    spec, url = args.candidate, args.candidate_url
    if (spec is None) == (url is None):
        raise UsageError("give the candidate: --candidate package.module:function or --candidate-url URL (one)")
    if url is not None:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--candidate-url {url!r} is not an http(s) URL")
        if args.accepts != "auto" or args.device is not None:
            raise UsageError("--accepts and --device are for --candidate: a v2 server takes the wire's tensors")
        return Candidate(
            url,
            token=args.candidate_token,
            parameters=_parameters(args.candidate_parameter),
            timeout_s=args.candidate_timeout,
        )
    if args.candidate_parameter:
        raise UsageError("--candidate-parameter is for --candidate-url (a v2 request's parameters)")
    if os.getcwd() not in sys.path:  # as `python -m` does: the user's own modules import
        sys.path.insert(0, os.getcwd())
    try:
        return Candidate.load(spec, accepts=args.accepts, device=args.device)
    except ValueError as exc:  # not module:function, nothing callable there, --device without torch
        raise UsageError(f"--candidate {spec}: {exc}") from None
    except Exception as exc:  # the candidate's module may raise anything while it imports
        raise UsageError(f"cannot import --candidate {spec}: {type(exc).__name__}: {exc}") from None


def read_call(args: argparse.Namespace, read_npy: ReadNpy, command: str) -> MoeInitRoutingV2GradCall:
    """The call from ``--case FILE`` or from the .npy files and attributes.

    Raises:
        UsageError: both or neither given, or a file that cannot be read.
        InvalidArgument: the operator's rules refuse the call.
    """
    files = {
        "--grad-expanded-x": args.grad_expanded_x,
        "--expanded-row-idx": args.expanded_row_idx,
        "--top-k": args.top_k,
    }
    if args.case:
        given = [flag for flag, value in files.items() if value is not None]
        given += [
            flag
            for flag, value in (
                ("--drop-pad-mode", args.drop_pad_mode),
                ("--active-num", args.active_num),
                ("--allow-duplicate-indices", args.allow_duplicate_indices),
            )
            if value
        ]
        if given:
            raise UsageError(f"--case FILE holds the call: leave out {', '.join(given)}")
        try:
            fields, _ = load_case(args.case)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read --case {args.case}: {exc}") from None
    else:
        missing = [flag for flag, value in files.items() if value is None]
        if missing:
            raise UsageError(f"{command} needs {', '.join(missing)} (or --case FILE)")
        index = read_npy(args.expanded_row_idx, "--expanded-row-idx")
        fields = {
            "grad_expanded_x": read_npy(args.grad_expanded_x, "--grad-expanded-x"),
            "expanded_row_idx": index_as_int32(index, "--expanded-row-idx", args.expanded_row_idx),
            "top_k": args.top_k,
            "drop_pad_mode": args.drop_pad_mode,
            "active_num": args.active_num,
            "allow_duplicate_indices": args.allow_duplicate_indices,
        }
    if args.order is not None:
        fields["order"] = args.order
    return MoeInitRoutingV2GradCall(**fields)


def run_probe_order(args: argparse.Namespace) -> int:
    """``moegrad probe-order``: 0 a tree found, 1 no single tree explains the answers."""
    with open_candidate(args) as candidate:
        try:
            probe = moegrad.probe_order(
                candidate,
                args.top_k,
                args.dtype,
                num_tokens=args.tokens,
                hidden_size=args.hidden,
                ub_size_bytes=args.ub_size_bytes,
                vector_core_count=args.vector_core_count,
                seed=args.seed,
            )
        except OrderProbeError as exc:
            kind = type(exc).__name__
            if args.json:
                print(json.dumps({"error": kind, "message": exc.message, "calls": exc.calls}, indent=2))
            else:
                print(f"no single order of adds: {kind}: {exc.message} ({exc.calls} candidate calls)")
            return EXIT_MISMATCH
        except ValueError as exc:  # K or the dtype out of the probe's range, N or H out of range
            raise UsageError(str(exc)) from None
    if args.json:
        fields = ("top_k", "dtype", "num_tokens", "hidden_size", "expression", "profiles", "closest", "calls", "pairs")
        document = {name: getattr(probe, name) for name in fields}
        print(json.dumps({**document, "distances": dict(probe.distances)}, indent=2))
    else:
        print(probe)
    return EXIT_OK


def _check_output(folder: str) -> None:
    """Refuse an ``--output`` that cannot become a folder to write in, before any candidate call."""
    path = os.path.abspath(folder)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"cannot write the reproducer to --output {folder}: it is a file, not a folder")
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write the reproducer to --output {folder}: {path} is not a writable folder")


def run_shrink(args: argparse.Namespace, read_npy: ReadNpy) -> int:
    """``moegrad shrink``: 1 a fault shrunk and its reproducer written, 0 nothing to shrink."""
    _check_output(args.output)
    call = read_call(args, read_npy, "shrink")
    with open_candidate(args) as candidate:
        try:
            result = moegrad.shrink(call, candidate, label=args.label, row=args.row, max_tests=args.max_tests)
        except NothingToShrink as exc:
            print(f"nothing to shrink: {exc}")
            return EXIT_OK
        except ShrinkError as exc:
            print(f"moegrad: {exc}", file=sys.stderr)
            return EXIT_MISMATCH
        except ValueError as exc:  # --label or --row that no differing row has
            raise UsageError(str(exc)) from None
    try:
        case, script = result.save(args.output, args.name)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot write the reproducer to --output {args.output}: {exc}") from None
    if args.json:
        row = result.explanation.row(result.row)
        document = {
            "original": result.original,
            "shrunk": result.size,
            "label": result.label,
            "slot": result.slot,
            "row": result.row,
            "tests": result.tests,
            "seconds": result.seconds,
            "exhausted": result.exhausted,
            "history": [vars(step) for step in result.history],
            "case": str(case),
            "script": str(script),
            "explanation": None if row is None else row.to_dict(),
        }
        print(json.dumps(document, indent=2, allow_nan=False))
    else:
        print(result, end="")
        print(f"wrote {case} and {script}: `python {script}` replays it (exit 1 while the fault reproduces)")
    return EXIT_MISMATCH


def run_determinism(args: argparse.Namespace, read_npy: ReadNpy) -> int:
    """``moegrad determinism``: 0 the same bits every run (within the bound), 1 otherwise."""
    call = read_call(args, read_npy, "determinism")
    with open_candidate(args) as candidate:
        check = moegrad.check_determinism(candidate, call, runs=args.runs)
    if args.json:
        document = {
            "runs": check.runs,
            "deterministic": check.deterministic,
            "varying_rows": check.varying_rows.tolist(),
            "most_distinct_per_row": int(check.distinct_per_row.max(initial=1)),
            "within_bound": check.within_bound,
            "outside_rows": check.outside_rows.tolist(),
        }
        print(json.dumps(document, indent=2))
    else:
        print(check)
        if check.varying_rows.size:
            print(f"varying rows: {_listed(check.varying_rows)}")
        if check.outside_rows.size:
            print(f"rows outside the any-order bound: {_listed(check.outside_rows)}")
    return EXIT_OK if check.deterministic and check.within_bound else EXIT_MISMATCH


def _listed(rows: np.ndarray, most: int = 20) -> str:
    shown = ", ".join(str(int(row)) for row in rows[:most])
    return shown + (f", ... ({rows.size} in all)" if rows.size > most else "")


_NOT_WITH_ORDER_FREE = (
    ("--grad-expanded-x", "grad_expanded_x"),
    ("--expanded-row-idx", "expanded_row_idx"),
    ("--cases", "cases"),
    ("--merge", "merge"),
    ("--standard", "standards"),
    ("--require-exact", "require_exact"),
    ("--report", "report"),
    ("--report-json", "report_json"),
    ("--report-csv", "report_csv"),
    ("--html", "html"),
    ("--allow-duplicate-indices", "allow_duplicate_indices"),
    ("--explain", "explain"),
    ("--summary", "summary"),
    ("--reports", "reports"),
    ("--plots", "plots"),
    ("--shard", "shard"),
    ("--output", "output"),
    ("--max-concurrency", "max_concurrency"),
    ("--exit-zero-on-findings", "exit_zero_on_findings"),
)


def _order_free_call(args: argparse.Namespace) -> MoeInitRoutingV2GradCall:
    wrong = [flag for flag, name in _NOT_WITH_ORDER_FREE if getattr(args, name, None)]
    if wrong:
        raise UsageError(f"--order-free builds its own call and judges it by the golden: leave out {', '.join(wrong)}")
    if args.top_k is None:
        raise UsageError("--order-free needs --top-k K")
    profile = {"order": args.order} if args.order is not None else {}
    try:
        return moegrad.order_free_inputs(
            args.tokens,
            args.top_k,
            args.hidden,
            args.dtype,
            drop_pad_mode=args.drop_pad_mode,
            active_num=args.active_num,
            expert_num=args.expert_num,
            expert_capacity=args.expert_capacity,
            seed=args.seed,
            **profile,
        )
    except ValueError as exc:  # a size out of range, K past the dtype's limit
        raise UsageError(str(exc)) from None


def run_order_free(args: argparse.Namespace) -> int:
    """``moegrad compare --order-free``: 0 clean, 1 a fault (rows whose bits differ from the golden's)."""
    if not args.order_free:
        raise UsageError("--candidate-url runs a candidate's code: it needs --order-free")
    if args.candidate is None and args.candidate_url is None:
        raise UsageError(
            "--order-free needs the candidate's code: --candidate package.module:function or --candidate-url URL"
        )
    call = _order_free_call(args)
    golden = moegrad.moe_init_routing_v2_grad_golden(call).astype(call.grad_expanded_x.dtype)
    with open_candidate(args) as candidate:
        grad_x = candidate(call)
    grad_x = grad_x.astype(golden.dtype)
    words = np.dtype(f"u{golden.itemsize}")
    faulty = np.flatnonzero((grad_x.view(words) != golden.view(words)).any(axis=1))
    attributes = f"drop_pad_mode={call.drop_pad_mode}, active_num={call.active_num}"
    shape = f"N={call.num_tokens} K={call.top_k} H={call.hidden_size} {call.dtype_name}, {attributes}, seed {args.seed}"
    explanation = moegrad.explain(call, grad_x, device_result=golden) if faulty.size else None
    if args.save_case and faulty.size:
        try:
            save_case(args.save_case, **_case_fields(call), candidate=grad_x)
        except OSError as exc:
            raise UsageError(f"cannot write --save-case {args.save_case}: {exc}") from None
    if args.json:
        document = {
            "verdict": "fault" if faulty.size else "clean",
            "call": shape,
            "rows_at_fault": faulty.tolist(),
            "explanation": None if explanation is None else explanation.to_dict(),
        }
        print(json.dumps(document, indent=2, allow_nan=False))
    elif faulty.size:
        print(f"fault: {faulty.size} of {call.num_tokens} rows differ from the golden on order-free inputs ({shape}),")
        print("where every order of adds gives the golden's bits: not rounding")
        print(explanation, end="")
        if args.save_case:
            print(f"wrote {args.save_case}: `moegrad shrink --case {args.save_case} ...` shrinks it")
    else:
        print(f"clean: every row has the golden's bits on order-free inputs ({shape})")
    return EXIT_MISMATCH if faulty.size else EXIT_OK


def _case_fields(call: MoeInitRoutingV2GradCall) -> dict[str, Any]:
    return {
        "grad_expanded_x": call.grad_expanded_x,
        "expanded_row_idx": call.expanded_row_idx,
        "top_k": call.top_k,
        "drop_pad_mode": call.drop_pad_mode,
        "active_num": call.active_num,
        "order": call.order,
    }
