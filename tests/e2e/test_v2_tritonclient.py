"""Protocol v2 end to end: the stock ``tritonclient[http]`` and plain httpx against a real uvicorn.

Every result is compared bit for bit (viewed as unsigned integers) with ``moegrad.moe_init_routing_v2_grad``
computed in this process, which shares nothing with the HTTP path; the documentation's example is
checked against its documented bits.
"""

from __future__ import annotations

import json

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

import moegrad
from support.docexample import v2_inputs

MODEL = "moe_init_routing_v2_grad"
TRITON_DATATYPES = {np.dtype(np.float16): "FP16", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "FP32"}
UINT = {2: np.uint16, 4: np.uint32}
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
MODES = ["dropless", "active", "drop_pad"]


@pytest.fixture
def triton_client(server_url):
    client = triton.InferenceServerClient(url=server_url.removeprefix("http://"), connection_timeout=30.0,
                                          network_timeout=60.0)
    yield client
    client.close()


def make_call(mode: str, dtype, *, tokens: int = 6, top_k: int = 3, hidden: int = 16, seed: int = 0) -> dict:
    """Inputs and attributes for one call in ``mode`` (random values, valid indices)."""
    rng = np.random.default_rng(seed)
    slots = tokens * top_k
    if mode == "dropless":
        grad = rng.standard_normal((slots, hidden))
        idx = rng.permutation(slots)
        attributes = {"top_k": top_k, "drop_pad_mode": 0, "active_num": 0}
    elif mode == "active":
        active = slots - 5  # indices >= active_num are skipped
        grad = rng.standard_normal((active, hidden))
        idx = rng.permutation(slots)
        attributes = {"top_k": top_k, "drop_pad_mode": 0, "active_num": active}
    else:
        experts, capacity = 4, 5
        grad = rng.standard_normal((experts, capacity, hidden))
        idx = rng.choice(experts * capacity, size=slots, replace=False)
        idx[rng.choice(slots, size=4, replace=False)] = -1  # dropped tokens
        attributes = {"top_k": top_k, "drop_pad_mode": 1, "active_num": 0}
    return {"grad": grad.astype(dtype), "idx": idx.astype(np.int32), **attributes}


def expected(call: dict, **options) -> np.ndarray:
    return moegrad.moe_init_routing_v2_grad(call["grad"], call["idx"], call["top_k"], call["drop_pad_mode"],
                                            call["active_num"], **options)


def assert_bits_equal(actual: np.ndarray, want: np.ndarray) -> None:
    assert actual.dtype == want.dtype and actual.shape == want.shape
    uint = UINT[want.dtype.itemsize]
    assert np.array_equal(actual.view(uint), want.view(uint))


def triton_inputs(call: dict, *, binary: bool) -> list[triton.InferInput]:
    grad = triton.InferInput("grad_expanded_x", list(call["grad"].shape), TRITON_DATATYPES[call["grad"].dtype])
    grad.set_data_from_numpy(call["grad"], binary_data=binary)
    idx = triton.InferInput("expanded_row_idx", list(call["idx"].shape), "INT32")
    idx.set_data_from_numpy(call["idx"], binary_data=binary)
    return [grad, idx]


def attributes(call: dict) -> dict:
    return {name: call[name] for name in ("top_k", "drop_pad_mode", "active_num")}


def test_health_and_server_metadata(triton_client):
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready(MODEL)
    assert triton_client.is_model_ready(MODEL, model_version="1")
    assert not triton_client.is_model_ready("resnet50")
    metadata = triton_client.get_server_metadata()
    assert metadata["name"] == "moegrad" and metadata["version"] == moegrad.__version__
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_metadata(triton_client):
    metadata = triton_client.get_model_metadata(MODEL)
    assert metadata["name"] == MODEL and metadata["versions"] == ["1"]
    assert metadata["platform"] == "moegrad_reference"
    assert metadata["inputs"] == [
        {"name": "grad_expanded_x", "datatype": "FP32", "shape": [-1, -1]},
        {"name": "expanded_row_idx", "datatype": "INT32", "shape": [-1]},
    ]
    assert metadata["outputs"] == [{"name": "grad_x", "datatype": "FP32", "shape": [-1, -1]}]
    assert metadata["parameters"]["grad_expanded_x_datatypes"] == "FP16,BF16,FP32"
    assert "[-1,-1,-1]" in metadata["parameters"]["grad_expanded_x_shape_drop_pad"]
    with pytest.raises(InferenceServerException) as raised:
        triton_client.get_model_metadata("resnet50")
    assert raised.value.status() == "404" and "resnet50" in raised.value.message()


