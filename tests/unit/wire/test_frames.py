"""The frames codec and the batch codec (docs/protocol.md, "Frames" and "Batches"), and the client's copies.

Frames bodies are checked against the layout the protocol documents (read here with struct and
msgpack, not with moegrad's decoder), and against the msgpack form of the same document, bitwise,
for every wire dtype.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc

import httpx
import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import (
    MalformedRequest,
    decode_batch,
    decode_body,
    decode_frames,
    decode_tensor,
    encode_body,
    encode_frames,
    encode_tensor,
)
from moegrad.wire._frames import FramesReader

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "int32": np.int32}
UINT = {2: np.uint16, 4: np.uint32}


def sample(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "int32":
        return rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32)
    return rng.standard_normal(shape).astype(DTYPES[name])


def joined(document: dict) -> bytes:
    parts, length = encode_frames(document)
    body = b"".join(bytes(part) for part in parts)
    assert len(body) == length
    return body


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (1,), (0, 4), (7, 1, 3)])
def test_frames_layout_is_the_documented_one_and_its_bits_are_msgpacks(name, shape):
    first, second = sample(name, shape), sample("int32", (5,), seed=1)
    document = {"a": encode_tensor(first), "top_k": 2, "b": encode_tensor(second), "order": "ascend910b"}
    body = joined(document)
    assert body[:4] == b"MGF1"
    (length,) = struct.unpack("<I", body[4:8])
    header = msgpack.unpackb(body[8:8 + length], raw=False)
    assert header["top_k"] == 2 and header["order"] == "ascend910b"
    for key, array in (("a", first), ("b", second)):
        entry = header[key]
        assert set(entry) == {"dtype", "shape", "offset", "nbytes"}
        assert entry["dtype"] == name if key == "a" else entry["dtype"] == "int32"
        assert entry["shape"] == list(array.shape) and entry["nbytes"] == array.nbytes
        assert entry["offset"] % 16 == 0 and entry["offset"] >= 8 + length
        assert body[entry["offset"]:entry["offset"] + entry["nbytes"]] == array.tobytes()
    by_frames = decode_frames(body)
    by_msgpack = decode_body(encode_body(document))
    for key in ("a", "b"):
        x, y = decode_tensor(by_frames[key], key), decode_tensor(by_msgpack[key], key)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert (x.view(UINT[x.dtype.itemsize]) == y.view(UINT[y.dtype.itemsize])).all()
        assert not x.flags.writeable  # a view of the body, read-only


def test_decoded_frames_view_the_body_without_copying():
    array = sample("float32", (64, 64))
    body = bytearray(joined({"a": encode_tensor(array)}))
    decoded = decode_tensor(decode_frames(body)["a"], "a")
    assert np.shares_memory(decoded, np.frombuffer(body, np.uint8))


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda b, h: b"XXXX" + b[4:], "starts with"),
    (lambda b, h: b[:4] + struct.pack("<I", len(b)) + b[8:], "runs past the body"),
    (lambda b, h: b + bytes(16), "after its last segment"),
    (lambda b, h: b[:-1], "inside the body"),
])
def test_a_broken_frames_body_is_refused(mangle, message):
    body = joined({"a": encode_tensor(sample("float32", (4, 4)))})
    (length,) = struct.unpack("<I", body[4:8])
    with pytest.raises(MalformedRequest, match=message):
        decode_frames(mangle(body, length))


@pytest.mark.parametrize(("change", "message"), [
    ({"offset": 16}, "must lie after the header"),
    ({"offset": 1 << 20}, "inside the body"),
    ({"extra": 1}, "exactly the keys"),
    ({"nbytes": -1}, "non-negative"),
])
def test_a_frames_header_entry_that_breaks_a_rule_is_refused(change, message):
    header = {"a": {"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}}
    packed = msgpack.packb(header)
    start = -(-(8 + len(packed) + 16) // 16) * 16
    header["a"].update({"offset": start, **change})
    packed = msgpack.packb(header)
    body = b"MGF1" + struct.pack("<I", len(packed)) + packed
    body += bytes(start - len(body)) + bytes(16)
    with pytest.raises(MalformedRequest, match=message):
        decode_frames(body)


def test_overlapping_segments_are_refused():
    packed = msgpack.packb({"a": {"dtype": "int32", "shape": [4], "offset": 256, "nbytes": 16},
                            "b": {"dtype": "int32", "shape": [4], "offset": 256, "nbytes": 16}})
    body = b"MGF1" + struct.pack("<I", len(packed)) + packed
    body += bytes(272 - len(body))
    with pytest.raises(MalformedRequest, match="overlap"):
        decode_frames(body)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 1000, 1 << 20])
def test_the_frames_reader_fills_owned_arrays_whatever_the_chunks(name, chunk):
    grad_x = sample(name, (33, 9), seed=3)
    body = joined({"grad_x": encode_tensor(grad_x), "backend": "reference", "timings_ms": {"total": 1.0}})
    reader = FramesReader(len(body))
    for start in range(0, len(body), chunk):
        reader.feed(body[start:start + chunk])
    document = reader.document()
    result = document["grad_x"]
    assert document["backend"] == "reference" and document["timings_ms"] == {"total": 1.0}
    assert result.flags.owndata and result.flags.writeable and result.flags.c_contiguous and result.base is None
    assert result.dtype == grad_x.dtype and (result.view(np.uint16) == grad_x.view(np.uint16)).all()


def test_the_frames_reader_refuses_a_short_body():
    body = joined({"grad_x": encode_tensor(sample("float32", (8, 8)))})
    reader = FramesReader(len(body))
    reader.feed(body[:-5])
    with pytest.raises(MalformedRequest, match="inside a tensor"):
        reader.document()


# --- batches ---------------------------------------------------------------------------------------------


def test_a_batch_body_decodes_to_its_items_in_order_with_non_maps_refused_alone():
    body = msgpack.packb([{"top_k": 1}, 3, {"top_k": 2}, {1: 2}], use_bin_type=True)
    items = decode_batch(body, moegrad.REQUEST_LIMITS)
    assert items[0] == {"top_k": 1} and items[2] == {"top_k": 2}
    assert isinstance(items[1], MalformedRequest) and "batch item 1" in items[1].message
    assert isinstance(items[3], MalformedRequest) and "not a string" in items[3].message


@pytest.mark.parametrize(("body", "message"), [
    (msgpack.packb({"a": 1}), "not a valid msgpack array"),
    (msgpack.packb([{}]) + b"\x00", "trailing"),
    (msgpack.packb([{"a": [1, 2]}])[:-1], "truncated"),
    (msgpack.packb([{"a": msgpack.ExtType(1, b"x")}]), "ext"),
    (msgpack.packb([{"a": [[]] * 40}]), "batch item 0 has more than 32"),
])
def test_a_batch_body_that_cannot_be_read_is_refused_whole(body, message):
    with pytest.raises(MalformedRequest, match=message):
        decode_batch(body, moegrad.REQUEST_LIMITS)


def test_the_container_limit_restarts_at_each_item_and_the_length_is_capped():
    item = {"t": {"dtype": "int32", "shape": [1], "data": b"1234"}, "u": {"shape": [1]}}  # 4 containers
    assert len(decode_batch(msgpack.packb([item] * 50), moegrad.REQUEST_LIMITS)) == 50
    with pytest.raises(MalformedRequest, match="over the limit of 10"):
        decode_batch(msgpack.packb([item] * 11), moegrad.REQUEST_LIMITS, max_calls=10)


# --- the client's copies ---------------------------------------------------------------------------------


class FramesServer(httpx.BaseTransport):
    """A server that reads each request body chunk by chunk, keeping only its hash (httpx's
    MockTransport would join it first), and answers the prebuilt frames ``reply``: it holds no copy
    of its own, so what tracemalloc sees is the client's."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.seen: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"wire_formats": ["msgpack", "frames"]})
        digest = hashlib.sha256()
        for chunk in request.stream:
            digest.update(chunk)
        self.seen.append((request.headers["content-type"], digest.hexdigest()))
        return httpx.Response(200, stream=httpx.ByteStream(self.reply),
                              headers={"content-type": "application/vnd.moegrad.frames",
                                       "content-length": str(len(self.reply))})


