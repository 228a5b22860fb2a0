"""The v1 msgpack endpoint in-process: results, every error status, queueing, deadlines and faults."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from moegrad import DeviceFault
from moegrad_service.engine import ReferenceBackend
from moegrad_service.engine import pool as pool_module
from support.docexample import DOC_GRAD, DOC_IDX, example_document
from support.servicekit import grad_x_of, pack, post

F32_03 = np.float32(0.3).view(np.uint32)
F32_07 = np.float32(0.70000005).view(np.uint32)


def problem(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status and body["title"] and body["detail"]
    assert body["request_id"] == response.headers["x-request-id"]
    return body


def metric(client, name: str, **labels) -> float:
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return 0.0


def test_documentation_example_bits(client):
    response = post(client, example_document())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    grad_x = grad_x_of(response)
    assert grad_x.dtype == np.float32 and grad_x.shape == (2, 2)
    assert (grad_x.view(np.uint32) == np.array([[F32_03, F32_03], [F32_07, F32_07]])).all()
    reply = msgpack.unpackb(response.content)
    # the default profile, by its canonical name
    assert reply["backend"] == "reference" and reply["order"] == "ascend910b@9.1" and reply["device"] is None
    assert set(reply["timings_ms"]) == {"queue", "compute", "total"}


def test_x_msgpack_media_type_and_request_id_echo(client):
    response = post(client, example_document(), headers={"content-type": "application/x-msgpack", "x-request-id": "abc-123"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc-123"


def test_order_default_comes_from_settings(serve):
    rng = np.random.default_rng(7)
    grad = rng.standard_normal((12, 16)).astype(np.float32)
    idx = rng.permutation(12).astype(np.int32)
    document = example_document(grad_expanded_x={"dtype": "float32", "shape": [12, 16], "data": grad.tobytes()},
                                expanded_row_idx={"dtype": "int32", "shape": [12], "data": idx.tobytes()}, top_k=4)
    # Huawei's sequential golden, computed independently: float32 from +0.0, t = 0..K-1.
    rows = grad[idx].reshape(3, 4, 16)
    sequential = np.zeros((3, 16), np.float32)
    for t in range(4):
        sequential = sequential + rows[:, t]
    with serve(order="sequential") as client:
        response = post(client, document)
        assert msgpack.unpackb(response.content)["order"] == "sequential"
        assert (grad_x_of(response).view(np.uint32) == sequential.view(np.uint32)).all()
        named = post(client, {**document, "order": "ascend910b"})
        assert msgpack.unpackb(named.content)["order"] == "ascend910b@9.1"  # the alias, as the profile it means


@pytest.mark.parametrize(
    ("overrides", "status", "field"),
    [
        ({"grad_expanded_x": None}, 161001, "grad_expanded_x"),
        ({"expanded_row_idx": None}, 161001, "expanded_row_idx"),
        ({"grad_expanded_x": {"dtype": "int32", "shape": [4, 2], "data": bytes(32)}}, 161002, "grad_expanded_x"),
        ({"expanded_row_idx": {"dtype": "float32", "shape": [4], "data": bytes(16)}}, 161002, "expanded_row_idx"),
        ({"drop_pad_mode": 2}, 561103, "drop_pad_mode"),
        ({"top_k": 0}, 561103, "top_k"),
        ({"active_num": -1}, 561103, "active_num"),
        ({"top_k": "2"}, 561103, "top_k"),
        ({"drop_pad_mode": 1}, 561103, "grad_expanded_x"),
        ({"expanded_row_idx": {"dtype": "int32", "shape": [2, 2], "data": DOC_IDX.tobytes()}}, 561103, "expanded_row_idx"),
        ({"active_num": 3}, 561103, "grad_expanded_x"),
        ({"top_k": 3}, 561103, "expanded_row_idx"),
        ({"expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.array([2, 0, 1, 4], np.int32).tobytes()}},
         161002, "expanded_row_idx"),
        ({"expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.array([2, 0, 2, 3], np.int32).tobytes()}},
         161002, "expanded_row_idx"),
        ({"order": "ascend960"}, 161002, "order"),
        # the attribute/shape code before CANN 9.1 (561103 above is the default profile's, 9.1's)
        ({"top_k": 0, "order": "ascend910b@9.0"}, 561002, "top_k"),
        ({"active_num": 3, "order": "ascend950@8.5"}, 561002, "grad_expanded_x"),
    ],
)
def test_constraint_violations_are_422_with_aclnn_code(client, overrides, status, field):
    body = problem(post(client, example_document(**overrides)), 422)
    assert body["aclnn_status"] == status
    assert body["aclnn_name"] == {161001: "ACLNN_ERR_PARAM_NULLPTR", 161002: "ACLNN_ERR_PARAM_INVALID",
                                  561002: "ACLNN_ERR_INNER_TILING_ERROR", 561103: "ACLNN_ERR_INNER_NULLPTR"}[status]
    assert body["field"] == field
    assert metric(client, "moegrad_inference_request_failure_total", endpoint="/v1/moe_init_routing_v2_grad",
                  reason="invalid_argument") == 1


def test_duplicates_accepted_when_allowed(client):
    idx = np.array([2, 0, 2, 3], np.int32)
    document = example_document(expanded_row_idx={"dtype": "int32", "shape": [4], "data": idx.tobytes()},
                                allow_duplicate_indices=True)
    response = post(client, document)
    assert response.status_code == 200
    expected = np.stack([DOC_GRAD[2] + DOC_GRAD[0], DOC_GRAD[2] + DOC_GRAD[3]])
    assert (grad_x_of(response).view(np.uint32) == expected.view(np.uint32)).all()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"\xc1", None),  # never-used msgpack byte
        (b"\x92\x01\x02", None),  # an array, not a map
        (pack(example_document()) + b"\x00", None),  # trailing bytes
        (msgpack.packb({"top_k": msgpack.ExtType(5, b"x")}), None),
        (pack(example_document(grad_expanded_x={"dtype": "float32", "shape": [4, 2], "data": bytes(31)})), "grad_expanded_x"),
        (pack(example_document(grad_expanded_x={"dtype": "float99", "shape": [4, 2], "data": bytes(64)})), "grad_expanded_x"),
        (pack(example_document(expanded_row_idx={"dtype": "int32", "shape": [-4], "data": b""})), "expanded_row_idx"),
        (pack(example_document(extra=1)), "extra"),
    ],
)
def test_malformed_bodies_are_400_and_service_keeps_serving(client, body, field):
    assert problem(post(client, body), 400)["field"] == field
    assert post(client, example_document()).status_code == 200


@pytest.mark.parametrize(("field", "tensor"), [
    ("grad_expanded_x", {"dtype": "float64", "shape": [4, 2], "data": bytes(64)}),
    ("expanded_row_idx", {"dtype": "int64", "shape": [4], "data": bytes(32)}),
])
def test_a_dtype_the_operator_does_not_take_is_161002_as_on_every_path(client, field, tensor):
    """The documentation's supported dtypes are FLOAT16/BFLOAT16/FLOAT32 and INT32: another real
    dtype is ACLNN_ERR_PARAM_INVALID (161002), the answer v2 and the client give too."""
    body = problem(post(client, example_document(**{field: tensor})), 422)
    assert (body["field"], body["aclnn_status"], body["aclnn_name"]) == (field, 161002, "ACLNN_ERR_PARAM_INVALID")


def test_wrong_content_type_is_415(client):
    response = client.post("/v1/moe_init_routing_v2_grad", content=pack(example_document()),
                           headers={"content-type": "application/json"})
    problem(response, 415)
    problem(client.post("/v1/moe_init_routing_v2_grad", content=pack(example_document())), 415)


def test_body_over_limit_is_413_by_content_length_and_by_stream(serve):
    with serve(max_body_bytes=4096) as client:
        big = pack(example_document(grad_expanded_x={"dtype": "float32", "shape": [4, 2000], "data": bytes(32000)}))
        assert "limit of 4096" in problem(post(client, big), 413)["detail"]

        def chunks():  # no Content-Length: the body is counted while it is read
            for start in range(0, len(big), 1000):
                yield big[start:start + 1000]

        assert "grew past" in problem(post(client, chunks()), 413)["detail"]
        assert post(client, example_document()).status_code == 200


def test_tensor_over_element_cap_is_413(serve):
    with serve(max_elements=4) as client:
        body = problem(post(client, example_document()), 413)
        assert body["field"] == "grad_expanded_x"


@pytest.mark.parametrize(("tokens", "hidden"), [(0, 8), (3, 0), (0, 0)])
def test_empty_calls_return_empty_results(client, tokens, hidden):
    document = example_document(
        grad_expanded_x={"dtype": "bfloat16", "shape": [tokens * 2, hidden], "data": b""},
        expanded_row_idx={"dtype": "int32", "shape": [tokens * 2], "data": np.arange(tokens * 2, dtype=np.int32).tobytes()},
    )
    response = post(client, document)
    assert response.status_code == 200, response.text
    tensor = msgpack.unpackb(response.content)["grad_x"]
    assert tensor == {"dtype": "bfloat16", "shape": [tokens, hidden], "data": b""}


def test_bad_request_timeout_header_is_400(client):
    assert problem(post(client, example_document(), headers={"x-request-timeout": "soon"}), 400)["field"] == "X-Request-Timeout"
    assert problem(post(client, example_document(), headers={"x-request-timeout": "-1"}), 400)["field"] == "X-Request-Timeout"


def test_health_info_and_routing_errors(client):
    assert client.get("/health/live").json() == {"status": "live"}
    assert client.get("/health/ready").json()["status"] == "ready"
    info = client.get("/v1/info").json()
    assert info["backend"] == "reference" and info["streams"] == 2 and info["max_queue"] == 64
    problem(client.get("/nowhere"), 404)
    problem(client.get("/v1/moe_init_routing_v2_grad"), 405)


def test_ready_is_503_when_backend_unhealthy(serve):
    class Sick(ReferenceBackend):
        def check_health(self) -> None:
            raise DeviceFault("HBM query failed")

    with serve(backend=Sick()) as client:
        assert client.get("/health/live").status_code == 200
        body = problem(client.get("/health/ready"), 503)
        assert "HBM query failed" in body["detail"]


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_full_queue_is_503_with_retry_after(serve, gate, gated_backend):
    with serve(backend=gated_backend, streams=1, express_max_adds=0, max_queue=1, retry_after_s=2) as client, ThreadPoolExecutor(2) as ex:
        first = ex.submit(post, client, example_document())
        assert gate.started.acquire(timeout=10)  # running, blocked in the backend
        second = ex.submit(post, client, example_document())
        wait_until(lambda: metric(client, "moegrad_inference_pending_request_count") == 1)
        busy = post(client, example_document())
        assert problem(busy, 503)["detail"].startswith("the queue is full")
        assert busy.headers["retry-after"] == "2"
        gate.release.set()
        assert first.result(10).status_code == 200 and second.result(10).status_code == 200
        path = "/v1/moe_init_routing_v2_grad"
        assert metric(client, "moegrad_inference_request_failure_total", endpoint=path, reason="busy") == 1
        assert metric(client, "moegrad_inference_request_success_total", endpoint=path) == 2


def test_deadline_passed_while_queued_is_504_and_never_runs(serve, gate, gated_backend):
    with serve(backend=gated_backend, streams=1, express_max_adds=0) as client, ThreadPoolExecutor(1) as ex:
        first = ex.submit(post, client, example_document())
        assert gate.started.acquire(timeout=10)
        late = post(client, example_document(), headers={"x-request-timeout": "0.2"})
        assert "not run" in problem(late, 504)["detail"]
        gate.release.set()
        assert first.result(10).status_code == 200
        assert post(client, example_document()).status_code == 200
        assert gate.calls == 2  # the first and the last; the late one never reached the backend


def test_hung_backend_is_504_and_pool_regains_capacity(serve, gate, gated_backend, monkeypatch):
    monkeypatch.setattr(pool_module, "ABANDON_GRACE_S", 0.1)
    with serve(backend=gated_backend, streams=1, express_max_adds=0) as client:
        hung = post(client, example_document(), headers={"x-request-timeout": "0.3"})
        assert "while the call was running" in problem(hung, 504)["detail"]
        gate.release.set()  # let later calls through; the hung worker was already written off
        response = post(client, example_document(), headers={"x-request-timeout": "10"})
        assert response.status_code == 200
        assert (grad_x_of(response).view(np.uint32) == np.array([[F32_03, F32_03], [F32_07, F32_07]])).all()


def test_backend_exception_is_500_with_its_text_then_next_call_succeeds(serve, gate, gated_backend):
    gate.error = RuntimeError("injected launch failure")
    with serve(backend=gated_backend) as client:
        body = problem(post(client, example_document()), 500)
        assert "injected launch failure" in body["detail"] and body["title"] == "Device fault"
        gate.error = None
        gate.release.set()
        assert post(client, example_document()).status_code == 200


def test_each_answered_call_is_timed_under_its_endpoint(client):
    """moegrad_inference_request_duration_seconds: one observation per call answered with a result,
    labelled with its route, no longer than the client saw the call take; failures are not timed."""
    import json

    v2_body = json.dumps({"parameters": {"top_k": 2}, "inputs": [
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "data": DOC_GRAD.ravel().tolist()},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": DOC_IDX.tolist()}]}).encode()
    expected = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], np.float32)
    candidate = {"dtype": "float32", "shape": [2, 2], "data": expected.tobytes()}
    calls = {
        "/v1/moe_init_routing_v2_grad": lambda: post(client, example_document()),
        "/v1/moe_init_routing_v2_grad/compare": lambda: client.post(
            "/v1/moe_init_routing_v2_grad/compare", content=pack(example_document(candidate=candidate)),
            headers={"content-type": "application/msgpack"}),
        "/v2/models/{model_name}/infer": lambda: client.post("/v2/models/moe_init_routing_v2_grad/infer",
                                                             content=v2_body),
    }
    for endpoint, call in calls.items():
        started = time.perf_counter()
        assert call().status_code == 200
        seen_s = time.perf_counter() - started
        count = metric(client, "moegrad_inference_request_duration_seconds_count", endpoint=endpoint)
        total = metric(client, "moegrad_inference_request_duration_seconds_sum", endpoint=endpoint)
        assert count == 1, endpoint
        assert 0 < total <= seen_s, endpoint
    problem(post(client, example_document(top_k=0)), 422)
    assert metric(client, "moegrad_inference_request_duration_seconds_count",
                  endpoint="/v1/moe_init_routing_v2_grad") == 1


@pytest.mark.parametrize(("declared", "refusal"), [
    ("9" * 5000, "PayloadTooLarge"),
    ("1" + "0" * 18, "PayloadTooLarge"),
    ("0" * 5000 + "5", "MalformedRequest"),  # 5 bytes promised (leading zeros), none sent
])
def test_a_content_length_of_thousands_of_digits_is_refused_not_an_error(declared, refusal):
    """Content-Length is compared with the limit before any byte is read; thousands of digits
    (past int()'s 4300-digit cap) are a client's mistake, never an internal error. uvicorn refuses
    such a header itself, so the intake is called directly, as another ASGI server would reach it."""
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    import moegrad
    from moegrad_service.api.intake import Intake
    from moegrad_service.memory import Memory
    from moegrad_service.settings import Settings

    admitting = SimpleNamespace(admit=Memory(1 << 30).admit)  # the app's, less the pool
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", b"application/msgpack"), (b"content-length", declared.encode())],
             "state": {"dataplane": admitting, "settings": Settings(backend="reference")}}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def read():
        with Intake(Request(scope, receive)) as intake:
            return await intake.read(limit=1 << 20)

    with pytest.raises(getattr(moegrad, refusal)) as caught:
        asyncio.run(read())
    assert type(caught.value).__name__ == refusal
    assert len(str(caught.value)) < 200  # the digits are not echoed whole
