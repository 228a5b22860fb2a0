"""Client.compare and AsyncClient.compare against httpx.MockTransport: the request, the typed result,
local validation before any I/O, error mapping and retries.

The fake service decodes the request with msgpack and NumPy directly, computes gradX with a plain
float32 loop (K = 2: one add, the same in every order) and judges the candidate with
``moegrad.compare_arrays`` (the accuracy module, tested on its own in test_accuracy.py). What is
asserted is what the client does with the answer: the report it rebuilds must be the document the
fake sent, field for field; expected gradX bits come from the operator documentation's example.
"""

from __future__ import annotations

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
    CompareResult,
    ComparisonReport,
    DeviceBusy,
    InvalidArgument,
    MalformedRequest,
    MoeInitRoutingV2GradCall,
    ServiceError,
)
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS
from support.oracle import device_k2, oracle_call, oracle_candidate

BASE = "http://moegrad.test"
COMPARE_URL = BASE + "/v1/moe_init_routing_v2_grad/compare"

# The operator documentation's example: gradX = [[0.3, 0.3], [0.7, 0.7]]; float32 0.2+0.1 = 0.3,
# 0.4+0.3 = 0.70000005 (bits 0x3E99999A, 0x3F333334).
EXAMPLE = EXAMPLE_BITS.view(np.float32)
NULLPTR, INVALID, SHAPE = 161001, 161002, 561103  # documentation, "Return Value" (CANN 9.1: the default profile)

WIRE = {"float16": np.dtype("<f2"), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype("<f4"),
        "int32": np.dtype("<i4")}


def tensor_from(obj: dict) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=WIRE[obj["dtype"]]).reshape(obj["shape"])


def tensor_to(array: np.ndarray, name: str) -> dict:
    return {"dtype": name, "shape": list(array.shape), "data": array.tobytes()}


