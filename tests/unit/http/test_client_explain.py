"""Client.explain and AsyncClient.explain against httpx.MockTransport: the request, checks before any
I/O, the reply's bounds.

The fake service decodes the request with msgpack directly and answers an explanation document it
was given; what is asserted is what the client sends (the call's fields and the candidate, bytes
as given; frames when asked) and what it does with the answer (the explanation rebuilt field for
field, a reply over its bound refused). The bounds are checked against the largest explanation a
call can give: every row differing, each with the most an explanation lists (16 candidates, 8
elements, 8 NaN/Inf columns, every schedule name, a long summary).
"""

from __future__ import annotations

import asyncio
import struct

import httpx
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import AsyncClient, Client, Explanation, InvalidArgument, ServiceError
from moegrad.accuracy import ElementTable, Evidence, Hypothesis, RowExplanation, SlotTable
from moegrad.http._reply_bounds import explain_reply_bytes  # what the client allows, per N and K
from moegrad.wire._limits import explain_reply_limits
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX

BASE = "http://moegrad.test"
EXPLAIN_URL = BASE + "/v1/moe_init_routing_v2_grad/explain"


def example_call() -> moegrad.MoeInitRoutingV2GradCall:
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX, top_k=2)


def widest_row(row: int, top_k: int) -> RowExplanation:
    """A row holding the most an explanation lists for it, every number at its widest encoding."""
    big, names = 2**31 - 1, tuple(moegrad.PROFILES)
    hypothesis = Hypothesis("replaced", big, big, max(names, key=len), True, -1.2345678901234567e-300)
    return RowExplanation(
        row=row, label="ambiguous", slot=None, source_row=None, profile=None,
        evidence=Evidence(summary="x" * 600, exact=False, schedules=names, accumulator="bfloat16",
                          residual_ratio=-1.2345678901234567e-300, outside_bound_columns=big,
                          nonfinite_columns=(big,) * 8, candidates=(hypothesis,) * 16, search_complete=False),
        slots=SlotTable(t=tuple(range(top_k)), index=(big,) * top_k, row=(big,) * top_k, skipped=(False,) * top_k,
                        expert=(big,) * top_k, capacity_row=(big,) * top_k),
        elements=ElementTable(differing=big, outside_bound=big, candidate_closer=big, device_closer=big,
                              column=(big,) * 8, candidate=(-1.2345678901234567e-300,) * 8, device=(np.nan,) * 8,
                              golden=(-np.inf,) * 8, bound=(1e300,) * 8, ulp_candidate_device=(1e300,) * 8,
                              ulp_candidate_golden=(1e300,) * 8, ulp_device_golden=(1e300,) * 8,
                              within_bound=(False,) * 8, closer=("candidate",) * 8),
    )  # fmt: skip


def widest(tokens: int, top_k: int, hidden: int) -> Explanation:
    rows = tuple(widest_row(i, top_k) for i in range(tokens))
    labels = {**dict.fromkeys(moegrad.accuracy.LABELS, 0), "ambiguous": tokens}
    return Explanation(dtype="bfloat16", shape=(tokens, hidden), profile=max(moegrad.PROFILES, key=len),
                       differing_rows=tokens, labels=labels, rows=rows, capacity=2**31 - 1)


def reply_body(explanation: Explanation) -> bytes:
    return msgpack.packb({"explanation": explanation.to_dict(), "backend": "reference", "order": "ascend910b@9.1",
                          "device": None, "timings_ms": {"queue": 0.1, "compute": 0.2, "explain": 3.0, "total": 4.0}},
                         use_bin_type=True)


class FakeExplain:
    """An explain endpoint that answers ``explanation`` (or ``body``) and records each request."""

    def __init__(self, explanation: Explanation | None = None, body: bytes | None = None):
        self.requests: list[httpx.Request] = []
        self.explanation, self.body = explanation, body

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"order": "ascend910b@9.1", "wire_formats": ["msgpack", "frames"]})
        assert str(request.url) == EXPLAIN_URL
        body = self.body if self.body is not None else reply_body(self.explanation)
        return httpx.Response(200, content=body, headers={"content-type": "application/msgpack"})


def sent_document(request: httpx.Request) -> dict:
    content = request.read()
    if request.headers["content-type"] == "application/vnd.moegrad.frames":
        (length,) = struct.unpack("<I", content[4:8])  # docs/protocol.md, "Frames": the header's length
        header = msgpack.unpackb(content[8:8 + length], raw=False)
        return {key: (bytes(content[value["offset"]:value["offset"] + value["nbytes"]])
                      if isinstance(value, dict) and "offset" in value else value) for key, value in header.items()}
    document = msgpack.unpackb(content, raw=False)
    return {key: value["data"] if isinstance(value, dict) and "data" in value else value
            for key, value in document.items()}


