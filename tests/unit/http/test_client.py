"""Client and AsyncClient against httpx.MockTransport: requests, error mapping, retries, timeouts.

The fake service below decodes the request with msgpack and NumPy directly and computes gradX with a
plain loop (sequential float32 adds, which equal the device order for K <= 2); expected values come
from the operator documentation's example, never from moegrad's own numerics or codec.
"""

from __future__ import annotations

import builtins
import dataclasses
import json

import httpx
import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    GradResult,
    InvalidArgument,
    MalformedRequest,
    MoeInitRoutingV2GradCall,
    PayloadTooLarge,
    ServiceError,
    TransportError,
    Unauthorized,
)
from moegrad.http._client import USE_CLIENT_DEFAULT
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS

BASE = "http://moegrad.test"
GRAD_URL = BASE + "/v1/moe_init_routing_v2_grad"

# The operator documentation's example: gradX = [[0.3, 0.3], [0.7, 0.7]]; float32 0.2+0.1 = 0.3,
# 0.4+0.3 = 0.70000005 (bits 0x3E99999A, 0x3F333334).

WIRE = {"float16": np.dtype("<f2"), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype("<f4"),
        "int32": np.dtype("<i4")}
TILING, NULLPTR, INVALID = 561002, 161001, 161002  # documentation, "Return Value"
SHAPE = 561103  # rules 3-6 on the default profile, ascend910b@9.1 (the CANN 9.1 documentation's code)


def tensor_from(obj: dict) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=WIRE[obj["dtype"]]).reshape(obj["shape"])


def tensor_to(array: np.ndarray, name: str) -> dict:
    return {"dtype": name, "shape": list(array.shape), "data": array.tobytes()}


