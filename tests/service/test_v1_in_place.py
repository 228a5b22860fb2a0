"""v1 msgpack bodies read in place (``moegrad.wire.decode_body`` with ``min_view_bytes``) against msgpack's own
decoding, the buffers they view, and replies written in parts (api/v1/parts.py).

The oracle is msgpack alone (``decode_body`` / ``decode_batch`` without ``min_view_bytes``: every bin copied)
and ``msgpack.packb`` (support.msgpack_oracle). What is checked:

- every body of this module and of the fuzz and field tests (tests/service/conftest.py's
  ORACLE_CHECKED, through the routes) decodes to the same document, or the same error (type,
  message, field, aclnn code), as the oracle; here also hostile bodies built by hand: every
  truncation, trailing bytes, repeated keys, ext types, keys that are no str, a bin key named data,
  a bin longer than the body, an array at the top, nesting and containers over the limits;
- the same status and problem document at the endpoint with the walk forced on every body and off;
- a large tensor is a read-only view of the receive buffer, bitwise equal to the oracle's array;
- a view never outlives its buffer's loan: while an array views a body, the buffer is not kept
  for the next body (a body of the same size goes into other memory) and the viewed bytes stay
  as they were; once it is gone, the buffer is kept again;
- a reply is sent in parts whose large part is grad_x's own buffer, and joined they are msgpack's bytes.
"""

from __future__ import annotations

import functools
import gc
import importlib
import weakref

import msgpack
import numpy as np
import pytest

from moegrad import REQUEST_LIMITS, MoeInitRoutingV2GradCall, decode_batch, decode_body
from moegrad.wire import VIEW_MIN_BYTES
from moegrad_service.api.v1.grouping import GROUP_CALL_BYTES
from moegrad_service.api.v1.parts import encode_parts
from support.msgpack_oracle import outcome
from support.servicekit import gauge, grad_x_of, pack, post, random_call

routes = importlib.import_module("moegrad_service.api.v1.routes")
BATCH = "/v1/moe_init_routing_v2_grad/batch"
COMPARE = "/v1/moe_init_routing_v2_grad/compare"


def document(n: int = 4, h: int = 2, seed: int = 0) -> dict:
    grad, idx, k = random_call(np.float32, n=n, k=2, h=h, seed=seed)
    return {"grad_expanded_x": {"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
            "expanded_row_idx": {"dtype": "int32", "shape": [idx.size], "data": idx.tobytes()}, "top_k": k}


def str8(text: str) -> bytes:
    """``text`` as msgpack str 8 (a longer form than msgpack's packer picks for a short string)."""
    raw = text.encode()
    return b"\xd9" + bytes([len(raw)]) + raw


def hostile_bodies() -> list[bytes]:
    valid = pack(document())
    tensor = pack({"dtype": "float32", "shape": [4, 2], "data": bytes(32)})
    idx = pack({"dtype": "int32", "shape": [4], "data": np.arange(4, dtype="<i4").tobytes()})
    bodies = [valid[:cut] for cut in range(len(valid))]  # every truncation
    bodies += [valid + b"\x00", valid + valid, b"", b"\xc1", b"\x90", b"\x80", pack([document()]), pack(7)]
    # a repeated key: the last one counts (a tensor, then not; not, then a tensor; data twice)
    bodies.append(b"\x83" + pack("grad_expanded_x") + tensor + pack("grad_expanded_x") + pack(3)
                  + pack("top_k") + pack(2))
    bodies.append(b"\x84" + pack("grad_expanded_x") + pack(3) + pack("grad_expanded_x") + tensor
                  + pack("expanded_row_idx") + idx + pack("top_k") + pack(2))
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x84" + pack("dtype") + pack("float32") + pack("shape")
                  + pack([4, 2]) + pack("data") + pack(bytes(32)) + pack("data") + pack("text")
                  + pack("expanded_row_idx") + idx + pack("top_k") + pack(2))
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x84" + pack("dtype") + pack("float32") + pack("shape")
                  + pack([4, 2]) + pack("data") + pack("text") + pack("data") + pack(bytes(32))
                  + pack("expanded_row_idx") + idx + pack("top_k") + pack(2))
    # keys in the longer str forms, a bin key named data, a key that is no str, ext types
    bodies.append(b"\x83" + str8("grad_expanded_x") + b"\x83" + str8("dtype") + pack("float32") + str8("shape")
                  + pack([4, 2]) + str8("data") + pack(bytes(32)) + pack("expanded_row_idx") + idx + pack("top_k")
                  + pack(2))
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x83" + pack("dtype") + pack("float32") + pack("shape")
                  + pack([4, 2]) + pack(b"data") + pack(bytes(32)) + pack("expanded_row_idx") + idx + pack("top_k")
                  + pack(2))
    bodies.append(b"\x83" + pack(1) + tensor + pack("expanded_row_idx") + idx + pack("top_k") + pack(2))
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x83" + pack("dtype") + pack("float32") + pack("shape")
                  + pack([4, 2]) + pack("data") + b"\xd4\x01\x00" + pack("expanded_row_idx") + idx + pack("top_k")
                  + pack(2))
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x83" + pack("dtype") + pack("float32") + pack("shape")
                  + pack([4, 2]) + pack("data") + b"\xc6\xff\xff\xff\xf0" + bytes(32))  # a bin past the body
    bodies.append(b"\x83" + pack("grad_expanded_x") + b"\x83" + pack("dtype") + pack("\xff") + pack("shape")
                  + pack([4, 2]) + pack("data") + pack(bytes(32)) + pack("top_k") + pack(2) + pack("x") + pack(1))
    bodies.append(b"\x82" + b"\xa1\xff" + tensor + pack("top_k") + pack(2))  # a key that is no UTF-8
    # over the limits: a long string, a long array, a wide map, many containers, deep nesting
    bodies.append(pack({**document(), "order": "x" * 2000}))
    bodies.append(pack({**document(), "order": list(range(100))}))
    bodies.append(pack({**document(), "order": {str(i): i for i in range(40)}}))
    bodies.append(pack({**document(), "order": [[1]] * 40}))
    bodies.append(pack({**document(), "order": "P"}).replace(pack("P"), b"\x91" * 30 + b"\x01"))
    # NaN and -0.0 values: read alike both ways (a NaN equals no other NaN, so compared by their bits)
    bodies.append(pack({**document(), "top_k": float("nan")}))
    bodies.append(pack({**document(), "order": [float("nan"), -0.0, 0.0]}))
    return bodies


