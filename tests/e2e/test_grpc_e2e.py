"""Protocol v2 over gRPC end to end: a real ``moegrad-service serve`` process (uvicorn and gRPC in one
process, ``--grpc-port``) called by the stock ``tritonclient.grpc`` (sync and aio) and
``tritonclient.http``.

The server is tests/e2e/slow_server.py, which runs ``moegrad_service.__main__.serve`` itself (the
same servers, SIGTERM drain and exit code as the real command) with a reference backend whose
calls can be held at a gate. Results are compared bit for bit with ``moegrad.moe_init_routing_v2_grad``
computed in the test process; refusals carry the aclnn code the operator documentation gives.
"""

from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
import tritonclient.http as triton_http
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from support.bits import same_bits
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
from support.launch import REFERENCE_FLAGS, ServerProcess, free_port, moegrad_server

LAUNCHER = Path(__file__).with_name("slow_server.py")
READY_WITHIN_S = 60.0
STOP_WITHIN_S = 90.0


def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.02)


@dataclass
class Server:
    """A started server (support.launch's launcher) and the ``host:port`` of its gRPC side."""

    process: ServerProcess
    target: str

    @property
    def url(self) -> str:
        return self.process.url

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5.0).text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[-1])
        return 0.0


def start_server(log_dir: Path, hook=(), flags=(), ca_path: Path | None = None) -> Server:
    """``slow_server.py [hook flags] -- [serve flags] --grpc-port P`` on free loopback ports, ready
    (the lifespan starts gRPC before the HTTP side reports ready)."""
    grpc_port = free_port()
    process = moegrad_server(log_dir, command=[sys.executable, str(LAUNCHER), *hook, "--"],
                             flags=[*REFERENCE_FLAGS, "--grpc-port", str(grpc_port), *flags], tls_ca=ca_path,
                             ready_within_s=READY_WITHIN_S, stop_within_s=STOP_WITHIN_S)
    return Server(process, f"127.0.0.1:{grpc_port}")


@pytest.fixture
def launch(tmp_path):
    """``launch(hook=[...], flags=[...], ca_path=None) -> Server``; every server is stopped at the end."""
    servers: list[Server] = []

    def start(hook=(), flags=(), ca_path=None) -> Server:
        servers.append(start_server(tmp_path, hook, flags, ca_path))
        return servers[-1]

    yield start
    for server in servers:
        server.process.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory.mktemp("grpc-e2e"))
    yield started
    assert started.process.stop() == 0, started.process.log()


# --- every mode and dtype, sync and aio -------------------------------------------------------------

def test_every_mode_and_dtype_sync_client(server):
    with triton.InferenceServerClient(server.target) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.infer(MODEL, inputs(triton, doc_call()), parameters={"top_k": 2}).as_numpy(
            "grad_x").view(np.uint32).tolist() == DOC_BITS
        for seed, (mode, dtype) in enumerate((m, d) for m in MODES for d in DTYPES):
            call = routed_call(seed, mode, dtype, tokens=9, top_k=4, hidden=24)
            result = client.infer(MODEL, inputs(triton, call), parameters=attributes(call), request_id=f"r{seed}")
            assert result.get_response().id == f"r{seed}"
            assert same_bits(result.as_numpy("grad_x"), expected(call)), (mode, dtype)


@pytest.mark.asyncio
async def test_every_mode_and_dtype_aio_client(server):
    async with triton_aio.InferenceServerClient(server.target) as client:
        assert await client.is_server_ready()
        for seed, (mode, dtype) in enumerate((m, d) for m in MODES for d in DTYPES):
            call = routed_call(100 + seed, mode, dtype, tokens=5, top_k=8, hidden=33)
            for order in ("ascend910b", "sequential"):
                result = await client.infer(MODEL, inputs(triton_aio, call),
                                            parameters={**attributes(call), "order": order})
                assert same_bits(result.as_numpy("grad_x"), expected(call, order=order)), (mode, dtype, order)


