"""The tensor codec and the body decoder (docs/protocol.md, "Tensors").

A tensor is ``{"dtype": name, "shape": [ints], "data": bin}`` with little-endian, C-order data.
Expected bytes below are written from IEEE 754 / two's complement, not produced by moegrad.
"""

from __future__ import annotations

import struct
import tracemalloc

import ml_dtypes
import msgpack
import numpy as np
import pytest

from moegrad import (
    DTYPES,
    REQUEST_LIMITS,
    InvalidArgument,
    MalformedRequest,
    PayloadTooLarge,
    decode_body,
    decode_tensor,
    dtype_name,
    encode_body,
    encode_body_view,
    encode_tensor,
)

WIRE = {
    "float16": (np.dtype("<f2"), np.uint16),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), np.uint16),
    "float32": (np.dtype("<f4"), np.uint32),
    "int32": (np.dtype("<i4"), np.uint32),
}


def through_the_wire(array: np.ndarray, field: str = "t") -> np.ndarray:
    body = encode_body({field: encode_tensor(array)})
    return decode_tensor(decode_body(body)[field], field)


def malformed(obj, message_part: str, *, field: str = "t", **kwargs) -> MalformedRequest:
    with pytest.raises(MalformedRequest) as info:
        decode_tensor(obj, field, **kwargs)
    assert info.value.field == field
    assert message_part in info.value.message, info.value.message
    return info.value


def tensor(dtype="float32", shape=(2, 3), data=None):
    if data is None:
        data = bytes(4 * int(np.prod(shape)))
    return {"dtype": dtype, "shape": list(shape), "data": data}


# --------------------------------------------------------------------------------------------------
# The dtype table.
# --------------------------------------------------------------------------------------------------

def test_the_dtype_table_is_the_documented_one():
    assert set(DTYPES) == set(WIRE)
    for name, (dtype, _) in WIRE.items():
        assert DTYPES[name] == dtype
        assert dtype_name(dtype) == name
    assert dtype_name(np.dtype(">f4")) == "float32"
    assert dtype_name(np.dtype(">i4")) == "int32"
    assert dtype_name(np.float64) is None
    assert dtype_name(np.int64) is None


# --------------------------------------------------------------------------------------------------
# Round trips.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WIRE))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 5), (1, 1, 1, 1, 4)])
def test_every_bit_pattern_round_trips(name, shape):
    dtype, uint = WIRE[name]
    rng = np.random.default_rng(len(shape))
    raw = rng.integers(0, np.iinfo(uint).max, size=shape, dtype=uint, endpoint=True)
    array = raw.view(dtype)
    back = through_the_wire(array)
    assert back.dtype == dtype and back.shape == shape
    np.testing.assert_array_equal(back.view(uint), raw)


SPECIAL_BITS = {
    # -0.0, +0.0, inf, -inf, quiet NaN, NaN with payloads (quiet and signalling), smallest subnormal
    "float16": [0x8000, 0x0000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0x7C01, 0xFD55, 0x0001],
    "bfloat16": [0x8000, 0x0000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0x7F81, 0xFFAA, 0x0001],
    "float32": [0x80000000, 0, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFA5A5A5, 1],
}


@pytest.mark.parametrize("name", sorted(SPECIAL_BITS))
def test_signed_zero_infinities_and_nan_payloads_survive(name):
    dtype, uint = WIRE[name]
    raw = np.array(SPECIAL_BITS[name], dtype=uint)
    np.testing.assert_array_equal(through_the_wire(raw.view(dtype)).view(uint), raw)