class FakeCompare:
    """A minimal compare endpoint: records each request document and the report it answered."""

    def __init__(self, **reply_overrides):
        self.documents: list[dict] = []
        self.reports: list[dict] = []
        self.reply_overrides = reply_overrides

    def __call__(self, request: httpx.Request) -> httpx.Response:
        doc = msgpack.unpackb(request.content, raw=False)
        self.documents.append(doc)
        x, idx, k = tensor_from(doc["grad_expanded_x"]), tensor_from(doc["expanded_row_idx"]), doc["top_k"]
        name = doc["grad_expanded_x"]["dtype"]
        rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
        device = np.zeros((idx.size // k, x.shape[-1]), dtype=np.float32)
        for i in range(device.shape[0]):
            for t in range(k):
                device[i] += rows[idx[i * k + t]]
        device = device.astype(WIRE[name])
        golden = np.zeros(device.shape)
        for i in range(device.shape[0]):
            for t in range(k):
                golden[i] += rows[idx[i * k + t]].astype(np.float64)
        report = moegrad.compare_arrays(tensor_from(doc["candidate"]), device, golden,
                                        standards=doc.get("standards")).to_dict()
        self.reports.append(report)
        reply = {"report": report, "backend": "fake", "order": doc.get("order", "server-default"), "device": "npu:3",
                 "timings_ms": {"queue": 0.5, "compute": 1.0, "golden": 2.0, "compare": 3.0, "total": 7.0}}
        if doc.get("return_grad_x"):
            reply["grad_x"] = tensor_to(device, name)
        reply.update(self.reply_overrides)
        return httpx.Response(200, content=msgpack.packb(reply, use_bin_type=True),
                              headers={"content-type": "application/msgpack",
                                       "x-request-id": request.headers.get("x-request-id", "")})


class Script:
    """Answers from a list of responses (the last one repeats), recording each request."""

    def __init__(self, *steps):
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        return step(request) if callable(step) else step


def problem(status: int, headers: dict | None = None, **fields) -> httpx.Response:
    body = {"type": "about:blank", "title": "t", "status": status, "detail": f"detail {status}", "field": None,
            "aclnn_status": None, "aclnn_name": None, "request_id": "r", **fields}
    return httpx.Response(status, content=json.dumps(body).encode(),
                          headers={"content-type": "application/problem+json", **(headers or {})})


def no_io(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request should be sent, got {request.method} {request.url}")


def info_only(request: httpx.Request) -> httpx.Response:
    """A server of profile ascend910b@9.1 that answers only GET /v1/info (a call sent fails the test)."""
    assert (request.method, request.url.path) == ("GET", "/v1/info"), f"the call was sent: {request.url}"
    return httpx.Response(200, json={"order": "ascend910b@9.1"})


def client(handler, **kwargs) -> Client:
    return Client(BASE, transport=httpx.MockTransport(handler), **kwargs)


# ---- the request and the result ------------------------------------------------------------------


def test_public_names_are_exported():
    assert "CompareResult" in moegrad.__all__ and CompareResult.__module__ == "moegrad.http._answers"
    assert "check_compare_arguments" in moegrad.__all__


def test_request_carries_the_call_and_the_candidate():
    fake = FakeCompare()
    with client(fake, token="s3cret") as c:
        result = c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)
    assert isinstance(result, CompareResult)
    (doc,) = fake.documents
    assert doc["candidate"] == {"dtype": "float32", "shape": [2, 2], "data": EXAMPLE_BITS.tobytes()}
    assert doc["grad_expanded_x"] == {"dtype": "float32", "shape": [4, 2], "data": EXAMPLE_X.tobytes()}
    assert doc["expanded_row_idx"] == {"dtype": "int32", "shape": [4], "data": EXAMPLE_IDX.tobytes()}
    assert (doc["top_k"], doc["drop_pad_mode"], doc["active_num"]) == (2, 0, 0)
    # not given: the server's defaults apply (all standards, its order, no grad_x)
    assert not {"standards", "order", "return_grad_x"} & set(doc)


def test_request_headers_and_url():
    rec = Script(FakeCompare())
    with client(rec, token="s3cret") as c:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)
    (request,) = rec.requests
    assert request.method == "POST" and str(request.url) == COMPARE_URL
    assert request.headers["content-type"] == request.headers["accept"] == "application/msgpack"
    assert request.headers["authorization"] == "Bearer s3cret"
    assert 0 < float(request.headers["x-request-timeout"]) <= 60.0
    assert request.headers["x-request-id"]


def test_options_are_sent_when_given():
    fake = FakeCompare()
    with client(fake) as c:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, standards=["threshold", "bitwise"], order="sequential",
                  return_grad_x=True)
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, standards="benchmark")
    first, second = fake.documents
    assert first["standards"] == ["bitwise", "threshold"]  # each once, in report order (docs/accuracy.md)
    assert first["order"] == "sequential" and first["return_grad_x"] is True
    assert second["standards"] == ["benchmark"]


def test_the_result_is_typed_and_rebuilt_from_the_reply():
    fake = FakeCompare()
    with client(fake) as c:
        result = c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)
    assert isinstance(result.report, ComparisonReport)
    assert result.report.to_dict() == fake.reports[0]  # every field as the server sent it
    assert result.report.verdict == "pass" and result.passed is True
    assert result.grad_x is None
    assert (result.backend, result.order, result.device) == ("fake", "server-default", "npu:3")
    assert result.timings_ms == {"queue": 0.5, "compute": 1.0, "golden": 2.0, "compare": 3.0, "total": 7.0}
    assert result.request_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.report = None


def test_a_failing_candidate_is_not_passed():
    candidate = EXAMPLE.copy()
    candidate[1, 0] = np.float32(0.7)  # 0x3F333333, one ULP below the device's 0.70000005
    fake = FakeCompare()
    with client(fake) as c:
        result = c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=candidate, standards=["bitwise"])
    assert result.passed is False and result.report.verdict == "fail"
    (bitwise,) = result.report.verdicts
    assert bitwise.standard == "bitwise" and bitwise.failures[0].value == 1.0
    worst = result.report.candidate_vs_device.worst
    assert (worst.row, worst.column) == (1, 0)
    assert worst.actual == float(np.float32(0.7)) and worst.expected == float(np.float32(0.70000005))


def test_return_grad_x_gives_the_device_result():
    with client(FakeCompare()) as c:
        result = c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, return_grad_x=True)
    assert result.grad_x.dtype == np.float32
    np.testing.assert_array_equal(result.grad_x.view(np.uint32), EXAMPLE_BITS)
    assert result.grad_x.flags.writeable and result.grad_x.flags.owndata


