"""Which factor makes a sweep's cases fail: ``analyse_factors``, ``call_traits`` and the summary's section.

Oracles: ``support.row_oracle.fisher_exact`` (the hypergeometric tail as an exact fraction of
binomial coefficients) and ``factor_support`` (the 2 x 2 counts by a loop over the cases); the
traits are counted by hand from the index. Random verdicts, seeded, over hundreds of cases, must
name no condition; verdicts that follow a planted rule must name that rule with its support.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

import moegrad
from moegrad import MoeInitRoutingV2GradCall, accuracy
from moegrad.accuracy import CaseResult, CallTraits, analyse_factors, call_traits, fisher_tail
from support.row_oracle import factor_support, fisher_exact

PROFILES = ("ascend910b@9.1", "ascend950@9.1", "ascend910_93@9.0")
DTYPES = ("float16", "bfloat16", "float32")
MODES = ("dropless", "active", "drop_pad")


def random_case(rng: np.random.Generator) -> dict:
    return {
        "profile": str(rng.choice(PROFILES)),
        "dtype": str(rng.choice(DTYPES)),
        "mode": str(rng.choice(MODES)),
        "K": int(rng.choice([1, 2, 3, 4, 8, 16, 130])),
        "H": int(rng.choice([1, 7, 64, 256, 1024, 1025, 2048, 7168])),
        "skipped": int(rng.integers(0, 3)),
        "repeated": int(rng.random() < 0.2),
        "active_edge": bool(rng.random() < 0.2),
        "capacity_edge": bool(rng.random() < 0.3),
    }


def judged(case: dict, status: str) -> SimpleNamespace:
    """A case result as analyse_factors reads it: its status and its report's context."""
    traits = CallTraits(tokens=8, hidden=case["H"], mode=case["mode"], skipped_slots=case["skipped"],
                        repeated_slots=case["repeated"], active_edge=case["active_edge"],
                        capacity_edge=case["capacity_edge"])
    context = SimpleNamespace(order=case["profile"], dtypes={"grad_expanded_x": case["dtype"]}, top_k=case["K"],
                              shapes={"grad_expanded_x": (8 * case["K"], case["H"])}, traits=traits,
                              drop_pad_mode=int(case["mode"] == "drop_pad"), active_num=3 * (case["mode"] == "active"))
    return SimpleNamespace(status=status, report=SimpleNamespace(context=context))


@pytest.mark.parametrize("seed", range(12))
def test_random_verdicts_name_no_condition(seed):
    rng = np.random.default_rng(seed)
    cases = [random_case(rng) for _ in range(400)]
    share = [0.05, 0.2, 0.5][seed % 3]
    statuses = ["fail" if rng.random() < share else str(rng.choice(["pass", "warning"])) for _ in cases]
    analysis = analyse_factors([judged(c, s) for c, s in zip(cases, statuses, strict=True)])
    assert analysis.factors == ()
    assert analysis.failing == statuses.count("fail") and analysis.passing == 400 - analysis.failing
    assert analysis.lines()[0].startswith(f"which factor makes cases fail: no condition separates the "
                                          f"{analysis.failing} failing cases from the {analysis.passing} passing ones")
    assert analysis.strongest is not None and analysis.strongest.p_value >= analysis.threshold


def named(analysis) -> dict[str, object]:
    return {f.condition: f for f in analysis.factors} | {s: f for f in analysis.factors for s in f.same}


def check_support(factor, cases, statuses, condition) -> None:
    rows = [{**case, "status": status} for case, status in zip(cases, statuses, strict=True)]
    counts = factor_support(rows, condition)
    assert (factor.failing_with, factor.failing_without, factor.passing_with, factor.passing_without) == counts
    failing = counts[0] + counts[1]
    want = float(fisher_exact(counts[0], failing, counts[0] + counts[2], sum(counts)))
    assert factor.p_value == pytest.approx(want, rel=1e-9)


def test_a_hidden_size_threshold_is_named_exactly():
    rng = np.random.default_rng(1)
    cases = [random_case(rng) for _ in range(300)]
    statuses = ["fail" if c["H"] > 1024 else "pass" for c in cases]
    analysis = analyse_factors([judged(c, s) for c, s in zip(cases, statuses, strict=True)])
    (factor,) = analysis.factors
    assert factor.condition == "H >= 1025" and factor.exact
    check_support(factor, cases, statuses, lambda c: c["H"] >= 1025)
    assert factor.describe().endswith(": exactly the failing cases")


def test_two_conditions_together_are_named_as_a_pair():
    rng = np.random.default_rng(2)
    cases = [random_case(rng) for _ in range(400)]
    statuses = ["fail" if c["dtype"] == "bfloat16" and c["K"] >= 8 else "pass" for c in cases]
    analysis = analyse_factors([judged(c, s) for c, s in zip(cases, statuses, strict=True)])
    factor = analysis.factors[0]
    assert factor.condition == "dtype = bfloat16 and K >= 8" and factor.exact
    check_support(factor, cases, statuses, lambda c: c["dtype"] == "bfloat16" and c["K"] >= 8)