@pytest.mark.parametrize("body", hostile_bodies())
def test_a_hostile_call_body_decodes_as_the_old_decoder_decodes_it(body):
    expected = outcome(decode_body, body, REQUEST_LIMITS)
    assert outcome(decode_body, bytearray(body), REQUEST_LIMITS, min_view_bytes=0) == expected
    assert outcome(decode_body, bytearray(body), REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES) == expected


def batch_bodies() -> list[bytes]:
    items = [document(seed=i) for i in range(3)]
    valid = pack(items)
    bodies = [valid[:cut] for cut in range(0, len(valid), 7)]
    bodies += [valid + b"\x00", pack([*items, 5, "x", [1]]), pack([*items, {1: 2}]), pack(items[:1] * 5),
               pack([]), pack({"a": 1}), b"\xdd\xff\xff\xff\xff", pack([{**items[0], "order": [[1]] * 40}])]
    bodies += hostile_bodies()[-6:]
    return bodies


@pytest.mark.parametrize("body", batch_bodies())
def test_a_hostile_batch_body_decodes_as_the_old_decoder_decodes_it(body):
    for calls in (2, 10_000):
        expected = outcome(decode_batch, body, REQUEST_LIMITS, max_calls=calls)
        forced = outcome(decode_batch, bytearray(body), REQUEST_LIMITS, max_calls=calls, min_view_bytes=0)
        assert forced == expected
        own = outcome(decode_batch, bytearray(body), REQUEST_LIMITS, max_calls=calls,
                      min_view_bytes=GROUP_CALL_BYTES + 1)
        assert own == expected


def test_a_large_tensor_is_a_read_only_view_of_the_body_bitwise_equal_to_the_old_path():
    call = document(n=4096, h=16)  # 512 KiB of grad
    body = bytearray(pack(call))
    viewed = MoeInitRoutingV2GradCall.from_wire(decode_body(body, REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES),
                                                default_order="sequential")
    copied = MoeInitRoutingV2GradCall.from_wire(decode_body(bytes(body), REQUEST_LIMITS), default_order="sequential")
    grad = viewed.grad_expanded_x
    assert np.shares_memory(grad, np.frombuffer(body, np.uint8)) and not grad.flags.writeable
    assert grad.tobytes() == copied.grad_expanded_x.tobytes()
    assert viewed.expanded_row_idx.tobytes() == copied.expanded_row_idx.tobytes()