def test_bfloat16_call_with_a_float32_candidate():
    x = EXAMPLE_X.astype(ml_dtypes.bfloat16)
    wide = x.astype(np.float32)
    candidate = np.stack([wide[2] + wide[0], wide[1] + wide[3]])  # float32 sums, never rounded
    fake = FakeCompare()
    with client(fake) as c:
        result = c.compare(x, EXAMPLE_IDX, 2, candidate=candidate, return_grad_x=True)
    assert fake.documents[0]["candidate"]["dtype"] == "float32"
    assert (result.report.dtype, result.report.candidate_dtype) == ("bfloat16", "float32")
    assert result.grad_x.dtype == np.dtype(ml_dtypes.bfloat16)


# ---- local validation, before any I/O ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "aclnn", "field"),
    [
        ({"candidate": None}, NULLPTR, "candidate"),
        ({"candidate": EXAMPLE[:1]}, INVALID, "candidate"),
        ({"candidate": EXAMPLE.reshape(-1)}, INVALID, "candidate"),
        ({"candidate": EXAMPLE.astype(np.float16)}, INVALID, "candidate"),
        ({"candidate": EXAMPLE.astype(np.float64)}, INVALID, "candidate"),
        ({"candidate": EXAMPLE.tolist()}, INVALID, "candidate"),
        ({"candidate": EXAMPLE, "standards": ["bitwise", "exact"]}, INVALID, "standards"),
        ({"candidate": EXAMPLE, "standards": []}, INVALID, "standards"),
        ({"candidate": EXAMPLE, "top_k": 3}, SHAPE, "expanded_row_idx"),
        ({"candidate": EXAMPLE, "order": "ascend960"}, INVALID, "order"),
    ],
)
def test_bad_arguments_raise_before_the_comparison_is_sent(kwargs, aclnn, field):
    arguments = {"top_k": 2, **kwargs}
    with client(info_only) as c, pytest.raises(InvalidArgument) as caught:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, **arguments)
    assert (caught.value.aclnn_status, caught.value.field) == (aclnn, field)


def test_return_grad_x_must_be_a_bool():
    for validate in (True, False):
        with client(no_io, validate=validate) as c, pytest.raises(TypeError, match="return_grad_x"):
            c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, return_grad_x=1)


def test_candidate_is_required_by_the_signature():
    with client(no_io) as c, pytest.raises(TypeError):
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2)  # type: ignore[call-arg]


def test_without_validation_the_request_is_sent_as_given_and_the_server_answers():
    rec = Script(problem(422, field="standards", aclnn_status=INVALID, detail="unknown standard 'exact'"))
    with client(rec, validate=False) as c, pytest.raises(InvalidArgument) as caught:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE[:1], standards=["exact"])
    assert (caught.value.aclnn_status, caught.value.field) == (INVALID, "standards")
    doc = msgpack.unpackb(rec.requests[0].content, raw=False)
    assert doc["standards"] == ["exact"]
    assert doc["candidate"]["shape"] == [1, 2]


def test_without_validation_a_missing_candidate_is_left_out():
    rec = Script(problem(422, field="candidate", aclnn_status=NULLPTR))
    with client(rec, validate=False) as c, pytest.raises(InvalidArgument) as caught:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=None)
    assert caught.value.aclnn_status == NULLPTR
    assert "candidate" not in msgpack.unpackb(rec.requests[0].content, raw=False)


# ---- errors and retries --------------------------------------------------------------------------


def test_busy_is_retried_then_answered():
    rec = Script(problem(503, headers={"Retry-After": "0"}), FakeCompare())
    with client(rec) as c:
        assert c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE).passed
    assert len(rec.requests) == 2


def test_busy_past_the_retries_raises():
    rec = Script(problem(503, headers={"Retry-After": "0"}))
    with client(rec, retries=1) as c, pytest.raises(DeviceBusy):
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)
    assert len(rec.requests) == 2


def test_a_400_is_a_malformed_request():
    with client(Script(problem(400, field="candidate"))) as c, pytest.raises(MalformedRequest) as caught:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)
    assert caught.value.field == "candidate"