def fake_grad(request: httpx.Request) -> httpx.Response:
    """A minimal service: sequential float32 sum per token (dropless), reply per the protocol."""
    doc = msgpack.unpackb(request.read(), raw=False)  # the client streams its body: read it as a transport does
    x, idx, k = tensor_from(doc["grad_expanded_x"]), tensor_from(doc["expanded_row_idx"]), doc["top_k"]
    name = doc["grad_expanded_x"]["dtype"]
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    out = np.zeros((idx.size // k, x.shape[-1]), dtype=np.float32)
    for i in range(out.shape[0]):
        for t in range(k):
            out[i] += rows[idx[i * k + t]]
    reply = {"grad_x": tensor_to(out.astype(WIRE[name]), name), "backend": "fake", "order": doc.get("order", "server-default"),
             "device": None, "timings_ms": {"queue": 0.5, "compute": 1.0, "total": 1.5}}
    return httpx.Response(200, content=msgpack.packb(reply, use_bin_type=True),
                          headers={"content-type": "application/msgpack",
                                   "x-request-id": request.headers.get("x-request-id", "")})


def problem(status: int, headers: dict | None = None, **fields) -> httpx.Response:
    body = {"type": "about:blank", "title": "t", "status": status, "detail": f"detail {status}", "field": None,
            "aclnn_status": None, "aclnn_name": None, "request_id": "r"}
    body.update(fields)
    return httpx.Response(status, content=json.dumps(body).encode(),
                          headers={"content-type": "application/problem+json", **(headers or {})})


class Recorder:
    """A MockTransport handler that answers from a script (responses, exceptions or callables) and records requests."""

    def __init__(self, *script):
        self.script = list(script)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        if callable(step):
            return step(request)
        return step


def no_io(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request should be sent, got {request.method} {request.url}")


def info_only(order: str):
    """A server that answers GET /v1/info with ``order`` (its profile) and fails the test on any call."""
    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/v1/info"), f"the call was sent: {request.url}"
        return httpx.Response(200, json={"order": order})
    return handler


def client(handler, **kwargs) -> Client:
    return Client(BASE, transport=httpx.MockTransport(handler), **kwargs)


def bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint32)


# ---- public surface ------------------------------------------------------------------------------


def test_public_names_are_exported():
    for name in ("AsyncClient", "Client", "GradResult"):
        assert name in moegrad.__all__
        modules = {"GradResult": "moegrad.http._answers", "AsyncClient": "moegrad.http._async_client"}
        assert getattr(moegrad, name).__module__ == modules.get(name, "moegrad.http._client")


# ---- requests ------------------------------------------------------------------------------------


def test_example_request_and_result():
    rec = Recorder(fake_grad)
    with client(rec, token="s3cret", headers={"X-Team": "acc"}) as c:
        grad_x = c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    assert grad_x.dtype == np.float32 and grad_x.shape == (2, 2)
    assert grad_x.flags.writeable and grad_x.flags.owndata
    (request,) = rec.requests
    assert request.method == "POST" and str(request.url) == GRAD_URL
    assert request.headers["content-type"] == "application/msgpack"
    assert request.headers["accept"] == "application/msgpack"
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.headers["x-team"] == "acc"
    assert request.headers["x-request-id"]
    assert 0 < float(request.headers["x-request-timeout"]) <= 60.0
    doc = msgpack.unpackb(request.content, raw=False)
    assert "order" not in doc  # None: the server's default order applies
    assert (doc["top_k"], doc["drop_pad_mode"], doc["active_num"]) == (2, 0, 0)
    assert doc["grad_expanded_x"] == {"dtype": "float32", "shape": [4, 2], "data": EXAMPLE_X.tobytes()}
    assert doc["expanded_row_idx"] == {"dtype": "int32", "shape": [4], "data": EXAMPLE_IDX.tobytes()}


def test_order_is_sent_when_given():
    rec = Recorder(fake_grad)
    with client(rec) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, order="sequential")
    assert msgpack.unpackb(rec.requests[0].content)["order"] == "sequential"


def test_run_returns_the_full_answer():
    rec = Recorder(fake_grad)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX, top_k=2)
    with client(rec) as c:
        result = c.run(call)
    assert isinstance(result, GradResult)
    np.testing.assert_array_equal(bits(result.grad_x), EXAMPLE_BITS)
    assert result.backend == "fake" and result.device is None
    assert result.order == "server-default"  # the call did not set an order, so none was sent
    assert result.timings_ms == {"queue": 0.5, "compute": 1.0, "total": 1.5}
    assert result.request_id == rec.requests[0].headers["x-request-id"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.backend = "x"


def test_base_url_path_prefix_is_kept():
    rec = Recorder(fake_grad)
    with Client(BASE + "/moe/", transport=httpx.MockTransport(rec)) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert str(rec.requests[0].url) == BASE + "/moe/v1/moe_init_routing_v2_grad"


def test_bfloat16_round_trip():
    x = EXAMPLE_X.astype(ml_dtypes.bfloat16)
    # independent: widen bf16 rows to float32, add, round once to bf16
    wide = x.astype(np.float32)
    expected = np.stack([wide[2] + wide[0], wide[1] + wide[3]]).astype(ml_dtypes.bfloat16)
    with client(Recorder(fake_grad)) as c:
        grad_x = c.moe_init_routing_v2_grad(x, EXAMPLE_IDX, 2)
    assert grad_x.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(grad_x.view(np.uint16), expected.view(np.uint16))


def test_big_endian_and_strided_inputs_travel_little_endian():
    rec = Recorder(fake_grad)
    x = np.asfortranarray(EXAMPLE_X.astype(">f4"))
    with client(rec) as c:
        grad_x = c.moe_init_routing_v2_grad(x, EXAMPLE_IDX.astype(">i4"), 2)
    np.testing.assert_array_equal(bits(grad_x.astype("<f4")), EXAMPLE_BITS)
    doc = msgpack.unpackb(rec.requests[0].content)
    assert doc["grad_expanded_x"]["data"] == EXAMPLE_X.tobytes()


def test_info_ready_live():
    info = {"version": "0.1.0", "backend": "reference", "device": None, "order": "ascend910b", "streams": 2}
    rec = Recorder(httpx.Response(200, json=info), httpx.Response(200, json={"status": "ready"}),
                   httpx.Response(200, json={"status": "live"}))
    with client(rec) as c:
        assert c.info() == {**info, "orders": {BASE: "ascend910b"}}  # each replica's profile
        assert c.ready() is True
        assert c.live() is True
    assert [(r.method, r.url.path) for r in rec.requests] == [
        ("GET", "/v1/info"), ("GET", "/health/ready"), ("GET", "/health/live")]
    assert rec.requests[0].headers["accept"] == "application/json"


def test_ready_is_false_when_busy_or_unreachable_and_never_retries():
    rec = Recorder(problem(503, headers={"Retry-After": "0"}))
    with client(rec) as c:
        assert c.ready() is False
    assert len(rec.requests) == 1
    rec = Recorder(httpx.ConnectError("refused"))
    with client(rec) as c:
        assert c.ready() is False
        assert c.live() is False
    assert len(rec.requests) == 2


def test_ready_raises_for_a_wrong_token():
    with client(Recorder(problem(401))) as c, pytest.raises(Unauthorized):
        c.ready()


def test_info_that_is_not_json_is_a_service_error():
    with client(Recorder(httpx.Response(200, text="<html>hi</html>"))) as c, pytest.raises(ServiceError):
        c.info()


# ---- status -> exception -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "kind", "attrs"),
    [
        (problem(400, field="top_k"), MalformedRequest, {"field": "top_k", "message": "detail 400"}),
        (problem(413, field="grad_expanded_x"), PayloadTooLarge, {"field": "grad_expanded_x"}),
        (problem(415), MalformedRequest, {"field": None}),
        (problem(422, field="expanded_row_idx", aclnn_status=INVALID, aclnn_name="ACLNN_ERR_PARAM_INVALID"),
         InvalidArgument, {"field": "expanded_row_idx", "aclnn_status": INVALID, "aclnn_name": "ACLNN_ERR_PARAM_INVALID"}),
        (problem(422, field="top_k", aclnn_status=TILING), InvalidArgument,
         {"field": "top_k", "aclnn_status": TILING, "aclnn_name": "ACLNN_ERR_INNER_TILING_ERROR"}),
        (problem(422, field="x"), MalformedRequest, {"field": "x"}),  # a 422 without an aclnn code
        (problem(401), Unauthorized, {"status_code": 401}),
        (problem(503, headers={"Retry-After": "7"}), DeviceBusy, {"retry_after_s": 7.0}),
        (problem(503), DeviceBusy, {"retry_after_s": 1.0}),
        (problem(504), DeadlineExceeded, {}),
        (problem(500, aclnn_status=361001, device_message="EZ9999 vector core exception"), DeviceFault,
         {"aclnn_status": 361001, "device_message": "EZ9999 vector core exception", "message": "detail 500"}),
        (problem(404), ServiceError, {"status_code": 404}),
        (problem(409), ServiceError, {"status_code": 409}),
        (httpx.Response(502, text="<html><body><h1>502 Bad Gateway</h1><hr>nginx</body></html>",
                        headers={"content-type": "text/html"}), ServiceError, {"status_code": 502, "problem": {}}),
        (httpx.Response(503, text="<html><title>upstream down</title></html>", headers={"Retry-After": "3"}),
         DeviceBusy, {"retry_after_s": 3.0}),
        (httpx.Response(500, content=b""), DeviceFault, {"aclnn_status": None, "device_message": None}),
    ],
)
def test_status_maps_to_exception(response, kind, attrs):
    rec = Recorder(response)
    with client(rec, retries=0) as c, pytest.raises(kind) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert type(info.value) is kind
    for name, value in attrs.items():
        assert getattr(info.value, name) == value, name
    assert str(response.status_code) in str(info.value) or "detail" in str(info.value)
    assert len(rec.requests) == 1


