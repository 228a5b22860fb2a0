"""The HTML page's numbers and text, without a browser (tests/e2e/test_html_page_e2e.py loads it in one).

Oracles: the residual's coefficient on a slot left out of every row is -1 and on a slot added twice
+1 (the definition: candidate - golden = -x_t or +x_t, up to float32 rounding); the map against
``support.row_oracle.scaled_map``; a case name holding markup is shown as text.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import moegrad
from moegrad import MoeInitRoutingV2GradCall, accuracy
from moegrad.accuracy import _html, _html_data
from support import planted
from support.row_oracle import scaled_map


def faulty_call(fault: str, slot: int = 2, top_k: int = 4, tokens: int = 64, hidden: int = 32):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=x, expanded_row_idx=rng.permutation(tokens * top_k).astype(np.int32),
                                    top_k=top_k, order="sequential")
    rows = x.astype(np.float64)[call.expanded_row_idx].reshape(tokens, top_k, hidden)
    sign = {"missing": -1.0, "duplicated": 1.0}[fault]
    candidate = (rows.sum(axis=1) + sign * rows[:, slot]).astype(np.float32)
    return call, candidate


@pytest.mark.parametrize(("fault", "coefficient"), [("missing", -1.0), ("duplicated", 1.0)])
def test_the_residual_on_the_faulty_slot_is_minus_or_plus_one(fault, coefficient):
    call, candidate = faulty_call(fault)
    view = _html_data.case_view(call, candidate)
    assert view.slots.rows == 64  # every row lies outside the any-order bound
    assert view.slots.coefficient[2] == pytest.approx(coefficient, abs=1e-6)
    others = np.delete(view.slots.coefficient, 2)
    assert np.all(np.abs(others) < 0.3), others  # the other slots' summands are unrelated to the residual


def test_the_slot_counts_are_the_explanations():
    case = planted.build("dropless", planted.F32, 8, 7, "drop", "ascend910b@9.1")
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    explanation = moegrad.explain(call, case.candidate)
    view = _html_data.case_view(call, case.candidate, explanation=explanation)
    for t in range(8):
        assert view.slots.labels["missing"][t] == sum(1 for p in case.planted.values() if p.slot == t)
    worst = {w.row: w for w in view.worst}
    assert set(case.planted) <= set(worst)
    for row, plant in case.planted.items():
        assert (worst[row].explained.label, worst[row].explained.slot) == ("missing", plant.slot)
        assert worst[row].slots.index == tuple(int(v) for v in case.index[row * 8:(row + 1) * 8])


@pytest.mark.parametrize("entry", [("drop_pad", planted.F16, 3, 7, "extra_capacity", "ascend910b@9.1"),
                                   ("active", planted.BF16, 4, 256, "duplicate", "ascend950@9.1")])
def test_the_map_is_the_oracles(entry):
    case = planted.build(*entry)
    call = MoeInitRoutingV2GradCall(**case.kwargs())
    view = _html_data.case_view(call, case.candidate, device_result=case.device)
    row_edges, column_edges, cells = scaled_map(case.grad, case.index, case.top_k, case.drop_pad_mode, case.candidate)
    assert (list(view.map.row_edges), list(view.map.column_edges)) == (row_edges, column_edges)
    for got, want in zip(view.map.values.ravel().tolist(), [v for line in cells for v in line], strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12)
    assert view.map.kind == ("experts" if case.drop_pad_mode else "rows")


def test_a_page_without_matplotlib_keeps_every_table(monkeypatch):
    call, candidate = faulty_call("missing")
    report = accuracy.with_row_errors(moegrad.compare(call, candidate), call, candidate)
    monkeypatch.setattr(_html, "plotting", lambda: False)
    page = _html.case_page(report, _html_data.case_view(call, candidate), name="<b>x</b> & 'y'")
    assert "<img" not in page and "Plots skipped: matplotlib is not installed" in page
    assert "&lt;b&gt;x&lt;/b&gt; &amp; &#x27;y&#x27;" in page and "<b>x</b>" not in page
    assert f'data-field="row_errors.failing">{report.row_errors.failing}<' in page
    assert 'data-field="map.0.0"' in page and "<script" not in page


@pytest.mark.parametrize(("value", "shown"), [(0.1, "0.1"), (1e-300, "1e-300"), (math.nan, "nan"), (math.inf, "inf"),
                                              (-math.inf, "-inf"), (3, "3"), (None, "-"), (True, "true"),
                                              (np.float64(2.5), "2.5"), (np.int64(7), "7")])
def test_numbers_are_written_as_the_json_writes_them(value, shown):
    assert _html.number(value) == shown