@pytest.mark.parametrize(
    "overrides",
    [
        {"report": None},
        {"report": {"dtype": "float32"}},
        {"report": "pass"},
        {"grad_x": {"dtype": "float32", "shape": [3, 2], "data": bytes(24)}},
        {"grad_x": {"dtype": "float32", "shape": [2, 2], "data": bytes(3)}},
    ],
)
def test_a_reply_that_is_not_a_comparison_is_a_service_error(overrides):
    with client(FakeCompare(**overrides)) as c, pytest.raises(ServiceError):
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, return_grad_x=True)


def test_a_report_about_another_shape_is_a_service_error():
    report = moegrad.compare_arrays(np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32), np.zeros((3, 2)))
    with client(FakeCompare(report=report.to_dict())) as c, pytest.raises(ServiceError, match=r"\[3, 2\]"):
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)


def test_a_newer_servers_extra_keys_are_ignored():
    fake = FakeCompare(added_later={"x": 1})
    with client(fake) as c:
        assert c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE).report.to_dict() == fake.reports[0]


def test_per_call_timeout():
    rec = Script(FakeCompare())
    with client(rec) as c:
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, timeout_s=5)
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, timeout_s=None)
    assert 0 < float(rec.requests[0].headers["x-request-timeout"]) <= 5.0
    assert "x-request-timeout" not in rec.requests[1].headers
    with client(no_io) as c, pytest.raises(ValueError):
        c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, timeout_s=-1)


# ---- AsyncClient: the same flow, awaited ---------------------------------------------------------


def async_client(handler, **kwargs) -> AsyncClient:
    return AsyncClient(BASE, transport=httpx.MockTransport(handler), **kwargs)


@pytest.mark.asyncio
async def test_async_compare():
    fake = FakeCompare()
    async with async_client(fake) as c:
        result = await c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, standards=["bitwise"],
                                 return_grad_x=True)
    assert result.report.to_dict() == fake.reports[0] and result.passed
    assert [v.standard for v in result.report.verdicts] == ["bitwise"]
    np.testing.assert_array_equal(result.grad_x.view(np.uint32), EXAMPLE_BITS)
    assert fake.documents[0]["standards"] == ["bitwise"]


def test_a_call_object_is_compared_as_moegrad_compare_takes_it():
    """``compare(call, candidate=...)`` sends what the arrays' form sends; a call with other call
    arguments besides is a TypeError that says how to pass it."""
    call = MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX, top_k=2)
    fake = FakeCompare()
    with client(fake) as c:
        by_call = c.compare(call, candidate=EXAMPLE, standards=["bitwise"])
        by_arrays = c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE, standards=["bitwise"])
        assert by_call.passed and by_arrays.passed
        assert fake.documents[0] == fake.documents[1]
        with pytest.raises(TypeError, match="takes a MoeInitRoutingV2GradCall alone"):
            c.compare(call, EXAMPLE, candidate=EXAMPLE)
        with pytest.raises(TypeError, match="takes a MoeInitRoutingV2GradCall alone"):
            c.compare(call, candidate=EXAMPLE, drop_pad_mode=1)


@pytest.mark.asyncio
async def test_async_compare_takes_a_call_object():
    call = MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX, top_k=2)
    fake = FakeCompare()
    async with async_client(fake) as c:
        result = await c.compare(call, candidate=EXAMPLE, standards=["bitwise"])
    assert result.passed and fake.documents[0]["top_k"] == 2


@pytest.mark.asyncio
async def test_async_validation_before_any_io():
    async with async_client(no_io) as c:
        with pytest.raises(InvalidArgument) as caught:
            await c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE[:1])
    assert (caught.value.aclnn_status, caught.value.field) == (INVALID, "candidate")


@pytest.mark.asyncio
async def test_async_busy_is_retried():
    rec = Script(problem(503, headers={"Retry-After": "0"}), FakeCompare())
    async with async_client(rec) as c:
        assert (await c.compare(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=EXAMPLE)).passed
    assert len(rec.requests) == 2


# ---- require_exact and compare_many ---------------------------------------------------------------


