"""Client / AsyncClient with torch tensors: tensors in, tensors out on the input's device; NumPy as before.

The service is an ``httpx.MockTransport`` that decodes the request as the protocol says and answers
with the reference result of the decoded arrays, so what is checked is the client's edges: what
went on the wire (dtype, shape, bytes of the tensor) and what came back (type, dtype, device, bits).
"""

from __future__ import annotations

import asyncio

import httpx
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moegrad  # noqa: E402

SENT: list[dict] = []
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
WIRE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def serve(request: httpx.Request) -> httpx.Response:
    document = moegrad.decode_body(request.read())
    SENT.append(document)
    call = moegrad.MoeInitRoutingV2GradCall.from_wire(document)
    reply = {"grad_x": moegrad.encode_tensor(moegrad.moe_init_routing_v2_grad(call)), "backend": "mock",
             "order": call.order, "device": None, "timings_ms": {}}
    return httpx.Response(200, content=moegrad.encode_body(reply), headers={"content-type": "application/msgpack"})


def inputs(dtype, device="cpu"):
    torch.manual_seed(0)
    idx = torch.randperm(12, dtype=torch.int32)
    grad = torch.randn(12, 5).to(dtype)
    return grad.to(device), idx.to(device)


@pytest.mark.parametrize("dtype", list(WIRE))
def test_client_takes_and_returns_tensors(dtype):
    SENT.clear()
    grad, idx = inputs(dtype)
    with moegrad.Client(transport=httpx.MockTransport(serve)) as client:
        got = client.moe_init_routing_v2_grad(grad.requires_grad_() if dtype == torch.float32 else grad, idx, 3)
    sent = SENT[0]["grad_expanded_x"]
    assert sent["dtype"] == WIRE[dtype] and sent["shape"] == [12, 5]
    assert bytes(sent["data"]) == grad.detach().view(BITS[dtype]).numpy().tobytes()
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == grad.device
    want = moegrad.moe_init_routing_v2_grad(np.frombuffer(bytes(sent["data"]), moegrad.DTYPES[WIRE[dtype]]).reshape(12, 5),
                                            idx.numpy(), 3)
    assert got.view(BITS[dtype]).numpy().tobytes() == want.tobytes()


def test_async_client_takes_and_returns_tensors():
    grad, idx = inputs(torch.bfloat16)

    async def main():
        async with moegrad.AsyncClient(transport=httpx.MockTransport(serve)) as client:
            return await client.moe_init_routing_v2_grad(grad, idx, 3)

    got = asyncio.run(main())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.device.type == "cpu"


def test_numpy_in_numpy_out():
    grad = np.ones((4, 2), ml_dtypes.bfloat16)
    with moegrad.Client(transport=httpx.MockTransport(serve)) as client:
        got = client.moe_init_routing_v2_grad(grad, np.arange(4, dtype=np.int32), 2)
    assert type(got) is np.ndarray and got.dtype == ml_dtypes.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this host)")
def test_a_cuda_tensor_comes_back_on_its_device():
    import moegrad.torch as mt

    grad, idx = inputs(torch.float16, "cuda")
    with moegrad.Client(transport=httpx.MockTransport(serve)) as client:
        got = client.moe_init_routing_v2_grad(grad, idx, 3)
    assert got.device == grad.device and got.dtype == torch.float16
    assert torch.equal(got.cpu(), mt.moe_init_routing_grad(grad.cpu(), idx.cpu(), 3))
    assert mt.moe_init_routing_grad(grad, idx, 3).device == grad.device