def test_problem_fields_are_kept_on_service_error():
    with client(Recorder(problem(418, detail="short and stout")), retries=0) as c:
        with pytest.raises(ServiceError) as info:
            c.info()
    assert info.value.status_code == 418
    assert info.value.problem["detail"] == "short and stout"
    assert info.value.message == "short and stout"


def test_html_error_body_gives_a_readable_message():
    html = "<html><head><style>p{}</style></head><body><h1>502 Bad Gateway</h1><p>nginx/1.25</p></body></html>"
    with client(Recorder(httpx.Response(502, text=html, headers={"content-type": "text/html"}))) as c:
        with pytest.raises(ServiceError) as info:
            c.info()
    message = str(info.value)
    assert "502" in message and "Bad Gateway" in message and "nginx/1.25" in message
    assert "<" not in message and "p{}" not in message


def test_invalid_argument_str_names_field_and_code():
    response = problem(422, detail="expanded_row_idx[3]=9 is outside [0, N*K)", field="expanded_row_idx",
                       aclnn_status=INVALID)
    with client(Recorder(response)) as c, pytest.raises(InvalidArgument) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert "expanded_row_idx" in str(info.value) and "161002" in str(info.value)


@pytest.mark.parametrize(
    "reply",
    [
        httpx.Response(200, text="<html>captive portal</html>"),
        httpx.Response(200, content=msgpack.packb({"backend": "x"})),  # no grad_x
        httpx.Response(200, content=msgpack.packb(  # grad_x of the wrong shape
            {"grad_x": tensor_to(np.zeros((3, 2), np.float32), "float32"), "backend": "x", "order": "o",
             "device": None, "timings_ms": {}})),
        httpx.Response(200, content=msgpack.packb(  # grad_x of the wrong dtype
            {"grad_x": tensor_to(np.zeros((2, 2), np.float16), "float16"), "backend": "x", "order": "o",
             "device": None, "timings_ms": {}})),
    ],
)
def test_a_broken_success_reply_is_a_service_error(reply):
    with client(Recorder(reply)) as c, pytest.raises(ServiceError) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert type(info.value) is ServiceError  # not MalformedRequest: the caller's request was fine


