"""moegrad.shrink's reproducer (a case file and a script, run in a subprocess), and shrinking a
candidate served over protocol v2.

Oracles: the candidates of tests/support/triggers.py (their faults and triggers by definition);
the case file read back by moegrad.accuracy.load_case, bit for bit; the script's exit status as its
docstring promises (1 while the fault reproduces, 0 for the bins' order, 3 for another fault); the
v2 server of tests/support/v2server.py (a bare ASGI app written from docs/protocol.md), whose count
of answered requests must equal the candidate calls the shrinker reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import moegrad
from moegrad import Candidate, shrink
from moegrad.accuracy import load_case
from support import routing, triggers
from support.bits import same_bits
from support.v2server import candidate_app, serving

TESTS = str(Path(__file__).resolve().parents[2])


def routed_call(tokens=16, top_k=8, hidden=64, seed=0):
    rng = np.random.default_rng(seed)
    routed = routing.route(rng, tokens, top_k, top_k + 4, "dropless")
    grad = rng.standard_normal(routed.grad_shape(hidden)).astype(np.float32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, **routed.kwargs())


def replay(script: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *options], capture_output=True, text=True, timeout=300,
                          env=env, cwd=script.parent)


def test_the_case_file_holds_the_shrunk_call_and_result_bit_for_bit(tmp_path):
    result = shrink(routed_call(), triggers.missing_odd_rows)
    case, script = result.save(tmp_path / "out", "odd")
    assert (case.name, script.name) == ("odd.npz", "odd.py") and os.access(script, os.X_OK)
    fields, saved = load_case(case)
    assert same_bits(fields["grad_expanded_x"], result.call.grad_expanded_x)
    assert same_bits(fields["expanded_row_idx"], result.call.expanded_row_idx)
    assert (fields["top_k"], fields["order"]) == (result.call.top_k, "ascend910b@9.1")
    assert same_bits(saved, result.candidate)


def test_a_sweep_reads_the_case_file(tmp_path):
    result = shrink(routed_call(), triggers.missing_at_k8)
    result.save(tmp_path)
    cases = moegrad.accuracy.find_cases(tmp_path)
    [judged] = moegrad.accuracy.compare_cases(cases, moegrad.accuracy.compare_in_process())
    assert judged.name == "reproducer" and judged.status == "fail"  # a summand left out is no rounding
    assert judged.report.exact.mismatched == 2  # the row's two nonzero columns


def test_the_script_reproduces_then_tells_a_fix_and_another_fault_apart(tmp_path):
    result = shrink(routed_call(), triggers.missing_above_h)  # N=1 K=2 H=49: slot 1 left out
    assert result.replay.target == "support.triggers:missing_above_h"
    _, script = result.save(tmp_path)
    done = replay(script)
    assert done.returncode == 1, done.stderr
    assert "the fault reproduces: missing at slot 1" in done.stdout
    fixed = replay(script, "--candidate", "support.triggers:correct")
    assert fixed.returncode == 0, fixed.stderr
    assert "bit-identical" in fixed.stdout
    other = replay(script, "--candidate", "support.triggers:negated")  # differs, but not by a missing slot
    assert other.returncode == 3, other.stderr
    assert "not by this fault" in other.stdout


def test_a_candidate_with_no_importable_name_is_replayed_from_the_saved_grad_x(tmp_path):
    def local(grad_expanded_x, expanded_row_idx, top_k, **attributes):
        return triggers.missing_at_k8(grad_expanded_x, expanded_row_idx, top_k, **attributes)

    assert Candidate(local).spec is None and Candidate(triggers.missing_at_k8).spec is not None
    result = shrink(routed_call(), local)
    assert result.replay.target is None
    _, script = result.save(tmp_path)
    assert "CANDIDATE = None" in script.read_text()
    done = replay(script)
    assert done.returncode == 1, done.stderr


def test_the_replay_keeps_how_a_torch_candidate_takes_its_tensors():
    on_gpu = Candidate.load("support.triggers:correct", accepts="torch", device="cuda")
    assert moegrad.accuracy._reproducer.Replay.of(on_gpu).options == {"accepts": "torch", "device": "cuda"}
    assert moegrad.accuracy._reproducer.Replay.of(Candidate("http://h:1", parameters={"order": "x"})).options == {
        "parameters": {"order": "x"}}


def test_a_name_that_is_not_a_file_name_is_refused(tmp_path):
    result = shrink(routed_call(), triggers.missing_at_k8, max_tests=30)
    for name in ("../x", "a/b", ""):
        try:
            result.save(tmp_path, name)
        except ValueError as exc:
            assert "plain file name" in str(exc)
        else:
            raise AssertionError(name)


def test_a_candidate_served_over_v2_shrinks_to_the_same_call_and_replays(tmp_path):
    call = routed_call()
    here = shrink(call, triggers.missing_odd_rows)
    app = candidate_app(triggers.missing_odd_rows)
    with serving(app) as url:
        remote = shrink(call, url)
        assert app.requests == remote.tests
        assert remote.replay.target == url + "/v2/models/moe_init_routing_v2_grad/infer"
        _, script = remote.save(tmp_path)
        done = replay(script)
    assert same_bits(remote.call.grad_expanded_x, here.call.grad_expanded_x)
    assert same_bits(remote.call.expanded_row_idx, here.call.expanded_row_idx)
    assert (remote.label, remote.slot, remote.row) == (here.label, here.slot, here.row)
    assert done.returncode == 1, done.stderr