def example_fields() -> dict:
    return {"grad_expanded_x": EXAMPLE_X, "expanded_row_idx": EXAMPLE_IDX, "top_k": 2}


def test_require_exact_decides_the_verdict_on_the_client():
    call = oracle_call()
    device = device_k2(call)
    port = oracle_candidate("one_ulp_noise", device)  # a correct port (tests/support/oracle.py): tolerances pass
    fields = {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": 2}
    fake = FakeCompare()
    with client(fake) as c:
        # FakeCompare judges against |golden| (no summand magnitude): the accumulative bound fits it
        relaxed = c.compare(**fields, candidate=port, standards="accumulative")
        strict = c.compare(**fields, candidate=port, standards="accumulative", require_exact=True)
        exact = c.compare(**fields, candidate=device, standards="accumulative", require_exact=True)
    assert "require_exact" not in fake.documents[1]  # the server reports exactness either way
    differing = int(np.count_nonzero(port.view(np.uint32) != device.view(np.uint32)))
    assert relaxed.report.exact.mismatched == strict.report.exact.mismatched == differing > 0
    assert relaxed.passed and not strict.passed and strict.report.exact.required
    assert exact.passed and exact.report.exact.bit_exact
    with client(no_io) as c, pytest.raises(TypeError, match="require_exact"):
        c.compare(**example_fields(), candidate=EXAMPLE.copy(), require_exact="yes")


class FakeBatch:
    """A minimal batch endpoint: each item judged as FakeCompare judges one call, except the items
    whose position is in ``failing``, answered with a device fault's problem document."""

    def __init__(self, failing: set[int] = frozenset()):
        self.one = FakeCompare()
        self.failing = failing
        self.requests: list[list[dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":  # a sweep asks every replica's profile first
            return httpx.Response(200, json={"order": "ascend910b@9.1"})
        assert request.url.path.endswith("/batch"), request.url
        items = msgpack.unpackb(request.content, raw=False)
        self.requests.append(items)
        results = []
        for position, item in enumerate(items):
            assert item.pop("op") == "compare"
            if position in self.failing:
                results.append({"problem": {"status": 500, "title": "Device fault", "detail": "injected",
                                            "field": None, "aclnn_status": None, "aclnn_name": None}})
                continue
            answer = self.one(httpx.Request("POST", COMPARE_URL, content=msgpack.packb(item, use_bin_type=True)))
            results.append(msgpack.unpackb(answer.content, raw=False))
        return httpx.Response(200, content=msgpack.packb({"results": results, "timings_ms": {"total": 1.0}},
                                                          use_bin_type=True),
                              headers={"content-type": "application/msgpack"})


def test_compare_many_sends_the_cases_in_one_batch_and_never_stops():
    # "off" is 1 ULP from the example's exact answer in every element: require_exact fails it.
    cases = [("good", example_fields(), EXAMPLE.copy()),
             ("bad_shape", example_fields(), EXAMPLE[:1].copy()),  # refused locally: never sent
             ("server_failed", example_fields(), EXAMPLE.copy()),
             ("off", example_fields(), (EXAMPLE_BITS + np.uint32(1)).view(np.float32))]
    fake = FakeBatch(failing={1})  # the second item sent is "server_failed"
    seen, judged = [], []
    with client(fake, retries=0) as c:
        results = c.compare_many(cases, require_exact=True, on_result=seen.append, progress=False,
                                 on_judged=lambda result, fields, candidate: judged.append((result, fields, candidate)))
    assert [(r.name, r.status) for r in results] == [("good", "pass"), ("bad_shape", "invalid"),
                                                      ("server_failed", "error"), ("off", "fail")]
    assert seen == results
    # on_judged: every case judged (a refused one too), after on_result, with the very inputs given
    assert [result for result, _, _ in judged] == results
    assert all(fields is case[1] and candidate is case[2] for (_, fields, candidate), case in zip(judged, cases))
    assert len(fake.requests) == 1 and len(fake.requests[0]) == 3  # one request; the refused case not in it
    assert "161002" in results[1].error and "DeviceFault" in results[2].error
    context = results[0].report.context
    assert (context.server_url, context.backend, context.device, context.case) == (BASE, "fake", "npu:3", "good")
