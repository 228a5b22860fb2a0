"""Protocol v2 over gRPC in process: the app's lifespan serves gRPC on a free port beside HTTP, and
stock ``tritonclient.grpc`` (sync and aio) calls it over TCP.

Results are compared bit for bit with ``moegrad.moe_init_routing_v2_grad`` computed in the test
process; refusals carry the aclnn code the operator documentation gives (tests/grpckit.py) and the
same message as the v2 HTTP answer to the same call; statistics are checked against the calls the
test made.
"""

from __future__ import annotations

import contextlib
import json
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
import trustme
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import moegrad
from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.bits import same_bits
from support.docexample import DOC_GRAD, DOC_IDX
from support.grpckit import (
    DOC_BITS,
    DTYPES,
    INVALID,
    MODEL,
    MODES,
    attributes,
    doc_call,
    expected,
    inputs,
    parameters_of,
    routed_call,
)

SERVICE = "inference.GRPCInferenceService"


@pytest.fixture
def grpc_service():
    """``with grpc_service(backend=..., **settings) as (http, target)``: the app with gRPC on a free
    port (``target`` is ``127.0.0.1:<port>``) and an HTTP TestClient of the same app."""

    @contextlib.contextmanager
    def start(backend=None, **settings):
        settings = {"backend": "reference", "grpc_port": 0, "warm_up": False, **settings}
        app = create_app(Settings(**settings), backend=backend)
        with TestClient(app, raise_server_exceptions=False) as http:
            yield http, f"127.0.0.1:{app.state.grpc_port}"

    return start


@pytest.fixture
def service(grpc_service):
    with grpc_service() as started:
        yield started


@pytest.fixture
def client(service):
    with triton.InferenceServerClient(service[1]) as grpc_client:
        yield grpc_client


def infer(client, call: dict, **options):
    return client.infer(MODEL, inputs(triton, call), parameters=parameters_of(call), **options)


# --- health, metadata --------------------------------------------------------------------------


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("resnet50") and not client.is_model_ready(MODEL, "2")
    server = client.get_server_metadata(as_json=True)
    assert server == {"name": "moegrad", "version": moegrad.__version__,
                      "extensions": ["model_configuration", "statistics"]}
    metadata = client.get_model_metadata(MODEL, as_json=True)
    assert metadata["name"] == MODEL and metadata["versions"] == ["1"] and metadata["platform"] == "moegrad_reference"
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("grad_expanded_x", "FP32", ["-1", "-1"]), ("expanded_row_idx", "INT32", ["-1"])]  # int64 in JSON: strings
    assert metadata["outputs"] == [{"name": "grad_x", "datatype": "FP32", "shape": ["-1", "-1"]}]
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("resnet50")
    assert raised.value.status() == "StatusCode.NOT_FOUND" and "'resnet50'" in raised.value.message()


def test_standard_health_service(service):
    http, target = service
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for name in ("", SERVICE):
            assert check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=10)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        http.app.state.drain()  # what SIGTERM does: stop admitting
        assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING


def test_unserved_rpcs_are_unimplemented(service):
    with grpc.insecure_channel(service[1]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for rpc, request in ((stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(model_name=MODEL)),
                             (stub.SystemSharedMemoryStatus, service_pb2.SystemSharedMemoryStatusRequest())):
            with pytest.raises(grpc.RpcError) as raised:
                rpc(request, timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --- inference -----------------------------------------------------------------------------------


def test_documentation_example_bits(client):
    result = infer(client, doc_call(), request_id="doc-1")
    assert result.as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS
    response = result.get_response()
    assert response.id == "doc-1" and response.model_name == MODEL and response.model_version == "1"
    assert response.parameters["backend"].string_param == "reference"
    assert response.parameters["order"].string_param == "ascend910b@9.1"  # the default profile
    assert len(response.raw_output_contents) == 1 and len(response.raw_output_contents[0]) == 16


def test_calls_are_counted_in_the_metrics_under_the_method(service, client):
    http, _ = service
    infer(client, doc_call())
    with pytest.raises(InferenceServerException):
        infer(client, {**doc_call(), "top_k": 3})
    text = http.get("/metrics").text
    endpoint = f'endpoint="/{SERVICE}/ModelInfer"'
    assert f"moegrad_inference_request_success_total{{{endpoint}}} 1.0" in text
    assert f'moegrad_inference_request_failure_total{{{endpoint},reason="invalid_argument"}} 1.0' in text
    received = float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("moegrad_inference_request_bytes_total ")))
    assert 48 < received < 400  # the successful call's message: its 48 tensor bytes and a header


