"""Batches (``POST /v1/moe_init_routing_v2_grad/batch``) and the frames form of v1, in-process.

A batch answers every call on its own, in order, exactly as the single-call endpoint answers it
alone (the same bits, the same problem fields and aclnn codes). A frames body gives the same bits
as the msgpack body of the same call, for every dtype; so does a frames reply, and a v2 reply sent
from its parts.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import GradResult, InvalidArgument, MalformedRequest
from support.docexample import DOC_GRAD, DOC_IDX, example_document
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS
from support.servicekit import (
    FRAMES,
    frames_body,
    frames_reply,
    gauge,
    grad_x_of,
    pack,
    post,
    post_frames_call,
    random_call,
)

BATCH = "/v1/moe_init_routing_v2_grad/batch"
PROBLEM_FIELDS = ("status", "title", "detail", "field", "aclnn_status", "aclnn_name")


def post_batch(client, items, **headers):
    body = items if isinstance(items, bytes) else msgpack.packb(items, use_bin_type=True)
    return client.post(BATCH, content=body, headers={"content-type": "application/msgpack", **headers})


def results_of(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    return msgpack.unpackb(response.content, raw=False)["results"]


def bits_of(tensor: dict) -> np.ndarray:
    return np.frombuffer(tensor["data"], dtype=np.uint32).reshape(tensor["shape"])


# The single-call endpoint's refusals (tests/service/test_v1.py's table): a batch item earns the same.
BAD_CALLS = [
    {"grad_expanded_x": None},
    {"drop_pad_mode": 2},
    {"top_k": 0},
    {"top_k": 3},
    {"expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.array([2, 0, 2, 3], np.int32).tobytes()}},
    {"expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.array([2, 0, 1, 4], np.int32).tobytes()}},
    {"order": "ascend960"},
    {"grad_expanded_x": {"dtype": "float64", "shape": [4, 2], "data": bytes(64)}},
    {"grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": bytes(31)}},
    {"extra": 1},
    {"grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": DOC_GRAD.tobytes(), 1: 2}},  # a key not a string
]


@pytest.mark.parametrize("overrides", BAD_CALLS, ids=lambda o: next(iter(o)))
def test_a_bad_call_in_a_batch_gets_the_single_call_answer_and_its_neighbours_their_results(client, overrides):
    alone = post(client, example_document(**overrides))
    assert alone.status_code in (400, 422)
    results = results_of(post_batch(client, [example_document(), example_document(**overrides), example_document()]))
    assert len(results) == 3
    for good in (results[0], results[2]):
        assert set(good) == {"grad_x", "backend", "order", "device", "timings_ms"}
        assert (bits_of(good["grad_x"]) == EXAMPLE_BITS).all()
    problem = results[1]["problem"]
    expected = alone.json()
    assert {k: problem[k] for k in PROBLEM_FIELDS} == {k: expected[k] for k in PROBLEM_FIELDS}
    if expected["status"] == 422:
        assert problem["aclnn_status"] in (161001, 161002, 561103)  # 561103: rules 3-6 on the default profile (9.1)


def test_each_call_of_a_batch_is_counted_in_the_metrics_as_a_single_call_is(client):
    def counts() -> dict[str, float]:
        found = {}
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("moegrad_inference_request_") and BATCH in line and "_total{" in line:
                name, value = line.rsplit(" ", 1)
                found[name] = float(value)
        return found

    bad = {"top_k": 3}
    post(client, example_document(**bad))  # the single call's reason, for the batch item to match
    reason = next(line for line in client.get("/metrics").text.splitlines()
                  if line.startswith("moegrad_inference_request_failure_total{")).split('reason="')[1].split('"')[0]
    results_of(post_batch(client, [example_document(), example_document(**bad), example_document()]))
    assert counts() == {
        f'moegrad_inference_request_success_total{{endpoint="{BATCH}"}}': 2.0,
        f'moegrad_inference_request_failure_total{{endpoint="{BATCH}",reason="{reason}"}}': 1.0,
    }


def test_a_batch_answers_in_order_with_each_calls_own_bits(client):
    rng = np.random.default_rng(5)
    items, expected = [], []
    for n in range(1, 9):  # K=2 float32: each row is one add, v0 + v1, whatever the order
        grad = rng.standard_normal((2 * n, 3), dtype=np.float32)
        idx = rng.permutation(2 * n).astype(np.int32)
        items.append(example_document(grad_expanded_x={"dtype": "float32", "shape": [2 * n, 3], "data": grad.tobytes()},
                                      expanded_row_idx={"dtype": "int32", "shape": [2 * n], "data": idx.tobytes()}))
        expected.append(grad[idx[0::2]] + grad[idx[1::2]])
    items.insert(3, 7)  # not a map: its own 400, nothing else
    expected.insert(3, None)
    results = results_of(post_batch(client, items))
    assert len(results) == len(items)
    for result, want in zip(results, expected, strict=True):
        if want is None:
            assert result["problem"]["status"] == 400 and "batch item 3" in result["problem"]["detail"]
        else:
            assert (bits_of(result["grad_x"]) == want.view(np.uint32)).all()


def test_every_mode_dtype_and_order_in_one_batch_gives_the_single_call_bits(client):
    """Calls of every mode, dtype and order, several of each shape (the CPU emulation computes such
    calls of a batch together): each result has the bits the single-call endpoint answers."""
    from support import routing

    rng = np.random.default_rng(11)
    items = []
    for number in range(36):
        mode = ("dropless", "active", "drop_pad")[number % 3]
        dtype = ("float16", "bfloat16", "float32")[number // 3 % 3]
        order = moegrad.ORDERS[number // 9 % len(moegrad.ORDERS)]
        r = routing.route(np.random.default_rng(number % 4), 6, 3, 4, mode)
        grad = rng.standard_normal(r.grad_shape(5)).astype(moegrad.DTYPES[dtype])
        items.append(example_document(
            grad_expanded_x={"dtype": dtype, "shape": list(grad.shape), "data": grad.tobytes()},
            expanded_row_idx={"dtype": "int32", "shape": [r.expanded_row_idx.size],
                              "data": r.expanded_row_idx.astype("<i4").tobytes()},
            top_k=r.top_k, drop_pad_mode=r.drop_pad_mode, active_num=r.active_num, order=order))
    results = results_of(post_batch(client, items * 2))
    for item, result in zip(items * 2, results, strict=True):
        alone = post(client, item)
        assert alone.status_code == 200, alone.text
        want = msgpack.unpackb(alone.content, raw=False)["grad_x"]
        assert result["grad_x"] == want


def test_empty_calls_and_an_empty_batch(client):
    results = results_of(post_batch(client, [example_document(
        grad_expanded_x={"dtype": "float32", "shape": [0, 2], "data": b""},
        expanded_row_idx={"dtype": "int32", "shape": [0], "data": b""})]))
    assert results[0]["grad_x"]["shape"] == [0, 2]
    assert results_of(post_batch(client, [])) == []


def test_a_compare_rides_in_a_batch(client):
    candidate = {"dtype": "float32", "shape": [2, 2], "data": EXAMPLE_BITS.view(np.float32).tobytes()}
    items = [example_document(), example_document(op="compare", candidate=candidate, return_grad_x=True),
             example_document(op="compare"), example_document(op="nope")]
    results = results_of(post_batch(client, items))
    assert (bits_of(results[0]["grad_x"]) == EXAMPLE_BITS).all()
    report = results[1]["report"]
    assert report["shape"] == [2, 2] and report["verdict"] in ("pass", "warn")
    assert (bits_of(results[1]["grad_x"]) == EXAMPLE_BITS).all()
    assert results[2]["problem"]["aclnn_status"] == 161001 and results[2]["problem"]["field"] == "candidate"
    assert results[3]["problem"]["status"] == 400 and results[3]["problem"]["field"] == "op"


@pytest.mark.parametrize("body", [b"\xc1", pack(example_document()), msgpack.packb([example_document()]) + b"\0",
                                  msgpack.packb([example_document()])[:-3]])
def test_a_body_that_is_not_an_array_of_calls_is_one_400(client, body):
    response = post_batch(client, body)
    assert response.status_code == 400 and response.headers["content-type"] == "application/problem+json"


def test_a_batch_over_the_call_limit_is_one_400(client):
    body = b"\xdd" + struct.pack(">I", moegrad.MAX_BATCH_CALLS + 1) + b"\x80" * (moegrad.MAX_BATCH_CALLS + 1)
    response = post_batch(client, body)
    assert response.status_code == 400 and str(moegrad.MAX_BATCH_CALLS) in response.json()["detail"]


def test_each_item_is_bounded_as_one_request(client):
    """100 calls of 4 containers each pass (the count restarts per item); one item of 40 lists does not."""
    assert len(results_of(post_batch(client, [example_document()] * 100))) == 100
    bloated = example_document(extra=[[]] * 40)
    response = post_batch(client, [example_document(), bloated])
    assert response.status_code == 400 and "batch item 1" in response.json()["detail"]
    # a list of 65 items: refused alone (400, 64 items a list), and in a batch, which it refuses whole
    # (the batch's own array may hold far more, but an item's may not)
    long_list = example_document(order=list(range(65)))
    assert post(client, long_list).status_code == 400
    response = post_batch(client, [example_document(), long_list])
    assert response.status_code == 400, response.text
    assert "batch item 1 has an array of 65 items, over the limit of 64" in response.json()["detail"]
    assert len(results_of(post_batch(client, [example_document(order=["x"] * 64)] * 2))) == 2  # 64 fit


def test_the_client_batch_returns_results_and_exceptions_in_order(client):
    with moegrad.Client("http://testserver", transport=client._transport, retries=0) as remote:
        good = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=2)
        raw = example_document(top_k=3)  # a wire document: checked locally, refused without being sent
        answers = remote.batch([good, raw, good, moegrad.BatchCompare(good, candidate=EXAMPLE_BITS.view(np.float32))])
        assert isinstance(answers[0], GradResult) and (answers[0].grad_x.view(np.uint32) == EXAMPLE_BITS).all()
        assert answers[0].grad_x.flags.owndata and answers[0].grad_x.flags.writeable
        assert isinstance(answers[1], InvalidArgument) and answers[1].aclnn_status == 561103  # the default: 9.1
        assert isinstance(answers[2], GradResult)
        assert isinstance(answers[3], moegrad.CompareResult) and answers[3].passed and answers[3].grad_x is None
    with moegrad.Client("http://testserver", transport=client._transport, retries=0, validate=False) as remote:
        answers = remote.batch([example_document(), example_document(top_k=3), example_document(extra=1)])
        assert isinstance(answers[0], GradResult)
        assert isinstance(answers[1], InvalidArgument) and answers[1].aclnn_status == 561103  # the default: 9.1
        assert answers[1].field == "expanded_row_idx"
        assert isinstance(answers[2], MalformedRequest) and answers[2].field == "extra"


# --- frames --------------------------------------------------------------------------------------------

DTYPE_CASES = [("float32", np.float32), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)]


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES)
@pytest.mark.parametrize("accept", ["application/msgpack", FRAMES])
def test_frames_and_msgpack_bodies_give_the_same_bits_for_every_dtype(client, name, dtype, accept):
    grad, idx, k = random_call(dtype)
    document = example_document(grad_expanded_x={"dtype": name, "shape": list(grad.shape), "data": grad.tobytes()},
                                expanded_row_idx={"dtype": "int32", "shape": list(idx.shape), "data": idx.tobytes()},
                                top_k=k)
    by_msgpack = grad_x_of(post(client, document))
    response = client.post("/v1/moe_init_routing_v2_grad", content=frames_body(document),
                           headers={"content-type": FRAMES, "accept": accept})
    assert response.status_code == 200, response.text
    if accept == FRAMES:
        assert response.headers["content-type"] == FRAMES
        header, tensors = frames_reply(response)
        assert header["backend"] == "reference" and set(header["timings_ms"]) == {"queue", "compute", "total"}
        grad_x = tensors["grad_x"]
    else:
        grad_x = grad_x_of(response)
    assert grad_x.dtype == by_msgpack.dtype and grad_x.shape == by_msgpack.shape == (37, 13)
    assert (grad_x.view(np.uint16) == by_msgpack.view(np.uint16)).all()


@pytest.mark.parametrize("mangle", ["magic", "misaligned", "past_end", "trailing", "header_length"])
def test_a_broken_frames_body_is_400_and_the_service_keeps_serving(client, mangle):
    body = bytearray(frames_body(example_document()))
    (length,) = struct.unpack("<I", body[4:8])
    header = msgpack.unpackb(bytes(body[8:8 + length]))
    if mangle == "magic":
        body[:4] = b"MGF2"
    elif mangle == "header_length":
        body[4:8] = struct.pack("<I", len(body))
    elif mangle in ("misaligned", "past_end"):  # the same header but one offset moved, the bytes placed there
        header["grad_expanded_x"]["offset"] += 4 if mangle == "misaligned" else 1 << 20
        packed = msgpack.packb(header)
        rebuilt = bytearray(b"MGF1" + struct.pack("<I", len(packed)) + packed)
        for key, data in (("grad_expanded_x", DOC_GRAD.tobytes()), ("expanded_row_idx", DOC_IDX.tobytes())):
            at = header[key]["offset"]
            if mangle == "past_end" and key == "grad_expanded_x":
                continue  # the body ends before the moved tensor's bytes
            rebuilt += bytes(max(0, at - len(rebuilt)))
            rebuilt[at:at + len(data)] = data
        body = rebuilt
    else:
        body += bytes(16)
    response = client.post("/v1/moe_init_routing_v2_grad", content=bytes(body), headers={"content-type": FRAMES})
    assert response.status_code == 400 and response.headers["content-type"] == "application/problem+json"
    assert post(client, example_document()).status_code == 200


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES)
def test_the_client_sends_frames_when_the_server_offers_them_with_the_same_bits(client, name, dtype):
    grad, idx, k = random_call(dtype, n=700, k=2, h=64, seed=1)  # 175 KiB: over FRAMES_MIN_BYTES
    seen = []
    transport = client._transport
    original = transport.handle_request

    def recording(request):
        seen.append((request.url.path, request.headers.get("content-type")))
        return original(request)

    transport.handle_request = recording
    try:
        with moegrad.Client("http://testserver", transport=transport, retries=0, wire="msgpack") as plain, \
                moegrad.Client("http://testserver", transport=transport, retries=0) as auto:
            by_msgpack = plain.moe_init_routing_v2_grad(grad, idx, k)
            by_frames = auto.moe_init_routing_v2_grad(grad, idx, k)
            again = auto.moe_init_routing_v2_grad(grad, idx, k)
    finally:
        transport.handle_request = original
    assert seen == [("/v1/moe_init_routing_v2_grad", "application/msgpack"), ("/v1/info", None),
                    ("/v1/moe_init_routing_v2_grad", FRAMES), ("/v1/moe_init_routing_v2_grad", FRAMES)]
    for result in (by_frames, again):
        assert result.dtype == by_msgpack.dtype and (result.view(np.uint16) == by_msgpack.view(np.uint16)).all()
        assert result.flags.owndata and result.flags.writeable and result.flags.c_contiguous


def test_a_v2_binary_reply_sent_from_its_parts_has_the_header_then_grad_x(client):
    header = json.dumps({"inputs": [
        {"name": "grad_expanded_x", "datatype": "FP32", "shape": [4, 2], "parameters": {"binary_data_size": 32}},
        {"name": "expanded_row_idx", "datatype": "INT32", "shape": [4], "parameters": {"binary_data_size": 16}}],
        "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}], "parameters": {"top_k": 2}}).encode()
    response = client.post("/v2/models/moe_init_routing_v2_grad/infer",
                           content=header + DOC_GRAD.tobytes() + DOC_IDX.tobytes(),
                           headers={"inference-header-content-length": str(len(header))})
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    assert int(response.headers["content-length"]) == len(response.content) == length + 16
    assert json.loads(response.content[:length])["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert (np.frombuffer(response.content[length:], np.uint32).reshape(2, 2) == EXAMPLE_BITS).all()


def test_a_receive_buffer_is_reused_only_when_nothing_views_it(client):
    """A large body's buffer is kept once its call is answered and taken by the next body of its size;
    the second call's bits are its own (nothing of the first survives), and a buffer that an array
    still views is kept only once nothing does."""
    from moegrad_service.memory import MemoryBudget, ReceiveBuffers

    results = []
    for seed in (1, 2):
        grad, idx, k = random_call(np.float32, n=8192, k=2, h=32, seed=seed)  # 2 MiB
        response = post_frames_call(client, grad, idx, k)
        assert response.status_code == 200
        assert gauge(client, "moegrad_receive_buffer_kept_bytes") >= grad.nbytes
        want = grad[idx[0::2]] + grad[idx[1::2]]  # K=2: one float32 add per element
        results.append((grad_x_of(response), want))
    for got, want in results:
        assert (got.view(np.uint32) == want.view(np.uint32)).all()
    buffers = ReceiveBuffers(MemoryBudget(64 << 20), keep_s=10)
    loan = buffers.body_loan(2 << 20)
    alive = np.frombuffer(memoryview(loan.array)[:64], np.uint8)
    loan.forget()
    assert buffers.kept_bytes == 0 and alive.size == 64
    del alive  # nothing views it any more: kept
    assert buffers.kept_bytes >= 2 << 20
