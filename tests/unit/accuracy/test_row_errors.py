"""Compare reports say where the error lives: ``row_errors`` and its JSON, CSV, text and markdown.

Oracles: ``support.row_oracle`` recomputes every figure one element at a time from docs/accuracy.md
(``math.fsum`` goldens, ``math.frexp`` ULPs, sorted-list percentiles), over candidates and device
results that ``support.planted`` builds with slow per-row loops (a slot dropped, a NaN in an input,
accumulation in float16, ...) and over a K = 2 call whose device result ``support.oracle.device_k2``
fixes, with errors planted row by row; msprobe's column names are typed out here.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

import moegrad
from moegrad import MoeInitRoutingV2GradCall, accuracy
from support import planted
from support.oracle import device_k2
from support.row_oracle import RowFigures, expected_dict, nearest_rank, row_figures

MSPROBE = ["API Name", "Bench Dtype", "DEVICE Dtype", "Shape", "余弦相似度", "最大绝对误差", "双百指标", "双千指标", "双万指标",
           "二进制一致错误率", "误差均衡性", "均方根误差", "小值域错误占比", "相对误差最大值", "相对误差平均值", "inf/nan错误率",
           "相对误差错误率", "绝对误差错误率", "ULP误差最大值", "ULP误差平均值", "ULP误差大于阈值占比", "Status", "Message"]


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """Each block measured by the compiled kernel (where numba is installed and the block is all
    finite), or every block by the NumPy path; yields the list of the compiled kernel's answers
    (None: the block went the NumPy way)."""
    answers = []
    if request.param == "numpy":
        monkeypatch.setattr(moegrad.accuracy._where, "_measure_compiled", lambda *args: None)
    else:
        compiled = moegrad.accuracy._where._measure_compiled

        def recorded(*args):
            answers.append(compiled(*args))
            return answers[-1]

        monkeypatch.setattr(moegrad.accuracy._where, "_measure_compiled", recorded)
    return answers


def oracle_of(case) -> dict:
    figures = row_figures(case.grad, case.index, case.top_k, case.drop_pad_mode, case.candidate, case.device)
    return expected_dict(figures, case.candidate.shape[0])


def same(got, want) -> bool:
    """Equal dicts, floats compared exactly except NaN (the dict form writes it "nan")."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    return got == want


PLANTS = ("drop", "duplicate", "neighbour", "extra_last", "extra_active", "extra_capacity", "accumulate_f16",
          "cast_before_add", "sequential", "kahan", "nan_input", "nan_candidate")


def planted_cases():
    cases = []
    for mode, dtype, top_k, hidden, plant, profile in planted.sample(60, seed=3737):
        if plant in PLANTS and top_k <= 16:
            cases.append(pytest.param(mode, dtype, top_k, hidden, plant, profile,
                                      id=f"{plant}-{mode}-{np.dtype(dtype).name}-K{top_k}-H{hidden}-{profile}"))
    return cases


@pytest.mark.parametrize(("mode", "dtype", "top_k", "hidden", "plant", "profile"), planted_cases())
def test_row_errors_match_the_slow_loops_on_planted_faults(path, mode, dtype, top_k, hidden, plant, profile):
    case = planted.build(mode, dtype, top_k, hidden, plant, profile)
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    got = accuracy.row_errors(call, case.candidate, device_result=case.device).to_dict()
    want = oracle_of(case)
    assert same(got, want), json.dumps({"got": got, "want": want}, default=str)


def test_the_device_result_and_its_emulation_agree_on_the_planted_matrix():
    """row_errors without device_result emulates the device: on the planted cases, the same figures."""
    case = planted.build("drop_pad", planted.F32, 4, 7, "extra_capacity", "ascend910b@9.1")
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    assert accuracy.row_errors(call, case.candidate) == accuracy.row_errors(call, case.candidate, device_result=case.device)


@pytest.mark.parametrize(("mode", "dtype", "plant"), [("dropless", planted.F32, "drop"),
                                                    ("drop_pad", planted.BF16, "nan_input"),
                                                    ("active", planted.F16, "accumulate_f16")])
def test_blocks_whose_candidate_has_the_devices_bits_match_the_slow_loops(path, monkeypatch, mode, dtype, plant):
    """The planted rows are a few: with blocks of two rows, most blocks hold the device's own bits
    (their device figures are the candidate's) and some do not; the device result itself as the
    candidate has every figure of the device's. Both against the slow loops."""
    case = planted.build(mode, dtype, 4, 6, plant)
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    monkeypatch.setattr(moegrad.accuracy._where, "_BLOCK_ELEMENTS", 2 * 6)
    got = accuracy.row_errors(call, case.candidate, device_result=case.device).to_dict()
    assert same(got, oracle_of(case)), json.dumps(got, default=str)
    case.candidate = case.device.copy()
    got = accuracy.row_errors(call, case.candidate, device_result=case.device).to_dict()
    want = oracle_of(case)
    assert same(got, want) and want["differing"] == 0, json.dumps(got, default=str)


