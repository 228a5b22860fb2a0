"""moegrad.torch: the torch.library ops, their fake kernels and autograd, and the routing pairing.

Oracles: the schema string of Huawei's binding; :func:`moegrad.moe_init_routing_v2_grad` (itself
tested against independent loops in test_reference.py) for the op's bits, compared as integers;
torch's own autograd of a plain gather where the orders cannot differ (K <= 2: one or two
summands); the routing oracle of test_routing.py for the forward.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moegrad  # noqa: E402
import moegrad.torch as mt  # noqa: E402
from moegrad import AclnnStatus, InvalidArgument  # noqa: E402
from moegrad._tensors import to_numpy, to_torch  # noqa: E402

OPS = torch.ops.moegrad
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
NP_BITS = {torch.float32: np.int32, torch.float16: np.int16, torch.bfloat16: np.int16}


def bits(tensor):
    return tensor.detach().contiguous().view(BITS[tensor.dtype]).tolist()


def routed(mode, tokens=9, top_k=3, experts=4, seed=0):
    """expanded_row_idx and the grad shape of one routing (from the numpy forward, tested in test_routing.py)."""
    rng = np.random.default_rng(seed)
    expert_idx = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    x = np.zeros((tokens, 1), np.float32)
    if mode == "dropless":
        r = moegrad.moe_init_routing_v2(x, expert_idx)
        return torch.from_numpy(r.expanded_row_idx), (tokens * top_k,), {"top_k": top_k}
    if mode == "active":
        active = tokens * top_k // 2
        r = moegrad.moe_init_routing_v2(x, expert_idx, active_num=active)
        return torch.from_numpy(r.expanded_row_idx), (active,), {"top_k": top_k, "active_num": active}
    capacity = 3
    r = moegrad.moe_init_routing_v2(x, expert_idx, expert_capacity=capacity, expert_num=experts, drop_pad_mode=1)
    return torch.from_numpy(r.expanded_row_idx), (experts, capacity), {"top_k": top_k, "drop_pad_mode": 1}


def test_the_schema_is_huaweis():
    assert str(OPS.moe_init_routing_grad.default._schema) == (
        "moegrad::moe_init_routing_grad(Tensor grad_expanded_x, Tensor expanded_row_idx, int top_k, "
        "int drop_pad_mode=0, int active_num=0) -> Tensor")


def test_importing_moegrad_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, moegrad; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
def test_opcheck(mode):
    idx, rows, kwargs = routed(mode)
    grad = torch.randn(*rows, 5, requires_grad=True)
    args = (grad, idx, kwargs["top_k"], kwargs.get("drop_pad_mode", 0), kwargs.get("active_num", 0))
    torch.library.opcheck(OPS.moe_init_routing_grad.default, args)
    torch.library.opcheck(OPS.moe_init_routing_grad_ordered.default, (*args, "sequential"))


@pytest.mark.parametrize("mode", [0, 1])
def test_opcheck_routing(mode):
    x = torch.randn(7, 4)
    expert_idx = torch.randint(0, 5, (7, 2), dtype=torch.int32)
    args = (x, expert_idx, 0, 3, 5, mode, 1, True)
    torch.library.opcheck(OPS.moe_init_routing_v2.default, args)


@pytest.mark.parametrize("order", ["ascend910b", "sequential"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_bits_equal_the_numpy_call(order, dtype, mode, top_k):
    idx, rows, kwargs = routed(mode, tokens=6, top_k=top_k, experts=8, seed=top_k)
    grad = torch.randn(*rows, 33).to(dtype)
    want = moegrad.moe_init_routing_v2_grad(to_numpy(grad), idx.numpy(), order=order, **kwargs)
    with mt.using_order(order):
        got = mt.moe_init_routing_grad(grad, idx, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape
    assert bits(got) == want.view(NP_BITS[dtype]).tolist()
    ordered = OPS.moe_init_routing_grad_ordered(grad, idx, kwargs["top_k"], kwargs.get("drop_pad_mode", 0),
                                                kwargs.get("active_num", 0), order)
    assert bits(ordered) == bits(got)


def test_strided_input_gives_the_same_bits():
    idx, rows, kwargs = routed("dropless")
    wide = torch.randn(rows[0], 10, dtype=torch.bfloat16)
    assert bits(mt.moe_init_routing_grad(wide[:, ::2], idx, **kwargs)) == bits(
        mt.moe_init_routing_grad(wide[:, ::2].contiguous(), idx, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_tensors_cross_without_a_copy(dtype):
    tensor = torch.randn(4, 6).to(dtype)
    array = to_numpy(tensor)
    assert array.dtype == np.dtype(NP_DTYPES[dtype]) and array.ctypes.data == tensor.data_ptr()
    back = to_torch(array, tensor)
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()


def test_bad_input_raises_invalid_argument():
    idx, rows, kwargs = routed("dropless")
    with pytest.raises(InvalidArgument) as caught:
        mt.moe_init_routing_grad(torch.zeros(*rows, 4, dtype=torch.float64), idx, **kwargs)
    assert caught.value.aclnn_status == AclnnStatus.ACLNN_ERR_PARAM_INVALID and ".astype" in caught.value.message
    with pytest.raises(InvalidArgument) as caught:
        mt.moe_init_routing_grad(torch.zeros(*rows, 4), idx.long(), **kwargs)
    assert caught.value.field == "expanded_row_idx"
    with pytest.raises(InvalidArgument, match="order"):
        mt.set_order("fastest")


@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_pairing_gives_the_ops_result(mode, dtype):
    torch.manual_seed(1)
    x = torch.randn(9, 16).to(dtype).requires_grad_()
    expert_idx = torch.stack([torch.randperm(6)[:4] for _ in range(9)])
    options = {"dropless": {}, "active": {"active_num": 20},
               "drop_pad": {"expert_capacity": 5, "expert_num": 6, "drop_pad_mode": 1}}[mode]
    out = mt.moe_init_routing_v2(x, expert_idx, **options)
    g = torch.randn_like(out.expanded_x)
    out.expanded_x.backward(g)
    want = mt.moe_init_routing_grad(g, out.expanded_row_idx, 4, options.get("drop_pad_mode", 0),
                                    out.expanded_x.shape[0] if mode == "active" else 0)
    assert x.grad.dtype == dtype and bits(x.grad) == bits(want)


@pytest.mark.parametrize("mode", ["dropless", "drop_pad"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_backward_equals_autograd_of_a_plain_gather(mode, top_k):
    # With one or two summands every order gives the same float32 bits, so torch's own autograd of
    # expanded_x = x[slot // K] (scattered to the slot's row) is an independent oracle.
    torch.manual_seed(2)
    x = torch.randn(11, 8, requires_grad=True)
    expert_idx = torch.stack([torch.randperm(5)[:top_k] for _ in range(11)])
    options = {"expert_capacity": 3, "expert_num": 5, "drop_pad_mode": 1} if mode == "drop_pad" else {}
    out = mt.moe_init_routing_v2(x, expert_idx, **options)
    g = torch.randn_like(out.expanded_x)
    (ours,) = torch.autograd.grad(out.expanded_x, x, g)

    x2 = x.detach().clone().requires_grad_()
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the documentation's key-value sort
    if mode == "dropless":
        plain = x2[order // top_k]
    else:
        sorted_expert = flat[order]
        first = torch.searchsorted(sorted_expert, torch.arange(5))
        rank = torch.arange(flat.numel()) - first[sorted_expert]
        keep = rank < 3
        plain = torch.zeros(5 * 3, 8).index_put((sorted_expert[keep] * 3 + rank[keep],), x2[order[keep] // top_k])
        plain = plain.reshape(5, 3, 8)
    assert torch.equal(plain.detach(), out.expanded_x.detach())
    (theirs,) = torch.autograd.grad(plain, x2, g)
    assert bits(ours) == bits(theirs)


def test_the_order_is_the_one_set_at_forward_time():
    x = torch.randn(5, 64, requires_grad=True)
    expert_idx = torch.stack([torch.randperm(8) for _ in range(5)])  # K = 8: the orders differ
    with mt.using_order("sequential"):
        out = mt.moe_init_routing_v2(x, expert_idx)
    g = torch.randn_like(out.expanded_x)
    out.expanded_x.backward(g)  # outside the with block
    want = moegrad.moe_init_routing_v2_grad(g.numpy(), out.expanded_row_idx.numpy(), 8, order="sequential")
    assert x.grad.numpy().view(np.int32).tolist() == want.view(np.int32).tolist()


# torch 2.13's dynamo instantiates autograd.Function classes itself while tracing .apply and warns about it.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
def test_torch_compile_of_a_small_moe_layer():
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = torch.nn.Linear(16, 6)
            self.expert = torch.nn.Linear(16, 16)

        def forward(self, x):
            expert_idx = torch.topk(self.router(x), 2, dim=-1).indices.int()
            out = mt.MoeInitRoutingV2.apply(x, expert_idx, 0, 0, 6, 0, 1, False)
            expanded_x, expanded_row_idx = out[0], out[1]
            return self.expert(expanded_x).square().sum(), expanded_row_idx

    torch.manual_seed(3)
    layer = Layer()
    x = torch.randn(12, 16, requires_grad=True)
    loss, idx = layer(x)
    (eager,) = torch.autograd.grad(loss, x)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    loss_c, idx_c = compiled(x)
    (grad_c,) = torch.autograd.grad(loss_c, x)
    assert torch.equal(idx, idx_c) and bits(grad_c) == bits(eager)


def test_a_configured_service_serves_the_op():
    import httpx

    served = []

    def handler(request: httpx.Request) -> httpx.Response:  # a service that runs the reference
        document = moegrad.decode_body(request.read())
        call = moegrad.MoeInitRoutingV2GradCall.from_wire(document)
        served.append(call.order)
        reply = {"grad_x": moegrad.encode_tensor(moegrad.moe_init_routing_v2_grad(call)), "backend": "mock",
                 "order": call.order, "device": None, "timings_ms": {}}
        return httpx.Response(200, content=moegrad.encode_body(reply), headers={"content-type": "application/msgpack"})

    idx, rows, kwargs = routed("drop_pad")
    grad = torch.randn(*rows, 8, dtype=torch.bfloat16)
    with moegrad.Client(transport=httpx.MockTransport(handler)) as client, mt.using_service(client):
        got = mt.moe_init_routing_grad(grad, idx, **kwargs)
    assert served == ["ascend910b@9.1"]  # the default profile
    assert got.dtype == torch.bfloat16 and bits(got) == bits(mt.moe_init_routing_grad(grad, idx, **kwargs))