# ---- retries -------------------------------------------------------------------------------------


def test_retry_on_503_then_success_with_one_request_id():
    rec = Recorder(problem(503, headers={"Retry-After": "0"}), problem(503, headers={"Retry-After": "0"}), fake_grad)
    with client(rec, retries=3) as c:
        grad_x = c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    assert len(rec.requests) == 3
    assert len({r.headers["x-request-id"] for r in rec.requests}) == 1
    assert len({r.content for r in rec.requests}) == 1


def test_503_retries_are_bounded():
    rec = Recorder(problem(503, headers={"Retry-After": "0"}))
    with client(rec, retries=2) as c, pytest.raises(DeviceBusy):
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert len(rec.requests) == 3  # the first try and 2 retries


@pytest.mark.parametrize("status", [400, 401, 404, 413, 415, 422, 500, 502, 504])
def test_no_retry_on_other_errors(status):
    rec = Recorder(problem(status, aclnn_status=INVALID if status == 422 else None))
    with client(rec, retries=3) as c, pytest.raises(moegrad.MoegradError):
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert len(rec.requests) == 1


def test_connection_error_is_retried_then_succeeds():
    rec = Recorder(httpx.ConnectError("refused"), httpx.RemoteProtocolError("peer closed"), fake_grad)
    with client(rec, retries=2) as c:
        grad_x = c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    assert len(rec.requests) == 3


def test_connection_errors_exhaust_into_transport_error():
    rec = Recorder(httpx.ConnectError("refused"))
    with client(rec, retries=1) as c, pytest.raises(TransportError) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert len(rec.requests) == 2
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert info.value.status_code is None
    assert "moegrad.test" in str(info.value)


@pytest.mark.parametrize("exc", [httpx.ReadTimeout("slow"), httpx.WriteTimeout("slow"), httpx.PoolTimeout("slow")])
def test_httpx_timeout_is_deadline_exceeded_and_not_retried(exc):
    rec = Recorder(exc)
    with client(rec, retries=3) as c, pytest.raises(DeadlineExceeded) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert len(rec.requests) == 1
    assert not isinstance(info.value, builtins.TimeoutError)
    assert isinstance(info.value.__cause__, type(exc))