@pytest.mark.parametrize(("change", "code", "field"), [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_every_invalid_input_class_carries_the_aclnn_code(server, change, code, field):
    call = change(doc_call())
    with triton.InferenceServerClient(server.target) as client, pytest.raises(InferenceServerException) as raised:
        client.infer(MODEL, inputs(triton, call), parameters=parameters_of(call))
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f" {code})" in raised.value.message() and f"[field {field}]" in raised.value.message()


# --- the extensions over both protocols -------------------------------------------------------------

def _counts(statistics: dict) -> dict[str, int]:
    """Counts of the one model's statistics as ints (gRPC's JSON writes uint64 as strings, omits zeros)."""
    (model,) = statistics["model_stats"]
    counts = {key: int(model.get(key, 0)) for key in ("inference_count", "execution_count")}
    for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        counts[name] = int(model.get("inference_stats", {}).get(name, {}).get("count", 0))
    return counts


def test_config_and_statistics_match_the_calls_over_both_protocols(launch):
    server = launch()
    http_target = server.url.removeprefix("http://")
    with triton.InferenceServerClient(server.target) as grpc_client, \
            triton_http.InferenceServerClient(http_target) as http_client:
        grpc_config = grpc_client.get_model_config(MODEL, as_json=True)["config"]
        http_config = http_client.get_model_config(MODEL)
        for config in (grpc_config, http_config):
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
                ("grad_expanded_x", "TYPE_FP32", [-1, -1]), ("expanded_row_idx", "TYPE_INT32", [-1])]
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["output"]] == [
                ("grad_x", "TYPE_FP32", [-1, -1])]
            assert config["parameters"]["grad_expanded_x_datatypes"]["string_value"] == "FP16,BF16,FP32"
        assert http_client.get_model_repository_index() == [
            {"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
        assert [m["name"] for m in grpc_client.get_model_repository_index(as_json=True)["models"]] == [MODEL]

        calls = [routed_call(seed, MODES[seed % 3]) for seed in range(4)]
        for call in calls:  # 4 over gRPC
            assert same_bits(grpc_client.infer(MODEL, inputs(triton, call), parameters=attributes(call))
                             .as_numpy("grad_x"), expected(call))
        for call in calls[:3]:  # 3 over HTTP
            http_inputs = [triton_http.InferInput(name, list(call[name].shape),
                                                  {"float32": "FP32", "int32": "INT32"}[call[name].dtype.name])
                           for name in ("grad_expanded_x", "expanded_row_idx")]
            for tensor, name in zip(http_inputs, ("grad_expanded_x", "expanded_row_idx"), strict=True):
                tensor.set_data_from_numpy(call[name])
            assert same_bits(http_client.infer(MODEL, http_inputs, parameters=attributes(call)).as_numpy("grad_x"),
                             expected(call))
        with pytest.raises(InferenceServerException):  # refused while decoding: not a model failure
            grpc_client.infer(MODEL, inputs(triton, {**doc_call(), "top_k": 0}), parameters={"top_k": 0})

        by_grpc = _counts(grpc_client.get_inference_statistics(MODEL, as_json=True))
        by_http = _counts(http_client.get_inference_statistics(MODEL))
        want = {"inference_count": 7, "execution_count": 7, "success": 7, "fail": 0, "queue": 7,
                "compute_input": 7, "compute_infer": 7, "compute_output": 7}
        assert by_grpc == by_http == want
        assert _counts(http_client.get_inference_statistics()) == want  # every model: the one


# --- tokens and TLS ----------------------------------------------------------------------------------

def test_tls_and_tokens_over_grpc(launch, tmp_path):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_path))
    cert_path.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key_path))
    token = "grpc-tls-token"
    server = launch(flags=["--tls-certfile", str(cert_path), "--tls-keyfile", str(key_path), "--auth-tokens", token],
                    ca_path=ca_path)
    call = routed_call(8, "drop_pad", np.float16)
    with triton.InferenceServerClient(server.target, ssl=True, root_certificates=str(ca_path)) as client:
        assert client.is_server_ready()  # open without a token, as /v2/health/ready is
        result = client.infer(MODEL, inputs(triton, call), parameters=attributes(call),
                              headers={"authorization": f"Bearer {token}"})
        assert same_bits(result.as_numpy("grad_x"), expected(call))
        for headers in (None, {"authorization": "Bearer not-it"}):
            with pytest.raises(InferenceServerException) as raised:
                client.infer(MODEL, inputs(triton, call), parameters=attributes(call), headers=headers)
            assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
    with triton.InferenceServerClient(server.target) as plaintext, pytest.raises(InferenceServerException) as raised:
        plaintext.infer(MODEL, inputs(triton, call), parameters=attributes(call), client_timeout=10,
                        headers={"authorization": f"Bearer {token}"})
    assert raised.value.status() == "StatusCode.UNAVAILABLE"  # no result over plaintext to a TLS port
    credentials = grpc.ssl_channel_credentials(ca_path.read_bytes())
    with grpc.secure_channel(server.target, credentials) as channel:  # the health service, no token
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


# --- SIGTERM ----------------------------------------------------------------------------------------

def test_sigterm_answers_the_grpc_calls_in_flight_and_exits_0(launch, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()  # open for the warm-up
    server = launch(hook=["--gate-file", str(gate), "--delay-s", "0.2"],
                    flags=["--streams", "2", "--shutdown-grace-s", "60", "--shutdown-drain-s", "1"])
    calls = [routed_call(i, MODES[i % 3], DTYPES[i % 3], hidden=4 + i) for i in range(6)]

    def run(call: dict) -> np.ndarray:
        with triton.InferenceServerClient(server.target) as client:
            return client.infer(MODEL, inputs(triton, call), parameters=attributes(call),
                                client_timeout=120).as_numpy("grad_x")

    for call in calls:  # warm up: a cold server may compile kernels on its first calls
        assert same_bits(run(call), expected(call))
    gate.unlink()  # from now on the two workers hold their calls until the gate opens again
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, call) for call in calls]
        wait_until(lambda: server.metric("moegrad_inference_pending_request_count")
                   + server.metric("moegrad_inference_exec_count") == 6, what="6 calls admitted")
        server.process.process.send_signal(signal.SIGTERM)

        def health() -> int | None:
            with grpc.insecure_channel(server.target) as channel:
                try:
                    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    return None  # the listener is already closed

        wait_until(lambda: health() != health_pb2.HealthCheckResponse.SERVING, what="gRPC health drained")
        with pytest.raises(InferenceServerException) as raised:  # a new call is refused while draining
            run(calls[0])
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
        gate.touch()  # the 6 admitted calls now run, two at a time, while the server stops
        for future, call in zip(futures, calls, strict=True):
            assert same_bits(future.result(timeout=120), expected(call))
    assert server.process.process.wait(STOP_WITHIN_S) == 0, server.process.log()