def test_a_noisy_rule_is_named_with_its_support():
    rng = np.random.default_rng(3)
    cases = [random_case(rng) for _ in range(500)]
    # skipped slots fail 80% of the time, the rest 5%: the rule holds, not exactly
    statuses = ["fail" if rng.random() < (0.8 if c["skipped"] else 0.05) else "pass" for c in cases]
    analysis = analyse_factors([judged(c, s) for c, s in zip(cases, statuses, strict=True)])
    factor = named(analysis)["skipped slots"]
    assert factor is analysis.factors[0] and not factor.exact
    check_support(factor, cases, statuses, lambda c: c["skipped"] > 0)


@pytest.mark.parametrize(("failing", "total"), [(3, 10), (5, 12), (1, 7), (6, 9)])
def test_the_fisher_tail_is_the_exact_hypergeometric_tail(failing, total):
    for with_condition, failing_with in itertools.product(range(total + 1), range(failing + 1)):
        want = float(fisher_exact(failing_with, failing, with_condition, total))
        assert fisher_tail(failing_with, failing, with_condition, total) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_nothing_to_separate_is_said_plainly():
    rng = np.random.default_rng(4)
    cases = [judged(random_case(rng), "pass") for _ in range(20)]
    analysis = analyse_factors([*cases, SimpleNamespace(status="invalid", report=None)])
    assert analysis.factors == () and analysis.lines() == [
        "which factor makes cases fail: nothing to separate (no case failed; 20 judged)"]


def test_cases_without_traits_are_judged_on_what_their_context_records():
    rng = np.random.default_rng(5)
    cases = [random_case(rng) for _ in range(300)]
    results = [judged(c, "fail" if c["mode"] == "drop_pad" else "pass") for c in cases]
    results[0].report.context.traits = None  # a report written before traits were recorded
    analysis = analyse_factors(results)
    assert analysis.factors[0].condition == "mode = drop_pad" and analysis.traits_missing == 1
    assert any("slots and edges not tested" in line for line in analysis.lines())


def traits_by_hand(index: list[int], rows: int, mode: str, tokens_slots: int, active_num: int,
                   capacity: int | None) -> tuple[int, int, bool, bool]:
    read = [v for v in index if 0 <= v < rows]
    skipped = len(index) - len(read)
    repeated = sum(1 for v in read if read.count(v) > 1)
    active_edge = mode == "active" and (active_num == 1 or active_num >= tokens_slots)
    capacity_edge = capacity is not None and any(v % capacity == capacity - 1 for v in read)
    return skipped, repeated, active_edge, capacity_edge


@pytest.mark.parametrize(("index", "top_k", "attributes", "shape"), [
    ([2, 0, 1, 3], 2, {}, (4, 2)),
    ([0, 5, 4, 1, 3, 2], 3, {"active_num": 4}, (4, 2)),
    ([0, 1, 2, 3], 2, {"active_num": 4}, (4, 2)),
    ([0, 3, -1, 1, -1, -1], 3, {"drop_pad_mode": 1}, (2, 2, 2)),
    ([0, 2, -1, 3, 1, 0], 3, {"drop_pad_mode": 1, "allow_duplicate_indices": True}, (2, 2, 2)),
])
def test_call_traits_are_the_counts_by_hand(index, top_k, attributes, shape):
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.ones(shape, np.float32),
                                    expanded_row_idx=np.array(index, np.int32), top_k=top_k, **attributes)
    traits = call_traits(call)
    rows = int(np.prod(shape[:-1]))
    mode = "drop_pad" if attributes.get("drop_pad_mode") else "active" if attributes.get("active_num") else "dropless"
    capacity = shape[1] if mode == "drop_pad" else None
    want = traits_by_hand(index, rows, mode, len(index), attributes.get("active_num", 0), capacity)
    assert (traits.skipped_slots, traits.repeated_slots, traits.active_edge, traits.capacity_edge) == want
    assert (traits.tokens, traits.hidden, traits.mode, traits.capacity) == (len(index) // top_k, shape[-1], mode, capacity)


def test_every_report_context_records_its_calls_traits():
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((2, 2, 2), np.float32),
                                    expanded_row_idx=np.array([0, 3, -1, 1], np.int32), top_k=2, drop_pad_mode=1)
    context = accuracy.report_context(call, moegrad.moe_init_routing_v2_grad(call))
    assert context.traits == call_traits(call)
    assert accuracy.ReportContext.from_dict(context.to_dict()) == context


def test_the_summary_markdown_names_the_factor(tmp_path):
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((4, 2), np.float32),
                                    expanded_row_idx=np.array([2, 0, 1, 3], np.int32), top_k=2)
    report = moegrad.compare(call, moegrad.moe_init_routing_v2_grad(call))
    base = accuracy.report_context(call, moegrad.moe_init_routing_v2_grad(call))
    rng = np.random.default_rng(6)
    results = []
    for i in range(120):
        k = int(rng.choice([2, 4, 8]))
        context = dataclasses.replace(base, top_k=k, case=f"c{i:03d}")
        results.append(CaseResult(f"c{i:03d}", "fail" if k == 8 else "pass",
                                  dataclasses.replace(report, context=context, verdict="fail" if k == 8 else "pass")))
    accuracy.write_summary(results, tmp_path / "s.csv", tmp_path / "s.md")
    markdown = (tmp_path / "s.md").read_text()
    fails = sum(r.status == "fail" for r in results)
    assert "## Which factor makes cases fail" in markdown
    assert f"| K \\>= 8 | K = 8 | {fails} | 0 | 0 | {120 - fails} |" in markdown  # ">" escaped: markdown shows it
