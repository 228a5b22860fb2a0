"""``moegrad explain`` and ``moegrad compare --explain`` with no server (``--local``).

Oracle: tests/support/planted.py plants one wrong summand per chosen row with slow per-row loops
that share no code with moegrad, and says which label, slot and row each such row must get; the
command's output (table, JSON, report files, results file, summary) is checked against that. A
row the fault left bit-identical is not listed ("agrees").
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

import moegrad
from moegrad.accuracy import save_case
from moegrad.cli._main import main
from support import planted
from support.inputs import F16, F32

DROP = ("dropless", F32, 8, 7, "drop", "ascend910b@9.1")  # every planted row changes and is labelled (H = 7)


@pytest.fixture
def case():
    built = planted.build(*DROP)
    assert built is not None
    return built


def expected_rows(case) -> dict[int, tuple[str, int | None, int | None]]:
    """row -> (label, slot, source row) for every planted row the fault changed."""
    changed = np.flatnonzero((case.candidate.view(np.uint32) != case.device.view(np.uint32)).any(axis=1))
    return {int(i): (p.label, p.slot, p.source) for i, p in case.planted.items() if i in changed}


def npy_args(tmp_path, case, candidate=None) -> list[str]:
    for name, array in (("x", case.grad), ("idx", case.index.astype(np.int32)),
                        ("candidate", case.candidate if candidate is None else candidate)):
        np.save(tmp_path / f"{name}.npy", array)
    return ["--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", str(case.top_k), "--candidate", str(tmp_path / "candidate.npy")]


def given_rows(document: dict) -> dict[int, tuple[str, int | None, int | None]]:
    return {row["row"]: (row["label"], row["slot"], row["source_row"]) for row in document["rows"]}


def save(path, case, candidate=None) -> None:
    save_case(path, grad_expanded_x=case.grad, expanded_row_idx=case.index.astype(np.int32), top_k=case.top_k,
              candidate=case.candidate if candidate is None else candidate)


def test_explain_prints_each_planted_row_and_exits_1(tmp_path, capsys, case):
    want = expected_rows(case)
    assert want and {label for label, _, _ in want.values()} == {"missing"}
    assert main(["explain", "--local", *npy_args(tmp_path, case)]) == 1
    out = capsys.readouterr().out
    assert f"{len(want)} rows differ (missing {len(want)})" in out
    for row, (label, slot, source) in want.items():
        assert any(line.split()[:4] == [str(row), label, str(slot), str(source)] for line in out.splitlines())
    assert "(in-process emulation, order ascend910b@9.1)" in out


def test_explain_json_and_output_file_from_a_case_file(tmp_path, capsys, case):
    save(tmp_path / "c.npz", case)
    output = tmp_path / "explained.json"
    assert main(["explain", "--local", "--case", str(tmp_path / "c.npz"), "--json", "-o", str(output)]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert given_rows(printed) == expected_rows(case)
    assert json.loads(output.read_text()) == printed
    assert printed["labels"]["missing"] == len(expected_rows(case)) and printed["profile"] == "ascend910b@9.1"


def test_the_device_result_exits_0(tmp_path, capsys, case):
    assert main(["explain", "--local", *npy_args(tmp_path, case, candidate=case.device)]) == 0
    assert "every row is bit-identical to the device's" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--case", "c.npz"], "--case FILE holds the call and the candidate: leave out"),
    (["--candidate", None], "explain needs --candidate (or --case FILE)"),
])
def test_usage_errors_exit_2(tmp_path, capsys, case, extra, message):
    args = npy_args(tmp_path, case)
    if extra[0] == "--candidate":
        args = args[:-2]  # the candidate left out
    else:
        args += [extra[0], str(tmp_path / extra[1])]
    assert main(["explain", "--local", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_float32_candidate_of_a_float16_call_is_rejected_with_its_code(tmp_path, capsys):
    half = planted.build("dropless", F16, 4, 7, "drop", "ascend910b@9.1")
    assert main(["explain", "--local", *npy_args(tmp_path, half, candidate=half.candidate.astype(np.float32))]) == 3
    err = capsys.readouterr().err
    assert "[field candidate]" in err and "ACLNN_ERR_PARAM_INVALID 161002" in err


def test_compare_explain_puts_the_counts_in_the_report_and_the_rows_beside_it(tmp_path, capsys, case):
    want = expected_rows(case)
    markdown, report_json = tmp_path / "out.md", tmp_path / "out.json"
    code = main(["compare", "--local", *npy_args(tmp_path, case), "--explain", "--report", str(markdown),
                 "--report-json", str(report_json)])
    assert code == 1  # a slot left out fails the tolerance standards
    out = capsys.readouterr().out
    assert f"{len(want)} rows differ (missing {len(want)})" in out  # the table after the report
    report = json.loads(report_json.read_text())
    assert report["explained"] == {**dict.fromkeys(moegrad.accuracy.LABELS, 0), "missing": len(want)}
    assert given_rows(json.loads((tmp_path / "out.explain.json").read_text())) == want
    text = markdown.read_text()
    assert "## Explanation" in text
    for row, (label, slot, source) in want.items():
        assert f"| {row} | {label} | {slot} | {source} |" in text


def test_compare_json_carries_the_counts(tmp_path, capsys, case):
    assert main(["compare", "--local", *npy_args(tmp_path, case), "--explain", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["explained"]["missing"] == len(expected_rows(case))


def test_compare_explain_of_a_float32_candidate_of_a_half_call_judges_it_unexplained(tmp_path, capsys):
    half = planted.build("dropless", F16, 4, 7, "drop", "ascend910b@9.1")
    wide = half.device.astype(np.float32)
    assert main(["compare", "--local", *npy_args(tmp_path, half, candidate=wide), "--explain", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["explained"] is None
    assert "moegrad: not explained:" in captured.err and "161002" in captured.err


def test_a_sweep_records_the_counts_per_case_and_writes_each_cases_rows(tmp_path, capsys, case):
    cases, reports = tmp_path / "cases", tmp_path / "reports"
    cases.mkdir()
    save(cases / "planted.npz", case)
    save(cases / "device.npz", case, candidate=case.device)
    results = tmp_path / "run.jsonl"
    code = main(["compare", "--local", "--cases", str(cases), "--explain", "--output", str(results),
                 "--summary", str(tmp_path / "summary"), "--reports", str(reports)])
    assert code == 1
    capsys.readouterr()
    want = expected_rows(case)
    lines = [json.loads(line) for line in results.read_text().splitlines()][1:]
    explained = {line["case"]: line["report"]["explained"] for line in lines}
    assert explained["planted"]["missing"] == len(want) and sum(explained["planted"].values()) == len(want)
    assert set(explained["device"].values()) == {0}
    with open(tmp_path / "summary.csv", encoding="utf-8-sig") as file:
        summary = {row["API Name"]: row["explained"] for row in csv.DictReader(file)}
    assert summary == {"planted": f"missing {len(want)}", "device": "no row differs"}
    assert "| missing " in (tmp_path / "summary.md").read_text()
    assert given_rows(json.loads((reports / "planted.explain.json").read_text())) == want
    assert "## Explanation" in (reports / "planted.md").read_text()