def k2_call(seed: int = 5, tokens: int = 200, hidden: int = 8) -> MoeInitRoutingV2GradCall:
    rng = np.random.default_rng(seed)
    values = rng.uniform(0.25, 1.0, (2 * tokens, hidden)) * rng.choice([-1.0, 1.0], (2 * tokens, hidden))
    return MoeInitRoutingV2GradCall(grad_expanded_x=values.astype(np.float32),
                                    expanded_row_idx=rng.permutation(2 * tokens).astype(np.int32), top_k=2)


def test_percentiles_are_nearest_rank_over_rows_with_errors_planted_row_by_row(path):
    call = k2_call()
    device = device_k2(call)
    candidate = device.copy()
    rng = np.random.default_rng(7)
    # rows 0..199 get errors of 0 .. about 2^10 ULPs in one column each: a known spread over the rows
    for i in range(call.num_tokens):
        steps = int(rng.integers(0, 1024)) if i % 3 else 0
        candidate[i, i % 8] = np.float32(float(candidate[i, i % 8]) * (1 + steps * 2.0**-23))
    got = accuracy.row_errors(call, candidate, device_result=device)
    figures = row_figures(call.grad_expanded_x, call.expanded_row_idx, 2, 0, candidate, device)
    assert same(got.to_dict(), expected_dict(figures, call.num_tokens))
    assert got.differing == sum(1 for i in range(200) if (candidate[i] != device[i]).any())
    values = sorted(v for _, v in figures.ulp)
    # rank ceil(0.9 * 200) = 180 of 200 (1-based): the 180th smallest row figure, never an interpolation
    assert got.ulp_error.p90 == values[179] == nearest_rank(values, 90)
    assert got.ulp_error.p99 == values[197] and got.ulp_error.p50 == values[99]
    assert all(answer is not None for answer in path)  # all finite: the compiled path measured every block


def _ulps_apart(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """``values`` moved ``steps`` representable values away from zero (their bits plus ``steps``)."""
    words = np.uint16 if values.dtype.itemsize == 2 else np.uint32
    return (values.view(words) + steps.astype(words)).view(values.dtype)


@pytest.mark.parametrize(("dtype", "lowest", "highest"), [(np.float16, -28, 12), (planted.BF16, -140, 100),
                                                           (np.float32, -150, 100)])
def test_values_over_every_binade_match_the_slow_loops(path, dtype, lowest, highest):
    """Summands from below the subnormals to far above 1 (zeros, signed), a token whose summands all
    lie below the small value (no relative error: NaN), candidates 0 to 40 ULPs off and -0.0 for
    +0.0: the figures and ULP distances of every binade, both paths against the slow loops."""
    rng = np.random.default_rng(17)
    tokens, top_k, hidden = 48, 3, 16
    exponents = rng.integers(lowest, highest, (tokens * top_k, hidden))
    values = rng.uniform(1.0, 2.0, exponents.shape) * np.exp2(exponents) * rng.choice([-1.0, 1.0], exponents.shape)
    values[rng.random(values.shape) < 0.1] = 0.0
    order = rng.permutation(tokens * top_k).astype(np.int32)
    values[order[:top_k]] = 2.0**-40  # token 0: every summand below every dtype's small value
    call = MoeInitRoutingV2GradCall(grad_expanded_x=values.astype(dtype), expanded_row_idx=order, top_k=top_k)
    device = moegrad.moe_init_routing_v2_grad(call)
    assert np.isfinite(device.astype(np.float64)).all()
    steps = np.where(rng.random(device.shape) < 0.3, rng.integers(0, 40, device.shape), 0)
    candidate = np.where(device == 0, device, _ulps_apart(device, steps)).astype(device.dtype)
    candidate[5, :4] = -0.0
    assert np.isfinite(candidate.astype(np.float64)).all()
    got = accuracy.row_errors(call, candidate, device_result=device).to_dict()
    figures = row_figures(call.grad_expanded_x, order, top_k, 0, candidate, device)
    assert same(got, expected_dict(figures, tokens)), json.dumps(got, default=str)
    assert 0 not in dict(figures.relative) and got["relative_error"]["rows"] < tokens  # token 0 has none
    assert all(answer is not None for answer in path)


@pytest.mark.parametrize(("n", "percent", "rank"), [(1, 50, 1), (1, 99, 1), (2, 50, 1), (3, 50, 2), (10, 90, 9),
                                                    (10, 99, 10), (100, 99, 99), (101, 99, 100), (7, 50, 4)])
def test_nearest_rank_by_hand(n, percent, rank):
    values = np.arange(n, dtype=np.float64)[::-1].copy()  # n-1 .. 0: the rank-th smallest is rank - 1
    assert accuracy._where.nearest_rank(values, percent) == rank - 1 == nearest_rank(list(values), percent)


@pytest.mark.parametrize(("steps", "failing"), [(5, 1), (4, 0)])
def test_a_relative_error_exactly_at_its_limit_fails(path, steps, failing):
    """float32's relative limit is 10 * 2^-13, and a criterion ``< limit`` fails at the limit itself
    (docs/accuracy.md, "Standards"): 0.25 read as 0.25 + 5 * 2^-14 is a relative error of exactly
    10 * 2^-13 (and an accumulative one of 5 * 2^-14, under its 2^-11); 4 * 2^-14 is under both."""
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.full((1, 1), 0.25, np.float32),
                                    expanded_row_idx=np.zeros(1, np.int32), top_k=1)
    candidate = np.full((1, 1), 0.25 + steps * 2.0**-14, np.float32)
    got = accuracy.row_errors(call, candidate)
    assert got.relative_error.max == steps * 2.0**-14 / 0.25 and got.failing == failing
    device = moegrad.moe_init_routing_v2_grad(call)
    figures = row_figures(call.grad_expanded_x, call.expanded_row_idx, 1, 0, candidate, device)
    assert same(got.to_dict(), expected_dict(figures, 1))
    assert all(answer is not None for answer in path)


