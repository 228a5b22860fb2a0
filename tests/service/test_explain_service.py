"""``POST /v1/moe_init_routing_v2_grad/explain`` in-process: msgpack and frames bodies, checks before
the backend runs, the reservation.

Bodies are packed here by hand (msgpack, and frames by ``support.servicekit.frames_body``, written
from docs/protocol.md). Transport only: the expected explanation is :func:`moegrad.explain` of the
same call and candidate against the server's result (the reference backend serves the emulation),
the function the server runs; the labels themselves are proven by tests/unit/accuracy/test_explain.py
(the planted-fault matrix of tests/support/planted.py). The rejections' status, field, aclnn code
and message are the ones ``moegrad.explain`` raises in-process for the same input.
"""

from __future__ import annotations

import threading

import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from support import planted
from support.inputs import BF16, F16, F32
from support.servicekit import FRAMES, MSGPACK_HEADERS, frames_body, gauge, pack

PATH = "/v1/moe_init_routing_v2_grad/explain"
WIRE = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
        np.dtype(np.int32): "int32", np.dtype(np.float64): "float64"}
# one case per label family (tests/support/planted.py): its mode, dtype, K, H and plant
CASES = [
    ("dropless", F32, 8, 7, "drop"),
    ("active", F16, 4, 7, "neighbour"),
    ("drop_pad", BF16, 3, 7, "extra_capacity"),
    ("dropless", BF16, 8, 256, "accumulate_f16"),
    ("dropless", F32, 16, 7, "sequential"),
    ("drop_pad", F32, 4, 7, "nan_input"),
    ("dropless", F32, 2, 1, "duplicate"),
]


def tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": WIRE[array.dtype], "shape": list(array.shape),
            "data": array.astype(array.dtype.newbyteorder("<")).tobytes()}


