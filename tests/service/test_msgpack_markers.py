"""The v1 msgpack reader (moegrad.wire.decode_body in place) and reply writer (api/v1/parts.py) at every marker
and length boundary.

Oracles: the msgpack specification (msgpack/msgpack, spec.md: each format's first byte and the
bytes that follow it) for the values written by hand here, and msgpack's own ``unpackb`` /
``packb`` for what they decode to and encode as. What is checked:

- every format the spec defines (ext aside: refused on every path) read before a large ``data``
  bin, in the call map, in a tensor map and in an array: the bin is still read in place (a view of
  the body, the walk having stepped over the value by its spec width), and the document is msgpack's;
- a call or a batch whose N*K is 65,536 or more (the shape's N*K a uint 32, 0xce) is read in place,
  at the module and at the endpoint, and answers the formula's grad_x (K = 2: one float32 add);
- a reply's bin of every size about the bin 8 / 16 / 32 boundaries (255/256, 65,535/65,536 ...)
  carries the spec's marker and length before its bytes, as msgpack packs it and as msgpack reads it
  back; at the endpoint, grad_x of 65,532, 65,536 and 65,540 bytes.
"""

from __future__ import annotations

import importlib
import struct

import msgpack
import numpy as np
import pytest

from moegrad import REQUEST_LIMITS
from moegrad.wire import VIEW_MIN_BYTES, decode_batch, decode_body, holds_views
from moegrad_service.api.v1.grouping import GROUP_CALL_BYTES
from moegrad_service.api.v1.parts import encode_parts
from support.servicekit import MSGPACK_HEADERS, grad_x_of, pack, post, random_call

routes = importlib.import_module("moegrad_service.api.v1.routes")
BATCH = "/v1/moe_init_routing_v2_grad/batch"
#: Bytes of the large data bin: a view is taken of 64 KiB or more (VIEW_MIN_BYTES, GROUP_CALL_BYTES + 1).
LARGE = 1 << 18


def _sized(marker: int, width: int, payload: bytes) -> bytes:
    """``marker``, ``len(payload)`` as a big-endian unsigned of ``width`` bytes, ``payload`` (spec: bin, str)."""
    return bytes([marker]) + len(payload).to_bytes(width, "big") + payload


#: Each format of the spec with a value written by hand: (marker, bytes, what msgpack reads).
FORMATS = [
    ("positive fixint", b"\x07", 7),
    ("fixmap", b"\x81\xa1k\x01", {"k": 1}),
    ("fixarray", b"\x92\x01\x02", [1, 2]),
    ("fixstr", b"\xa3abc", "abc"),
    ("nil", b"\xc0", None),
    ("false", b"\xc2", False),
    ("true", b"\xc3", True),
    ("bin 8", _sized(0xC4, 1, b"xyz"), b"xyz"),
    ("bin 16", _sized(0xC5, 2, b"x" * 300), b"x" * 300),
    ("bin 32", _sized(0xC6, 4, b"xy"), b"xy"),
    ("float 32", b"\xca" + struct.pack(">f", 1.5), 1.5),
    ("float 64", b"\xcb" + struct.pack(">d", -2.25), -2.25),
    ("uint 8", b"\xcc" + (200).to_bytes(1, "big"), 200),
    ("uint 16", b"\xcd" + (60000).to_bytes(2, "big"), 60000),
    ("uint 32", b"\xce" + (65536).to_bytes(4, "big"), 65536),
    ("uint 64", b"\xcf" + (1 << 40).to_bytes(8, "big"), 1 << 40),
    ("int 8", b"\xd0" + (-100).to_bytes(1, "big", signed=True), -100),
    ("int 16", b"\xd1" + (-30000).to_bytes(2, "big", signed=True), -30000),
    ("int 32", b"\xd2" + (-(1 << 20)).to_bytes(4, "big", signed=True), -(1 << 20)),
    ("int 64", b"\xd3" + (-(1 << 40)).to_bytes(8, "big", signed=True), -(1 << 40)),
    ("str 8", _sized(0xD9, 1, b"hello"), "hello"),
    ("str 16", _sized(0xDA, 2, b"s" * 300), "s" * 300),
    ("str 32", _sized(0xDB, 4, b"hi"), "hi"),
    ("array 16", b"\xdc" + (3).to_bytes(2, "big") + b"\x01\xcd\x01\x00\xa1a", [1, 256, "a"]),
    ("array 32", b"\xdd" + (2).to_bytes(4, "big") + b"\xc0\xce\x00\x01\x00\x00", [None, 65536]),
    ("map 16", b"\xde" + (1).to_bytes(2, "big") + b"\xa1k\xcc\xff", {"k": 255}),
    ("map 32", b"\xdf" + (1).to_bytes(4, "big") + b"\xa1k\xcf" + (1 << 33).to_bytes(8, "big"), {"k": 1 << 33}),
    ("negative fixint", b"\xe0", -32),
]