def test_grpc_port_settings():
    with pytest.raises(ValueError, match="grpc_port and port must differ"):
        Settings(port=8001, grpc_port=8001)
    assert Settings().grpc_port is None  # off unless set


def test_a_grpc_port_in_use_fails_startup():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        app = create_app(Settings(backend="reference", warm_up=False, grpc_port=taken.getsockname()[1]))
        with pytest.raises(RuntimeError), TestClient(app):
            pass


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_and_dtype_is_bit_exact(client, mode, dtype):
    call = routed_call(MODES.index(mode), mode, dtype)
    for order, profile in (("ascend910b", "ascend910b@9.1"), ("sequential", "sequential")):
        result = infer(client, {**call, "order": order})
        assert result.get_response().parameters["order"].string_param == profile  # the alias's profile
        assert same_bits(result.as_numpy("grad_x"), expected(call, order=order))


@pytest.mark.asyncio
async def test_asyncio_client(service):
    async with triton_aio.InferenceServerClient(service[1]) as client:
        assert await client.is_server_ready()
        for mode in MODES:
            call = routed_call(7, mode, ml_dtypes.bfloat16, top_k=4)
            result = await client.infer(MODEL, inputs(triton_aio, call), parameters=attributes(call))
            assert same_bits(result.as_numpy("grad_x"), expected(call))


def test_empty_call_and_typed_contents(service):
    """An empty call answers an empty grad_x; tensors in typed contents (fp32_contents, int_contents)
    give the same bits as raw ones."""
    with grpc.insecure_channel(service[1]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name=MODEL)
        request.parameters["top_k"].int64_param = 2
        grad = request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[4, 2])
        grad.contents.fp32_contents.extend(DOC_GRAD.ravel().tolist())
        request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[4]).contents.int_contents.extend(
            DOC_IDX.tolist())
        response = stub.ModelInfer(request, timeout=30)
        assert list(response.outputs[0].shape) == [2, 2] and response.outputs[0].datatype == "FP32"
        assert np.frombuffer(response.raw_output_contents[0], np.uint32).reshape(2, 2).tolist() == DOC_BITS

        empty = service_pb2.ModelInferRequest(model_name=MODEL)
        empty.parameters["top_k"].int64_param = 2
        empty.inputs.add(name="grad_expanded_x", datatype="FP16", shape=[0, 8])
        empty.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[0])
        empty.raw_input_contents.extend([b"", b""])
        response = stub.ModelInfer(empty, timeout=30)
        assert list(response.outputs[0].shape) == [0, 8] and response.outputs[0].datatype == "FP16"
        assert response.raw_output_contents[0] == b""


# --- refusals ------------------------------------------------------------------------------------