def test_wire_bytes_are_little_endian_c_order():
    # float32 1.0 = 0x3F800000, -2.0 = 0xC0000000; bfloat16 1.0 = 0x3F80; float16 1.0 = 0x3C00.
    assert bytes(encode_tensor(np.array([[1.0], [-2.0]], dtype=np.float32))["data"]) == bytes.fromhex("0000803f000000c0")
    assert bytes(encode_tensor(np.array([1.0], dtype=ml_dtypes.bfloat16))["data"]) == bytes.fromhex("803f")
    assert bytes(encode_tensor(np.array([1.0], dtype=np.float16))["data"]) == bytes.fromhex("003c")
    assert bytes(encode_tensor(np.array([1, -2], dtype=np.int32))["data"]) == struct.pack("<ii", 1, -2)
    encoded = encode_tensor(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32))
    assert encoded["dtype"] == "int32" and encoded["shape"] == [2, 3]
    assert bytes(encoded["data"]) == struct.pack("<6i", 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("big", [">f2", ">f4", ">i4"])
def test_big_endian_arrays_are_converted(big):
    values = np.array([[1, -2, 3], [0, 5, -7]], dtype=big)
    encoded = encode_tensor(values)
    little = np.dtype(big).newbyteorder("<")
    assert encoded["dtype"] == dtype_name(little)
    assert bytes(encoded["data"]) == values.astype(little).tobytes()
    back = through_the_wire(values)
    assert back.dtype == little
    np.testing.assert_array_equal(back, values)


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::2],
        lambda a: a.T,
        lambda a: a[::-1, ::-3],
        lambda a: np.broadcast_to(a[:1], (5, 6)),
        lambda a: a[1:4, 2:5],
    ],
    ids=["strided", "transposed", "negative-strides", "broadcast", "sliced"],
)
def test_non_contiguous_arrays_are_encoded_in_c_order(view):
    base = np.arange(30, dtype=np.float32).reshape(5, 6)
    array = view(base)
    encoded = encode_tensor(array)
    assert encoded["shape"] == list(array.shape)
    expected = b"".join(struct.pack("<f", float(x)) for x in array.reshape(-1))  # C order, by hand
    assert bytes(encoded["data"]) == expected
    np.testing.assert_array_equal(through_the_wire(array), array)


def test_encode_rejects_dtypes_the_wire_does_not_carry():
    for dtype in (np.float64, np.int64, np.bool_, np.uint32):
        with pytest.raises(TypeError, match="cannot travel"):
            encode_tensor(np.zeros(3, dtype=dtype))


def test_decoded_arrays_are_read_only_zero_copy_views():
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    array = decode_tensor({"dtype": "float32", "shape": [2, 2], "data": data}, "t")
    np.testing.assert_array_equal(array, [[1.0, 2.0], [3.0, 4.0]])
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0, 0] = 5.0
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is data  # a view of the received bytes, not a copy


# --------------------------------------------------------------------------------------------------
# Malformed tensor maps.
# --------------------------------------------------------------------------------------------------

def test_truncated_data():
    error = malformed(tensor(data=bytes(23)), "23 bytes")
    assert "24" in error.message
    malformed(tensor(data=bytes(25)), "25 bytes")
    malformed(tensor("bfloat16", (3,), bytes(5)), "5 bytes")


@pytest.mark.parametrize("shape", [[-1], [2, -3], [-(2**63)]])
def test_negative_dim(shape):
    malformed(tensor(shape=(1,)) | {"shape": shape}, "non-negative integers")


@pytest.mark.parametrize("dim", [True, False, 2.0, "2", None, [2], b"\x02"])
def test_non_integer_dim(dim):
    malformed(tensor(shape=(1,)) | {"shape": [dim]}, "non-negative integers")


@pytest.mark.parametrize("shape", [6, "6", {"0": 6}, None, (6,)])
def test_shape_must_be_a_list(shape):
    malformed(tensor() | {"shape": shape}, "must be a list")


@pytest.mark.parametrize("name", ["bf16", "Float32", "", 5, None, b"float32"])
def test_unknown_dtype(name):
    malformed(tensor() | {"dtype": name}, "is not one of")


@pytest.mark.parametrize("name", ["float64", "int64", "int8", "uint8", "bool"])
def test_a_real_dtype_the_operator_does_not_take_is_161002(name):
    """The operator documents FLOAT16/BFLOAT16/FLOAT32 grads and INT32 indices; any other real dtype
    is its ACLNN_ERR_PARAM_INVALID (161002), as the client and v2 answer, with the cast to make."""
    with pytest.raises(InvalidArgument) as info:
        decode_tensor(tensor() | {"dtype": name}, "t")
    assert info.value.aclnn_status == 161002 and info.value.field == "t"
    assert ".astype(" in info.value.message