def document(call: moegrad.MoeInitRoutingV2GradCall, candidate=None, **extra) -> dict:
    doc = {"grad_expanded_x": tensor(call.grad_expanded_x), "expanded_row_idx": tensor(call.expanded_row_idx),
           "top_k": call.top_k, "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}
    if candidate is not None:
        doc["candidate"] = tensor(candidate)
    return {**doc, **extra}


def post(client, doc: dict, *, frames: bool = False):
    if frames:
        return client.post(PATH, content=frames_body(doc), headers={"content-type": FRAMES})
    return client.post(PATH, content=pack(doc), headers=MSGPACK_HEADERS)


def planted_case(entry) -> tuple[moegrad.MoeInitRoutingV2GradCall, np.ndarray]:
    case = planted.build(*entry, "ascend910b@9.1")
    assert case is not None
    return moegrad.MoeInitRoutingV2GradCall(**case.kwargs()), case.candidate


@pytest.mark.parametrize("frames", [False, True], ids=["msgpack", "frames"])
@pytest.mark.parametrize("entry", CASES, ids=[entry[4] for entry in CASES])
def test_the_reply_is_the_in_process_explanation(client, entry, frames):
    call, candidate = planted_case(entry)
    response = post(client, document(call, candidate), frames=frames)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    reply = msgpack.unpackb(response.content, raw=False)
    assert reply["explanation"] == moegrad.explain(call, candidate).to_dict()
    assert reply["explanation"]["differing_rows"] > 0
    assert (reply["backend"], reply["order"], reply["device"]) == ("reference", "ascend910b@9.1", None)
    assert set(reply["timings_ms"]) == {"queue", "compute", "explain", "total"}
    assert all(value >= 0 for value in reply["timings_ms"].values())


def test_the_device_result_itself_has_nothing_to_explain(client):
    call, _ = planted_case(CASES[0])
    reply = msgpack.unpackb(post(client, document(call, moegrad.moe_init_routing_v2_grad(call))).content)
    assert reply["explanation"]["rows"] == [] and reply["explanation"]["differing_rows"] == 0
    assert set(reply["explanation"]["labels"].values()) == {0}


def test_the_named_profile_picks_the_device_result(client):
    """A call naming ascend950@9.1 is explained against that profile's result (docs/protocol.md)."""
    call, candidate = planted_case(("dropless", F32, 8, 7, "sequential"))
    named = call.model_copy(update={"order": "ascend950@9.1"})
    reply = msgpack.unpackb(post(client, document(call, candidate, order="ascend950@9.1")).content)
    assert reply["order"] == "ascend950@9.1"
    assert reply["explanation"] == moegrad.explain(named, candidate).to_dict()


def _rejections():
    call, candidate = planted_case(("dropless", F16, 4, 7, "drop"))
    return call, candidate, [
        ("missing candidate", {}, None, 422),
        ("short candidate", {"candidate": tensor(candidate[:-1])}, candidate[:-1], 422),
        ("float32 candidate of a float16 call", {"candidate": tensor(candidate.astype(np.float32))},
         candidate.astype(np.float32), 422),
        ("1-D candidate", {"candidate": tensor(candidate.reshape(-1))}, candidate.reshape(-1), 422),
        ("constraint", {"candidate": tensor(candidate), "top_k": 5}, None, 422),
        ("unknown profile", {"candidate": tensor(candidate), "order": "ascend999"}, None, 422),
    ]


@pytest.mark.parametrize("case", range(len(_rejections()[2])), ids=[case[0] for case in _rejections()[2]])
def test_rejections_are_the_in_process_ones_and_never_run_the_backend(serve, gate, gated_backend, case):
    call, candidate, cases = _rejections()
    name, overrides, given, status = cases[case]
    fields = {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k}
    with pytest.raises(moegrad.InvalidArgument) as raised:  # the same input, in-process
        if name in ("constraint", "unknown profile"):
            moegrad.MoeInitRoutingV2GradCall(**{**fields, **{k: v for k, v in overrides.items() if k != "candidate"}})
        else:
            moegrad.explain(call, given)
    gate.release.set()
    with serve(backend=gated_backend) as client:
        response = post(client, {**document(call), **overrides})
        assert response.status_code == status, response.text
        body = response.json()
        assert (body["field"], body["aclnn_status"], body["detail"]) == (
            raised.value.field, raised.value.aclnn_status, raised.value.message)
        assert gate.calls == 0  # refused before the device was asked for anything
        assert post(client, document(call, candidate)).status_code == 200
        assert gate.calls == 1


def test_a_broken_candidate_map_and_an_unknown_key_are_400(client):
    call, candidate = planted_case(CASES[0])
    broken = post(client, {**document(call), "candidate": {"dtype": "float32", "shape": [1, 2], "data": bytes(3)}})
    assert broken.status_code == 400 and broken.json()["field"] == "candidate"
    unknown = post(client, document(call, candidate, standards=["bitwise"]))
    assert unknown.status_code == 400 and unknown.json()["field"] == "standards"


def test_the_explanation_is_reserved_beside_the_body(serve, gate, gated_backend):
    """While the call runs, the request holds its body twice (body and grad_x) and what explain may
    allocate beyond them (moegrad.explain_peak_bytes with the device's result given, and the reply)."""
    call, candidate = planted_case(("dropless", F32, 8, 256, "sequential"))
    body = pack(document(call, candidate))
    answers: list = []
    with serve(backend=gated_backend) as client:
        sender = threading.Thread(target=lambda: answers.append(
            client.post(PATH, content=body, headers=MSGPACK_HEADERS)))
        sender.start()
        assert gate.started.acquire(timeout=30)
        held = gauge(client, "moegrad_inflight_bytes")
        gate.release.set()
        sender.join(60)
        assert answers and answers[0].status_code == 200
        assert held == 2 * len(body) + moegrad.explain_peak_bytes(call, device_result=True, reply=True)
        assert gauge(client, "moegrad_inflight_bytes") == 0  # all given back once answered


def test_an_explanation_over_the_budget_is_413_and_a_compare_of_it_is_not(serve):
    """A budget that holds the body twice but not the explanation beside it: explain is refused as
    too large (nothing runs), the comparison of the same body answered."""
    call, candidate = planted_case(CASES[0])
    need = moegrad.explain_peak_bytes(call, device_result=True, reply=True)
    with serve(max_inflight_bytes=need) as client:  # seven eighths of it for a large reservation
        refused = post(client, document(call, candidate))
        assert refused.status_code == 413, refused.text
        assert "max_inflight_bytes" in refused.json()["detail"]
        compared = client.post("/v1/moe_init_routing_v2_grad/compare", content=pack(document(call, candidate)),
                               headers=MSGPACK_HEADERS)
        assert compared.status_code == 200
        assert gauge(client, "moegrad_inflight_bytes") == 0


def test_success_is_counted(client):
    call, candidate = planted_case(CASES[0])
    assert post(client, document(call, candidate)).status_code == 200
    metrics = client.get("/metrics").text
    assert f'moegrad_inference_request_success_total{{endpoint="{PATH}"}} 1.0' in metrics.splitlines()
