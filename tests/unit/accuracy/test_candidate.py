"""moegrad.Candidate: a callable (NumPy or torch), ``package.module:function``, or a v2 URL, called the same way.

Oracles: the planted candidates of tests/support/candidates.py (known trees), served over v2 by
tests/support/v2server.py, a bare ASGI app written from docs/protocol.md; the probe must name the
planted tree through the wire as in-process, and the server's request count must equal the calls
the harness reports.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import moegrad
from moegrad import Candidate, CandidateError, as_candidate, check_determinism, order_free_inputs, probe_order
from support.bits import same_bits
from support.candidates import bins_tree, chain_tree, expression_of, groups_tree, shuffled_rows, tree_candidate
from support.v2server import candidate_app, serving

A2A3 = {f"{chip}@{release}" for chip in ("ascend910b", "ascend910_93") for release in ("8.5", "9.0", "9.1")}


def doc_call(dtype="float32", **attributes):
    grad = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], np.float32).astype(moegrad.DTYPES[dtype])
    index = np.array([2, 0, 1, 3], np.int32)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=2, **attributes)


def test_a_numpy_candidate_gets_copies_and_the_attributes():
    seen = {}

    def candidate(grad_expanded_x, expanded_row_idx, top_k, **attributes):
        seen.update(types=(type(grad_expanded_x), type(expanded_row_idx)), top_k=top_k, attributes=attributes)
        grad_expanded_x[:] = 0  # the harness's arrays must not change
        return np.zeros((2, 2), np.float32)

    call = doc_call(active_num=4)
    before = call.grad_expanded_x.copy()
    wrapped = Candidate(candidate)
    assert wrapped.accepts == "numpy"
    wrapped(call)
    assert seen == {"types": (np.ndarray, np.ndarray), "top_k": 2, "attributes": {"drop_pad_mode": 0, "active_num": 4}}
    assert same_bits(call.grad_expanded_x, before) and wrapped.calls == 1


def tensor_sum(grad_expanded_x: torch.Tensor, expanded_row_idx: torch.Tensor, top_k: int, **_) -> torch.Tensor:
    rows = grad_expanded_x.float()[expanded_row_idx.long()].reshape(-1, top_k, grad_expanded_x.shape[-1])
    total = rows[:, 0]
    for t in range(1, top_k):
        total = total + rows[:, t]
    return total.to(grad_expanded_x.dtype)


class Summing(torch.nn.Module):
    def forward(self, grad_expanded_x, expanded_row_idx, top_k, **attributes):
        return tensor_sum(grad_expanded_x, expanded_row_idx, top_k)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("target", [tensor_sum, Summing()], ids=["annotated", "module"])
def test_a_torch_candidate_is_detected_and_gets_tensors(target, dtype):
    wrapped = Candidate(target)
    assert (wrapped.accepts, wrapped.device) == ("torch", "cpu")
    got = wrapped(doc_call(dtype))
    assert got.dtype == moegrad.DTYPES[dtype]
    assert same_bits(got, moegrad.moe_init_routing_v2_grad(doc_call(dtype)))  # K = 2: one add, every order
    assert probe_order(wrapped, 6, dtype).expression == expression_of(chain_tree(6))


def test_accepts_can_be_given_and_is_checked():
    assert Candidate(lambda *a, **k: None, accepts="torch").device == "cpu"
    with pytest.raises(ValueError, match="accepts"):
        Candidate(tensor_sum, accepts="jax")
    with pytest.raises(ValueError, match="device"):
        Candidate(tree_candidate(0), device="cuda")
    with pytest.raises(TypeError, match="callable or a v2 URL"):
        Candidate(42)


@pytest.mark.parametrize(
    ("result", "match"),
    [(np.zeros((3, 2), np.float32), r"shape \[3, 2\]"), (np.zeros((2, 2), np.float64), "dtype float64"),
     ([[0.0]], "not an array")],
)
def test_a_result_that_is_not_grad_x_is_refused(result, match):
    with pytest.raises(CandidateError, match=match):
        Candidate(lambda *args, **kwargs: result)(doc_call())


def test_a_failing_candidate_keeps_its_cause():
    def broken(*args, **kwargs):
        raise KeyError("boom")

    with pytest.raises(CandidateError, match="raised KeyError") as caught:
        Candidate(broken)(doc_call())
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_float32_result_of_a_narrow_call_is_accepted():
    assert Candidate(lambda *a, **k: np.zeros((2, 2), np.float32))(doc_call("bfloat16")).dtype == np.float32


def test_load_imports_package_module_function():
    loaded = Candidate.load("support.candidates:float64_sum")
    assert loaded.name == "support.candidates:float64_sum"
    assert as_candidate("support.candidates:sorted_by_magnitude").name == "support.candidates:sorted_by_magnitude"
    for spec, match in [("support.candidates", "package.module:function"), ("support.candidates:nothing", "no attribute"),
                        ("support.candidates:__all__", "not a callable")]:
        with pytest.raises(ValueError, match=match):
            Candidate.load(spec)
    with pytest.raises(ImportError):
        Candidate.load("support.no_such_module:fn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_v2_candidate_is_probed_end_to_end(dtype):
    app = candidate_app(tree_candidate(bins_tree(8)))
    with serving(app) as url, Candidate(url) as remote:
        probe = probe_order(remote, 8, dtype)
        assert probe.expression == expression_of(bins_tree(8))
        assert set(probe.profiles) == A2A3 | {"ascend950@9.0", "ascend950@9.1"}  # K = 8: pairs of pairs
        assert probe.calls == app.requests == remote.calls == 3
        call = order_free_inputs(6, 8, 5, dtype, seed=2)
        assert same_bits(remote(call), moegrad.moe_init_routing_v2_grad_golden(call).astype(moegrad.DTYPES[dtype]))


def test_a_v2_candidate_by_its_infer_url_and_its_errors():
    with serving(candidate_app(tree_candidate(groups_tree(7, 7)))) as url:
        probe = probe_order(f"{url}/v2/models/moe_init_routing_v2_grad/infer", 7)
        assert set(probe.profiles) == {"ascend950@9.0", "ascend950@9.1"}
        with Candidate(url, model="another") as wrong, pytest.raises(CandidateError, match="answered 404"):
            wrong(doc_call())
    with serving(candidate_app(lambda *args, **kwargs: 1 / 0)) as url, Candidate(url) as failing:
        with pytest.raises(CandidateError, match="answered 400: ZeroDivisionError"):
            failing(doc_call())


def test_a_v2_candidate_that_varies_is_caught():
    with serving(candidate_app(shuffled_rows(seed=4))) as url:
        call = order_free_inputs(8, 4, 4, seed=1)  # order-free: every variant has the same bits
        assert check_determinism(url, call, runs=3).deterministic
        rng = np.random.default_rng(0)
        grad = rng.standard_normal((32, 16)).astype(np.float32)
        wide = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=rng.permutation(32).astype(
            np.int32), top_k=4)
        result = check_determinism(url, wide, runs=4)
        assert result.varying_rows.size > 0 and result.within_bound


def test_bfloat16_bits_survive_the_wire():
    values = np.arange(-8, 8, dtype=np.float32).reshape(8, 2) / 3
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=values.astype(ml_dtypes.bfloat16),
                                            expanded_row_idx=np.arange(8, dtype=np.int32), top_k=1)
    with serving(candidate_app(tree_candidate(0))) as url, Candidate(url) as remote:
        assert same_bits(remote(call), call.grad_expanded_x)
