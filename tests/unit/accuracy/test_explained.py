"""A comparison explained (moegrad.accuracy._explained): the label counts in the report, kept through
the dict form and rejudge; which cases a sweep explains, and against which profile.

Oracle: tests/support/planted.py's planted rows (label, slot, row) from slow loops that share no
code with moegrad; a bit-exact candidate has nothing to explain by definition.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import moegrad
from moegrad import accuracy
from moegrad.accuracy import LABELS, ComparisonReport, explain_case, explaining_batch, explaining_one, with_explanation
from support import planted
from support.inputs import F16, F32


def case_of(*entry):
    built = planted.build(*entry)
    assert built is not None
    fields = {"grad_expanded_x": built.grad, "expanded_row_idx": built.index.astype(np.int32), "top_k": built.top_k,
              "drop_pad_mode": built.drop_pad_mode, "active_num": built.active_num}
    return built, fields


def changed(built) -> int:
    words = np.uint16 if built.candidate.dtype.itemsize == 2 else np.uint32
    return int((built.candidate.view(words) != built.device.view(words)).any(axis=1).sum())


def test_the_counts_survive_the_dict_form_and_rejudge():
    built, fields = case_of("dropless", F32, 8, 7, "drop", "ascend910b@9.1")
    call = moegrad.MoeInitRoutingV2GradCall(**fields)
    report = with_explanation(moegrad.compare(call, built.candidate), moegrad.explain(call, built.candidate))
    assert report.explained == {**dict.fromkeys(LABELS, 0), "missing": changed(built)}
    assert ComparisonReport.from_dict(report.to_dict()).explained == report.explained
    assert accuracy.rejudge(report, require_exact=True).explained == report.explained
    assert moegrad.compare(call, built.candidate).explained is None  # not explained: absent, not zeros


def test_a_sweep_explains_each_case_against_the_profile_that_judged_it():
    built, fields = case_of("dropless", F32, 8, 7, "sequential", "ascend950@9.1")
    one = explaining_one(accuracy.compare_in_process(order="ascend950@9.1"))
    report = one("c", fields, built.candidate)
    assert report.context.order == "ascend950@9.1"
    assert report.explained["order"] == changed(built) > 0  # against 950@9.1: every changed row by order
    batch = explaining_batch(lambda chunk: [accuracy.compare_in_process(order="ascend950@9.1")(*item) for item in chunk])
    (batched,) = batch([("c", fields, built.candidate)])
    assert batched.explained == report.explained  # (its context carries the time it was judged)


def test_what_a_sweep_leaves_unexplained():
    built, fields = case_of("dropless", F16, 4, 7, "drop", "ascend910b@9.1")
    call = moegrad.MoeInitRoutingV2GradCall(**fields)
    judged = accuracy.with_context(moegrad.compare(call, built.device), accuracy.report_context(call, built.device))
    exact, explanation = explain_case(judged, fields, built.device)
    assert explanation is None and set(exact.explained.values()) == {0}  # bit-exact: nothing ran, all 0
    wide = built.candidate.astype(np.float32)  # compare judges a float32 candidate, explain compares bits
    judged = accuracy.with_context(moegrad.compare(call, wide), accuracy.report_context(call, wide))
    assert explain_case(judged, fields, wide) == (judged, None)
    unknown = dataclasses.replace(judged, context=dataclasses.replace(judged.context, order="unknown"))
    assert explain_case(unknown, fields, built.candidate) == (unknown, None)  # no profile to replay