@pytest.mark.parametrize("data", ["\0" * 24, [0] * 24, None, 24, bytearray(24), memoryview(bytes(24))])
def test_data_must_be_bin(data):
    malformed(tensor() | {"data": data}, "msgpack bin")


@pytest.mark.parametrize("obj", [[1, 2], 3, "tensor", None, b"data"])
def test_tensor_must_be_a_map(obj):
    malformed(obj, "tensor map")


def test_tensor_keys_are_exactly_dtype_shape_data():
    error = malformed({"dtype": "float32", "shape": [0]}, "missing ['data']")
    assert "unknown []" in error.message
    malformed(tensor() | {"strides": [12, 4]}, "unknown ['strides']")


def test_rank_and_unrepresentable_shapes():
    malformed(tensor(shape=(1,) * 9, data=bytes(4)), "at most 8")  # the operator's tensors have rank 1-3
    malformed(tensor(shape=(1,) * 100, data=bytes(4)), "at most 8")
    assert through_the_wire(np.zeros((1,) * 8, dtype=np.float32)).shape == (1,) * 8
    malformed(tensor(shape=(0, 2**70), data=b""), "too large")
    malformed(tensor(shape=(0, 2**62, 2**62), data=b""), "too large")


def test_element_cap_is_payload_too_large():
    with pytest.raises(PayloadTooLarge) as info:
        decode_tensor(tensor(shape=(2, 3)), "t", max_elements=5)
    assert info.value.field == "t" and "6 elements" in info.value.message
    assert decode_tensor(tensor(shape=(2, 3)), "t", max_elements=6).shape == (2, 3)


def test_a_huge_declared_shape_is_rejected_without_allocating():
    tracemalloc.start()
    try:
        with pytest.raises(MalformedRequest):
            decode_tensor(tensor(shape=(2**40, 2**20), data=bytes(4)), "t")
        with pytest.raises(MalformedRequest):
            decode_tensor(tensor(shape=(2**31, 2**31), data=bytes(16)), "t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --------------------------------------------------------------------------------------------------
# Bodies.
# --------------------------------------------------------------------------------------------------

def body_error(body: bytes, message_part: str) -> MalformedRequest:
    with pytest.raises(MalformedRequest) as info:
        decode_body(body)
    assert info.value.field is None
    assert message_part in info.value.message, info.value.message
    return info.value


def test_body_round_trip():
    document = {"a": 1, "b": [1.5, "x", None, True], "c": {"d": b"\x00\x01"}, "t": encode_tensor(np.arange(3, dtype=np.int32))}
    back = decode_body(encode_body(document))
    assert back["a"] == 1 and back["b"] == [1.5, "x", None, True] and back["c"] == {"d": b"\x00\x01"}
    assert back["t"]["data"] == struct.pack("<3i", 0, 1, 2)


def test_body_view_is_the_same_bytes_as_the_packed_body():
    document = {"grad_x": encode_tensor(np.arange(70_000, dtype=np.float32)), "backend": "reference", "device": None,
                "timings_ms": {"queue": 0.25}}
    view = encode_body_view(document)
    assert isinstance(view, memoryview)
    assert view.tobytes() == msgpack.packb(document, use_bin_type=True)


def test_ext_types_are_rejected():
    body_error(msgpack.packb({"a": msgpack.ExtType(5, b"xx")}), "ext type")
    body_error(bytes.fromhex("81a161d6ff00000001"), "ext type")  # {"a": timestamp 32 (fixext 4, code -1)}, by hand
    body_error(msgpack.packb({"a": msgpack.Timestamp(1_700_000_000, 5)}), "ext type")
    body_error(bytes.fromhex("81a161d40100"), "ext type")  # fixext 1 written by hand: {"a": ext(1, b"\0")}


def test_trailing_bytes_are_rejected():
    body_error(msgpack.packb({"a": 1}) + b"\x00", "trailing bytes")
    body_error(msgpack.packb({"a": 1}) * 2, "trailing bytes")


@pytest.mark.parametrize("value", [[1, 2], 3, "body", None, b"bin", 1.5, True])
def test_body_must_be_a_map(value):
    body_error(msgpack.packb(value), "must be a msgpack map")


@pytest.mark.parametrize("depth", [50, 2_000, 100_000])
def test_deeply_nested_body_is_rejected(depth):
    # {"a": [[[...[nil]...]]]}: msgpack's own stack limit, or moegrad's tighter cap, refuses it.
    body_error(b"\x81\xa1a" + b"\x91" * depth + b"\xc0", "nested")


def test_moderate_nesting_is_accepted():
    assert decode_body(b"\x81\xa1a" + b"\x91" * 8 + b"\xc0")["a"] == [[[[[[[[None]]]]]]]]


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"\xff\xff\xff", b"\x81\xa1", b"\x82\xa1a\x01", b"not msgpack at all", bytes(range(256))],
    ids=["empty", "never-used", "negative-fixints", "truncated-key", "missing-pair", "text", "all-bytes"],
)
def test_garbage_is_rejected(body):
    body_error(body, "msgpack")


