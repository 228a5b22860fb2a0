"""gRPC's ModelInfer in the same admission as HTTP's calls: once decoded it holds what its call does
(moegrad_service.memory.peaks), so one input gets the same status on v1, v2 and gRPC; and it runs
in its token's turn.

Oracles: docs/operations.md, "Memory a request holds", worked by hand for each call below (a call
holds its body and grad_x, N x H x 4 bytes for float32; gRPC holds grad_x twice, its copy in the
serialized reply; one request may take seven eighths of ``max_inflight_bytes``); the status table
of docs/protocol.md (413 is RESOURCE_EXHAUSTED, 503 UNAVAILABLE); and, for the turns, round robin
written out by hand (docs/operations.md, "Tenants"), checked by the order a gated backend ran the
calls in, never by a time.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from fastapi.testclient import TestClient
from pydantic import SecretStr
from tritonclient.grpc import service_pb2

from moegrad_service.app import create_app
from moegrad_service.engine import ReferenceBackend
from moegrad_service.settings import Settings
from support.grpckit import MODEL
from support.servicekit import GateHook, Recorder, gauge, pack

MIB = 1 << 20
SERVICE = "inference.GRPCInferenceService"
HIDDEN = 64
V1 = "/v1/moe_init_routing_v2_grad"
V2 = f"/v2/models/{MODEL}/infer"


def all_dropped(tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A drop/pad call (top_k 1) whose every token is dropped: a 256-byte grad row, an index of
    ``tokens`` x 4 bytes, and a grad_x of ``tokens`` x HIDDEN x 4 bytes, all +0.0."""
    return np.ones((1, 1, HIDDEN), np.float32), np.full(tokens, -1, np.int32)


def v1_status(http: TestClient, tokens: int, headers: dict | None = None) -> int:
    grad, index = all_dropped(tokens)
    body = pack({"grad_expanded_x": {"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
                 "expanded_row_idx": {"dtype": "int32", "shape": list(index.shape), "data": index.tobytes()},
                 "top_k": 1, "drop_pad_mode": 1})
    return http.post(V1, content=body, headers={"content-type": "application/msgpack", **(headers or {})}).status_code


def v2_status(http: TestClient, tokens: int) -> int:
    grad, index = all_dropped(tokens)
    header = json.dumps({
        "parameters": {"top_k": 1, "drop_pad_mode": 1},
        "inputs": [
            {"name": "grad_expanded_x", "shape": list(grad.shape), "datatype": "FP32",
             "parameters": {"binary_data_size": grad.nbytes}},
            {"name": "expanded_row_idx", "shape": list(index.shape), "datatype": "INT32",
             "parameters": {"binary_data_size": index.nbytes}},
        ],
        "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}],
    }).encode()
    body = header + grad.tobytes() + index.tobytes()
    return http.post(V2, content=body, headers={"Inference-Header-Content-Length": str(len(header))}).status_code


def infer_message(grad: np.ndarray, index: np.ndarray, **attributes: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    for name, value in attributes.items():
        request.parameters[name].int64_param = value
    request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=list(grad.shape))
    request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=list(index.shape))
    request.raw_input_contents.extend([grad.tobytes(), index.tobytes()])
    return request.SerializeToString()


def grpc_status(channel: grpc.Channel, tokens: int) -> grpc.StatusCode:
    message = infer_message(*all_dropped(tokens), top_k=1, drop_pad_mode=1)
    try:
        channel.unary_unary(f"/{SERVICE}/ModelInfer")(message, timeout=60)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def held_bytes(http: TestClient, settled: float) -> float:
    """The in-flight bytes held, once they are ``settled`` (within 10 s): a gRPC status reaches the
    client as it is sent, a moment before the server's handler has given its reservation back."""
    deadline = time.monotonic() + 10
    while gauge(http, "moegrad_inflight_bytes") != settled and time.monotonic() < deadline:
        time.sleep(0.01)
    return gauge(http, "moegrad_inflight_bytes")


