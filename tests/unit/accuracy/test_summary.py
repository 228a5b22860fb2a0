"""A sweep's summary as a team triages it (issue 38): what each case is, the device beside the
candidate, real failures first, the policy, one message per criterion with its unit.

Oracles: each case's dtype, shape, K, mode and active_num are the inputs the test wrote; the device
results are tests/support/oracle.py's (``device_k2``: one float32 add, K <= 2; for K = 1 a copy,
whose error against the float64 golden is 0, so every benchmark ratio of a candidate that is off is
``inf``); the order of the rows follows docs/accuracy.md ("The summary") from what each case was
built to break: a row that must be +0.0 (a defect), every value 1 + 2^-12 too large (a finite
tolerance), 1-ULP noise where the device is exact (a ratio over 0); the elements that differ from
the device under ``require_exact``, counted here on the bits.
"""

from __future__ import annotations

import csv
import math

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import accuracy
from moegrad.operator import DEFAULT_PROFILE
from support import planted
from support.inputs import F32
from support.oracle import device_k2, oracle_call, oracle_candidate

BF16 = np.dtype(ml_dtypes.bfloat16)


def fields_of(call) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k,
            "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}


def k1_call(seed: int):
    """A dropless K=1 float32 call: grad_x is a copy of the rows, exact."""
    rng = np.random.default_rng(seed)
    grad = rng.uniform(0.25, 1.0, (64, 16)).astype(np.float32) * rng.choice([-1, 1], (64, 16)).astype(np.float32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=rng.permutation(64).astype(np.int32),
                                            top_k=1)


def drop_pad_call():
    """Drop/pad mode, N=4 tokens, K=2, E=2 experts of capacity 4, H=8; token 0's two slots dropped (-1)."""
    rng = np.random.default_rng(5)
    grad = rng.uniform(0.25, 1.0, (2, 4, 8)).astype(np.float32)
    idx = np.array([-1, -1, 0, 5, 2, 7, 4, 1], dtype=np.int32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=2, drop_pad_mode=1)


def active_call():
    """Active mode: N=4 tokens, K=2, A=6 rows of grad_expanded_x; slots 6 and 7 are not materialised."""
    rng = np.random.default_rng(6)
    grad = rng.uniform(0.25, 1.0, (6, 8)).astype(np.float32)
    idx = np.array([0, 6, 1, 2, 3, 7, 4, 5], dtype=np.int32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=2, active_num=6)


def read_csv(path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8-sig", newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture
def judged():
    """Six cases, built to give the statuses and tiers the module docstring names."""
    k1 = k1_call(1)
    device_k1 = device_k2(k1)  # K = 1: the copy, exact
    noisy = oracle_candidate("one_ulp_noise", device_k1)
    k2 = oracle_call(seed=2, tokens=16, hidden=16)
    dropped = drop_pad_call()
    zero_row = device_k2(dropped).copy()
    zero_row[0] = 1.0  # token 0's row must be +0.0
    active = active_call()
    bf16 = oracle_call(seed=4, tokens=32, hidden=32)
    bf16 = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=bf16.grad_expanded_x.astype(BF16),
                                            expanded_row_idx=bf16.expanded_row_idx, top_k=2)
    cases = [
        ("a_ratio_over_zero", fields_of(k1), noisy),
        ("b_active_pass", fields_of(active), device_k2(active)),
        ("c_bf16_device", fields_of(bf16), device_k2(bf16)),
        ("d_scaled", fields_of(k2), oracle_candidate("scaled_up", device_k2(k2))),
        ("e_zero_row", fields_of(dropped), zero_row),
    ]
    results = accuracy.compare_cases(cases, accuracy.compare_in_process(), progress=False)
    assert [r.status for r in results] == ["fail", "pass", "warning", "fail", "fail"]
    return results


