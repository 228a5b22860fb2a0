"""Protocol Buffers' wire format (protobuf.dev, "Encoding"), the little of it that the gRPC codec reads
and writes itself.

:func:`check_typed_contents` walks a ModelInferRequest's fields before the message is parsed: its
top level and each of its ``inputs``, a bounded number of fields each, skipping every value by its
length. So a message whose tensors travel in typed ``contents`` larger than
:data:`TYPED_CONTENTS_MAX_BYTES` is refused before protobuf parses it (parsing and converting
typed values costs per value, where raw contents are copied whole), as is one with more fields
than a request can use. :func:`append_bytes_field` appends a bytes field to a serialized message
(one copy of the bytes, where setting a message's field and serializing it copies them twice).
"""

from __future__ import annotations

from collections.abc import Iterator

from moegrad import MalformedRequest, PayloadTooLarge

__all__ = ["MAX_FIELDS", "TYPED_CONTENTS_MAX_BYTES", "append_bytes_field", "check_typed_contents", "varint"]

#: The most bytes of typed contents (``fp32_contents``, ``int_contents``, ...) one request may carry,
#: all inputs together: about a million 4-byte values. Larger tensors go in ``raw_input_contents``.
TYPED_CONTENTS_MAX_BYTES = 4 << 20
#: The most fields a request may have at its top level, and each of its inputs (a valid one has a few
#: dozen at most: its names, parameters, inputs, outputs and raw contents).
MAX_FIELDS = 4096
_VARINT, _FIXED64, _LENGTH, _START_GROUP, _END_GROUP, _FIXED32 = 0, 1, 2, 3, 4, 5
_INPUTS, _NAME, _CONTENTS = 5, 1, 5  # ModelInferRequest.inputs; InferInputTensor.name, .contents
#: InferTensorContents' fields by number (the order of the message in grpc_service.proto).
_CONTENTS_FIELDS = {
    1: "bool_contents",
    2: "int_contents",
    3: "int64_contents",
    4: "uint_contents",
    5: "uint64_contents",
    6: "fp32_contents",
    7: "fp64_contents",
    8: "bytes_contents",
}
_MESSAGE = "inference.ModelInferRequest"


class _Malformed(Exception):
    pass


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while pos < end and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Malformed(f"a varint at byte {pos} is cut short or longer than 10 bytes")


def _fields(data: bytes, start: int, end: int, where: str) -> Iterator[tuple[int, int, int, int]]:
    """``(number, wire type, value start, value end)`` of each field in ``data[start:end]``; a group
    is one field. At most MAX_FIELDS of them."""
    pos, count = start, 0
    while pos < end:
        count += 1
        if count > MAX_FIELDS:
            raise MalformedRequest(
                f"the request has more than {MAX_FIELDS} fields {where} (a ModelInfer request has a few dozen at "
                "most: its parameters, inputs, outputs and raw contents); send one field per name"
            )
        key, pos = _varint(data, pos, end)
        number, kind = key >> 3, key & 7
        value = pos
        if kind == _VARINT:
            pos = _varint(data, pos, end)[1]
        elif kind == _FIXED64:
            pos += 8
        elif kind == _FIXED32:
            pos += 4
        elif kind == _LENGTH:
            length, value = _varint(data, pos, end)
            pos = value + length
        elif kind == _START_GROUP:
            pos = _group_end(data, pos, end, number)
        else:
            raise _Malformed(f"field {number} at byte {value} has wire type {kind}")
        if number == 0 or pos > end:
            raise _Malformed(f"field {number} at byte {value} runs past the end of its message")
        yield number, kind, value, pos


def _group_end(data: bytes, pos: int, end: int, number: int) -> int:
    """The position after the end-group tag of the group ``number`` that starts at ``pos``."""
    depth = 1
    while pos < end:
        key, pos = _varint(data, pos, end)
        kind = key & 7
        if kind == _VARINT:
            pos = _varint(data, pos, end)[1]
        elif kind == _FIXED64:
            pos += 8
        elif kind == _FIXED32:
            pos += 4
        elif kind == _LENGTH:
            length, pos = _varint(data, pos, end)
            pos += length
        elif kind == _START_GROUP:
            depth += 1
        elif kind == _END_GROUP:
            depth -= 1
            if depth == 0:
                if key >> 3 != number:
                    break
                return pos
        else:
            break
    raise _Malformed(f"group {number} is not closed")


def check_typed_contents(data: bytes) -> None:
    """Refuse a serialized ModelInferRequest whose typed contents are over TYPED_CONTENTS_MAX_BYTES,
    or that has more than MAX_FIELDS fields at its top level or in one of its inputs, before it is
    parsed. Cost: a few operations per field at those two levels, none per byte.

    Raises:
        PayloadTooLarge: (RESOURCE_EXHAUSTED) the typed contents are over TYPED_CONTENTS_MAX_BYTES
            (named: the input and its contents field).
        MalformedRequest: (INVALID_ARGUMENT) too many fields, or bytes that are not a message.
    """
    total = 0
    try:
        for number, kind, start, end in _fields(data, 0, len(data), "at its top level"):
            if number != _INPUTS or kind != _LENGTH:
                continue
            name, contents = b"", None
            for inner, inner_kind, inner_start, inner_end in _fields(data, start, end, "in one of its inputs"):
                if inner == _NAME and inner_kind == _LENGTH:
                    name = data[inner_start : min(inner_end, inner_start + 64)]
                elif inner == _CONTENTS and inner_kind == _LENGTH:
                    contents = (inner_start, inner_end)
                    total += inner_end - inner_start
            if contents is not None and total > TYPED_CONTENTS_MAX_BYTES:
                _refuse_typed(data, name.decode("utf-8", "replace"), *contents, total)
    except _Malformed as exc:
        raise MalformedRequest(
            f"the request is not a valid {_MESSAGE} message ({exc}); send one serialized from the protocol's "
            "service definition"
        ) from None


def _refuse_typed(data: bytes, name: str, start: int, end: int, total: int) -> None:
    first = next(_fields(data, start, end, "in an input's contents"), None)
    field = f"contents.{_CONTENTS_FIELDS.get(first[0], 'contents') if first else 'contents'}"
    raise PayloadTooLarge(
        f"{name}.{field} makes the request's typed contents {total} bytes, over the limit of "
        f"{TYPED_CONTENTS_MAX_BYTES} bytes (typed values are converted one by one); send large tensors in "
        "raw_input_contents, one entry per input, little-endian and row-major (what tritonclient sends)",
        field=name or "inputs",
    )


def varint(value: int) -> bytes:
    """``value`` (0 or more) as a varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def append_bytes_field(message: bytes, number: int, value: memoryview) -> bytes:
    """``message`` with a bytes field ``number`` = ``value`` after its fields: a repeated bytes
    field gets one more entry, in the place protobuf itself serializes it when ``number`` is the
    message's last field and the message holds none of it yet."""
    return b"".join((message, varint(number << 3 | _LENGTH), varint(value.nbytes), value))