@contextlib.contextmanager
def service(backend=None, **settings):
    settings = {"backend": "reference", "grpc_port": 0, "warm_up": False, **settings}
    app = create_app(Settings(**settings), backend=backend)
    with TestClient(app, raise_server_exceptions=False) as http, \
            grpc.insecure_channel(f"127.0.0.1:{app.state.grpc_port}",
                                  options=[("grpc.max_receive_message_length", -1)]) as channel:
        yield http, channel


# A 64 MiB budget: one request may take seven eighths of it, 58,720,256 bytes. A gRPC read
# reserves 4 times the 1 MiB message limit, 4,194,304, so the read itself always finds room below.
BUDGET = {"max_inflight_bytes": 64 * MIB, "grpc_max_message_bytes": MIB, "body_timeout_s": 5.0}
#: 80,000 tokens: grad_x 20,480,000 bytes; over HTTP about 20.8 MB held, over gRPC about 41.3 MB.
FITS_ALONE = 80_000
#: 240,000 tokens: grad_x 61,440,000 bytes, over the 58,720,256 a request may take on every protocol.
NEVER_FITS = 240_000
#: 160,000 tokens: grad_x 40,960,000 bytes and a 640 KB body held by a call the gate keeps running;
#: beside it FITS_ALONE fits neither over HTTP (41.6 + 20.8 MB) nor over gRPC (41.6 + 41.3 MB).
BLOCKER = 160_000


def test_a_call_that_could_never_fit_is_413_on_v1_and_v2_and_resource_exhausted_on_grpc():
    with service(**BUDGET) as (http, channel):
        assert (v1_status(http, NEVER_FITS), v2_status(http, NEVER_FITS)) == (413, 413)
        assert grpc_status(channel, NEVER_FITS) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert held_bytes(http, 0) == 0  # every reservation given back
        # the same call, smaller, is answered on every protocol
        assert (v1_status(http, FITS_ALONE), v2_status(http, FITS_ALONE)) == (200, 200)
        assert grpc_status(channel, FITS_ALONE) == grpc.StatusCode.OK


def test_a_call_that_does_not_fit_now_is_503_on_v1_and_v2_and_unavailable_on_grpc():
    gate = GateHook()
    with service(ReferenceBackend(warm_up=False, fault_hook=gate), **BUDGET) as (http, channel), \
            ThreadPoolExecutor(1) as pool:
        try:
            blocker = pool.submit(v1_status, http, BLOCKER)
            assert gate.started.acquire(timeout=30)  # it runs, holding its peak
            held = gauge(http, "moegrad_inflight_bytes")
            assert held >= BLOCKER * HIDDEN * 4
            assert (v1_status(http, FITS_ALONE), v2_status(http, FITS_ALONE)) == (503, 503)
            assert grpc_status(channel, FITS_ALONE) == grpc.StatusCode.UNAVAILABLE
            assert held_bytes(http, held) == held  # the refusals took nothing
        finally:
            gate.release.set()
        assert blocker.result(30) == 200
        assert grpc_status(channel, FITS_ALONE) == grpc.StatusCode.OK  # alone, it fits


def test_a_grpc_call_holds_its_peak_while_it_runs_and_nothing_after():
    # FITS_ALONE over gRPC: its message (320,000 bytes of index, 256 of grad and the fields), grad_x
    # 20,480,000 bytes and its copy in the reply; the read's 4 x 1 MiB is given back once decoded
    gate = GateHook()
    with service(ReferenceBackend(warm_up=False, fault_hook=gate), **BUDGET) as (http, channel):
        message = infer_message(*all_dropped(FITS_ALONE), top_k=1, drop_pad_mode=1)
        try:
            running = channel.unary_unary(f"/{SERVICE}/ModelInfer").future(message, timeout=60)
            assert gate.started.acquire(timeout=30)
            assert gauge(http, "moegrad_inflight_bytes") == len(message) + 2 * FITS_ALONE * HIDDEN * 4
        finally:
            gate.release.set()
        reply = service_pb2.ModelInferResponse.FromString(running.result(60))
        assert reply.raw_output_contents[0] == bytes(FITS_ALONE * HIDDEN * 4)
        assert held_bytes(http, 0) == 0