def test_moegrad_errors_do_not_shadow_builtin_timeout_error():
    assert not hasattr(moegrad, "TimeoutError")
    assert not issubclass(DeadlineExceeded, builtins.TimeoutError)


# The sans-I/O core: the retry decisions, driven by hand (no transport, no sleeping).


def drive_until_sleep(flow, first_response):
    request = next(flow)
    assert isinstance(request, httpx.Request)
    return flow.send(first_response)


def example_call():
    return MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX, top_k=2)


@pytest.mark.parametrize(("retry_after", "expected_s"), [("2", 2.0), ("0.5", 0.5), ("3600", 30.0)])
def test_core_honours_retry_after_with_a_cap(retry_after, expected_s):
    core = Client(BASE, transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    assert drive_until_sleep(flow, problem(503, headers={"Retry-After": retry_after})) == expected_s
    second = flow.send(None)
    assert isinstance(second, httpx.Request) and second.url == httpx.URL(GRAD_URL)
    reply = fake_grad(second)
    with pytest.raises(StopIteration) as stop:
        flow.send(reply)
    np.testing.assert_array_equal(bits(stop.value.value.grad_x), EXAMPLE_BITS)


def test_core_backs_off_on_connection_errors():
    core = Client(BASE, transport=httpx.MockTransport(no_io), timeout_s=None, retries=3)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    delays = [drive_until_sleep(flow, httpx.ConnectError("refused"))]
    for _ in range(2):
        assert isinstance(flow.send(None), httpx.Request)
        delays.append(flow.send(httpx.ConnectError("refused")))
    assert delays == sorted(delays) and delays[0] > 0 and delays[-1] <= 2.0
    assert isinstance(flow.send(None), httpx.Request)
    with pytest.raises(TransportError):
        flow.send(httpx.ConnectError("refused"))  # the 4th failure: retries exhausted


def test_core_never_waits_past_the_deadline():
    core = Client(BASE, transport=httpx.MockTransport(no_io), timeout_s=5.0, retries=3)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    next(flow)
    with pytest.raises(DeviceBusy) as info:  # Retry-After 10 s would end after the 5 s deadline
        flow.send(problem(503, headers={"Retry-After": "10"}))
    assert info.value.retry_after_s == 10.0


def test_retry_after_as_http_date():
    date = "Wed, 21 Oct 2015 07:28:00 GMT"  # in the past: retry now
    core = Client(BASE, transport=httpx.MockTransport(no_io), timeout_s=None)._core
    flow = core.grad_flow(example_call(), USE_CLIENT_DEFAULT)
    delay = drive_until_sleep(flow, problem(503, headers={"Retry-After": date}))
    assert 0 <= delay <= 0.05


# ---- local validation before I/O -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "code", "field"),
    [
        ({"grad_expanded_x": None}, NULLPTR, "grad_expanded_x"),
        ({"expanded_row_idx": None}, NULLPTR, "expanded_row_idx"),
        ({"grad_expanded_x": EXAMPLE_X.astype(np.float64)}, INVALID, "grad_expanded_x"),
        ({"expanded_row_idx": EXAMPLE_IDX.astype(np.int64)}, INVALID, "expanded_row_idx"),
        ({"drop_pad_mode": 2}, SHAPE, "drop_pad_mode"),
        ({"top_k": 0}, SHAPE, "top_k"),
        ({"active_num": -1}, SHAPE, "active_num"),
        ({"grad_expanded_x": EXAMPLE_X.reshape(4, 1, 2)}, SHAPE, "grad_expanded_x"),
        ({"grad_expanded_x": EXAMPLE_X[:3]}, SHAPE, "grad_expanded_x"),
        ({"active_num": 3}, SHAPE, "grad_expanded_x"),
        ({"top_k": 3, "grad_expanded_x": np.zeros((6, 2), np.float32),
          "expanded_row_idx": np.arange(6, dtype=np.int32)[::-1].copy()[:4]}, SHAPE, "grad_expanded_x"),
        ({"top_k": 3}, SHAPE, "expanded_row_idx"),
        ({"expanded_row_idx": np.array([2, 0, 1, 4], np.int32)}, INVALID, "expanded_row_idx"),
        ({"expanded_row_idx": np.array([2, 0, 2, 3], np.int32)}, INVALID, "expanded_row_idx"),
    ],
)
def test_local_validation_raises_before_the_call_is_sent(kwargs, code, field):
    # the call names no profile: it is checked by the server's (ascend910b@9.1 here, its /v1/info says)
    args = {"grad_expanded_x": EXAMPLE_X, "expanded_row_idx": EXAMPLE_IDX, "top_k": 2, **kwargs}
    with client(info_only("ascend910b@9.1")) as c, pytest.raises(InvalidArgument) as info:
        c.moe_init_routing_v2_grad(**args)
    assert (info.value.aclnn_status, info.value.field) == (code, field)