def test_invalid_utf8_and_non_string_keys_are_rejected():
    body_error(b"\x81\xa1a\xa2\xff\xfe", "not a valid msgpack document")
    body_error(msgpack.packb({1: 2}), "body has a key that is not a string")


@pytest.mark.parametrize(
    "header",
    [
        "c6ffffffff",  # bin 32, 4 GiB
        "dbffffffff",  # str 32, 4 GiB
        "ddffffffff",  # array 32, 2**32 - 1 items
        "dfffffffff",  # map 32, 2**32 - 1 pairs
        "c9ffffffff01",  # ext 32
    ],
    ids=["bin32", "str32", "array32", "map32", "ext32"],
)
def test_a_tiny_body_declaring_a_huge_length_is_rejected_without_allocating(header):
    body = bytes.fromhex("81a161" + header)  # {"a": <header>} and nothing behind it
    tracemalloc.start()
    try:
        body_error(body, "msgpack")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_limits_are_sized_to_the_body():
    # Without structure limits (a trusted peer's reply), a 1000-item array is fine in a body that
    # holds it, whatever msgpack's defaults.
    assert decode_body(msgpack.packb({"a": [0] * 1000}))["a"] == [0] * 1000
    # An array header claiming 16 items with 3 present: refused by the limit (16 > body size 8) or as truncated.
    body_error(bytes.fromhex("81a161dc0010") + b"\x00" * 3, "msgpack")


# --------------------------------------------------------------------------------------------------
# Request bodies: a structure bounded whatever the body holds.
# --------------------------------------------------------------------------------------------------

def test_a_request_sized_document_passes_the_request_limits():
    call = {"grad_expanded_x": encode_tensor(np.zeros((4, 2), np.float32)),
            "expanded_row_idx": encode_tensor(np.arange(4, dtype=np.int32)), "top_k": 2, "drop_pad_mode": 0,
            "active_num": 0, "order": "ascend910b", "candidate": encode_tensor(np.zeros((2, 2), np.float32)),
            "standards": ["bitwise", "threshold"], "return_grad_x": True}
    assert decode_body(encode_body(call), REQUEST_LIMITS)["top_k"] == 2


@pytest.mark.parametrize(("what", "document"), [
    ("many empty maps", {"a": [{}] * 60}),                       # 61 containers, each 1 byte on the wire
    ("many empty arrays", {"a": [[]] * 60, "b": [[]] * 60}),
    ("a long array", {"a": [0] * 65}),
    ("a wide map", {f"k{i}": 0 for i in range(33)}),
    ("a long string", {"a": "x" * 1025}),
])
def test_request_limits_refuse_what_no_request_needs(what, document):
    with pytest.raises(MalformedRequest) as info:
        decode_body(msgpack.packb(document), REQUEST_LIMITS)
    assert "msgpack" in info.value.message or "maps and arrays" in info.value.message


def test_a_body_of_empty_maps_costs_about_its_size_to_refuse():
    """16 MiB of 1-byte empty maps once decoded to ~150x the body; now parsing stops at the limit."""
    body = b"\x81\xa1a\xdd" + (1 << 24).to_bytes(4, "big") + b"\x80" * (1 << 24)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedRequest):
            decode_body(body, REQUEST_LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
