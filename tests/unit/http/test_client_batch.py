"""Client.batch / AsyncClient.batch against a scripted server: the body sent, each answer mapped alone."""

from __future__ import annotations

import httpx
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import DeviceBusy, GradResult, InvalidArgument, MalformedRequest, ServiceError
from support.docexample import DOC_GRAD as GRAD
from support.docexample import DOC_IDX as IDX
from support.docexample import DOC_RESULT_BITS as BITS

BASE = "http://moegrad.test"
GOOD = {"grad_x": {"dtype": "float32", "shape": [2, 2], "data": BITS.tobytes()}, "backend": "reference",
        "order": "ascend910b", "device": None, "timings_ms": {"queue": 0.1, "compute": 0.1}}


def problem(status: int, **fields) -> dict:
    return {"problem": {"type": "about:blank", "title": "t", "status": status, "detail": f"detail {status}",
                        "field": None, "aclnn_status": None, "aclnn_name": None, **fields}}


class Scripted:
    """Answers each batch POST with the next scripted result list; records the bodies."""

    def __init__(self, *replies: list) -> None:
        self.replies = list(replies)
        self.bodies: list[list] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":  # asked for its profile
            return httpx.Response(200, json={"order": "ascend910b@9.1"})
        assert request.url.path == "/v1/moe_init_routing_v2_grad/batch"
        assert request.headers["content-type"] == "application/msgpack"
        self.bodies.append(msgpack.unpackb(request.content, raw=False))
        return httpx.Response(200, content=msgpack.packb({"results": self.replies.pop(0), "timings_ms": {}}),
                              headers={"content-type": "application/msgpack", "x-request-id": "r1"})


def call() -> moegrad.MoeInitRoutingV2GradCall:
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=GRAD, expanded_row_idx=IDX, top_k=2)


def check_answers(answers):
    assert isinstance(answers[0], GradResult) and (answers[0].grad_x.view(np.uint32) == BITS).all()
    assert answers[0].grad_x.flags.owndata and answers[0].grad_x.flags.writeable and answers[0].request_id == "r1"
    assert isinstance(answers[1], InvalidArgument) and answers[1].aclnn_status == 161002
    assert answers[1].field == "expanded_row_idx"
    assert isinstance(answers[2], DeviceBusy)
    assert isinstance(answers[3], MalformedRequest) and answers[3].field == "extra"
    assert isinstance(answers[4], ServiceError)  # a grad_x of the wrong shape for its call


REPLY = [GOOD, problem(422, aclnn_status=161002, aclnn_name="ACLNN_ERR_PARAM_INVALID", field="expanded_row_idx"),
         problem(503), problem(400, field="extra"),
         {**GOOD, "grad_x": {"dtype": "float32", "shape": [1, 2], "data": bytes(8)}}]


def test_the_batch_body_is_an_array_of_call_documents_and_each_answer_is_mapped_alone():
    server = Scripted(REPLY)
    with moegrad.Client(BASE, transport=httpx.MockTransport(server), retries=0) as client:
        answers = client.batch([call()] * 5)
    check_answers(answers)
    (body,) = server.bodies
    assert len(body) == 5
    assert body[0]["grad_expanded_x"] == {"dtype": "float32", "shape": [4, 2], "data": GRAD.tobytes()}
    assert body[0]["expanded_row_idx"]["data"] == IDX.tobytes() and body[0]["top_k"] == 2
    assert "order" not in body[0] and "op" not in body[0]


@pytest.mark.asyncio
async def test_the_async_client_batch_gives_the_same_answers():
    server = Scripted(REPLY)
    async with moegrad.AsyncClient(BASE, transport=httpx.MockTransport(server), retries=0) as client:
        answers = await client.batch([call()] * 5)
    check_answers(answers)


def test_a_locally_invalid_call_is_answered_without_being_sent_and_compares_carry_their_fields():
    server = Scripted([GOOD, {"report": None, "backend": "reference", "order": "ascend910b", "device": None}])
    bad = {"grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": GRAD.tobytes()},
           "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": IDX.tobytes()}, "top_k": 3}
    with moegrad.Client(BASE, transport=httpx.MockTransport(server), retries=0) as client:
        answers = client.batch([call(), bad, moegrad.BatchCompare(call(), candidate=BITS.view(np.float32),
                                                                  standards="bitwise"), {**bad, "extra": 1}])
    assert isinstance(answers[0], GradResult)
    assert isinstance(answers[1], InvalidArgument) and answers[1].aclnn_status == 561103  # the server's: CANN 9.1
    assert isinstance(answers[2], ServiceError)  # the scripted report is not a report
    assert isinstance(answers[3], MalformedRequest) and answers[3].field == "extra"
    (body,) = server.bodies
    assert len(body) == 2 and body[1]["op"] == "compare" and body[1]["standards"] == ["bitwise"]
    assert body[1]["candidate"]["data"] == BITS.tobytes()


def test_a_reply_with_the_wrong_number_of_results_is_a_service_error():
    server = Scripted([GOOD])
    with moegrad.Client(BASE, transport=httpx.MockTransport(server), retries=0) as client, \
            pytest.raises(ServiceError, match="1 results for a batch of 2"):
        client.batch([call(), call()])


def test_an_item_of_another_type_is_a_type_error_before_any_io():
    with moegrad.Client(BASE, transport=httpx.MockTransport(lambda r: pytest.fail("no I/O")), retries=0) as client, \
            pytest.raises(TypeError, match="batch item"):
        client.batch([call(), 42])


def test_a_wire_document_holding_arrays_says_how_to_send_them():
    grad = np.zeros((4, 2), np.float32)
    idx = np.arange(4, dtype=np.int32)
    with moegrad.Client("http://127.0.0.1:9", retries=0) as client:  # refused before anything is sent
        for send in (client.run, lambda item: client.batch([item])):
            with pytest.raises(TypeError, match=r"grad_expanded_x is an array: .*encode_tensor.*MoeInitRoutingV2GradCall"):
                send({"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": 2})