def _key(name: str) -> bytes:
    return pack(name)


def _tensor(pad: bytes | None = None) -> bytes:
    """A float32 tensor map whose data bin is LARGE bytes (bin 32, written by hand), with a "pad" key first."""
    data = bytes(range(256)) * (LARGE // 256)
    shape = pack([256, LARGE // 1024])  # no dimension past 65535: the formats here are the values under test
    pairs = [(_key("dtype"), pack("float32")), (_key("shape"), shape), (_key("data"), _sized(0xC6, 4, data))]
    if pad is not None:
        pairs.insert(0, (_key("pad"), pad))
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


@pytest.mark.parametrize(("name", "value", "decoded"), FORMATS, ids=[f[0] for f in FORMATS])
def test_the_hand_written_values_are_msgpacks(name, value, decoded):
    assert msgpack.unpackb(value, raw=False, strict_map_key=False) == decoded  # one value, nothing left over


@pytest.mark.parametrize("where", ["call map", "tensor map", "array"])
@pytest.mark.parametrize(("name", "value", "decoded"), FORMATS, ids=[f[0] for f in FORMATS])
def test_the_data_after_any_value_is_read_in_place(name, value, decoded, where):
    if where == "call map":
        body = b"\x82" + _key("pad") + value + _key("grad_expanded_x") + _tensor()
    elif where == "tensor map":
        body = b"\x81" + _key("grad_expanded_x") + _tensor(pad=value)
    else:
        body = b"\x82" + _key("pad") + b"\x93" + value + value + b"\xc0" + _key("grad_expanded_x") + _tensor()
    buffer = bytearray(body)
    document = decode_body(buffer, REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES)
    expected = msgpack.unpackb(body, raw=False, strict_map_key=False)
    assert holds_views(document), f"{name} ({value[:1].hex()}) stepped over by a width other than the spec's"
    view = document["grad_expanded_x"].pop("data").view
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(buffer, np.uint8))
    assert bytes(view) == expected["grad_expanded_x"].pop("data")
    assert document == expected


def _call(tokens: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A dropless float32 K = 2 call of ``tokens`` tokens, H = 1 (N*K = 2 * tokens), and its grad_x
    by the formula: grad_x[i] = grad[idx[2i]] + grad[idx[2i + 1]], one float32 add."""
    grad, idx, k = random_call(np.float32, n=tokens, k=2, h=1, seed=seed)
    document = {"grad_expanded_x": {"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
                "expanded_row_idx": {"dtype": "int32", "shape": [idx.size], "data": idx.tobytes()}, "top_k": k}
    return document, np.add(grad[idx[0::2]], grad[idx[1::2]], dtype=np.float32)


@pytest.mark.parametrize("tokens", [32767, 32768, 40000])
def test_a_call_with_n_times_k_past_65535_is_read_in_place(tokens):
    document, _ = _call(tokens)
    body = bytearray(pack(document))
    assert (b"\xce" + (2 * tokens).to_bytes(4, "big") in body) is (2 * tokens >= 1 << 16)  # the shape, uint 32
    decoded = decode_body(body, REQUEST_LIMITS, min_view_bytes=VIEW_MIN_BYTES)
    assert holds_views(decoded)
    for field in ("grad_expanded_x", "expanded_row_idx"):
        view = decoded[field]["data"].view
        assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(body, np.uint8))
        assert bytes(view) == document[field]["data"]
    batch = bytearray(pack([document, _call(tokens, seed=1)[0]]))
    items = decode_batch(batch, REQUEST_LIMITS, min_view_bytes=GROUP_CALL_BYTES + 1)
    assert all(holds_views(item) for item in items)
    assert all(np.shares_memory(np.frombuffer(item["grad_expanded_x"]["data"].view, np.uint8),
                                np.frombuffer(batch, np.uint8)) for item in items)


def test_the_endpoint_reads_a_call_with_n_times_k_of_65536_in_place(client, monkeypatch):
    seen = []

    def watched(body, limits, **kwargs):
        decoded = decode_body(body, limits, **kwargs)
        seen.append(holds_views(decoded))
        return decoded

    monkeypatch.setattr(routes, "decode_body", watched)
    document, expected = _call(32768)
    response = post(client, document)
    assert response.status_code == 200 and seen == [True]
    assert np.array_equal(grad_x_of(response).reshape(-1).view(np.uint32), expected.reshape(-1).view(np.uint32))


# ---- the reply ------------------------------------------------------------------------------------

SIZES = [0, 1, 255, 256, 65535, 65536, 65537, 131071, 131072, (1 << 20) + 3]


def spec_bin_header(size: int) -> bytes:
    """The spec's bin header: bin 8 below 2^8 bytes, bin 16 below 2^16, bin 32 below 2^32."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


@pytest.mark.parametrize("size", SIZES)
def test_a_reply_bin_of_any_size_has_the_specs_marker_and_length(size):
    payload = np.arange(size, dtype=np.uint8)
    reply = {"grad_x": {"dtype": "uint8", "shape": [size], "data": payload.data}, "backend": "reference"}
    parts, length = encode_parts(reply)
    joined = b"".join(bytes(part) for part in parts)
    assert length == len(joined)
    assert msgpack.unpackb(joined, raw=False) == {**reply, "grad_x": {**reply["grad_x"], "data": payload.tobytes()}}
    assert joined == msgpack.packb(reply, use_bin_type=True)
    assert spec_bin_header(size) + payload.tobytes() in joined
    large = [part for part in parts if isinstance(part, memoryview)]
    if size >= 1 << 16:  # sent from grad_x's own buffer, after a part that ends with the spec's header
        (part,) = large
        assert np.shares_memory(np.frombuffer(part, np.uint8), payload)
        assert bytes(parts[parts.index(part) - 1]).endswith(spec_bin_header(size))


def test_a_batch_reply_of_bins_about_the_boundary_is_msgpacks():
    results = [{"grad_x": {"dtype": "uint8", "shape": [size], "data": np.full(size, size % 251, np.uint8).data}}
               for size in (65535, 65536, 65537)]
    reply = {"results": results, "timings_ms": {"total": 1.0}}
    parts, length = encode_parts(reply)
    joined = b"".join(bytes(part) for part in parts)
    assert length == len(joined) and joined == msgpack.packb(reply, use_bin_type=True)
    decoded = msgpack.unpackb(joined, raw=False)["results"]
    assert [len(result["grad_x"]["data"]) for result in decoded] == [65535, 65536, 65537]


@pytest.mark.parametrize("nbytes", [65532, 65536, 65540])
def test_the_endpoint_answers_grad_x_of_64_kib_and_about(client, nbytes):
    document, expected = _call(nbytes // 4)  # grad_x [N, 1] float32: 4 N bytes
    response = post(client, document)
    assert response.status_code == 200
    reply = msgpack.unpackb(response.content, raw=False)
    assert len(reply["grad_x"]["data"]) == nbytes
    assert spec_bin_header(nbytes) + expected.tobytes() in response.content
    batch = client.post(BATCH, content=pack([document, document]), headers=MSGPACK_HEADERS)
    assert batch.status_code == 200
    results = msgpack.unpackb(batch.content, raw=False)["results"]
    assert [result["grad_x"]["data"] for result in results] == [expected.tobytes()] * 2