def test_the_client_sends_frames_from_the_callers_arrays_and_returns_an_owned_result():
    rng = np.random.default_rng(2)
    grad = rng.standard_normal((2 * 4096, 256), dtype=np.float32)  # 8 MiB
    idx = rng.permutation(grad.shape[0]).astype(np.int32)
    grad_x = grad[idx[0::2]] + grad[idx[1::2]]
    reply = joined({"grad_x": encode_tensor(grad_x), "backend": "reference", "order": "ascend910b", "device": None,
                    "timings_ms": {}})
    want = hashlib.sha256(joined({"grad_expanded_x": encode_tensor(grad), "expanded_row_idx": encode_tensor(idx),
                                  "top_k": 2, "drop_pad_mode": 0, "active_num": 0,
                                  "allow_duplicate_indices": False})).hexdigest()
    server = FramesServer(reply)
    with moegrad.Client("http://moegrad.test", transport=server, retries=0) as client:
        client.moe_init_routing_v2_grad(grad, idx, 2)  # warm: imports, the info call
        tracemalloc.start()
        try:
            result = client.moe_init_routing_v2_grad(grad, idx, 2)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert server.seen[-1] == ("application/vnd.moegrad.frames", want)
    assert result.flags.owndata and result.base is None and result.flags.writeable
    assert (result.view(np.uint32) == grad_x.view(np.uint32)).all()
    # The request is sent from the caller's arrays (slices of at most 1 MiB); the reply's bytes go
    # once into the result: the result plus a slice, never a second copy of either payload.
    assert peak < grad_x.nbytes + (2 << 20), peak