@pytest.mark.parametrize("wire", ["msgpack", "frames"])
def test_the_request_and_the_rebuilt_explanation(wire):
    answer = widest(2, 2, 2)
    fake = FakeExplain(answer)
    candidate = np.array([[0.25, 0.3], [0.7, 0.75]], np.float32)
    with Client(BASE, transport=httpx.MockTransport(fake), wire=wire) as client:
        result = client.explain(example_call(), candidate=candidate)
    assert result.explanation.to_dict() == answer.to_dict()  # NaN elements: compared in the dict form
    assert (result.backend, result.order, result.device) == ("reference", "ascend910b@9.1", None)
    assert result.timings_ms == {"queue": 0.1, "compute": 0.2, "explain": 3.0, "total": 4.0}
    (request,) = [r for r in fake.requests if r.url.path != "/v1/info"]
    document = sent_document(request)
    assert document["candidate"] == candidate.tobytes()
    assert document["grad_expanded_x"] == EXAMPLE_X.tobytes() and document["top_k"] == 2


def test_the_async_client_is_the_same():
    answer = widest(2, 2, 2)

    async def run():
        async with AsyncClient(BASE, transport=httpx.MockTransport(FakeExplain(answer))) as client:
            return await client.explain(EXAMPLE_X, EXAMPLE_IDX, 2, candidate=np.zeros((2, 2), np.float32))

    assert asyncio.run(run()).explanation.to_dict() == answer.to_dict()


@pytest.mark.parametrize("candidate, status", [
    (None, 161001),
    (np.zeros((2, 3), np.float32), 161002),
    (np.zeros((2, 2), np.float16), 161002),
])
def test_a_bad_candidate_is_refused_before_any_request(candidate, status):
    fake = FakeExplain(widest(2, 2, 2))
    with Client(BASE, transport=httpx.MockTransport(fake)) as client, pytest.raises(InvalidArgument) as raised:
        client.explain(example_call(), candidate=candidate)
    assert (raised.value.aclnn_status, raised.value.field) == (status, "candidate")
    assert fake.requests == []
    with pytest.raises(InvalidArgument) as in_process:  # the same refusal as the library's
        moegrad.explain(example_call(), candidate)
    assert str(in_process.value) == str(raised.value)


@pytest.mark.parametrize("tokens, top_k", [(1, 1), (3, 130), (64, 8)])
def test_the_widest_explanation_fits_the_replys_bounds(tokens, top_k):
    """The bound the client reads a reply within holds for the largest explanation of the call."""
    index = np.arange(tokens * top_k, dtype=np.int32)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=np.zeros((tokens * top_k, 4), np.float32),
                                            expanded_row_idx=index, top_k=top_k)
    body = reply_body(widest(tokens, top_k, 4))
    assert len(body) <= explain_reply_bytes(call)
    moegrad.decode_body(body, explain_reply_limits(tokens, top_k))  # raises when over a structure limit
    fake = FakeExplain(body=body)
    with Client(BASE, transport=httpx.MockTransport(fake)) as client:
        assert client.explain(call, candidate=np.zeros((tokens, 4), np.float32)).explanation.differing_rows == tokens


def test_a_reply_longer_than_the_call_can_produce_is_refused():
    fake = FakeExplain(body=reply_body(widest(200, 2, 2)))  # 200 rows for a call of 2 tokens
    with Client(BASE, transport=httpx.MockTransport(fake)) as client, pytest.raises(ServiceError, match="at most"):
        client.explain(example_call(), candidate=np.zeros((2, 2), np.float32))


def test_an_explanation_of_another_shape_is_a_service_error():
    fake = FakeExplain(widest(2, 2, 3))
    with Client(BASE, transport=httpx.MockTransport(fake)) as client, pytest.raises(ServiceError, match=r"\[2, 3\]"):
        client.explain(example_call(), candidate=np.zeros((2, 2), np.float32))


def test_a_broken_explanation_is_a_service_error():
    body = msgpack.packb({"explanation": {"rows": "nope"}, "backend": "reference"})
    with Client(BASE, transport=httpx.MockTransport(FakeExplain(body=body))) as client, \
            pytest.raises(ServiceError, match="not a valid explanation"):
        client.explain(example_call(), candidate=np.zeros((2, 2), np.float32))