def test_real_failures_come_first_and_an_inf_ratio_never_ranks_a_case(judged, tmp_path):
    ratio = judged[0].report.verdict_of("benchmark").criteria[0]
    assert ratio.measure == "rmse_ratio" and math.isinf(ratio.value)  # the device is exact: a ratio over 0
    ordered = accuracy.write_summary(judged, tmp_path / "s.csv", tmp_path / "s.md")
    # a defect, then a finite tolerance past the device, then the ratio over 0; the warning; the pass
    assert [r.name for r in ordered] == ["e_zero_row", "d_scaled", "a_ratio_over_zero", "c_bf16_device",
                                         "b_active_pass"]
    rows = {row["API Name"]: row for row in read_csv(tmp_path / "s.csv")}
    assert rows["e_zero_row"]["deciding"] == "zero_row_mismatches"
    assert rows["e_zero_row"]["excess"] == "8.0"  # H elements of the row that must be +0.0
    assert rows["a_ratio_over_zero"]["deciding"].endswith("_ratio")
    noisy = judged[0].report.exact
    assert float(rows["a_ratio_over_zero"]["excess"]) == noisy.share  # finite: the share that differs
    assert all(not math.isinf(float(row["excess"])) for row in rows.values() if row["excess"])


def test_each_row_says_what_the_case_is_and_the_device_s_own_status(judged, tmp_path):
    accuracy.write_summary(judged, tmp_path / "s.csv", tmp_path / "s.md")
    rows = {row["API Name"]: row for row in read_csv(tmp_path / "s.csv")}
    described = {name: (row["DEVICE Dtype"], row["Shape"], row["top_k"], row["mode"], row["active_num"], row["order"])
                 for name, row in rows.items()}
    profile = DEFAULT_PROFILE
    assert described == {
        "a_ratio_over_zero": ("float32", "(64, 16)", "1", "dropless", "0", profile),
        "b_active_pass": ("float32", "(4, 8)", "2", "active", "6", profile),
        "c_bf16_device": ("bfloat16", "(32, 32)", "2", "dropless", "0", profile),
        "d_scaled": ("float32", "(16, 16)", "2", "dropless", "0", profile),
        "e_zero_row": ("float32", "(4, 8)", "2", "drop_pad", "0", profile),
    }
    # bfloat16's device warns under dual_thousandth (docs/accuracy.md): the candidate's warning is shared
    assert (rows["c_bf16_device"]["moegrad_status"], rows["c_bf16_device"]["device_status"]) == ("warning", "warning")
    assert rows["c_bf16_device"]["shared_with_device"] == "true"
    assert (rows["d_scaled"]["device_status"], rows["d_scaled"]["shared_with_device"]) == ("pass", "false")
    table = [line for line in (tmp_path / "s.md").read_text().splitlines() if line.startswith("| c_bf16_device")]
    assert table[0].split(" | ")[1:10] == ["warning (device too)", "warning", "bfloat16", "32x32", "2", "dropless",
                                           "0", profile, "thousandth_share"]
    text = (tmp_path / "s.md").read_text()
    assert "5 cases: 1 pass, 1 warning (1 the device gets too), 3 fail" in text


def test_one_message_per_criterion_names_its_unit_and_the_policy_is_recorded(judged, tmp_path):
    notes = accuracy.SummaryNotes(standards=accuracy.DEFAULT_STANDARDS, require_exact=False)
    accuracy.write_summary(judged, tmp_path / "s.csv", tmp_path / "s.md", notes)
    rows = {row["API Name"]: row for row in read_csv(tmp_path / "s.csv")}
    message = rows["e_zero_row"]["Message"]
    assert message.count("zero_row_mismatches") == 1  # judged by every standard, said once
    assert ("zero_row_mismatches = 8 elements not +0.0 in rows that must be +0.0 (needs <= 0; device 0): fail "
            "[dual_thousandth, threshold, benchmark, accumulative]") in message
    assert "rmse_ratio = " in rows["d_scaled"]["Message"] and "x the device's RMSE" in rows["d_scaled"]["Message"]
    assert {row["require_exact"] for row in rows.values()} == {"false"}
    assert ("Policy: standards dual_thousandth, threshold, benchmark, accumulative; exactness reported, not "
            "required (require_exact).") in (tmp_path / "s.md").read_text()


