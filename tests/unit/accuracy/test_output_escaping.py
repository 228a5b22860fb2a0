"""A case's name (its file's name) and a server's text are written inert: CSV, markdown, console, JSON lines.

Names from the issue: cells that a spreadsheet reads as formulas (``=``, ``+``, ``-``, ``@``, a tab, a
carriage return first), a newline followed by a markdown row that says "pass", terminal escape
sequences that erase the line of a failing case, characters that ``str.splitlines`` splits a JSON
line at.

Oracles: OWASP's "CSV Injection" rule, written here (a leading single quote when the first
character is one of ``= + - @`` tab CR; a number kept as written); the markdown table's own shape
(its header, its separator, one line per case); the absence of the raw control characters.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, oracle_call

FORMULAS = ['=HYPERLINK("http://example.invalid/?leak","pass")', "+SUM(1,1)", "-2+3", "@SUM(A1)", "\t=1+1", "\r=1+1"]
FORGED_ROW = "quiet\n| all_good | pass | true | 1.0 | - |  |"
ERASER = "\x1b[2K\x1b[1Aall cases pass"  # erase the line, move up: hides the line listing this case


def fields_of(call) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k}


def owasp(text: str) -> str:
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


@pytest.fixture(scope="module")
def judged():
    call = oracle_call(seed=7, tokens=4, hidden=4)
    device = device_k2(call)
    wrong = device + np.float32(1.0)  # every element off by 1.0: a fail
    cases = [(name, fields_of(call), device) for name in [*FORMULAS, "plain"]]
    cases += [(FORGED_ROW, fields_of(call), wrong), (ERASER, fields_of(call), wrong)]
    return accuracy.compare_cases(cases, accuracy.compare_in_process(), progress=False)


def read_csv(path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8-sig", newline="") as file:
        return list(csv.DictReader(file))


def test_summary_csv_cells_are_never_formulas_and_numbers_stay_numbers(judged, tmp_path):
    accuracy.write_summary(judged, tmp_path / "s.csv")
    rows = {row["file"] or row["API Name"]: row for row in read_csv(tmp_path / "s.csv")}
    names = [row["API Name"] for row in rows.values()]
    assert sorted(names) == sorted(owasp(result.name) for result in judged)
    for row in rows.values():
        float(row["均方根误差比值"])  # numeric cells are written as numbers, no quote
    assert "'-2+3" in names and "plain" in names


def test_report_csv_escapes_the_case_name_and_writes_numbers_as_they_are(tmp_path):
    call = oracle_call(seed=3, tokens=8, hidden=8)
    device = device_k2(call)
    candidate = (device * np.float32(1 - 2**-10)).astype(np.float32)
    context = accuracy.report_context(call, candidate, case="=cmd|'/C calc'!A0")
    report = accuracy.with_context(accuracy.compare(call, candidate, device_result=device), context)
    accuracy.write_csv_report(tmp_path / "r.csv", report)
    rows = read_csv(tmp_path / "r.csv")
    assert [row["API Name"] for row in rows] == ["'=cmd|'/C calc'!A0.candidate", "'=cmd|'/C calc'!A0.device"]
    for written, row in zip(rows, accuracy.csv_rows(report), strict=True):
        numbers = {key: value for key, value in row.items() if value and value.lstrip("-+").replace(".", "", 1).isdigit()}
        assert numbers and all(written[key] == value for key, value in numbers.items())


@pytest.mark.parametrize("number", ["-0.5", "-inf", "-1e-05", "+3", "-0.0"])
def test_a_number_that_starts_with_a_sign_is_a_number_not_a_formula(number, tmp_path):
    from moegrad.accuracy._escape import csv_cell

    assert csv_cell(number) == number
    assert csv_cell(number + "+A1") == "'" + number + "+A1"


def test_a_newline_in_a_name_cannot_forge_a_markdown_row(judged, tmp_path):
    accuracy.write_summary(judged, tmp_path / "s.csv", tmp_path / "s.md")
    table = [line for line in (tmp_path / "s.md").read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(judged)  # header, separator, one row per case
    assert not any(line.startswith("| all_good") for line in table)
    forged = next(line for line in table if line.startswith("| quiet"))
    assert forged.split(" | ")[1] == "fail" and "\\\\n\\| all_good \\| pass" in forged


def test_the_markdown_report_escapes_its_context(tmp_path):
    call = oracle_call(seed=3, tokens=4, hidden=4)
    device = device_k2(call)
    context = accuracy.report_context(call, device, case="x\n| verdict | pass |<script>alert(1)</script>")
    text = accuracy.markdown_report(accuracy.with_context(accuracy.compare(call, device), context))
    assert "<script>" not in text and not any(line.startswith("| verdict") for line in text.splitlines())
    assert "x\\\\n\\| verdict \\| pass \\|\\<script\\>" in text
    erasing = accuracy.report_context(call, device, case=ERASER)
    terminal = accuracy.format_report(accuracy.with_context(accuracy.compare(call, device), erasing))
    assert "\x1b" not in terminal and "\\x1b[2K\\x1b[1Aall cases pass" in terminal


def case_files(folder) -> None:
    call = oracle_call(seed=7, tokens=4, hidden=4)
    device = device_k2(call)
    accuracy.save_case(folder / f"{ERASER}.npz", **fields_of(call), candidate=device + np.float32(1.0))
    accuracy.save_case(folder / "=1+1\u2028next\x85line.npz", **fields_of(call), candidate=device)


def test_the_console_shows_control_characters_of_a_name_and_hides_no_line(tmp_path, capsys):
    case_files(tmp_path)
    assert main(["compare", "--local", "--cases", str(tmp_path), "--no-progress", "--verbose"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u2028" not in out and "\x85" not in out
    assert "fail     \\x1b[2K\\x1b[1Aall cases pass" in out and "=1+1\\u2028next\\u0085line" in out


def test_a_results_file_holding_names_that_splitlines_splits_at_resumes(tmp_path, capsys):
    case_files(tmp_path)
    command = ["compare", "--local", "--cases", str(tmp_path), "--no-progress", "--output", str(tmp_path / "run.jsonl")]
    assert main(command) == 1
    capsys.readouterr()
    assert main(command) == 1
    assert "skipped 2 of 2 cases already judged" in capsys.readouterr().out
