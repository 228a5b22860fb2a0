"""Huawei's 950 binding end to end: forward with an active expert range, then its backward.

``cann_ops_transformer.moe_init_routing`` (recursion-ascend/ops-transformer
moe/moe_init_routing_v4/torch_extension/moe_init_routing.py @ a093e954) routes with V4, whose
``active_expert_range`` leaves -1 in expanded_row_idx for the slots of other experts, and its
backward calls aclnnMoeInitRoutingV2Grad with that index in dropless mode (active_num -1 -> 0).
Only the 950 from CANN 9.1 defines a -1 slot (a +0.0 row, docs/semantics.md section 9).

Oracle: a float loop written here from docs/semantics.md section 7.2 (one float32 accumulator from
+0.0, groups of four, leftovers one by one; one pass, as FullLoad runs these shapes) with a -1 slot
a row of +0.0, rounded with ``support.slow_loops.round_from_float32``.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import AclnnStatus, InvalidArgument
from support.bits import bits
from support.inputs import BF16, F16, F32
from support.slow_loops import round_from_float32

INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID


def grad_950_loop(grad, index, top_k):
    """grad_x [N, H]: per token, s = +0.0, s += ((v0 + v1) + (v2 + v3)) per group, s += v per leftover."""
    tokens, hidden = index.size // top_k, grad.shape[1]
    out = np.empty((tokens, hidden), dtype=grad.dtype)
    for i in range(tokens):
        rows = [np.zeros(hidden, np.float32) if j < 0 else grad[j].astype(np.float32)
                for j in index[i * top_k:(i + 1) * top_k]]
        total = np.zeros(hidden, np.float32)
        t = 0
        while top_k - t >= 4:
            total = total + ((rows[t] + rows[t + 1]) + (rows[t + 2] + rows[t + 3]))
            t += 4
        for row in rows[t:]:
            total = total + row
        out[i] = [round_from_float32(value, grad.dtype) for value in total]
    return out


def routed(rng, tokens, top_k, experts, start, end, dtype):
    x = rng.standard_normal((tokens, 3)).astype(dtype)
    expert_idx = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    result = moegrad.moe_init_routing_v2(x, expert_idx, expert_num=experts, active_expert_range=(start, end))
    return x, expert_idx, result


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize(("top_k", "start", "end"), [(6, 2, 5), (3, 0, 1), (9, 4, 12), (5, 0, 8)])
def test_the_950_at_9_1_reproduces_the_bindings_backward(dtype, top_k, start, end):
    rng = np.random.default_rng(top_k + start)
    _, expert_idx, forward = routed(rng, 7, top_k, 12, start, end, dtype)
    index = forward.expanded_row_idx
    flat = expert_idx.reshape(-1)
    assert ((index < 0) == ((flat < start) | (flat >= end))).all()  # -1 exactly for the other experts
    # the binding's grad of expanded_x [N*K, H] (V4's shape in dropless mode), values over many binades
    grad = (rng.choice([-1.0, 1.0], (index.size, 3)) * np.exp2(rng.integers(-12, 12, (index.size, 3)))).astype(dtype)
    got = moegrad.moe_init_routing_v2_grad(grad, index, top_k, 0, 0, order="ascend950@9.1")
    want = grad_950_loop(grad, index, top_k)
    assert got.dtype == want.dtype and (bits(got) == bits(want)).all()
    assert moegrad.identify({"grad_expanded_x": grad, "expanded_row_idx": index, "top_k": top_k}, want).matching == (
        ("ascend950@9.1",) if (index < 0).any() else ("ascend950@9.0", "ascend950@9.1")
    )


def test_every_other_profile_refuses_it_naming_the_950_at_9_1():
    rng = np.random.default_rng(1)
    _, _, forward = routed(rng, 6, 4, 8, 2, 6, F32)
    assert (forward.expanded_row_idx < 0).any()
    grad = rng.standard_normal((forward.expanded_row_idx.size, 3)).astype(np.float32)
    for order in ("ascend910b@9.1", "ascend910_93@9.1", "ascend950@9.0", "ascend950@8.5", "sequential"):
        with pytest.raises(InvalidArgument) as caught:
            moegrad.moe_init_routing_v2_grad(grad, forward.expanded_row_idx, 4, order=order)
        assert caught.value.aclnn_status == INVALID and caught.value.field == "expanded_row_idx"
        assert "ascend950@9.1" in caught.value.message


def test_the_torch_front_end_end_to_end():
    torch = pytest.importorskip("torch")
    import moegrad.torch as mt

    rng = np.random.default_rng(2)
    x_np, expert_idx, forward = routed(rng, 5, 6, 10, 3, 8, F32)
    g = rng.standard_normal((forward.expanded_row_idx.size, 3)).astype(np.float32)
    with mt.using_order("ascend950@9.1"):
        x = torch.from_numpy(x_np.copy()).requires_grad_(True)
        out = mt.moe_init_routing_v2(x, torch.from_numpy(expert_idx), expert_num=10, active_expert_range=(3, 8))
        assert out.expanded_row_idx.tolist() == forward.expanded_row_idx.tolist()
        out.expanded_x.backward(torch.from_numpy(g))
    want = grad_950_loop(g, forward.expanded_row_idx, 6)
    assert (bits(x.grad.numpy()) == bits(want)).all()
    with mt.using_order("ascend910b@9.1"):
        x = torch.from_numpy(x_np.copy()).requires_grad_(True)
        out = mt.moe_init_routing_v2(x, torch.from_numpy(expert_idx), expert_num=10, active_expert_range=(3, 8))
        with pytest.raises(InvalidArgument, match="ascend950@9.1"):
            out.expanded_x.backward(torch.from_numpy(g))