def test_duplicates_allowed_when_asked():
    idx = np.array([2, 0, 2, 3], np.int32)
    rec = Recorder(fake_grad)
    with client(rec) as c:
        grad_x = c.moe_init_routing_v2_grad(EXAMPLE_X, idx, 2, allow_duplicate_indices=True)
    assert msgpack.unpackb(rec.requests[0].content)["allow_duplicate_indices"] is True
    expected = np.stack([EXAMPLE_X[2] + EXAMPLE_X[0], EXAMPLE_X[2] + EXAMPLE_X[3]])
    np.testing.assert_array_equal(bits(grad_x), bits(expected))


def test_validate_false_sends_as_given():
    rec = Recorder(problem(422, field="top_k", aclnn_status=TILING))
    with client(rec, validate=False) as c, pytest.raises(InvalidArgument) as info:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 0)
    assert (info.value.aclnn_status, info.value.field) == (TILING, "top_k")
    doc = msgpack.unpackb(rec.requests[0].content)
    assert doc["top_k"] == 0


def test_validate_false_omits_a_missing_tensor():
    rec = Recorder(problem(422, field="grad_expanded_x", aclnn_status=NULLPTR))
    with client(rec, validate=False) as c, pytest.raises(InvalidArgument):
        c.moe_init_routing_v2_grad(None, EXAMPLE_IDX, 2)
    assert set(msgpack.unpackb(rec.requests[0].content)) == {
        "expanded_row_idx", "top_k", "drop_pad_mode", "active_num", "allow_duplicate_indices"}


def test_run_with_a_wire_document():
    document = {"grad_expanded_x": tensor_to(EXAMPLE_X, "float32"), "expanded_row_idx": tensor_to(EXAMPLE_IDX, "int32"),
                "top_k": 2, "drop_pad_mode": 0, "active_num": 0, "mystery": 1}
    with client(no_io) as c, pytest.raises(MalformedRequest) as info:  # checked locally first
        c.run(document)
    assert info.value.field == "mystery"
    rec = Recorder(problem(400, field="mystery"))
    with client(rec, validate=False) as c, pytest.raises(MalformedRequest):
        c.run(document)
    assert msgpack.unpackb(rec.requests[0].content, raw=False) == document  # sent exactly as given
    del document["mystery"]
    with client(Recorder(fake_grad)) as c:
        np.testing.assert_array_equal(bits(c.run(document).grad_x), EXAMPLE_BITS)


def test_run_rejects_other_types():
    with client(no_io) as c, pytest.raises(TypeError):
        c.run([EXAMPLE_X, EXAMPLE_IDX, 2])


# ---- timeouts ------------------------------------------------------------------------------------


def timeouts_of(request: httpx.Request) -> tuple[str | None, dict]:
    return request.headers.get("x-request-timeout"), request.extensions["timeout"]


def test_client_default_timeout_applies_when_not_passed():
    rec = Recorder(fake_grad)
    with client(rec, timeout_s=5.0, connect_timeout_s=1.0) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, timeout_s=USE_CLIENT_DEFAULT)
    for request in rec.requests:
        header, timeout = timeouts_of(request)
        assert 0 < float(header) <= 5.0
        assert 0 < timeout["read"] <= 5.0 and timeout["connect"] == 1.0