def test_a_server_without_frames_gets_msgpack():
    seen: list = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("content-type"))
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"version": "0.1"})  # no wire_formats: an older server
        document = decode_body(request.content)
        call = moegrad.MoeInitRoutingV2GradCall.from_wire(document)
        return httpx.Response(200, content=encode_body(
            {"grad_x": encode_tensor(moegrad.moe_init_routing_v2_grad(call)), "backend": "x", "order": "ascend910b",
             "device": None, "timings_ms": {}}), headers={"content-type": "application/msgpack"})

    grad = np.ones((2 * 1024, 64), np.float32)
    with moegrad.Client("http://moegrad.test", transport=httpx.MockTransport(handle), retries=0) as client:
        result = client.moe_init_routing_v2_grad(grad, np.arange(2048, dtype=np.int32), 2)
        client.moe_init_routing_v2_grad(grad, np.arange(2048, dtype=np.int32), 2)
    assert seen == [None, "application/msgpack", "application/msgpack"]
    assert (result == 2).all() and result.flags.owndata


class AsyncFramesServer(httpx.AsyncBaseTransport):
    """FramesServer for the AsyncClient: the reply streamed in 1000-byte pieces."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"wire_formats": ["msgpack", "frames"]})
        async for _ in request.stream:
            pass
        reply = self.reply

        class Pieces(httpx.AsyncByteStream):
            async def __aiter__(self):
                for start in range(0, len(reply), 1000):
                    yield reply[start:start + 1000]

        return httpx.Response(200, stream=Pieces(), headers={"content-type": "application/vnd.moegrad.frames",
                                                             "content-length": str(len(reply))})


@pytest.mark.asyncio
async def test_the_async_client_reads_a_streamed_frames_reply_into_an_owned_array():
    grad = sample("bfloat16", (2 * 2048, 16), seed=4)  # 128 KiB: over FRAMES_MIN_BYTES
    idx = np.random.default_rng(4).permutation(grad.shape[0]).astype(np.int32)
    grad_x = sample("bfloat16", (2048, 16), seed=5)  # what the scripted server answers
    reply = joined({"grad_x": encode_tensor(grad_x), "backend": "reference", "order": "ascend910b", "device": None,
                    "timings_ms": {}})
    async with moegrad.AsyncClient("http://moegrad.test", transport=AsyncFramesServer(reply), retries=0) as client:
        result = await client.moe_init_routing_v2_grad(grad, idx, 2)
    assert result.flags.owndata and result.flags.writeable and result.dtype == grad_x.dtype
    assert (result.view(np.uint16) == grad_x.view(np.uint16)).all()
