"""``moegrad explain`` and ``moegrad compare --explain``: why a candidate's rows differ from the device's.

``explain`` takes the call's .npy files and ``--candidate`` (or one case file, ``--case``) and prints
:func:`moegrad.explain`'s table (``--json``: the explanation's dict; ``-o PATH``: that dict written
to PATH), through a service (``Client.explain``) or in-process (``--local``). ``compare --explain``
records the label counts in the report and writes the rows beside its report files
(:func:`write_explanation`); docs/accuracy.md, "Explaining a mismatch".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from moegrad import Explanation, InvalidArgument, MoeInitRoutingV2GradCall, explain
from moegrad.accuracy import console_text, explanation_markdown, fields_with_order, load_case
from moegrad.cli._inputs import call_fields, check_writable, open_client, read_npy
from moegrad.cli._parser import EXIT_MISMATCH, EXIT_OK, UsageError

__all__ = ["cmd_explain", "explain_compared", "explanation_json_path", "explanation_text", "write_explanation"]


def _inputs(args: argparse.Namespace) -> tuple[dict[str, Any], np.ndarray]:
    """The call's keyword arguments and the candidate: from ``--case FILE``, or the .npy flags."""
    flags = {
        "--grad-expanded-x": args.grad_expanded_x,
        "--expanded-row-idx": args.expanded_row_idx,
        "--top-k": args.top_k,
        "--candidate": args.candidate,
    }
    if args.case:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise UsageError(f"--case FILE holds the call and the candidate: leave out {', '.join(given)}")
        try:
            fields, candidate = load_case(args.case)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read --case {args.case}: {exc}") from None
        return dict(fields_with_order(fields, args.order)), candidate
    missing = [flag for flag, value in flags.items() if value is None]
    if missing:
        raise UsageError(f"explain needs {', '.join(missing)} (or --case FILE)")
    return call_fields(args), read_npy(args.candidate, "--candidate")


def cmd_explain(args: argparse.Namespace) -> int:
    """``moegrad explain``: exit 0 when every row of the candidate is bit-identical to the
    device's, 1 when rows differ (each explained)."""
    fields, candidate = _inputs(args)
    if args.output:
        check_writable(args.output)
    if args.local:
        call = MoeInitRoutingV2GradCall(**fields)
        explanation = explain(call, candidate)
        source = f"in-process emulation, order {call.order}"
    else:
        with open_client(args) as client:
            result = client.explain(**fields, candidate=candidate)
        explanation = result.explanation
        source = console_text(f"backend {result.backend}, order {result.order}, device {result.device or '-'}")
    document = explanation.to_dict()
    if args.output:
        _write_json(args.output, document, "-o")
    if args.json:
        print(json.dumps(document, indent=2, allow_nan=False))
    else:
        print(explanation_text(explanation), end="")
        print(f"({source})" + (f"; wrote {args.output}" if args.output else ""))
    return EXIT_MISMATCH if explanation.differing_rows else EXIT_OK


def explanation_text(explanation: Explanation) -> str:
    """The explanation's table for the console, each line made inert (a server's words included)."""
    return "".join(console_text(line) + "\n" for line in str(explanation).splitlines())


def explain_compared(
    call: MoeInitRoutingV2GradCall, candidate: np.ndarray, device_result: np.ndarray | None
) -> Explanation | None:
    """``compare --explain`` of one call: the explanation against ``device_result`` (None: the
    emulation), or None, said on stderr, when the candidate cannot be explained (a float32
    candidate of a float16 or bfloat16 call: compare judges it, explain compares bits)."""
    try:
        return explain(call, candidate, device_result=device_result)
    except InvalidArgument as exc:
        print(f"moegrad: not explained: {console_text(str(exc))}", file=sys.stderr)
        return None


def explanation_json_path(json_path: str) -> str:
    """Where ``compare --explain`` writes the explanation beside a JSON report: ``out.json`` ->
    ``out.explain.json``."""
    root, extension = os.path.splitext(json_path)
    return f"{root if extension == '.json' else json_path}.explain.json"


def write_explanation(markdown_path: str | None, json_path: str | None, explanation: Explanation) -> None:
    """The explanation's rows beside a comparison's reports: a section at the end of the markdown
    report, and its dict in :func:`explanation_json_path` of the JSON report.

    Raises:
        UsageError: a file cannot be written.
    """
    if markdown_path:
        try:
            with open(markdown_path, "a", encoding="utf-8") as file:
                file.write("\n" + explanation_markdown(explanation))
        except OSError as exc:
            raise UsageError(f"cannot write --report {markdown_path}: {exc}") from None
    if json_path:
        _write_json(explanation_json_path(json_path), explanation.to_dict(), "--report-json")


def _write_json(path: str, document: dict[str, Any], flag: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(document, file, indent=2, allow_nan=False)
            file.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write {flag} {path}: {exc}") from None
