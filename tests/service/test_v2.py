"""Protocol v2 in-process: routes, JSON and binary bodies built by hand, and every error answer.

Requests are written out here (JSON text, ``numpy.tobytes``), never by the code under test; results
are checked against the documentation's example bits or ``moegrad.moe_init_routing_v2_grad``.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import DeviceFault
from moegrad_service.engine import ReferenceBackend
from moegrad_service.engine import pool as pool_module
from support.docexample import DOC_GRAD, DOC_IDX, DOC_RESULT_BITS, v2_inputs

MODEL = "moe_init_routing_v2_grad"
INFER = f"/v2/models/{MODEL}/infer"
ENDPOINT = "/v2/models/{model_name}/infer"
DOC_BITS = DOC_RESULT_BITS.ravel().tolist()  # [[0.3, 0.3], [0.70000005, 0.70000005]]


def example(parameters=None, inputs=None, **fields) -> dict:
    """The documentation's example as a v2 JSON request."""
    document = {
        "parameters": {"top_k": 2, "drop_pad_mode": 0, "active_num": 0} if parameters is None else parameters,
        "inputs": [
            {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "data": DOC_GRAD.ravel().tolist()},
            {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": DOC_IDX.tolist()},
        ] if inputs is None else inputs,
    }
    document.update(fields)
    return document


def binary_example(**fields) -> tuple[bytes, dict]:
    """The documentation's example with both tensors as binary data: (body, headers)."""
    document = example(inputs=[
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "parameters": {"binary_data_size": 32}},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "parameters": {"binary_data_size": 16}},
    ], **fields)
    header = json.dumps(document).encode()
    return header + DOC_GRAD.tobytes() + DOC_IDX.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def infer(client, document=None, *, body: bytes | None = None, headers=None, path: str = INFER):
    content = json.dumps(document).encode() if body is None else body
    return client.post(path, content=content, headers=headers or {})


