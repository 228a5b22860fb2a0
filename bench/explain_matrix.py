"""The confusion matrix of moegrad.explain: planted fault x label, over the whole planted-fault matrix.

Every case of ``support.planted.matrix()`` (three modes, three dtypes, K in {1, 2, 3, 4, 8, 16, 130},
H in {1, 7, 256}, every plant, the profiles ascend910b@9.1 and ascend950@9.1; the plants that need a
skipped slot only where the mode has one) is built by its slow loops, explained, and each planted
row's label counted (``agrees``: the fault changed no bit of that row, so it is not listed). The
gates of ``tests/unit/accuracy/test_explain.py`` are checked on every case and each breach is printed. Prints
Markdown; ``--write`` also puts it into bench/RESULTS.md and docs/accuracy.md (between the
``explain-matrix`` markers). The exit status is 1 when a gate is breached.

    python -m bench.explain_matrix [--sample N] [--write]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import moegrad
from bench._results import machine, write_section
from moegrad.accuracy import LABELS
from support import planted

__all__ = ["main"]

ACCURACY = Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
SUMMAND_FAULTS = {"missing", "duplicated", "replaced", "extra"}
COLUMNS = ("agrees", *LABELS)


def breaches(case: planted.Case, rows: list[dict], call: moegrad.MoeInitRoutingV2GradCall) -> list[str]:
    """The gates a case breaks, each a line."""
    found = []
    given = {row["row"]: row for row in rows}
    kind = planted.PLANTS[case.plant][1]
    if set(given) - set(case.planted):
        found.append(f"{case.name}: rows {sorted(set(given) - set(case.planted))} listed though nothing was planted there")
    if moegrad.explain(call, case.device).rows:
        found.append(f"{case.name}: the device's own bits gave a row")
    for i, want in case.planted.items():
        row = given.get(i)
        if row is None:
            continue
        label = row["label"]
        if kind == "summand" and label == "order":
            found.append(f"{case.name} row {i}: a summand fault labelled order")
        if kind == "order" and label not in ("order", "ambiguous"):
            found.append(f"{case.name} row {i}: a pure order difference labelled {label}")
        if label in SUMMAND_FAULTS and (label, row["slot"], row["source_row"]) != (want.label, want.slot, want.source):
            found.append(f"{case.name} row {i}: {label} slot {row['slot']} row {row['source_row']}, planted "
                         f"{want.label} slot {want.slot} row {want.source}")
        if case.hidden == 1 and label in SUMMAND_FAULTS | {"precision"}:
            found.append(f"{case.name} row {i}: H = 1 labelled {label}")
    return found


def run(entries) -> tuple[collections.Counter, collections.Counter, list[str], int, float]:
    """(plant x label counts, (plant, H) x label counts, the breaches, cases explained, seconds)."""
    counts: collections.Counter = collections.Counter()
    by_hidden: collections.Counter = collections.Counter()
    found: list[str] = []
    cases, started = 0, time.monotonic()
    for entry in entries:
        case = planted.build(*entry)
        if case is None:
            continue
        cases += 1
        call = moegrad.MoeInitRoutingV2GradCall(**case.kwargs())
        rows = moegrad.explain(call, case.candidate).to_dict()["rows"]
        found += breaches(case, rows, call)
        labels = planted.score(case, rows)
        for label in labels.values():
            counts[case.plant, label] += 1
            by_hidden[case.plant, case.hidden, label] += 1
    return counts, by_hidden, found, cases, time.monotonic() - started


def table(counts: collections.Counter, by_hidden: collections.Counter) -> str:
    lines = ["| planted \\ label | expected | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---:|" * len(COLUMNS)]
    for plant, (expected, _) in planted.PLANTS.items():
        cells = [str(counts[plant, label]) if counts[plant, label] else "." for label in COLUMNS]
        lines.append(f"| {plant} | {expected} | " + " | ".join(cells) + " |")
    lines += ["", "Planted rows labelled as planted, by H (of the rows the fault changed):", "",
              "| planted | H = 1 | H = 7 | H = 256 |", "|---|---:|---:|---:|"]
    for plant, (expected, _) in planted.PLANTS.items():
        cells = []
        for hidden in planted.HIDDEN:
            changed = sum(n for (p, h, label), n in by_hidden.items() if p == plant and h == hidden and label != "agrees")
            right = by_hidden[plant, hidden, expected]
            cells.append(f"{right}/{changed}" if changed else "-")
        lines.append(f"| {plant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.explain_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=0, help="a deterministic sample of this many cases (default: all)")
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md's and docs/accuracy.md's section")
    args = parser.parse_args(argv)
    moegrad.warm_up()
    entries = planted.sample(args.sample) if args.sample else list(planted.matrix())
    counts, by_hidden, found, cases, seconds = run(entries)
    command = "python -m bench.explain_matrix" + (f" --sample {args.sample}" if args.sample else "")
    body = (f"`{command}`: {cases} cases, {sum(counts.values())} planted rows, {seconds:.0f} s; {machine()}\n\n"
            f"{table(counts, by_hidden)}\n\nGates breached: {len(found)}.")
    print(body)
    for line in found[:50]:
        print("  " + line)
    if args.write:
        write_section("explain-matrix", "## moegrad.explain on the planted-fault matrix\n\n" + body)
        write_section("explain-matrix", body, ACCURACY)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