# Every mode and dtype, as JSON and as binary data; BF16 has no JSON form in the protocol (see
# test_bf16_json_input_is_refused_by_tritonclient).
INFER_CASES = [
    pytest.param(mode, dtype, binary, id=f"{mode}-{np.dtype(dtype).name}-{'binary' if binary else 'json'}")
    for mode in MODES for dtype in DTYPES for binary in (True, False)
    if binary or dtype is not ml_dtypes.bfloat16
]


@pytest.mark.parametrize(("mode", "dtype", "binary"), INFER_CASES)
def test_infer_is_bit_exact(triton_client, mode, dtype, binary):
    call = make_call(mode, dtype, seed=2 * MODES.index(mode) + binary)
    # JSON in, JSON out; or binary in, binary out (tritonclient asks binary_data_output when no outputs are named).
    outputs = None if binary else [triton.InferRequestedOutput("grad_x", binary_data=False)]
    result = triton_client.infer(MODEL, triton_inputs(call, binary=binary), outputs=outputs, request_id="req-7",
                                 parameters=attributes(call))
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == MODEL
    assert response["parameters"]["backend"] == "reference" and response["parameters"]["order"] == "ascend910b@9.1"
    assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) is binary
    assert_bits_equal(result.as_numpy("grad_x"), expected(call))


def test_json_in_binary_out_and_versioned_path(triton_client):
    call = make_call("dropless", np.float16, top_k=5, seed=11)
    result = triton_client.infer(MODEL, triton_inputs(call, binary=False), model_version="1",
                                 outputs=[triton.InferRequestedOutput("grad_x", binary_data=True)],
                                 parameters=attributes(call))
    assert_bits_equal(result.as_numpy("grad_x"), expected(call))


def test_bf16_binary_in_json_not_allowed_out(triton_client):
    call = make_call("active", ml_dtypes.bfloat16, seed=5)
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer(MODEL, triton_inputs(call, binary=True), parameters=attributes(call),
                            outputs=[triton.InferRequestedOutput("grad_x", binary_data=False)])
    assert raised.value.status() == "400" and "BF16" in raised.value.message()


def test_bf16_json_input_is_refused_by_tritonclient():
    grad = triton.InferInput("grad_expanded_x", [2, 2], "BF16")
    with pytest.raises(InferenceServerException, match="binary"):
        grad.set_data_from_numpy(np.zeros((2, 2), ml_dtypes.bfloat16), binary_data=False)


@pytest.mark.parametrize("top_k", [1, 8, 130])
def test_order_parameter_and_large_top_k(triton_client, top_k):
    call = make_call("dropless", np.float32, tokens=4, top_k=top_k, hidden=33, seed=top_k)
    for order, profile in (("ascend910b", "ascend910b@9.1"), ("sequential", "sequential")):
        result = triton_client.infer(MODEL, triton_inputs(call, binary=True),
                                     parameters={**attributes(call), "order": order})
        assert result.get_response()["parameters"]["order"] == profile
        assert_bits_equal(result.as_numpy("grad_x"), expected(call, order=order))


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"top_k": 0}, "561103", "top_k"),  # CANN 9.1's code (the default profile's)
        ({"top_k": 4}, "561103", "expanded_row_idx"),  # 18 slots are not a multiple of 4
        ({"drop_pad_mode": 2}, "561103", "drop_pad_mode"),
        ({"active_num": -1}, "561103", "active_num"),
        ({"active_num": 7}, "561103", "grad_expanded_x"),  # grad has 18 rows, not 7
        ({"active_num": 7, "order": "ascend910b@9.0"}, "561002", "grad_expanded_x"),  # before 9.1
        ({"order": "ascend960"}, "161002", "order"),
    ],
)
def test_invalid_attributes_carry_the_aclnn_code(triton_client, change, code, field):
    call = make_call("dropless", np.float32)
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer(MODEL, triton_inputs(call, binary=True), parameters={**attributes(call), **change})
    assert raised.value.status() == "400"
    assert code in raised.value.message() and f"[field {field}]" in raised.value.message()