def test_per_call_timeout_overrides():
    rec = Recorder(fake_grad)
    with client(rec, timeout_s=5.0) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, timeout_s=0.75)
    header, timeout = timeouts_of(rec.requests[0])
    assert 0 < float(header) <= 0.75 and timeout["connect"] <= 0.75


def test_timeout_none_means_no_deadline():
    rec = Recorder(fake_grad)
    with client(rec, timeout_s=5.0, connect_timeout_s=2.0) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, timeout_s=None)
    with client(rec, timeout_s=None) as c:
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    for request in rec.requests:
        header, timeout = timeouts_of(request)
        assert header is None
        assert timeout["read"] is None and timeout["write"] is None
    assert timeouts_of(rec.requests[0])[1]["connect"] == 2.0


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                              ("5", TypeError), (True, TypeError)])
def test_bad_per_call_timeout_is_refused_before_io(value, error):
    with client(no_io) as c, pytest.raises(error):
        c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, timeout_s=value)


# ---- configuration misuse ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"base_url": 8000}, TypeError),
        ({"base_url": b"http://x"}, TypeError),
        ({"base_url": "ftp://x"}, ValueError),
        ({"base_url": "127.0.0.1:8000"}, ValueError),
        ({"base_url": "http://x/?q=1"}, ValueError),
        ({"retries": -1}, ValueError),
        ({"retries": 1.5}, TypeError),
        ({"retries": True}, TypeError),
        ({"timeout_s": 0}, ValueError),
        ({"timeout_s": "60"}, TypeError),
        ({"connect_timeout_s": -1}, ValueError),
        ({"token": 123}, TypeError),
        ({"token": ""}, ValueError),
        ({"token": "a\nb"}, ValueError),
        ({"verify": "/no/such/ca-bundle.pem"}, ValueError),
        ({"verify": 1}, TypeError),
        ({"validate": "yes"}, TypeError),
        ({"headers": [("a", "b")]}, TypeError),
        ({"transport": httpx.AsyncHTTPTransport()}, TypeError),
    ],
)
def test_misuse_is_refused_at_construction(kwargs, error):
    with pytest.raises(error):
        Client(**kwargs)


def test_configuration_is_keyword_only():
    with pytest.raises(TypeError):
        Client(BASE, 60.0)  # type: ignore[misc]


def test_repr_never_shows_the_token():
    with client(no_io, token="hunter2") as c:
        assert "hunter2" not in repr(c) and BASE in repr(c)


def test_verify_accepts_a_ca_bundle_path(tmp_path):
    import ssl

    ca = tmp_path / "empty-dir"
    ca.mkdir()
    Client(BASE, verify=ca).close()  # a CA directory: no file is read until a handshake
    Client(BASE, verify=ssl.create_default_context()).close()
    Client(BASE, verify=False).close()


# ---- AsyncClient ---------------------------------------------------------------------------------


def aclient(handler, **kwargs) -> AsyncClient:
    return AsyncClient(BASE, transport=httpx.MockTransport(handler), **kwargs)


@pytest.mark.asyncio
async def test_async_example_and_run():
    rec = Recorder(fake_grad)
    async with aclient(rec, token="t") as c:
        grad_x = await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2, order="ascend910b")
        result = await c.run(example_call())
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    np.testing.assert_array_equal(bits(result.grad_x), EXAMPLE_BITS)
    assert rec.requests[0].headers["authorization"] == "Bearer t"
    assert msgpack.unpackb(rec.requests[0].content)["order"] == "ascend910b@9.1"  # the alias, as its profile


@pytest.mark.asyncio
async def test_async_retries_503_then_succeeds():
    rec = Recorder(problem(503, headers={"Retry-After": "0"}), fake_grad)
    async with aclient(rec) as c:
        grad_x = await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    assert len(rec.requests) == 2


@pytest.mark.asyncio
async def test_async_connection_error_retry_and_mapping():
    rec = Recorder(httpx.ConnectError("refused"), fake_grad)
    async with aclient(rec) as c:
        await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert len(rec.requests) == 2
    async with aclient(Recorder(httpx.ReadTimeout("slow"))) as c:
        with pytest.raises(DeadlineExceeded):
            await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)