def _http_v2_error(http: TestClient, call: dict) -> str:
    """The v2 HTTP answer's message for the same call (JSON tensors; binary for what JSON lacks)."""
    tensors = [(name, np.asarray(call[name])) for name in ("grad_expanded_x", "expanded_row_idx")
               if call.get(name) is not None]
    document = {"parameters": parameters_of(call), "inputs": []}
    binary = b""
    for name, array in tensors:
        datatype = {"f2": "FP16", "f4": "FP32", "f8": "FP64", "i4": "INT32", "i8": "INT64"}[array.dtype.str[1:]]
        document["inputs"].append({"name": name, "shape": list(array.shape), "datatype": datatype,
                                   "parameters": {"binary_data_size": array.nbytes}})
        binary += array.tobytes()
    header = json.dumps(document).encode()
    response = http.post(f"/v2/models/{MODEL}/infer", content=header + binary,
                         headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("change", "code", "field"), [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_invalid_inputs_carry_the_aclnn_code_and_the_http_message(service, change, code, field):
    http, target = service
    call = change(doc_call())
    with triton.InferenceServerClient(target) as client, pytest.raises(InferenceServerException) as raised:
        infer(client, call)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = raised.value.message()
    assert f" {code})" in message and f"[field {field}]" in message
    assert message == _http_v2_error(http, call)  # the same input gets the same answer on either protocol


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda r: r.parameters["top_k_"].CopyFrom(r.parameters["top_k"]), "unknown field 'top_k_'"),
        (lambda r: (r.inputs.add(name="bias", datatype="FP32", shape=[1]), r.raw_input_contents.append(bytes(4))),
         "'bias' is not an input"),
        (lambda r: r.outputs.add(name="scores"), "'scores' is not an output"),
        (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 1 entries but there are 2 inputs"),
        (lambda r: r.inputs[0].shape.__setitem__(0, 5), "raw_input_contents[0] has 32 bytes"),
        (lambda r: r.inputs[0].shape.__setitem__(0, -4), "must be a list of at most"),
        (lambda r: r.inputs[0].__setattr__("datatype", "BYTES"), "datatype='BYTES' is not supported"),
        (lambda r: setattr(r.inputs[0].parameters["shared_memory_region"], "string_param", "r0"),
         "grad_expanded_x.parameters has an unknown field 'shared_memory_region'"),
        (lambda r: r.parameters["drop_pad_mode"].Clear(), "parameters.drop_pad_mode has no value"),
        (lambda r: setattr(r.parameters["timeout"], "int64_param", -5), "positive number of microseconds"),
    ],
)
def test_malformed_requests_are_invalid_argument(service, edit, words):
    with grpc.insecure_channel(service[1]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name=MODEL)
        request.parameters["top_k"].int64_param = 2
        request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[4, 2])
        request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[4])
        request.raw_input_contents.extend([np.zeros((4, 2), np.float32).tobytes(),
                                           np.arange(4, dtype=np.int32).tobytes()])
        edit(request)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in raised.value.details()


def test_unknown_model_and_version_are_not_found(client):
    for name, version in (("resnet50", ""), (MODEL, "2")):
        with pytest.raises(InferenceServerException) as raised:
            client.infer(name, inputs(triton, doc_call()), model_version=version, parameters={"top_k": 2})
        assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_limits_are_resource_exhausted(grpc_service):
    call = routed_call(3, hidden=64)  # grad 18 x 64 float32: 4608 bytes, over a 4096-byte message limit
    with grpc_service(max_body_bytes=4096, max_elements=600) as (_, target), \
            triton.InferenceServerClient(target) as client:
        with pytest.raises(InferenceServerException) as raised:
            infer(client, call)
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        small = routed_call(3, hidden=40)  # 720 elements, over max_elements=600, in a 2.9 KiB message
        with pytest.raises(InferenceServerException) as raised:
            infer(client, small)
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "over the limit of 600" in \
            raised.value.message()
        fits = routed_call(3, hidden=8)
        assert same_bits(infer(client, fits).as_numpy("grad_x"), expected(fits))


def test_rpcs_beyond_max_connections_are_resource_exhausted(grpc_service, gated_backend, gate):
    from concurrent.futures import ThreadPoolExecutor

    with grpc_service(backend=gated_backend, streams=1, express_max_adds=0, max_connections=1) as (_, target), \
            triton.InferenceServerClient(target) as client, ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer, client, doc_call())
        assert gate.started.acquire(timeout=30)  # one RPC in flight, held at the gate
        with pytest.raises(InferenceServerException) as raised:
            client.is_server_live()
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        gate.release.set()
        assert running.result(timeout=30).as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS
        assert client.is_server_live()


def test_a_call_whose_client_gives_up_while_queued_never_runs(grpc_service, gated_backend, gate):
    from concurrent.futures import ThreadPoolExecutor

    with grpc_service(backend=gated_backend, streams=1, express_max_adds=0) as (http, target), \
            triton.InferenceServerClient(target) as client, ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer, client, doc_call())
        assert gate.started.acquire(timeout=30)  # the worker is held; the next call queues
        with pytest.raises(InferenceServerException) as raised:
            infer(client, routed_call(1), client_timeout=0.5)  # the client's gRPC deadline
        assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        gate.release.set()
        assert running.result(timeout=30).as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS
        assert same_bits(infer(client, routed_call(2)).as_numpy("grad_x"), expected(routed_call(2)))
        assert gate.calls == 2  # the held call and the last one: the abandoned call reached no worker
        assert _stats(http.get(f"/v2/models/{MODEL}/stats").json())["fail"][0] == 1