def _wait_for_queue(http: TestClient, depth: int) -> None:
    deadline = time.monotonic() + 30
    while gauge(http, "moegrad_inference_pending_request_count") < depth and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gauge(http, "moegrad_inference_pending_request_count") == depth


def test_grpc_calls_take_their_tokens_turns():
    recorder = Recorder()
    tokens = {"auth_tokens": [SecretStr("alpha"), SecretStr("beta")], "metrics_public": True}
    with service(ReferenceBackend(warm_up=False, fault_hook=recorder), streams=1, express_max_adds=0, **tokens) as (http, channel):
        rpc = channel.unary_unary(f"/{SERVICE}/ModelInfer")

        def send(hidden: int, token: str) -> grpc.Future:
            message = infer_message(np.ones((4, hidden), np.float32), np.arange(4, dtype=np.int32), top_k=2)
            return rpc.future(message, metadata=(("authorization", f"Bearer {token}"),), timeout=60)

        try:
            calls = [send(1, "alpha")]
            assert recorder.first.wait(30)
            calls += [send(hidden, "alpha") for hidden in (2, 3, 4)]
            _wait_for_queue(http, 3)
            calls.append(send(10, "beta"))
            _wait_for_queue(http, 4)
        finally:
            recorder.release.set()
        for call in calls:
            call.result(60)
    # alpha's call running and three queued (its lane had its turn: the old list), then beta's, a
    # new lane: beta's runs next, then alpha's in order
    assert recorder.order == [1, 10, 2, 3, 4]


def test_an_http_call_and_a_grpc_call_of_one_token_share_its_lane():
    recorder = Recorder()
    tokens = {"auth_tokens": [SecretStr("alpha"), SecretStr("beta")], "metrics_public": True}
    with service(ReferenceBackend(warm_up=False, fault_hook=recorder), streams=1, express_max_adds=0, **tokens) as (http, channel), \
            ThreadPoolExecutor(3) as pool:
        rpc = channel.unary_unary(f"/{SERVICE}/ModelInfer")

        def over_http(hidden: int, token: str) -> int:
            grad = np.ones((4, hidden), np.float32)
            body = pack({"grad_expanded_x": {"dtype": "float32", "shape": [4, hidden], "data": grad.tobytes()},
                         "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.arange(4, dtype=np.int32)
                                              .tobytes()}, "top_k": 2})
            headers = {"content-type": "application/msgpack", "authorization": f"Bearer {token}"}
            return http.post(V1, content=body, headers=headers).status_code

        try:
            first = pool.submit(over_http, 1, "alpha")
            assert recorder.first.wait(30)
            queued = [pool.submit(over_http, 2, "alpha")]
            _wait_for_queue(http, 1)
            message = infer_message(np.ones((4, 3), np.float32), np.arange(4, dtype=np.int32), top_k=2)
            queued.append(rpc.future(message, metadata=(("authorization", "Bearer alpha"),), timeout=60))
            _wait_for_queue(http, 2)
            queued.append(pool.submit(over_http, 10, "beta"))
            _wait_for_queue(http, 3)
        finally:
            recorder.release.set()
        assert first.result(60) == 200
        assert [call.result(60) for call in queued[::2]] == [200, 200]
        queued[1].result(60)
    # alpha's lane holds its HTTP call (2) and then its gRPC call (3), behind beta's new lane (10);
    # had the gRPC call a lane of its own, a new one, it would have run before beta's
    assert recorder.order == [1, 10, 2, 3]
