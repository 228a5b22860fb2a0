"""``moegrad compare`` with no server: where the error lives in every report, the sweep's factor
analysis on the console and in the summary, ``--html``'s refusals; the README's commands and ``--help``.

Oracles: ``support.planted`` builds the candidates and device results with slow per-row loops and
``support.row_oracle`` recomputes the row errors one element at a time from docs/accuracy.md.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from moegrad.accuracy import ROW_ERROR_COLUMNS, save_case
from moegrad.cli._main import main
from support import planted
from support.row_oracle import expected_dict, row_figures

ROOT = Path(__file__).resolve().parents[3]
DROP = ("drop_pad", planted.F32, 3, 7, "drop", "ascend910b@9.1")


def npy_args(tmp_path, case) -> list[str]:
    for name, array in (("x", case.grad), ("idx", case.index), ("candidate", case.candidate)):
        np.save(tmp_path / f"{name}.npy", array)
    return ["--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", str(case.top_k), "--candidate", str(tmp_path / "candidate.npy"),
            "--drop-pad-mode", str(case.drop_pad_mode), "--active-num", str(case.active_num), "--order", case.profile]


def test_compare_json_and_csv_carry_the_row_errors(tmp_path, capsys):
    case = planted.build(*DROP)
    code = main(["compare", "--local", *npy_args(tmp_path, case), "--json", "--no-profiles",
                 "--report-csv", str(tmp_path / "r.csv")])
    assert code == 1
    document = json.loads(capsys.readouterr().out)
    want = expected_dict(row_figures(case.grad, case.index, case.top_k, 1, case.candidate, case.device), 6)
    assert json.loads(json.dumps(want)) == document["row_errors"]
    assert document["explained"] is None  # not asked for
    with open(tmp_path / "r.csv", encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file))
        file.seek(0)
        candidate_row = next(csv.DictReader(file))
    assert header[-len(ROW_ERROR_COLUMNS):] == list(ROW_ERROR_COLUMNS)
    assert int(candidate_row["rows_differing"]) == want["differing"] == len(case.planted)


def test_compare_text_shows_where_the_error_lives(tmp_path, capsys):
    case = planted.build(*DROP)
    assert main(["compare", "--local", *npy_args(tmp_path, case), "--no-profiles", "--explain"]) == 1
    out = capsys.readouterr().out
    assert "where the error lives (per row):" in out
    assert f"rows that differ from the device  {len(case.planted)}" in out
    assert f"explained: missing {len(case.planted)}" in out


@pytest.mark.parametrize(("extra", "message"), [
    (["--html", "/nonexistent-folder/page.html"], "cannot write --html /nonexistent-folder/page.html"),
    (["--order-free", "--html", "p.html"], "leave out --candidate"),
])
def test_html_refusals_exit_2(tmp_path, capsys, extra, message):
    case = planted.build(*DROP)
    args = npy_args(tmp_path, case) if "--order-free" not in extra else ["--top-k", "2", "--candidate", "x:y"]
    code = main(["compare", "--local", *args, *extra])
    err = capsys.readouterr().err
    assert code == 2
    if "--order-free" in extra:
        assert "--html" in err
    else:
        assert message in err


def test_a_sweep_prints_which_factor_makes_cases_fail(tmp_path, capsys):
    cases = tmp_path / "cases"
    cases.mkdir()
    # 12 cases, K = 4 with a dropped slot (fail), K = 2 as the device computes it (pass): too few to
    # name a rule at the sweep's significance, which the console says plainly
    for i in range(6):
        for entry, faulty in ((("dropless", planted.F32, 4, 7, "drop", "ascend910b@9.1"), True),
                              (("dropless", planted.F32, 2, 7, "drop", "ascend910b@9.1"), False)):
            case = planted.build(*entry)
            save_case(cases / f"k{entry[2]}-{i}.npz", grad_expanded_x=case.grad, expanded_row_idx=case.index,
                      top_k=case.top_k, order=case.profile, candidate=case.candidate if faulty else case.device)
    assert main(["compare", "--local", "--cases", str(cases)]) == 1
    out = capsys.readouterr().out
    assert "which factor makes cases fail: no condition separates the 6 failing cases from the 6 passing ones" in out
    # C(12, 6) = 924 ways to place 6 failures: the one that matches K >= 4 has p = 1/924
    assert f"; K >= 4 holds on exactly the failing cases, but 12 cases are too few to tell that from chance " \
           f"(p = {1 / 924:.2g})" in out
    summary = (cases / "summary.md").read_text()
    assert "## Which factor makes cases fail" in summary


def test_the_readme_commands_use_compares_flags_and_help_lists_html(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    help_text = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text))
    assert "--html FILE" in help_text
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("moegrad compare")]
    assert any("--html" in line for line in lines)
    used = {flag for line in lines for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split("#")[0])}
    assert used <= flags, used - flags


def test_a_merge_writes_the_sweeps_page(tmp_path, capsys):
    cases = tmp_path / "cases"
    cases.mkdir()
    for name, entry in {"drop": DROP, "order": ("dropless", planted.F32, 4, 7, "sequential", "ascend910b@9.1")}.items():
        case = planted.build(*entry)
        save_case(cases / f"{name}.npz", grad_expanded_x=case.grad, expanded_row_idx=case.index, top_k=case.top_k,
                  drop_pad_mode=case.drop_pad_mode, active_num=case.active_num, order=case.profile,
                  candidate=case.candidate)
    results, page = tmp_path / "run.jsonl", tmp_path / "merged.html"
    assert main(["compare", "--local", "--cases", str(cases), "--output", str(results)]) == 1
    capsys.readouterr()
    assert main(["compare", "--merge", str(results), "--cases", str(cases), "--html", str(page)]) == 1
    assert f"wrote {page}" in capsys.readouterr().out
    text = page.read_text()
    assert 'href="#case-0"' in text and 'href="#case-1"' in text and "Which factor makes cases fail" in text
    assert "<script" not in text and "http" not in text