def with_views(min_view_bytes, body, limits, **_):
    """``decode_body`` as the route calls it, with ``min_view_bytes`` of the test's choosing."""
    return decode_body(body, limits, min_view_bytes=min_view_bytes)


@pytest.mark.parametrize("body", [*hostile_bodies()[::3], pack(document(n=4096, h=16))])
def test_the_endpoint_answers_the_same_status_and_problem_with_the_walk_on_every_body_and_off(serve, monkeypatch,
                                                                                             body):
    answers = []
    with serve() as client:
        for views in (0, None):  # every data bin viewed; none
            monkeypatch.setattr(routes, "decode_body", functools.partial(with_views, views))
            response = post(client, body)
            content = response.json() if response.status_code != 200 else grad_x_of(response).tobytes()
            if isinstance(content, dict):
                content.pop("request_id", None)
            answers.append((response.status_code, response.headers["content-type"], content))
    assert answers[0] == answers[1]


def test_every_body_of_this_module_goes_through_the_oracle(client, msgpack_oracle):
    assert post(client, document()).status_code == 200
    assert client.post(BATCH, content=pack([document()] * 2), headers={"content-type": "application/msgpack"}
                       ).status_code == 200
    assert msgpack_oracle == [2, 2]


def test_a_buffer_viewed_by_an_array_is_not_kept_for_the_next_body_until_the_array_is_gone(serve, monkeypatch):
    views: list[np.ndarray] = []
    holding = [True]

    def keeping(body, limits, **kwargs):  # what the route decodes; its grad kept alive here while holding
        decoded = decode_body(body, limits, **kwargs)
        if holding[0]:
            views.append(np.frombuffer(decoded["grad_expanded_x"]["data"].view, np.uint8))
        return decoded

    monkeypatch.setattr(routes, "decode_body", keeping)
    first, second = document(n=8192, h=64, seed=1), document(n=8192, h=64, seed=2)  # 4 MiB of grad each
    grad_x_bytes = 8192 * 64 * 4  # the result buffer, kept once its reply is sent
    with serve(receive_keep_s=30) as client:
        assert post(client, first).status_code == 200
        assert gauge(client, "moegrad_receive_buffer_kept_bytes") == grad_x_bytes  # the viewed body: not kept
        assert post(client, second).status_code == 200
        assert not np.shares_memory(views[0], views[1])  # the second body went into other memory
        assert views[0].tobytes() == first["grad_expanded_x"]["data"]
        holding[0] = False
        views.clear()
        gc.collect()
        assert post(client, second).status_code == 200  # nothing views its body once answered: kept
        assert gauge(client, "moegrad_receive_buffer_kept_bytes") >= grad_x_bytes + len(pack(second))


def test_a_reply_is_sent_in_parts_whose_large_part_is_grad_xs_own_buffer(client):
    grad_x = np.arange(64 << 10, dtype=np.float32).reshape(256, 256)
    data = grad_x.reshape(-1).view(np.uint8).data
    reply = {"grad_x": {"dtype": "float32", "shape": [256, 256], "data": data}, "backend": "reference",
             "order": "sequential", "device": None, "timings_ms": {"total": 1.0}}
    parts, length = encode_parts(reply)
    assert len(parts) == 3 and np.shares_memory(np.frombuffer(parts[1], np.uint8), grad_x)
    assert b"".join(bytes(part) for part in parts) == msgpack.packb(reply, use_bin_type=True)
    assert length == len(msgpack.packb(reply, use_bin_type=True))
    batch = {"results": [reply, {"problem": {"status": 422}}, reply], "timings_ms": {"total": 2.0}}
    parts, length = encode_parts(batch)
    assert len(parts) == 5 and b"".join(bytes(part) for part in parts) == msgpack.packb(batch, use_bin_type=True)
    call = document(n=4096, h=16)
    response = post(client, call)
    assert response.status_code == 200 and int(response.headers["content-length"]) == len(response.content)
    assert grad_x_of(response).shape == (4096, 16)


def test_a_replys_parts_let_grad_x_go_as_soon_as_they_are_dropped(collector_off):
    """Only reference counts free anything here: the parts hold grad_x's buffer through no cycle, so
    it goes back once the reply is sent, not whenever the collector next runs."""
    grad_x = np.ones((256, 256), np.float32)
    gone = weakref.ref(grad_x)
    parts, _ = encode_parts({"grad_x": {"dtype": "float32", "shape": [256, 256],
                                        "data": grad_x.reshape(-1).view(np.uint8).data}, "backend": "reference"})
    assert len(parts) == 3
    del parts, grad_x
    assert gone() is None
