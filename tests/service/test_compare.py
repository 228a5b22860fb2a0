"""``POST /v1/moe_init_routing_v2_grad/compare`` in-process: verdicts, validation before the backend, grad_x.

Requests are packed here by hand (msgpack and raw little-endian bytes, as docs/protocol.md
describes). Oracles: ``test_metrics_and_verdicts_match_an_independent_float64_computation`` takes
every expected figure and each standard's status from tests/support/oracle.py (float64 arithmetic and the
thresholds docs/accuracy.md lists), and bit mismatches are counted with NumPy here. The device
result is :func:`moegrad.moe_init_routing_v2_grad` (bit-exact emulation, tested against a slow loop
in tests/unit), Huawei's golden the same with ``order="sequential"``. Transport only:
``test_the_reply_carries_the_in_process_report_unchanged`` compares the reply with
:func:`moegrad.compare` of the same inputs (the function the server runs), so it proves the
serialisation, not the numbers. Codes, fields and statuses are the ones docs/protocol.md lists.
"""

from __future__ import annotations

import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from support import routing
from support.oracle import (
    ALL_STANDARDS,
    ORACLE_CASES,
    device_k2,
    figures,
    float32_statuses,
    golden_and_scale,
    oracle_call,
    oracle_candidate,
)
from support.servicekit import MSGPACK_HEADERS, pack

PATH = "/v1/moe_init_routing_v2_grad/compare"
MODES = ("dropless", "active", "drop_pad")
TOLERANCE = ("dual_thousandth", "threshold", "benchmark", "accumulative")
WIRE = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
        np.dtype(np.int32): "int32"}
NUMPY = {name: dtype for dtype, name in WIRE.items()}


def tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": WIRE[array.dtype], "shape": list(array.shape), "data": array.astype(array.dtype.newbyteorder("<")).tobytes()}


def from_tensor(obj: dict) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=NUMPY[obj["dtype"]]).reshape(obj["shape"])


def make_call(mode: str, dtype=np.float32, *, tokens: int = 24, top_k: int = 4, hidden: int = 32, seed: int = 0):
    """A routed call (tests/support/routing.py) with normally distributed gradients."""
    rng = np.random.default_rng(seed)
    r = routing.route(rng, tokens, top_k, 8, mode)
    grad = rng.standard_normal(r.grad_shape(hidden)).astype(dtype)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, **r.kwargs())


