"""The device profile in sweeps and saved reports: mixed replicas refused, each case's profile recorded.

Oracles: docs/accuracy.md ("Sweeps": the header's ``orders``, a case line's ``order``, the summary's
``order`` column; "CSV columns": the call's profile, attributes and its inputs' SHA-256, computed here
with hashlib over each array's C-order little-endian bytes); the refusal's wording as the issue asks
(each replica's URL and profile, and what to do).
"""

from __future__ import annotations

import csv
import hashlib
import json

import numpy as np
import pytest

from moegrad import MoeInitRoutingV2GradCall, accuracy
from moegrad.accuracy._batches import ProfilesDiffer, refuse_mixed_profiles
from moegrad.accuracy._ledger import SweepFile, SweepHeader
from support.docexample import DOC_GRAD as GRAD
from support.docexample import DOC_IDX as IDX
from support.docexample import DOC_RESULT as RESULT

MIXED = {"http://a:8000": "ascend950@9.1", "http://b:8000": "ascend910b@9.1"}


def case(name: str, order: str | None = None) -> tuple:
    fields = {"grad_expanded_x": GRAD, "expanded_row_idx": IDX, "top_k": 2}
    if order is not None:
        fields["order"] = order
    return name, fields, np.asarray(RESULT, np.float32)


def test_cases_that_name_no_profile_are_refused_over_replicas_of_different_profiles(tmp_path):
    with pytest.raises(ProfilesDiffer) as refused:
        refuse_mixed_profiles(MIXED, [case("named", "ascend950@9.1"), case("unnamed")], None)
    message = str(refused.value)
    assert "http://a:8000 ascend950@9.1" in message and "http://b:8000 ascend910b@9.1" in message
    assert "unnamed" in message and "--order" in message and "one profile" in message
    assert isinstance(refused.value, ValueError)
    # case files: the one whose archive holds no order is named
    for name, order in (("with", "ascend910b@9.0"), ("without", None)):
        _, fields, candidate = case(name, order)
        accuracy.save_case(tmp_path / f"{name}.npz", candidate=candidate, **fields)
    with pytest.raises(ProfilesDiffer, match="without.npz"):
        refuse_mixed_profiles(MIXED, sorted(tmp_path.glob("*.npz")), None)
    # not refused: every case names its profile, the sweep names one, the profiles agree, one is unknown
    refuse_mixed_profiles(MIXED, [tmp_path / "with.npz", case("a", "ascend950@9.0")], None)
    refuse_mixed_profiles(MIXED, [case("unnamed")], "ascend950@9.1")
    refuse_mixed_profiles({"http://a:8000": "ascend950@9.1", "http://b:8000": "ascend950@9.1"}, [case("u")], None)
    refuse_mixed_profiles({"http://a:8000": "ascend950@9.1", "http://b:8000": None}, [case("u")], None)


def test_the_results_file_records_the_replicas_profiles_and_each_case_s(tmp_path):
    path = tmp_path / "run.jsonl"
    header = SweepHeader.of(cases=1, standards=None, require_exact=False, orders=MIXED)
    call = MoeInitRoutingV2GradCall(**case("c")[1], order="ascend950@9.0")
    report = accuracy.with_context(accuracy.compare(call, case("c")[2]),
                                   accuracy.report_context(call, case("c")[2], case="c"))
    with SweepFile(path, header) as ledger:
        ledger.append(accuracy.CaseResult("c", report.verdict, report), "sha256:00")
    with SweepFile(path, header):  # the same replicas: no header of its own
        pass
    with SweepFile(path, SweepHeader.of(cases=1, standards=None, require_exact=False, orders={"http://a:8000": None})):
        pass  # other replicas: its header records them
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["header", "case", "header"]
    assert lines[0]["orders"] == MIXED and lines[2]["orders"] == {"http://a:8000": None}
    assert lines[1]["order"] == "ascend950@9.0"
    [(first, _), (second, _)] = accuracy._ledger.read_sweep_file(path)
    assert first.orders == MIXED and first.difference(second) is None  # the replicas do not make another sweep


def test_an_in_process_sweep_gives_its_order_to_the_cases_that_name_none_and_the_summary_says_it(tmp_path):
    judge = accuracy.compare_in_process(order="ascend950@8.5")
    results = accuracy.compare_cases([case("unnamed"), case("named", "ascend910_93@9.0")], judge)
    assert [r.report.context.order for r in results] == ["ascend950@8.5", "ascend910_93@9.0"]
    accuracy.write_summary(results, tmp_path / "s.csv")
    with open(tmp_path / "s.csv", encoding="utf-8-sig") as file:
        rows = {row["API Name"]: row for row in csv.DictReader(file)}
    assert rows["unnamed"]["order"] == "ascend950@8.5" and rows["named"]["order"] == "ascend910_93@9.0"


def test_the_csv_report_records_the_call_its_profile_and_its_inputs_sha256(tmp_path):
    _, fields, candidate = case("c")
    call = MoeInitRoutingV2GradCall(**fields, order="ascend950@9.0")
    report = accuracy.with_context(accuracy.compare(call, candidate), accuracy.report_context(call, candidate))
    accuracy.write_csv_report(tmp_path / "r.csv", report)
    with open(tmp_path / "r.csv", encoding="utf-8-sig") as file:
        rows = list(csv.DictReader(file))
    want = {"order": "ascend950@9.0", "product_line": "Ascend 950PR/950DT, CANN 9.0", "top_k": "2",
            "drop_pad_mode": "0", "active_num": "0",
            "sha256_grad_expanded_x": hashlib.sha256(np.asarray(GRAD, "<f4").tobytes()).hexdigest(),
            "sha256_expanded_row_idx": hashlib.sha256(np.asarray(IDX, "<i4").tobytes()).hexdigest(),
            "sha256_candidate": hashlib.sha256(np.asarray(candidate, "<f4").tobytes()).hexdigest()}
    assert len(rows) == 2 and all({k: row[k] for k in want} == want for row in rows)
    bare = accuracy.csv_rows(accuracy.compare(call, candidate))  # no context: the cells are empty
    assert all(row[column] == "" for row in bare for column in want)