def test_a_row_that_must_be_zero_fails_with_minus_zero_and_the_device_does_not():
    # drop/pad, E = 2, C = 2: token 1 has both slots dropped (-1): its row must be +0.0
    grad = np.arange(1, 17, dtype=np.float32).reshape(2, 2, 4)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([0, 2, -1, -1, 1, 3], np.int32),
                                    top_k=2, drop_pad_mode=1)
    device = moegrad.moe_init_routing_v2_grad(call)
    assert device[1].tolist() == [0, 0, 0, 0] and not np.signbit(device[1]).any()
    candidate = device.copy()
    candidate[1, 2] = -0.0
    r = accuracy.row_errors(call, candidate)
    assert (r.failing, r.device_failing, r.differing, r.outside_bound) == (1, 0, 1, 0)
    figures = row_figures(grad, call.expanded_row_idx, 2, 1, candidate, device)
    assert same(r.to_dict(), expected_dict(figures, 3))


@pytest.mark.parametrize(("dtype", "words", "signalling"), [(np.float32, np.uint32, 0x7F800001),
                                                        (planted.BF16, np.uint16, 0x7F81),
                                                        (np.float16, np.uint16, 0x7C01)])
def test_a_signalling_nan_in_the_candidate_is_a_nan_and_no_warning(path, dtype, words, signalling):
    """IEEE 754 (6.2): an exponent of all ones and a fraction whose top bit is clear (not zero) is a
    signalling NaN; widened it is a NaN like any other (pytest turns a warning into an error here)."""
    grad = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2).astype(dtype)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(8, dtype=np.int32), top_k=2)
    device = moegrad.moe_init_routing_v2_grad(call)
    candidate = device.copy()
    candidate.view(words)[1, 1] = signalling
    got = accuracy.row_errors(call, candidate, device_result=device)
    assert (got.nonfinite, got.failing, got.differing, got.device_failing) == (1, 1, 1, 0)
    assert got.first_nonfinite is not None and (got.first_nonfinite.row, got.first_nonfinite.columns) == (1, (1,))