def document(call, candidate=None, **extra) -> dict:
    doc = {"grad_expanded_x": tensor(call.grad_expanded_x), "expanded_row_idx": tensor(call.expanded_row_idx),
           "top_k": call.top_k, "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}
    if candidate is not None:
        doc["candidate"] = tensor(candidate)
    doc.update(extra)
    return doc


def post(client, doc: dict | bytes, **kwargs):
    body = pack(doc) if isinstance(doc, dict) else doc
    return client.post(PATH, content=body, headers=MSGPACK_HEADERS, **kwargs)


def reply(response) -> dict:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    return msgpack.unpackb(response.content, raw=False)


def problem(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return response.json()


def statuses(report: dict) -> dict[str, str]:
    return {v["standard"]: v["status"] for v in report["verdicts"]}


def criterion(report: dict, standard: str, measure: str) -> dict:
    (verdict,) = [v for v in report["verdicts"] if v["standard"] == standard]
    (found,) = [c for c in verdict["criteria"] if c["measure"] == measure]
    return found


def metric(client, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


# ---- verdicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_reference_result_passes_every_standard(client, mode, dtype):
    """The thresholds leave room for the device's own rounding (the candidate is the server's own result)."""
    call = make_call(mode, dtype)
    device = moegrad.moe_init_routing_v2_grad(call)
    answer = reply(post(client, document(call, device)))
    report = answer["report"]
    assert statuses(report) == dict.fromkeys(moegrad.DEFAULT_STANDARDS, "pass")
    assert report["verdict"] == "pass" and report["exact"]["bit_exact"] is True
    assert report["shape"] == [call.num_tokens, call.hidden_size]
    assert report["dtype"] == report["candidate_dtype"] == WIRE[np.dtype(dtype)]
    assert report["candidate_vs_device"]["bitwise_equal_count"] == device.size
    assert (answer["backend"], answer["order"], answer["device"]) == ("reference", "ascend910b@9.1", None)
    assert set(answer["timings_ms"]) == {"queue", "compute", "golden", "compare", "total"}
    assert all(value >= 0 for value in answer["timings_ms"].values())
    assert "grad_x" not in answer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("top_k", [3, 8])
def test_huaweis_sequential_golden_passes_the_tolerances_and_is_not_bit_exact_in_float32(client, mode, top_k):
    call = make_call(mode, top_k=top_k, seed=top_k)
    device = moegrad.moe_init_routing_v2_grad(call)
    sequential = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    differing = int(np.count_nonzero(sequential.view(np.uint32) != device.view(np.uint32)))
    assert differing > 0  # docs/semantics.md section 3: the orders differ bitwise once K >= 3
    report = reply(post(client, document(call, sequential)))["report"]
    assert statuses(report) == dict.fromkeys(TOLERANCE, "pass")
    assert report["verdict"] == "pass"  # the verdict policy: exactness is stated apart ...
    assert report["exact"] == {"bit_exact": False, "mismatched": differing, "count": sequential.size,
                               "share": differing / sequential.size, "required": False}
    named = reply(post(client, document(call, sequential, standards=["bitwise"])))["report"]
    assert named["verdict"] == "fail"  # ... and decides when the bitwise standard is named
    assert criterion(named, "bitwise", "bitwise_mismatches")["value"] == differing
    assert report["candidate_vs_device"]["bitwise_equal_count"] == device.size - differing


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupted_row_fails_with_that_row_as_the_worst_element(client, mode):
    call = make_call(mode, seed=5)
    device = moegrad.moe_init_routing_v2_grad(call)
    candidate = device.copy()
    row = 9
    candidate[row] += np.float32(1.0)
    report = reply(post(client, document(call, candidate)))["report"]
    assert report["verdict"] == "fail"
    for standard in ("threshold", "benchmark", "accumulative"):
        assert statuses(report)[standard] == "fail", standard
    for comparison in ("candidate_vs_golden", "candidate_vs_device"):
        worst = report[comparison]["worst"]
        assert worst["row"] == row, comparison
        assert worst["actual"] == float(candidate[row, worst["column"]])
    assert report["candidate_vs_device"]["worst"]["expected"] == float(device[row, report["candidate_vs_device"]["worst"]["column"]])
    assert report["exact"]["mismatched"] == int(np.count_nonzero(candidate.view(np.uint32) != device.view(np.uint32)))


def test_the_call_order_picks_the_device_result(client):
    call = make_call("dropless", top_k=5)
    sequential = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    answer = reply(post(client, document(call, sequential, order="sequential", standards=["bitwise"])))
    assert answer["order"] == "sequential"
    assert statuses(answer["report"]) == {"bitwise": "pass"}


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_metrics_and_verdicts_match_an_independent_float64_computation(client, case):
    call = oracle_call()
    device = device_k2(call)
    candidate = oracle_candidate(case, device)
    golden, scale = golden_and_scale(call)
    report = reply(post(client, document(call, candidate, standards=ALL_STANDARDS)))["report"]
    assert statuses(report) == float32_statuses(candidate, device, golden, scale)
    for comparison, actual in (("candidate_vs_golden", candidate), ("device_vs_golden", device)):
        for name, value in figures(actual, golden, scale).items():
            assert report[comparison][name] == pytest.approx(value, rel=1e-9, abs=1e-300, nan_ok=True), (comparison, name)
    mismatches = int(np.count_nonzero(candidate.view(np.uint32) != device.view(np.uint32)))
    assert criterion(report, "bitwise", "bitwise_mismatches")["value"] == mismatches


def test_the_oracle_cases_cover_every_status_of_every_standard():
    # The cases above are worth as much as the spread of outcomes they force.
    call = oracle_call()
    device = device_k2(call)
    golden, scale = golden_and_scale(call)
    seen = {case: float32_statuses(oracle_candidate(case, device), device, golden, scale) for case in ORACLE_CASES}
    assert seen["device"] == dict.fromkeys(ALL_STANDARDS, "pass")
    assert seen["scaled_up"] == {"bitwise": "fail", "dual_thousandth": "warning", "threshold": "fail",
                                 "benchmark": "fail", "accumulative": "pass"}
    assert seen["one_gross_element"] == {"bitwise": "fail", "dual_thousandth": "fail", "threshold": "fail",
                                         "benchmark": "fail", "accumulative": "fail"}
    assert seen["one_ulp_noise"] == {**dict.fromkeys(ALL_STANDARDS, "pass"), "bitwise": "fail"}  # a correct port


def test_the_reply_carries_the_in_process_report_unchanged(client):
    """Transport only: the server runs moegrad.compare, so this proves the serialisation, not the numbers."""
    call = make_call("drop_pad", ml_dtypes.bfloat16, seed=3)
    candidate = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    answer = reply(post(client, document(call, candidate)))
    assert answer["report"] == moegrad.compare(call, candidate).to_dict()


def test_a_float32_candidate_for_a_bfloat16_call(client):
    call = make_call("active", ml_dtypes.bfloat16)
    wide = call.model_copy(update={"grad_expanded_x": call.grad_expanded_x.astype(np.float32)})
    candidate = moegrad.moe_init_routing_v2_grad(wide)  # float32 sums, never rounded to bfloat16
    report = reply(post(client, document(call, candidate)))["report"]
    assert (report["dtype"], report["candidate_dtype"]) == ("bfloat16", "float32")
    assert report["exact"]["bit_exact"] is False


def test_standards_choose_the_verdicts_in_report_order(client):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    report = reply(post(client, document(call, device, standards=["threshold", "bitwise", "threshold"])))["report"]
    assert [v["standard"] for v in report["verdicts"]] == ["bitwise", "threshold"]


def test_return_grad_x_gives_the_device_result(client):
    call = make_call("drop_pad", np.float16, seed=2)
    device = moegrad.moe_init_routing_v2_grad(call)
    answer = reply(post(client, document(call, device, return_grad_x=True)))
    grad_x = from_tensor(answer["grad_x"])
    assert grad_x.dtype == np.float16 and grad_x.shape == device.shape
    np.testing.assert_array_equal(grad_x.view(np.uint16), device.view(np.uint16))
    assert "grad_x" not in reply(post(client, document(call, device, return_grad_x=False)))


def test_an_empty_call_is_answered(client):
    grad = np.zeros((0, 8), np.float32)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.zeros(0, np.int32), top_k=2)
    answer = reply(post(client, document(call, np.zeros((0, 8), np.float32), return_grad_x=True)))
    assert answer["report"]["shape"] == [0, 8]
    assert answer["report"]["verdict"] == "pass"
    assert answer["grad_x"] == {"dtype": "float32", "shape": [0, 8], "data": b""}


def test_success_and_failure_are_counted(client):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    assert post(client, document(call, device)).status_code == 200
    assert post(client, document(call, device[:-1])).status_code == 422
    assert metric(client, "moegrad_inference_request_success_total", endpoint=PATH) == 1
    assert metric(client, "moegrad_inference_request_failure_total", endpoint=PATH, reason="invalid_argument") == 1


# ---- validation, all before the backend runs -----------------------------------------------------


def _rejections():
    call = make_call("dropless", np.float16)
    good = moegrad.moe_init_routing_v2_grad(call)
    return call, [
        ("missing candidate", {}, 422, 161001, "candidate"),
        ("short candidate", {"candidate": tensor(good[:-1])}, 422, 161002, "candidate"),
        ("transposed candidate", {"candidate": tensor(np.ascontiguousarray(good.T))}, 422, 161002, "candidate"),
        ("1-D candidate", {"candidate": tensor(good.reshape(-1))}, 422, 161002, "candidate"),
        ("bfloat16 candidate for float16", {"candidate": tensor(good.astype(ml_dtypes.bfloat16))}, 422, 161002, "candidate"),
        ("int32 candidate", {"candidate": tensor(good.astype(np.int32))}, 422, 161002, "candidate"),
        ("unknown standard", {"candidate": tensor(good), "standards": ["bitwise", "exact"]}, 422, 161002, "standards"),
        ("no standard", {"candidate": tensor(good), "standards": []}, 422, 161002, "standards"),
        ("constraint", {"candidate": tensor(good), "top_k": 5}, 422, 561103, "expanded_row_idx"),  # CANN 9.1
        ("constraint before 9.1", {"candidate": tensor(good), "top_k": 5, "order": "ascend910b@8.5"}, 422, 561002,
         "expanded_row_idx"),
        ("broken candidate map", {"candidate": {"dtype": "float16", "shape": [1, 2], "data": bytes(3)}}, 400, None, "candidate"),
        ("float64 candidate", {"candidate": {"dtype": "float64", "shape": list(good.shape),
                                             "data": good.astype(np.float64).tobytes()}}, 422, 161002, "candidate"),
        ("standards not a list", {"candidate": tensor(good), "standards": "bitwise"}, 400, None, "standards"),
        ("standards not names", {"candidate": tensor(good), "standards": [1]}, 400, None, "standards"),
        ("return_grad_x not a bool", {"candidate": tensor(good), "return_grad_x": 1}, 400, None, "return_grad_x"),
        ("unknown key", {"candidate": tensor(good), "candidates": 1}, 400, None, "candidates"),
    ]


@pytest.mark.parametrize("case", range(len(_rejections()[1])), ids=[case[0] for case in _rejections()[1]])
def test_rejections_name_the_field_and_never_run_the_backend(serve, gate, gated_backend, case):
    call, cases = _rejections()
    _, overrides, status, aclnn, field = cases[case]
    gate.release.set()
    with serve(backend=gated_backend) as client:
        body = problem(post(client, {**document(call), **overrides}), status)
        assert body["field"] == field
        assert body["aclnn_status"] == aclnn
        if aclnn is not None:
            assert body["aclnn_name"] == {161001: "ACLNN_ERR_PARAM_NULLPTR", 161002: "ACLNN_ERR_PARAM_INVALID",
                                          561002: "ACLNN_ERR_INNER_TILING_ERROR",
                                          561103: "ACLNN_ERR_INNER_NULLPTR"}[aclnn]
        assert gate.calls == 0  # rejected before the device was asked for anything
        good = moegrad.moe_init_routing_v2_grad(call)
        assert post(client, document(call, good)).status_code == 200
        assert gate.calls == 1


def test_a_candidate_over_the_element_cap_is_413(serve):
    call = make_call("dropless", tokens=4, top_k=2, hidden=4)  # 32 grad elements, 16 candidate elements
    grad = call.grad_expanded_x
    with serve(max_elements=grad.size) as client:
        body = problem(post(client, document(call, np.zeros((call.num_tokens, grad.size), np.float32))), 413)
        assert body["field"] == "candidate"


def test_messages_say_what_is_wrong(client):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    detail = problem(post(client, document(call, device[:, :-1])), 422)["detail"]
    assert str(list(device.shape[:1]) + [device.shape[1] - 1]) in detail and str(list(device.shape)) in detail
    detail = problem(post(client, document(call, device, standards=["exact"])), 422)["detail"]
    assert "'exact'" in detail and all(name in detail for name in moegrad.STANDARDS)
    assert "candidate" in problem(post(client, document(call)), 422)["detail"]


def test_authentication_applies(serve):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    with serve(auth_tokens="s3cret") as client:
        assert post(client, document(call, device)).status_code == 401
        answer = client.post(PATH, content=pack(document(call, device)),
                             headers={**MSGPACK_HEADERS, "authorization": "Bearer s3cret"})
        assert reply(answer)["report"]["verdict"] == "pass"


def test_wrong_content_type_is_415(client):
    call = make_call("dropless")
    response = client.post(PATH, content=pack(document(call, moegrad.moe_init_routing_v2_grad(call))),
                           headers={"content-type": "application/json"})
    assert problem(response, 415)["status"] == 415


def test_an_empty_integer_call_is_valid_but_has_nothing_to_judge(client):
    """From CANN 9.1 phase one skips the dtype check of an empty tensor, so an empty int32 call is a
    valid grad call (200, an empty int32 grad_x); a comparison judges floating results only, so the
    same call sent to compare is the caller's mistake: 422, 161002, field grad_expanded_x; inside a
    batch it is that item's problem alone (its neighbours answered)."""
    empty = {"dtype": "int32", "shape": [0, 4], "data": b""}
    doc = {"grad_expanded_x": empty, "expanded_row_idx": {"dtype": "int32", "shape": [0], "data": b""}, "top_k": 2}
    grad = client.post("/v1/moe_init_routing_v2_grad", content=pack(doc), headers=MSGPACK_HEADERS)
    assert grad.status_code == 200
    assert msgpack.unpackb(grad.content, raw=False)["grad_x"]["shape"] == [0, 4]
    found = problem(post(client, {**doc, "candidate": empty}), 422)
    assert (found["aclnn_status"], found["field"]) == (161002, "grad_expanded_x")
    call = make_call("dropless")
    good = {**document(call, moegrad.moe_init_routing_v2_grad(call)), "op": "compare"}
    items = [good, {**doc, "candidate": empty, "op": "compare"}, good]
    response = client.post("/v1/moe_init_routing_v2_grad/batch", content=pack(items), headers=MSGPACK_HEADERS)
    results = reply(response)["results"]
    assert "report" in results[0] and "report" in results[2]
    assert (results[1]["problem"]["status"], results[1]["problem"]["aclnn_status"]) == (422, 161002)