def error(response, status: int) -> str:
    """The message of a v2 error answer, after checking its status and its shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def json_output(response) -> tuple[dict, np.ndarray]:
    assert response.status_code == 200, response.text
    assert "inference-header-content-length" not in response.headers
    (output,) = response.json()["outputs"]
    return output, np.array(output["data"], dtype=np.float64)


def binary_output(response) -> tuple[dict, bytes]:
    assert response.status_code == 200, response.text
    size = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:size])
    (output,) = header["outputs"]
    assert "data" not in output
    data = response.content[size:]
    assert output["parameters"]["binary_data_size"] == len(data)
    return output, data


def metric(client, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}}" if labels else name
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return 0.0


# --- routes --------------------------------------------------------------------------------------


def test_server_routes(client):
    server = client.get("/v2").json()
    assert server == {"name": "moegrad", "version": moegrad.__version__, "extensions": ["binary_tensor_data", "model_configuration", "statistics"]}
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get(f"/v2/models/{MODEL}/ready").json() == {"name": MODEL, "ready": True}
    assert client.get(f"/v2/models/{MODEL}/versions/1/ready").status_code == 200


def test_model_metadata(client):
    for path in (f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/versions/1"):
        metadata = client.get(path).json()
        assert metadata["name"] == MODEL and metadata["versions"] == ["1"] and metadata["platform"] == "moegrad_reference"
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
            ("grad_expanded_x", "FP32", [-1, -1]), ("expanded_row_idx", "INT32", [-1])]
        assert metadata["outputs"] == [{"name": "grad_x", "datatype": "FP32", "shape": [-1, -1]}]
        parameters = metadata["parameters"]
        assert parameters["grad_expanded_x_datatypes"] == "FP16,BF16,FP32"
        assert parameters["default_order"] == "ascend910b@9.1"  # the default profile
        assert all(isinstance(value, (str, int, float, bool)) for value in parameters.values())  # $parameter values


@pytest.mark.parametrize(
    ("method", "path", "words"),
    [
        ("GET", "/v2/models/resnet50", "'resnet50'"),
        ("GET", "/v2/models/resnet50/ready", "'resnet50'"),
        ("POST", "/v2/models/resnet50/infer", "'resnet50'"),
        ("GET", f"/v2/models/{MODEL}/versions/2", "version '2'"),
        ("POST", f"/v2/models/{MODEL}/versions/2/infer", "version '2'"),
        ("GET", "/v2/repository/index", "/v2/repository/index"),
        ("POST", f"/v2/repository/models/{MODEL}/load", f"/v2/repository/models/{MODEL}/load"),  # load is not served
    ],
)
def test_unknown_models_versions_and_paths_are_404(client, method, path, words):
    response = client.request(method, path, content=json.dumps(example()) if method == "POST" else None)
    assert words in error(response, 404)


def test_v1_errors_stay_problem_json(client):
    response = client.post("/v1/moe_init_routing_v2_grad", content=b"\xc1", headers={"content-type": "application/msgpack"})
    assert response.status_code == 400 and response.headers["content-type"] == "application/problem+json"


# --- inference -----------------------------------------------------------------------------------


def test_json_request_without_content_type(client):
    request = client.build_request("POST", INFER, content=json.dumps(example(id="q1")).encode())
    assert "content-type" not in request.headers  # as tritonclient sends it
    response = client.send(request)
    assert response.headers["content-type"] == "application/json"
    reply = response.json()
    assert reply["id"] == "q1" and reply["model_name"] == MODEL and reply["model_version"] == "1"
    assert reply["parameters"]["backend"] == "reference" and reply["parameters"]["order"] == "ascend910b@9.1"
    output, data = json_output(response)
    assert output["name"] == "grad_x" and output["datatype"] == "FP32" and output["shape"] == [2, 2]
    assert data.astype(np.float32).view(np.uint32).tolist() == DOC_BITS
    assert metric(client, "moegrad_inference_request_success_total", endpoint=ENDPOINT) == 1


def test_id_is_omitted_when_not_sent_and_json_content_type_is_accepted(client):
    response = infer(client, example(), headers={"content-type": "application/json"})
    assert "id" not in response.json()
    assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == DOC_BITS


def test_binary_request_and_binary_output(client):
    body, headers = binary_example(parameters={"top_k": 2, "binary_data_output": True})
    response = infer(client, body=body, headers=headers)
    assert response.headers["content-type"] == "application/octet-stream"
    output, data = binary_output(response)
    assert output["datatype"] == "FP32" and output["shape"] == [2, 2]
    assert np.frombuffer(data, "<u4").tolist() == DOC_BITS


@pytest.mark.parametrize(
    ("request_level", "per_output", "binary"),
    [(None, None, False), (True, None, True), (False, None, False), (True, False, False), (False, True, True),
     (None, True, True)],
)
def test_binary_output_choice(client, request_level, per_output, binary):
    parameters = {"top_k": 2}
    if request_level is not None:
        parameters["binary_data_output"] = request_level
    output = {"name": "grad_x"}
    if per_output is not None:
        output["parameters"] = {"binary_data": per_output}
    response = infer(client, example(parameters=parameters, outputs=[output]))
    if binary:
        assert np.frombuffer(binary_output(response)[1], "<u4").tolist() == DOC_BITS
    else:
        assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == DOC_BITS


def test_versioned_path_and_chunked_body(client):
    body = json.dumps(example()).encode()

    def chunks():  # no Content-Length: Transfer-Encoding chunked
        for start in range(0, len(body), 7):
            yield body[start:start + 7]

    response = client.post(f"/v2/models/{MODEL}/versions/1/infer", content=chunks())
    assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == DOC_BITS


def test_nested_json_data_is_accepted(client):
    inputs = example()["inputs"]
    inputs[0]["data"] = DOC_GRAD.tolist()  # [[0.1, 0.1], ...]
    response = infer(client, example(inputs=inputs))
    assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == DOC_BITS


def test_mixed_json_and_binary_inputs(client):
    document = example()
    document["inputs"][1] = {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32",
                             "parameters": {"binary_data_size": 16}}
    header = json.dumps(document).encode()
    response = infer(client, body=header + DOC_IDX.tobytes(), headers={"Inference-Header-Content-Length": str(len(header))})
    assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == DOC_BITS


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_drop_pad_binary_with_misaligned_tensors(client, dtype):
    rng = np.random.default_rng(1)
    grad = rng.standard_normal((3, 4, 5)).astype(dtype)  # [E, C, H]
    idx = np.array([5, -1, 0, 11, -1, 7, 2, 9, -1, 3], np.int32)  # N = 5, K = 2
    name = {np.float16: "FP16", ml_dtypes.bfloat16: "BF16", np.float32: "FP32"}[dtype]
    document = {
        "parameters": {"top_k": 2, "drop_pad_mode": 1, "binary_data_output": True},
        "inputs": [
            {"name": "grad_expanded_x", "shape": [3, 4, 5], "datatype": name, "parameters": {"binary_data_size": grad.nbytes}},
            {"name": "expanded_row_idx", "shape": [10], "datatype": "INT32", "parameters": {"binary_data_size": 40}},
        ],
    }
    header = json.dumps(document).encode() + b" " * (1 - len(json.dumps(document)) % 2)  # odd offsets follow
    assert len(header) % 2 == 1
    response = infer(client, body=header + grad.tobytes() + idx.tobytes(),
                     headers={"Inference-Header-Content-Length": str(len(header))})
    output, data = binary_output(response)
    assert output["datatype"] == name and output["shape"] == [5, 5]
    want = moegrad.moe_init_routing_v2_grad(grad, idx, 2, 1, 0)
    uint = np.uint16 if grad.itemsize == 2 else np.uint32
    assert np.frombuffer(data, uint).tolist() == want.view(uint).ravel().tolist()


def test_empty_call_returns_empty_output(client):
    inputs = [{"name": "grad_expanded_x", "shape": [0, 3], "datatype": "FP16", "data": []},
              {"name": "expanded_row_idx", "shape": [0], "datatype": "INT32", "data": []}]
    output, data = json_output(infer(client, example(inputs=inputs)))
    assert output == {"name": "grad_x", "datatype": "FP16", "shape": [0, 3], "data": []}


def test_sequential_order_and_duplicates_as_parameters(client):
    idx = [2, 0, 2, 3]
    inputs = example()["inputs"]
    inputs[1]["data"] = idx
    params = {"top_k": 2, "order": "sequential", "allow_duplicate_indices": True}
    response = infer(client, example(parameters=params, inputs=inputs))
    assert response.json()["parameters"]["order"] == "sequential"
    want = np.stack([DOC_GRAD[2] + DOC_GRAD[0], DOC_GRAD[2] + DOC_GRAD[3]])  # K = 2: one add per element
    assert json_output(response)[1].astype(np.float32).view(np.uint32).tolist() == want.view(np.uint32).ravel().tolist()


# --- errors --------------------------------------------------------------------------------------


def _with_input(position: int, **changes) -> dict:
    document = example()
    document["inputs"][position].update(changes)
    return document


def _binary(document: dict, blob: bytes, header_length: str | None = None) -> tuple[bytes, dict]:
    header = json.dumps(document).encode()
    return header + blob, {"Inference-Header-Content-Length": header_length or str(len(header))}


_BINARY_INPUTS = binary_example()


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (b"{", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (example(model="x"), "unknown field 'model'"),
        (example(parameters={"topk": 2}), "unknown field 'topk'"),
        (example(parameters={"top_k": 2, "binary_data_output": "yes"}), "binary_data_output"),
        (example(id=7), "id=7"),
        (example(inputs="x"), "inputs must be a JSON array"),
        (_with_input(0, name="hidden_states"), "'hidden_states' is not an input"),
        (example(inputs=[example()["inputs"][0]] * 2), "given twice"),
        (_with_input(0, shape=[4, -2]), "non-negative integers"),
        (_with_input(0, shape=[1] * 9), "at most 8"),
        (_with_input(0, datatype="BYTES"), "'BYTES' is not supported"),
        (_with_input(0, datatype="FP8"), "'FP8' is not supported"),
        (_with_input(0, data=[0.1] * 7), "has 7 elements but shape [4, 2] needs 8"),
        (_with_input(0, data=[0.1] * 7 + ["0.1"]), "grad_expanded_x.data[7]='0.1'"),
        (_with_input(0, data=[0.1] * 7 + [None]), "grad_expanded_x.data[7]=None"),
        (_with_input(0, data=[True] + [0.1] * 7), "grad_expanded_x.data[0]=True"),
        (_with_input(0, data=[0.1] * 7 + [1e6], datatype="FP16"), "out of FP16 range"),
        (_with_input(0, data=[1e39] + [0.1] * 7), "out of FP32 range"),
        (_with_input(0, data={"x": 1}), "must be a JSON array"),
        (_with_input(0, datatype="BF16"), "no JSON form"),
        (_with_input(1, data=[2, 0, 1, 3.0]), "expanded_row_idx.data[3]=3.0"),
        (_with_input(1, data=[2, 0, 1, 2**31]), "out of INT32 range"),
        (_with_input(1, data=None), "must be a JSON array"),
        (_with_input(0, parameters={"binary_data_size": 32}), "both data and"),
        (_with_input(0, parameters={"shared_memory_region": "r"}), "unknown field 'shared_memory_region'"),
        (example(inputs=[{"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32"}]), "neither data nor"),
        (_with_input(0, parameters={"binary_data_size": 32}, data=None), "both data and"),
        (example(outputs=[{"name": "logits"}]), "'logits' is not an output"),
        (example(outputs=[{"name": "grad_x"}, {"name": "grad_x"}]), "requested twice"),
        (example(outputs=[{"name": "grad_x", "parameters": {"binary_data": 1}}]), "binary_data=1"),
        (example(outputs=[{"name": "grad_x", "parameters": {"classification": 3}}]), "unknown field 'classification'"),
        (example(parameters={"top_k": 2, "timeout": -5}), "timeout=-5"),
    ],
)
def test_malformed_requests_are_400_and_service_keeps_serving(client, request_, words):
    response = infer(client, body=request_) if isinstance(request_, bytes) else infer(client, request_)
    assert words in error(response, 400)
    assert infer(client, example()).status_code == 200
    assert metric(client, "moegrad_inference_request_failure_total", endpoint=ENDPOINT, reason="malformed_request") == 1


def _binary_inputs(grad_size: int = 32, idx_size: int = 16) -> dict:
    return example(inputs=[
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "parameters": {"binary_data_size": grad_size}},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "parameters": {"binary_data_size": idx_size}},
    ])


@pytest.mark.parametrize(
    ("body_headers", "words"),
    [
        (_binary(_binary_inputs(grad_size=31), DOC_GRAD.tobytes()[:31] + DOC_IDX.tobytes()), "binary_data_size=31"),
        (_binary(_binary_inputs(idx_size=-16), DOC_GRAD.tobytes()), "binary_data_size=-16"),
        (_binary(_binary_inputs(), DOC_GRAD.tobytes()), "needs binary bytes [32, 48) but the binary data has 32 bytes"),
        (_binary(_binary_inputs(), DOC_GRAD.tobytes() + DOC_IDX.tobytes() + b"\0"), "1 bytes of binary data follow"),
        (_binary(example(), b"\0\0"), "2 bytes of binary data follow"),
        ((json.dumps(_binary_inputs()).encode(), {}), "no Inference-Header-Content-Length header"),
        ((_BINARY_INPUTS[0], {"Inference-Header-Content-Length": str(len(_BINARY_INPUTS[0]) + 1)}), "larger than the"),
        ((_BINARY_INPUTS[0], {"Inference-Header-Content-Length": "lots"}), "'lots' is not a byte count"),
        ((_BINARY_INPUTS[0], {"Inference-Header-Content-Length": "9" * 5000}), "is larger than the"),  # > int()'s cap
        ((_BINARY_INPUTS[0], {"Inference-Header-Content-Length": "0" * 5000 + "5"}), "not valid JSON"),  # 5, zero-padded
        ((_BINARY_INPUTS[0], {"Inference-Header-Content-Length": "10"}), "not valid JSON"),
        ((_BINARY_INPUTS[0], {**_BINARY_INPUTS[1], "Content-Encoding": "gzip"}), "Content-Encoding 'gzip'"),
    ],
)
def test_wrong_binary_layouts_are_400(client, body_headers, words):
    body, headers = body_headers
    assert words in error(infer(client, body=body, headers=headers), 400)
    assert infer(client, body=_BINARY_INPUTS[0], headers=_BINARY_INPUTS[1]).status_code == 200


def test_bf16_output_as_json_is_400(client):
    bits = DOC_GRAD.view(np.uint32) >> 16  # bfloat16 = the upper half of a float32
    document = example(inputs=[
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "BF16", "parameters": {"binary_data_size": 16}},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": DOC_IDX.tolist()},
    ])
    body, headers = _binary(document, bits.astype("<u2").tobytes())
    assert "grad_x is BF16" in error(infer(client, body=body, headers=headers), 400)
    document["outputs"] = [{"name": "grad_x", "parameters": {"binary_data": True}}]
    body, headers = _binary(document, bits.astype("<u2").tobytes())
    output, data = binary_output(infer(client, body=body, headers=headers))
    assert output["datatype"] == "BF16"
    want = moegrad.moe_init_routing_v2_grad(bits.astype("<u2").view(ml_dtypes.bfloat16), DOC_IDX, 2)
    assert np.frombuffer(data, "<u2").tolist() == want.view(np.uint16).ravel().tolist()


@pytest.mark.parametrize(
    ("document", "code", "field"),
    [
        (example(parameters={"top_k": 0}), "ACLNN_ERR_INNER_NULLPTR 561103", "top_k"),
        (example(parameters={}), "ACLNN_ERR_INNER_NULLPTR 561103", "top_k"),
        (example(parameters={"top_k": 2, "drop_pad_mode": 2}), "ACLNN_ERR_INNER_NULLPTR 561103", "drop_pad_mode"),
        (example(parameters={"top_k": 2, "active_num": 3}), "ACLNN_ERR_INNER_NULLPTR 561103", "grad_expanded_x"),
        (example(parameters={"top_k": 2, "drop_pad_mode": 1}), "ACLNN_ERR_INNER_NULLPTR 561103", "grad_expanded_x"),
        (example(parameters={"top_k": 2.0}), "ACLNN_ERR_INNER_NULLPTR 561103", "top_k"),
        (example(parameters={"top_k": 3}), "ACLNN_ERR_INNER_NULLPTR 561103", "expanded_row_idx"),
        (example(parameters={"top_k": 2, "order": "ascend960"}), "ACLNN_ERR_PARAM_INVALID 161002", "order"),
        # 561103 above is CANN 9.1's code (the default profile's); before 9.1 the same rule is 561002
        (example(parameters={"top_k": 3, "order": "ascend910b@9.0"}), "ACLNN_ERR_INNER_TILING_ERROR 561002",
         "expanded_row_idx"),
        (example(inputs=example()["inputs"][:1]), "ACLNN_ERR_PARAM_NULLPTR 161001", "expanded_row_idx"),
        (example(inputs=[]), "ACLNN_ERR_PARAM_NULLPTR 161001", "grad_expanded_x"),
        (_with_input(1, data=[2, 0, 1, 4]), "ACLNN_ERR_PARAM_INVALID 161002", "expanded_row_idx"),
        (_with_input(1, data=[2, 0, 2, 3]), "ACLNN_ERR_PARAM_INVALID 161002", "expanded_row_idx"),
        (_with_input(1, datatype="INT64"), "ACLNN_ERR_PARAM_INVALID 161002", "expanded_row_idx"),
        (_with_input(0, datatype="FP64"), "ACLNN_ERR_PARAM_INVALID 161002", "grad_expanded_x"),
    ],
)
def test_operator_constraints_are_400_with_aclnn_code(client, document, code, field):
    message = error(infer(client, document), 400)
    assert message.endswith(f"[field {field}] ({code})")
    assert metric(client, "moegrad_inference_request_failure_total", endpoint=ENDPOINT, reason="invalid_argument") == 1


def test_body_over_limit_is_413_by_content_length_and_by_stream(serve):
    with serve(max_body_bytes=1024) as client:
        body = json.dumps(_with_input(0, shape=[4, 100], data=[0.5] * 400)).encode()
        assert len(body) > 1024
        assert "limit of 1024" in error(infer(client, body=body), 413)

        def chunks():
            for start in range(0, len(body), 100):
                yield body[start:start + 100]

        assert "grew past the limit of 1024" in error(client.post(INFER, content=chunks()), 413)
        assert infer(client, example()).status_code == 200
        assert metric(client, "moegrad_inference_request_failure_total", endpoint=ENDPOINT,
                      reason="payload_too_large") == 2


def test_tensor_over_element_cap_is_413(serve):
    with serve(max_elements=4) as client:
        assert "grad_expanded_x.shape=[4, 2] has 8 elements" in error(infer(client, example()), 413)


def test_not_admitting_is_503_with_retry_after(serve):
    with serve(retry_after_s=3) as client:
        client.app.state.drain()
        for response in (infer(client, example()), client.get("/v2/health/ready"), client.get(f"/v2/models/{MODEL}/ready")):
            error(response, 503)
            assert response.headers["retry-after"] == "3"
        assert client.get("/v2/health/live").status_code == 200


def test_unhealthy_backend_is_not_ready(serve):
    class Sick(ReferenceBackend):
        def check_health(self) -> None:
            raise DeviceFault("HBM query failed")

    with serve(backend=Sick()) as client:
        assert "HBM query failed" in error(client.get("/v2/health/ready"), 503)


def test_device_fault_is_500_with_its_text(serve, gate, gated_backend):
    gate.error = DeviceFault("aclnn launch failed", device_message="EZ9999 AI Core error")
    with serve(backend=gated_backend) as client:
        message = error(infer(client, example()), 500)
        assert "aclnn launch failed" in message and "EZ9999 AI Core error" in message
        gate.error = None
        gate.release.set()
        assert infer(client, example()).status_code == 200


@pytest.mark.parametrize("how", ["header", "parameter"])
def test_deadline_is_504(serve, gate, gated_backend, monkeypatch, how):
    monkeypatch.setattr(pool_module, "ABANDON_GRACE_S", 0.1)
    with serve(backend=gated_backend, streams=1) as client:
        if how == "header":
            response = infer(client, example(), headers={"x-request-timeout": "0.3"})
        else:  # the protocol's timeout parameter, in microseconds
            response = infer(client, example(parameters={"top_k": 2, "timeout": 300_000}))
        error(response, 504)
        gate.release.set()
        assert infer(client, example()).status_code == 200


def test_bad_request_timeout_header_is_400(client):
    assert "X-Request-Timeout" in error(infer(client, example(), headers={"x-request-timeout": "soon"}), 400)


def test_tokens_are_required_when_configured(serve):
    with serve(auth_tokens="s3cret") as client:
        response = infer(client, example())
        assert "Bearer" in error(response, 401)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/v2/health/ready").status_code == 200
        assert infer(client, example(), headers={"authorization": "Bearer s3cret"}).status_code == 200


def test_huge_timeout_parameter_is_capped_not_a_500(client):
    response = infer(client, example(parameters={"top_k": 2, "timeout": 10**400}))
    assert response.status_code == 200, response.text
    _, grad_x = json_output(response)
    assert grad_x.astype(np.float32).view(np.uint32).ravel().tolist() == DOC_BITS


@pytest.mark.parametrize("binary", [False, True])
def test_empty_tensor_with_an_unrepresentable_dimension_is_400(client, binary):
    huge = [0, 2**62]
    grad = {"name": "grad_expanded_x", "shape": huge, "datatype": "FP32"}
    grad.update({"parameters": {"binary_data_size": 0}} if binary else {"data": []})
    idx = {"name": "expanded_row_idx", "shape": [0], "datatype": "INT32", "data": []}
    document = example(inputs=[grad, idx])
    header = json.dumps(document).encode()
    headers = {"Inference-Header-Content-Length": str(len(header))} if binary else None
    assert "too large for an array" in error(infer(client, body=header, headers=headers), 400)
    assert infer(client, example()).status_code == 200


def test_json_number_beyond_float_range_is_400_not_infinity(client):
    body = json.dumps(example()).replace('"data": [0.1', '"data": [1e400', 1).encode()
    assert "beyond the range" in error(infer(client, body=body), 400)


@pytest.mark.parametrize("datatype", [["FP32"], {"a": 1}, 32, None])
def test_a_datatype_that_is_not_a_string_is_400_naming_the_input(client, datatype):
    body = {"parameters": {"top_k": 2},
            "inputs": [{"name": "grad_expanded_x", "shape": [4, 2], "datatype": datatype, "data": [0.0] * 8},
                       v2_inputs()[1]]}
    response = client.post("/v2/models/moe_init_routing_v2_grad/infer", content=json.dumps(body))
    assert response.status_code == 400, response.text
    assert "grad_expanded_x.datatype" in response.json()["error"]


def test_a_null_order_is_the_servers_default_as_on_v1():
    """``"order": null`` names no profile on v2 JSON, as nil does on v1: the server's default
    (MOEGRAD_ORDER), not the library's; both paths answer with the same profile."""
    import msgpack
    from fastapi.testclient import TestClient

    from moegrad_service.app import create_app
    from moegrad_service.settings import Settings
    from support.docexample import example_document
    from support.servicekit import MSGPACK_HEADERS, pack

    body = {
        "inputs": [
            {"name": "grad_expanded_x", "datatype": "FP32", "shape": [4, 2], "data": DOC_GRAD.ravel().tolist()},
            {"name": "expanded_row_idx", "datatype": "INT32", "shape": [4], "data": DOC_IDX.tolist()},
        ],
        "parameters": {"top_k": 2, "order": None},
    }
    with TestClient(create_app(Settings(order="ascend950", warm_up=False))) as client:
        v2 = client.post("/v2/models/moe_init_routing_v2_grad/infer", json=body)
        v1 = client.post("/v1/moe_init_routing_v2_grad", content=pack({**example_document(), "order": None}),
                         headers=MSGPACK_HEADERS)
    assert v2.status_code == 200 and v2.json()["parameters"]["order"] == "ascend950@9.1"
    assert msgpack.unpackb(v1.content, raw=False)["order"] == "ascend950@9.1"