@pytest.mark.asyncio
async def test_async_error_mapping_and_local_validation():
    async with aclient(Recorder(problem(422, field="expanded_row_idx", aclnn_status=INVALID))) as c:
        with pytest.raises(InvalidArgument) as info:
            await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert (info.value.aclnn_status, info.value.field) == (INVALID, "expanded_row_idx")
    async with aclient(info_only("ascend910b@9.1")) as c:
        with pytest.raises(InvalidArgument) as info:
            await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 3)
    assert (info.value.aclnn_status, info.value.field) == (SHAPE, "expanded_row_idx")


@pytest.mark.asyncio
async def test_async_info_ready_live():
    rec = Recorder(httpx.Response(200, json={"version": "v"}), problem(503), httpx.Response(200, json={"status": "live"}))
    async with aclient(rec) as c:
        assert await c.info() == {"version": "v", "orders": {BASE: None}}  # a server that names no profile
        assert await c.ready() is False
        assert await c.live() is True


def test_async_transport_must_be_async():
    with pytest.raises(TypeError):
        AsyncClient(BASE, transport=httpx.HTTPTransport())


class SliceRecorder(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """A transport that reads each request body slice by slice, as httpx's own transports do (not
    through request.read(), as MockTransport does), answering from ``answers`` in turn."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.slices: list[list[int]] = []
        self.bodies: list[bytes] = []

    def _answer(self, request: httpx.Request, parts: list) -> httpx.Response:
        self.slices.append([len(part) for part in parts])
        self.bodies.append(b"".join(bytes(part) for part in parts))
        assert request.headers["content-length"] == str(len(self.bodies[-1]))
        assert "transfer-encoding" not in request.headers
        answer = self.answers.pop(0)
        return answer(httpx.Request("POST", GRAD_URL, content=self.bodies[-1])) if callable(answer) else answer

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._answer(request, list(request.stream))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self._answer(request, [part async for part in request.stream])


def test_a_large_body_is_streamed_in_slices_with_its_length_and_resent_whole_on_retry():
    """The request body goes out in slices of at most 1 MiB with an explicit Content-Length (no
    chunked encoding), the slices add up to the msgpack of the call (packed here by msgpack itself),
    and a retried attempt sends all of it again."""
    rng = np.random.default_rng(3)
    grad = rng.standard_normal((2 * 65536, 16), dtype=np.float32)  # 8 MiB
    idx = rng.permutation(grad.shape[0]).astype(np.int32)
    want = msgpack.packb({"grad_expanded_x": tensor_to(grad, "float32"), "expanded_row_idx": tensor_to(idx, "int32"),
                          "top_k": 2, "drop_pad_mode": 0, "active_num": 0, "allow_duplicate_indices": False},
                         use_bin_type=True)
    rows = grad[idx].reshape(-1, 2, 16).sum(1, dtype=np.float32)
    reply = httpx.Response(200, content=msgpack.packb(
        {"grad_x": tensor_to(rows, "float32"), "backend": "x", "order": "ascend910b", "device": None, "timings_ms": {}}),
        headers={"content-type": "application/msgpack"})
    transport = SliceRecorder(problem(503, headers={"Retry-After": "0"}), reply)
    with Client(BASE, transport=transport, retries=1, wire="msgpack") as c:
        np.testing.assert_array_equal(c.moe_init_routing_v2_grad(grad, idx, 2), rows)
    assert transport.bodies == [want, want]
    for slices in transport.slices:
        assert len(slices) == -(-len(want) // (1 << 20)) and max(slices) == 1 << 20


@pytest.mark.asyncio
async def test_the_async_client_streams_the_same_body():
    transport = SliceRecorder(fake_grad)
    async with moegrad.AsyncClient(BASE, transport=transport, retries=0, token="s3cret",
                                   headers={"x-team": "acc"}) as c:
        grad_x = await c.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    assert msgpack.unpackb(transport.bodies[0])["grad_expanded_x"]["data"] == EXAMPLE_X.tobytes()