def test_the_first_nonfinite_row_names_the_slot_whose_input_carries_it():
    case = planted.build("drop_pad", planted.F32, 3, 7, "nan_input", "ascend910b@9.1")
    # the candidate read the NaN as 0: its rows are finite; the device's carry the NaN. Put the NaN back
    # in the second planted row only, as a port that lost it in one row would not
    rows = sorted(case.planted)
    candidate = case.candidate.copy()
    candidate[rows[1], case.hidden // 2] = np.nan
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    first = accuracy.row_errors(call, candidate, device_result=case.device).first_nonfinite
    planted_slot = case.planted[rows[1]].slot
    assert first is not None and first.row == rows[1]
    assert first.carriers == (planted_slot,) and first.columns == (case.hidden // 2,)
    assert first.device_count >= 1 and first.golden_count >= 1
    assert first.slots.index == tuple(int(v) for v in case.index[rows[1] * 3:(rows[1] + 1) * 3])
    assert first.slots.expert[planted_slot] == case.index[rows[1] * 3 + planted_slot] // case.grad.shape[1]


def test_the_report_carries_the_row_errors_in_json_csv_text_and_markdown(tmp_path):
    case = planted.build("dropless", planted.F32, 4, 7, "drop", "ascend910b@9.1")
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    report = moegrad.compare(call, case.candidate, device_result=case.device)
    report = accuracy.with_explanation(report, moegrad.explain(call, case.candidate, device_result=case.device))
    report = accuracy.with_row_errors(report, call, case.candidate, device_result=case.device)
    want = oracle_of(case)
    # JSON: the dict form, read back
    accuracy.write_json_report(tmp_path / "r.json", report)
    document = json.loads((tmp_path / "r.json").read_text())
    assert same(document["row_errors"], want)
    assert accuracy.read_json_report(tmp_path / "r.json").row_errors == report.row_errors
    assert accuracy.rejudge(report).row_errors == report.row_errors
    # CSV: msprobe's columns first and unchanged, the new ones last
    accuracy.write_csv_report(tmp_path / "r.csv", report)
    with open(tmp_path / "r.csv", encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file))
        file.seek(0)
        cand, dev = list(csv.DictReader(file))
    assert header[:len(MSPROBE)] == MSPROBE
    assert header[-len(accuracy.ROW_ERROR_COLUMNS):] == list(accuracy.ROW_ERROR_COLUMNS)
    assert int(cand["rows_differing"]) == want["differing"] == len(case.planted)
    assert int(cand["rows_failing"]) == want["failing"] and int(dev["rows_failing"]) == want["device_failing"]
    assert int(cand["rows_outside_bound"]) == want["outside_bound"] and dev["rows_outside_bound"] == ""
    for q in ("p50", "p90", "p99", "max"):
        assert float(cand[f"row_relative_error_{q}"]) == want["relative_error"][q]
        assert float(dev[f"row_ulp_error_{q}"]) == want["device_ulp_error"][q]
    assert cand["explained"] == f"missing {len(case.planted)}" and dev["explained"] == ""
    # text and markdown: the table and its figures
    text = accuracy.format_report(report)
    assert "where the error lives (per row):" in text
    assert f"rows that differ from the device  {want['differing']}" in text
    assert f"explained: missing {len(case.planted)}" in text and "first NaN/Inf row: none" in text
    row = want["relative_error"]["max_row"]
    assert f"max {want['relative_error']['max']:.4g} (row {row})" in text
    markdown = accuracy.markdown_report(report)
    assert "## Where the error lives (per row)" in markdown
    assert f"| rows past an element's limit | {want['failing']} | {want['device_failing']} |" in markdown


def test_a_report_without_row_errors_renders_as_before():
    call = k2_call(tokens=4)
    report = moegrad.compare(call, device_k2(call))
    assert report.row_errors is None and "where the error lives" not in accuracy.format_report(report)
    cells = accuracy.csv_rows(report)[0]
    assert all(cells[column] == "" for column in accuracy.ROW_ERROR_COLUMNS)


def test_a_float32_candidate_of_a_bfloat16_call_is_measured_in_float32_ulps():
    case = planted.build("dropless", planted.BF16, 3, 7, "drop", "ascend910b@9.1")
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    candidate = case.candidate.astype(np.float32)
    got = accuracy.row_errors(call, candidate, device_result=case.device).to_dict()
    figures = row_figures(case.grad, case.index, 3, 0, candidate, case.device)
    assert same(got, expected_dict(figures, case.candidate.shape[0]))
    assert got["ulp_error"]["max"] != got["device_ulp_error"]["max"]


def test_a_wrong_candidate_is_refused_as_compare_refuses_it():
    call = k2_call(tokens=4)
    with pytest.raises(moegrad.InvalidArgument) as caught:
        accuracy.row_errors(call, np.zeros((3, 8), np.float32))
    assert caught.value.field == "candidate" and caught.value.aclnn_status == 161002


def test_spread_of_no_rows_is_nan():
    assert RowFigures.spread([]) == {"rows": 0, "p50": "nan", "p90": "nan", "p99": "nan", "max": "nan", "max_row": None}
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.zeros((0, 4), np.float32),
                                    expanded_row_idx=np.zeros(0, np.int32), top_k=2)
    r = accuracy.row_errors(call, np.zeros((0, 4), np.float32))
    assert r.rows == 0 and r.relative_error.rows == 0 and math.isnan(r.relative_error.p50)