def test_full_queue_is_unavailable_with_retry_after(grpc_service, gated_backend, gate):
    from concurrent.futures import ThreadPoolExecutor

    with grpc_service(backend=gated_backend, streams=1, express_max_adds=0, max_queue=1, retry_after_s=3) as (http, target), \
            triton.InferenceServerClient(target) as client, ThreadPoolExecutor(2) as pool:
        call = doc_call()
        running = pool.submit(infer, client, call)
        assert gate.started.acquire(timeout=30)  # one call holds the worker
        queued = pool.submit(infer, client, call)
        # wait until the second call holds the queue's one place: a probe sent before it could take
        # that place instead, wait out its 30 s deadline, and leave the place to the next probe
        for _ in range(3000):
            if "moegrad_inference_pending_request_count 1.0" in http.get("/metrics").text:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the second call was never queued")
        with grpc.insecure_channel(target) as channel:  # the probes now find the queue full
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(500):
                with pytest.raises(grpc.RpcError) as raised:
                    request = service_pb2.ModelInferRequest(model_name=MODEL)
                    request.parameters["top_k"].int64_param = 2
                    request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[4, 2])
                    request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[4])
                    request.raw_input_contents.extend([call["grad_expanded_x"].tobytes(),
                                                       call["expanded_row_idx"].tobytes()])
                    stub.ModelInfer(request, timeout=30)
                if "queue is full" in raised.value.details():
                    break
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ("retry-after", "3") in tuple(raised.value.trailing_metadata())
        gate.release.set()
        for future in (running, queued):
            assert future.result(timeout=30).as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS


# --- the extensions, on both protocols ------------------------------------------------------------


