"""moegrad.accuracy's reports: CSV against hand figures, JSON read back, markdown provenance, the plot.

Oracles: the CSV's values are checked against figures computed by hand on a 1x4 case (exact in
binary); the verdict a read-back report reproduces is the one the oracle cases of tests/support/oracle.py
fix; column names are msprobe's, as docs/accuracy.md lists them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import accuracy
from support.oracle import device_k2, oracle_call, oracle_candidate

BF16 = np.dtype(ml_dtypes.bfloat16)
MSPROBE = ["API Name", "Bench Dtype", "DEVICE Dtype", "Shape", "余弦相似度", "最大绝对误差", "双百指标", "双千指标", "双万指标",
           "二进制一致错误率", "误差均衡性", "均方根误差", "小值域错误占比", "相对误差最大值", "相对误差平均值", "inf/nan错误率",
           "相对误差错误率", "绝对误差错误率", "ULP误差最大值", "ULP误差平均值", "ULP误差大于阈值占比", "Status", "Message"]


def read_csv(path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8-sig", newline="") as file:
        return list(csv.DictReader(file))


def test_csv_columns_and_values_are_the_hand_figures(tmp_path):
    golden = np.array([[1.0, 2.0, 4.0, 8.0]])
    device = golden.astype(np.float32)
    candidate = np.array([[1.0, 2.0, 4.0, 8.5]], np.float32)
    report = accuracy.compare_arrays(candidate, device, golden)
    path = tmp_path / "r.csv"
    accuracy.write_csv_report(path, report)
    with open(path, encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file))
    assert header[:len(MSPROBE)] == MSPROBE
    cand, dev = read_csv(path)
    assert (cand["API Name"], dev["API Name"]) == ("aclnnMoeInitRoutingV2Grad.candidate", "aclnnMoeInitRoutingV2Grad.device")
    assert (cand["Bench Dtype"], cand["DEVICE Dtype"], cand["Shape"]) == ("float64", "float32", "(1, 4)")
    # By hand: one error of 0.5 at 8.0, three exact elements.
    assert float(cand["最大绝对误差"]) == 0.5
    assert float(cand["均方根误差"]) == 0.25  # sqrt(0.5^2 / 4)
    assert float(cand["相对误差最大值"]) == 0.0625  # 0.5 / 8
    assert float(cand["相对误差平均值"]) == 0.015625  # (0 + 0 + 0 + 0.0625) / 4
    assert float(cand["双千指标"]) == float(cand["双万指标"]) == 0.75 and float(cand["双百指标"]) == 0.75
    assert float(cand["二进制一致错误率"]) == 0.25
    assert float(cand["余弦相似度"]) == pytest.approx(89 / math.sqrt(85 * 93.25), rel=1e-15)
    assert float(cand["inf/nan错误率"]) == 0.0
    assert cand["相对误差错误率"] == cand["绝对误差错误率"] == ""  # msprobe's absolute-threshold rates: not computed
    assert cand["ULP误差大于阈值占比"] == ""  # float32: msprobe counts above 32 ULP, moegrad above 1
    assert (cand["Status"], cand["moegrad_status"], cand["bit_exact"], cand["bitwise_mismatches"]) == (
        "error", "fail", "false", "1")
    assert (cand["worst_row"], cand["worst_column"]) == ("0", "3")
    assert "max_relative_error" in cand["Message"]
    assert float(dev["最大绝对误差"]) == 0.0 and dev["Status"] == "pass" and dev["二进制一致错误率"] == "0.0"


def test_the_compact_json_is_the_same_document_and_reads_back_whole(tmp_path):
    """A sweep's per-case JSON (``indent=None``: pydantic's serializer) holds json.dumps's document,
    non-finite figures as the strings docs/accuracy.md names, and reads back to the same report."""
    call = oracle_call(seed=6)
    candidate = oracle_candidate("scaled_up", device_k2(call))
    candidate[0, 0] = np.nan  # NaN figures and a NaN/Inf mismatch in the report
    report = accuracy.with_context(moegrad.compare(call, candidate), accuracy.report_context(call, candidate))
    report = accuracy.with_row_errors(report, call, candidate)
    accuracy.write_json_report(tmp_path / "compact.json", report, indent=None)
    text = (tmp_path / "compact.json").read_text(encoding="utf-8")
    assert text.count("\n") == 1 and text.endswith("\n")
    assert json.loads(text) == json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert '"nan"' in text and "NaN" not in text
    assert accuracy.read_json_report(tmp_path / "compact.json").to_dict() == report.to_dict()  # NaN != NaN as floats


def test_a_report_read_back_reproduces_its_verdict(tmp_path):
    call = oracle_call(seed=6)
    candidate = oracle_candidate("scaled_up", device_k2(call))
    report = accuracy.with_context(moegrad.compare(call, candidate, require_exact=True),
                                   accuracy.report_context(call, candidate))
    accuracy.write_json_report(tmp_path / "r.json", report)
    again = accuracy.read_json_report(tmp_path / "r.json")
    assert again == report
    judged = accuracy.rejudge(again)
    assert judged.verdict == report.verdict == "fail" and judged.verdicts == report.verdicts
    assert accuracy.rejudge(again, require_exact=False, standards="accumulative").verdict == "pass"
    # The context names the inputs by digest: the saved report identifies them.
    assert again.context.sha256["candidate"] == hashlib.sha256(candidate.tobytes()).hexdigest()
    assert again.context.sha256["expanded_row_idx"] == hashlib.sha256(call.expanded_row_idx.tobytes()).hexdigest()
    assert (again.context.top_k, again.context.order, again.context.moegrad_version) == (2, "ascend910b@9.1",
                                                                                          moegrad.__version__)


def truncated_bfloat16(call) -> np.ndarray:
    wide = call.model_copy(update={"grad_expanded_x": call.grad_expanded_x.astype(np.float32)})
    total = moegrad.moe_init_routing_v2_grad(wide)
    return (total.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(BF16)


def test_a_truncating_bfloat16_port_fails_and_the_report_says_why(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 32)).astype(BF16)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=x, expanded_row_idx=rng.permutation(256).astype(np.int32),
                                            top_k=4)
    candidate = truncated_bfloat16(call)
    report = accuracy.with_context(moegrad.compare(call, candidate), accuracy.report_context(call, candidate))
    text = accuracy.format_report(report)
    assert "verdict: FAIL" in text
    (line,) = [line for line in text.splitlines() if "error_imbalance_excess" in line]
    assert "fail" in line and "device 0" in line
    accuracy.write_markdown_report(tmp_path / "t.md", report, call, candidate,
                                   device_result=moegrad.moe_init_routing_v2_grad(call))
    markdown = (tmp_path / "t.md").read_text()
    for fact in ("error_imbalance_excess", "top_k, drop_pad_mode, active_num | 4, 0, 0", "ascend910b@9.1 (Atlas A2, CANN 9.1)",
                 report.context.sha256["grad_expanded_x"], moegrad.__version__, "| server | in-process |", "bit-exact: no"):
        assert fact in markdown, fact


def test_the_plot_is_written_with_both_distributions(tmp_path):
    pytest.importorskip("matplotlib", reason="the optional 'plot' extra (matplotlib) is not installed here")
    call = oracle_call()
    device = device_k2(call)
    candidate = oracle_candidate("scaled_up", device)
    report = moegrad.compare(call, candidate)
    png = accuracy.write_markdown_report(tmp_path / "p.md", report, call, candidate, device_result=device)
    assert png == tmp_path / "p.png" and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    signed = accuracy.relative_errors(call, candidate, signed=True)
    assert (signed > 0).all()  # scaled up: every error grows the magnitude


def test_the_report_shows_each_criterion_beside_the_devices_figure():
    call = oracle_call(seed=7)
    candidate = oracle_candidate("one_ulp_noise", device_k2(call))
    text = accuracy.format_report(moegrad.compare(call, candidate))
    assert "verdict: PASS" in text and "bit-exact: no" in text
    rows = [line.split() for line in text.splitlines()]
    standards = {row[0]: row[1:3] for row in rows if row and row[0] in accuracy.DEFAULT_STANDARDS}
    assert standards == dict.fromkeys(accuracy.DEFAULT_STANDARDS, ["pass", "pass"])
    document = json.loads(json.dumps(moegrad.compare(call, candidate).to_dict(), allow_nan=False))
    assert document["exact"]["bit_exact"] is False and document["exact"]["mismatched"] > 0