def test_under_require_exact_a_case_failing_only_on_exactness_says_how_many_elements_differ(tmp_path):
    call = moegrad.MoeInitRoutingV2GradCall(**{**fields_of(oracle_call(seed=7, tokens=16, hidden=16)), "top_k": 4})
    candidate = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    device = moegrad.moe_init_routing_v2_grad(call)
    differ = int(np.count_nonzero(candidate.view(np.uint32) != device.view(np.uint32)))
    assert differ > 0
    [result] = accuracy.compare_cases([("seq", fields_of(call), candidate)],
                                      accuracy.compare_in_process(require_exact=True), progress=False)
    assert result.status == "fail" and all(v.status == "pass" for v in result.report.verdicts)
    notes = accuracy.SummaryNotes(standards=accuracy.DEFAULT_STANDARDS, require_exact=True)
    accuracy.write_summary([result], tmp_path / "s.csv", tmp_path / "s.md", notes)
    [row] = read_csv(tmp_path / "s.csv")
    tokens = 2 * 16 // 4  # the K=2 call's 32 slots, read with K=4
    assert row["Message"].startswith(f"not bit-exact: {differ} of {tokens * 16} elements differ from the device")
    assert (row["deciding"], row["excess"], row["require_exact"]) == ("exactness", f"{float(differ)!r}", "true")
    assert "exactness required: a candidate that is not bit-exact fails" in (tmp_path / "s.md").read_text()


def test_what_a_sweep_is_missing_is_said_first_with_a_row_per_case(judged, tmp_path):
    notes = accuracy.SummaryNotes(missing=("shard 1 (no file): expected out/shard-1.jsonl; its 2 cases are not judged",),
                                  missing_cases={"x1": "not judged: shard 1 has no file",
                                                 "=x2": "not judged: shard 1 has no file"},
                                  missing_count=2)
    accuracy.write_summary(judged, tmp_path / "s.csv", tmp_path / "s.md", notes)
    lines = (tmp_path / "s.md").read_text().splitlines()
    assert lines[2] == "**Not complete: 2 cases were not judged** (the exit status is 4)."
    assert lines[4] == "- shard 1 (no file): expected out/shard-1.jsonl; its 2 cases are not judged"
    assert lines[5] == "- the cases not judged: x1, =x2"
    assert lines[7] == "7 cases: 1 pass, 1 warning (1 the device gets too), 3 fail, 2 missing"
    rows = read_csv(tmp_path / "s.csv")
    assert [(row["API Name"], row["moegrad_status"], row["比对结果"]) for row in rows[:2]] == [
        ("x1", "missing", "error"), ("'=x2", "missing", "error")]  # first, and never a formula


def test_an_explained_sweep_s_label_counts_are_a_column_of_the_csv_and_the_markdown(tmp_path):
    # tests/support/planted.py plants one missing summand per chosen row (slow loops of its own)
    built = planted.build("dropless", F32, 8, 7, "drop", "ascend910b@9.1")
    changed = (built.candidate.view(np.uint32) != built.device.view(np.uint32)).any(axis=1)
    missing = sum(1 for row, p in built.planted.items() if changed[row] and p.label == "missing")
    assert missing > 0
    fields = {"grad_expanded_x": built.grad, "expanded_row_idx": built.index.astype(np.int32), "top_k": built.top_k,
              "order": "ascend910b@9.1"}
    explaining = accuracy.explaining_one(accuracy.compare_in_process())
    results = accuracy.compare_cases([("planted", fields, built.candidate), ("device", fields, built.device)],
                                     explaining, progress=False)
    unexplained = accuracy.compare_cases([("plain", fields, built.device)], accuracy.compare_in_process(),
                                         progress=False)
    accuracy.write_summary([*results, *unexplained], tmp_path / "s.csv", tmp_path / "s.md")
    rows = {row["API Name"]: row["explained"] for row in read_csv(tmp_path / "s.csv")}
    assert rows == {"planted": f"missing {missing}", "device": "no row differs", "plain": ""}
    table = [line.split(" | ") for line in (tmp_path / "s.md").read_text().splitlines() if line.startswith("| ")]
    column = table[0].index("explained")
    assert table[0][column - 1:column + 2] == ["worst row", "explained", "message |"]
    cells = {cells[0].removeprefix("| "): cells[column] for cells in table[1:]}
    assert cells == {"planted": f"missing {missing}", "device": "no row differs", "plain": "-"}