def test_model_config_on_both_protocols(service, client):
    http, _ = service
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL and config["backend"] == "reference"
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("grad_expanded_x", "TYPE_FP32", ["-1", "-1"]), ("expanded_row_idx", "TYPE_INT32", ["-1"])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("grad_x", "TYPE_FP32", ["-1", "-1"])]
    assert config["parameters"]["grad_expanded_x_datatypes"] == {"string_value": "FP16,BF16,FP32"}
    assert "max_batch_size" not in config  # 0: proto3 JSON leaves defaults out
    over_http = http.get(f"/v2/models/{MODEL}/config").json()
    assert over_http["max_batch_size"] == 0 and over_http["version_policy"] == {"specific": {"versions": [1]}}
    assert [(t["name"], t["data_type"], t["dims"]) for t in over_http["input"]] == [
        ("grad_expanded_x", "TYPE_FP32", [-1, -1]), ("expanded_row_idx", "TYPE_INT32", [-1])]
    assert {k: v["string_value"] for k, v in over_http["parameters"].items()} == \
        {k: v["string_value"] for k, v in config["parameters"].items()}
    assert http.get(f"/v2/models/{MODEL}/versions/1/config").json() == over_http
    assert http.get("/v2/models/resnet50/config").status_code == 404
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_config("resnet50")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_repository_index_on_both_protocols(service, client):
    http, _ = service
    want = [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
    assert http.post("/v2/repository/index").json() == want
    assert http.post("/v2/repository/index", json={"ready": True}).json() == want
    assert http.post("/v2/repository/index", json={"ready": 1}).status_code == 400
    index = client.get_model_repository_index(as_json=True)["models"]
    assert index == [{"name": MODEL, "version": "1", "state": "READY"}]  # "" reason: a proto3 default


def _stats(document: dict) -> dict:
    """The one model's statistics with every count and ns as int (proto3 JSON writes uint64 as
    strings and leaves zeros out)."""
    (model,) = document["model_stats"]
    stats = {key: int(model.get(key, 0)) for key in ("last_inference", "inference_count", "execution_count")}
    for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit"):
        entry = model.get("inference_stats", {}).get(name, {})
        stats[name] = (int(entry.get("count", 0)), int(entry.get("ns", 0)))
    return stats


def test_statistics_count_the_calls_made_over_both_protocols(service, client):
    http, _ = service
    assert _stats(http.get(f"/v2/models/{MODEL}/stats").json())["success"] == (0, 0)
    good = [routed_call(seed, mode) for seed, mode in enumerate(MODES)]
    for call in good:  # 3 gRPC successes
        assert same_bits(infer(client, call).as_numpy("grad_x"), expected(call))
    document = {"parameters": {"top_k": 2}, "inputs": [
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32",
         "data": [0.1, 0.1, 0.3, 0.3, 0.2, 0.2, 0.4, 0.4]},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": [2, 0, 1, 3]}]}
    for _ in range(2):  # 2 HTTP successes
        assert http.post(f"/v2/models/{MODEL}/infer", json=document).status_code == 200
    with pytest.raises(InferenceServerException):  # refused while decoding: never reaches the model
        infer(client, {**doc_call(), "top_k": 0})

    by_grpc = _stats(client.get_inference_statistics(MODEL, as_json=True))
    by_http = _stats(http.get(f"/v2/models/{MODEL}/stats").json())
    assert by_http == by_grpc
    assert _stats(http.get("/v2/models/stats").json()) == by_http == \
        _stats(http.get(f"/v2/models/{MODEL}/versions/1/stats").json())
    assert by_http["inference_count"] == by_http["execution_count"] == 5
    assert by_http["fail"] == (0, 0) and by_http["cache_hit"] == (0, 0)
    for name in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert by_http[name][0] == 5 and by_http[name][1] > 0
    success_ns = by_http["success"][1]
    assert by_http["queue"][1] + by_http["compute_infer"][1] + by_http["compute_input"][1] <= success_ns
    assert by_http["last_inference"] > 1.7e12  # milliseconds since the epoch, after 2023
    assert _stats(client.get_inference_statistics("", as_json=True)) == by_http


def test_statistics_count_failures_in_the_dataplane(grpc_service, gated_backend, gate):
    """A call whose deadline passes while it runs fails in the model: fail counts it."""
    with grpc_service(backend=gated_backend, streams=1, express_max_adds=0) as (http, target), \
            triton.InferenceServerClient(target) as client:
        with pytest.raises(InferenceServerException) as raised:
            infer(client, doc_call(), timeout=200_000)  # 0.2 s, while the gate holds the worker
        assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        gate.release.set()
        stats = _stats(http.get(f"/v2/models/{MODEL}/stats").json())
        assert stats["fail"][0] == 1 and stats["fail"][1] >= 0.2e9 and stats["success"] == (0, 0)


# --- tokens and TLS --------------------------------------------------------------------------------


def test_bearer_tokens_from_metadata(grpc_service):
    with grpc_service(auth_tokens="grpc-token,other") as (_, target), triton.InferenceServerClient(target) as client:
        assert client.is_server_live() and client.is_server_ready()  # open, as /v2/health/* are
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": "Basic grpc-token"}):
            with pytest.raises(InferenceServerException) as raised:
                infer(client, doc_call(), headers=headers)
            assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
            with pytest.raises(InferenceServerException):
                client.get_model_config(MODEL, headers=headers)
        result = infer(client, doc_call(), headers={"authorization": "Bearer grpc-token"})
        assert result.as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS
        with grpc.insecure_channel(target) as channel:  # the health service needs no token (probes)
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_tls_with_the_http_certificate(grpc_service, tmp_path):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_path))
    cert_path.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key_path))
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    with grpc_service(tls_certfile=cert_path, tls_keyfile=key_path) as (_, target):
        with triton.InferenceServerClient(target, ssl=True, root_certificates=str(ca_path)) as client:
            assert infer(client, doc_call()).as_numpy("grad_x").view(np.uint32).tolist() == DOC_BITS
        for untrusting in (triton.InferenceServerClient(target, ssl=True, root_certificates=str(other_ca)),
                           triton.InferenceServerClient(target)):  # another CA; plaintext to a TLS port
            with untrusting, pytest.raises(InferenceServerException) as raised:
                untrusting.infer(MODEL, inputs(triton, doc_call()), parameters={"top_k": 2}, client_timeout=10)
            assert raised.value.status() == "StatusCode.UNAVAILABLE"


@pytest.mark.parametrize("where", ["order", "parameter name"])
def test_a_client_string_echoed_in_an_error_is_cut_short(client, where):
    """A 20,000-character string the client sent (a profile name, an unknown parameter's name) is
    echoed in the refusal cut to about 1,000 characters: the answer is INVALID_ARGUMENT, not the
    RESOURCE_EXHAUSTED of a status over gRPC's 16 KiB metadata limit."""
    call = doc_call()
    parameters = parameters_of(call)
    long = "x" * 20_000
    if where == "order":
        parameters["order"] = long
    else:
        parameters[long] = 1
    with pytest.raises(InferenceServerException) as raised:
        client.infer(MODEL, inputs(triton, call), parameters=parameters)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = raised.value.message()
    assert len(message) < 1_200 and ("characters left out" in message or "x" * 29 + "..." in message), message