def test_invalid_tensors_carry_the_aclnn_code(triton_client):
    call = make_call("dropless", np.float32)
    call["idx"][1] = call["idx"][0]  # a repeated index: the documentation forbids it
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer(MODEL, triton_inputs(call, binary=True), parameters=attributes(call))
    assert "161002" in raised.value.message() and "repeats" in raised.value.message()

    only_grad = triton_inputs(make_call("dropless", np.float32), binary=True)[:1]
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer(MODEL, only_grad, parameters=attributes(call))
    assert "161001" in raised.value.message() and "expanded_row_idx" in raised.value.message()

    wide = triton.InferInput("expanded_row_idx", [18], "INT64")  # PyTorch's default index dtype
    wide.set_data_from_numpy(np.arange(18, dtype=np.int64))
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer(MODEL, [only_grad[0], wide], parameters=attributes(call))
    assert "161002" in raised.value.message() and "int64" in raised.value.message()


@pytest.mark.asyncio
async def test_asyncio_client(server_url):
    call = make_call("drop_pad", np.float32, seed=21)
    async with triton_aio.InferenceServerClient(server_url.removeprefix("http://")) as client:
        assert await client.is_server_ready()
        for binary in (True, False):
            inputs = [triton_aio.InferInput("grad_expanded_x", list(call["grad"].shape), "FP32"),
                      triton_aio.InferInput("expanded_row_idx", list(call["idx"].shape), "INT32")]
            inputs[0].set_data_from_numpy(call["grad"], binary_data=binary)
            inputs[1].set_data_from_numpy(call["idx"], binary_data=binary)
            result = await client.infer(MODEL, inputs, parameters=attributes(call),
                                        outputs=[triton_aio.InferRequestedOutput("grad_x", binary_data=binary)])
            assert_bits_equal(result.as_numpy("grad_x"), expected(call))


def test_unknown_model_is_404(triton_client):
    call = make_call("dropless", np.float32)
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer("resnet50", triton_inputs(call, binary=True), parameters=attributes(call))
    assert raised.value.status() == "404"


# --- plain httpx, no tritonclient: the JSON path on its own ------------------------------------


def test_httpx_json_documentation_example(server_url):
    document = {
        "id": "doc-example",
        "parameters": {"top_k": 2, "drop_pad_mode": 0, "active_num": 0},
        "inputs": v2_inputs(),
    }
    response = httpx.post(f"{server_url}/v2/models/{MODEL}/infer", content=json.dumps(document), timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    reply = response.json()
    assert reply["id"] == "doc-example" and reply["model_name"] == MODEL
    (output,) = reply["outputs"]
    assert output["name"] == "grad_x" and output["datatype"] == "FP32" and output["shape"] == [2, 2]
    bits = np.array(output["data"], dtype=np.float32).view(np.uint32)
    # The documentation's example: 0.2 + 0.1 = 0.3 and 0.3 + 0.4 = 0.70000005 in float32.
    assert bits.tolist() == [0x3E99999A, 0x3E99999A, 0x3F333334, 0x3F333334]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_httpx_json_modes(server_url, mode, dtype):
    call = make_call(mode, dtype, seed=3)
    document = {
        "parameters": attributes(call),
        "inputs": [
            {"name": "grad_expanded_x", "shape": list(call["grad"].shape), "datatype": TRITON_DATATYPES[call["grad"].dtype],
             "data": call["grad"].astype(np.float64).ravel().tolist()},
            {"name": "expanded_row_idx", "shape": list(call["idx"].shape), "datatype": "INT32",
             "data": call["idx"].tolist()},
        ],
    }
    response = httpx.post(f"{server_url}/v2/models/{MODEL}/infer", content=json.dumps(document), timeout=30)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert_bits_equal(np.array(output["data"], dtype=dtype).reshape(output["shape"]), expected(call))


def test_httpx_json_invalid_attribute(server_url):
    document = {
        "parameters": {"top_k": 3},
        "inputs": [
            {"name": "grad_expanded_x", "shape": [4, 1], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": [0, 1, 2, 3]},
        ],
    }
    response = httpx.post(f"{server_url}/v2/models/{MODEL}/infer", content=json.dumps(document), timeout=30)
    assert response.status_code == 400
    assert response.json() == {"error": "expanded_row_idx.shape[0]=4 is not divisible by top_k=3 "
                                        "[field expanded_row_idx] (ACLNN_ERR_INNER_NULLPTR 561103)"}
