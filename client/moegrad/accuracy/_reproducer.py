"""The reproducer :meth:`moegrad.accuracy.ShrinkResult.save` writes: a case file and a script that replays it.

``<name>.npz`` is a case file in the format the sweeps read (:func:`~moegrad.accuracy.save_case`: the
call, its profile, and the candidate's grad_x on it). ``<name>.py`` is a short script using
moegrad's public names only: it loads the case, calls the candidate again by its
``package.module:function`` name (or its v2 URL) when it has one, else takes the grad_x saved in
the case, explains the result against the device's emulation (:func:`moegrad.explain`, which
compares bits) and exits 0 when the bits are the device's, 1 while the fault reproduces (the same
label, and for a summand fault the same slot), 3 when grad_x differs another way. ``--candidate``
names another implementation (the fix) to replay instead. The script never holds a token: a v2
server that wants one gets ``$MOEGRAD_CANDIDATE_TOKEN``.
"""

from __future__ import annotations

import ast
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moegrad.accuracy._candidate import Candidate
from moegrad.accuracy._cases import save_case
from moegrad.accuracy._reduce import call_size
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["Replay", "write_reproducer"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Replay:
    """How a script calls the candidate again.

    Attributes:
        target: ``"package.module:function"`` or the v2 URL; None when the candidate has no name
            to import it by (a lambda, a closure, an object): the script then replays the saved grad_x.
        options: :class:`~moegrad.accuracy.Candidate`'s keywords to call it with (``accepts`` and
            ``device``; a v2 server's ``parameters``), each a Python literal.
    """

    target: str | None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, candidate: Candidate) -> Replay:
        """The replay of ``candidate``: its URL, or its importable name with how it takes tensors."""
        if candidate.url is not None:
            parameters = candidate.parameters
            return cls(candidate.url, {"parameters": parameters} if parameters and _literal(parameters) else {})
        spec = candidate.spec
        if spec is None:
            return cls(None)
        options: dict[str, Any] = {"accepts": candidate.accepts}
        if candidate.accepts == "torch" and candidate.device not in (None, "cpu"):
            options["device"] = candidate.device
        return cls(spec, options)


def _literal(value: Any) -> bool:
    """Whether ``repr(value)`` reads back as ``value`` (a script may hold it as a literal)."""
    try:
        return bool(ast.literal_eval(repr(value)) == value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


_SCRIPT = '''\
#!/usr/bin/env python3
"""Replays a fault moegrad.shrink found: {summary} ({size}).

python {name}.py                               the candidate named below ({how})
python {name}.py --candidate pkg.module:func   another implementation (the fix), or a v2 URL

Exit status: 0 grad_x is bit-identical to the device's emulation ({order}); 1 the fault reproduces;
3 grad_x differs from the device's another way. A v2 server's token: $MOEGRAD_CANDIDATE_TOKEN.
"""

import argparse
import os
import pathlib
import sys

import moegrad
from moegrad.accuracy import load_case

CASE = pathlib.Path(__file__).with_name({case!r})
CANDIDATE = {target!r}
OPTIONS = {options!r}
LABEL, SLOT = {label!r}, {slot!r}


def run(target, call):
    """The grad_x of the candidate ``target`` (a package.module:function name or a v2 URL) on ``call``."""
    options = OPTIONS if target == CANDIDATE else {{}}
    if target.startswith(("http://", "https://")):
        candidate = moegrad.Candidate(target, token=os.environ.get("MOEGRAD_CANDIDATE_TOKEN"), **options)
    else:
        sys.path.insert(0, os.getcwd())
        candidate = moegrad.Candidate.load(target, **options)
    with candidate:
        return candidate(call).astype(call.grad_expanded_x.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", default=CANDIDATE, help="package.module:function or a v2 URL")
    args = parser.parse_args()
    fields, saved = load_case(CASE)
    call = moegrad.MoeInitRoutingV2GradCall(**fields)
    grad_x = saved if args.candidate is None else run(args.candidate, call)
    explanation = moegrad.explain(call, grad_x)
    print(explanation, end="")
    if not explanation.rows:
        print("the fault does not reproduce: grad_x is bit-identical to the device's")
        return 0
    if any(row.label == LABEL and (SLOT is None or row.slot == SLOT) for row in explanation.rows):
        print("the fault reproduces: " + LABEL + ("" if SLOT is None else f" at slot {{SLOT}}"))
        return 1
    print("grad_x differs from the device's, but not by this fault (" + LABEL + ")")
    return 3


if __name__ == "__main__":
    sys.exit(main())
'''


def write_reproducer(
    directory: Path,
    name: str,
    *,
    call: MoeInitRoutingV2GradCall,
    grad_x: np.ndarray,
    label: str,
    slot: int | None,
    replay: Replay,
    summary: str,
) -> tuple[Path, Path]:
    """Write ``directory/<name>.npz`` and ``directory/<name>.py`` (module docstring).

    Raises:
        ValueError: ``name`` is not a plain file name (letters, digits, ``_``, ``.``, ``-``).
        OSError: the folder or a file cannot be written.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"name={name!r} must be a plain file name: letters, digits, '_', '.', '-'")
    directory.mkdir(parents=True, exist_ok=True)
    case, script = directory / f"{name}.npz", directory / f"{name}.py"
    save_case(
        case,
        grad_expanded_x=call.grad_expanded_x,
        expanded_row_idx=call.expanded_row_idx,
        top_k=call.top_k,
        candidate=grad_x,
        drop_pad_mode=call.drop_pad_mode,
        active_num=call.active_num,
        order=call.order,
        allow_duplicate_indices=call.allow_duplicate_indices,
    )
    how = "called again" if replay.target is not None else "none importable: the saved grad_x is replayed"
    text = _SCRIPT.format(
        summary=summary,
        size=call_size(call),
        name=name,
        how=how,
        order=call.order,
        case=case.name,
        target=replay.target,
        options=replay.options,
        label=label,
        slot=slot,
    )
    script.write_text(text, encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return case, script
