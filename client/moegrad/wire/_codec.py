"""Tensors and bodies on the wire: NumPy arrays <-> msgpack maps (docs/protocol.md).

A tensor travels as the map ``{"dtype": str, "shape": [int, ...], "data": bin}`` where ``data`` is
the C-order, little-endian bytes of the array. bfloat16 travels as raw 2-byte words
(``ml_dtypes.bfloat16``). No msgpack ext types are sent or accepted, and nothing is ever unpickled.
A body is one msgpack map (one call or reply), or an array of them (a batch): packed here, read by
:mod:`moegrad.wire._bodies`; the frames form of a body is :mod:`moegrad.wire._frames`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from moegrad._dtypes import DTYPES, brief, dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument, MalformedRequest, PayloadTooLarge
from moegrad.wire._limits import MAX_RANK

__all__ = [
    "TENSOR_KEYS",
    "Segment",
    "decode_tensor",
    "encode_batch",
    "encode_body",
    "encode_body_view",
    "encode_tensor",
    "fields_document",
]

#: The keys of a tensor map, exactly.
TENSOR_KEYS = frozenset({"dtype", "shape", "data"})
#: Dtype names that exist (NumPy's, and the Open Inference Protocol's lower-cased) but that the
#: operator does not take: such a tensor is the operator's 161002, not a malformed body.
_UNSUPPORTED_DTYPES = frozenset(
    {
        "float64",
        "int64",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    }
)


class Segment:
    """A tensor's bytes inside a frames body (:func:`moegrad.decode_frames`): a read-only memoryview
    that :func:`decode_tensor` takes as it takes a msgpack ``bin`` (a bare memoryview is refused
    there: msgpack never decodes one)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """Encode an array as a wire tensor map.

    Args:
        array: any shape, dtype float16 / bfloat16 / float32 / int32 in either byte order, any
            strides; it is made C-contiguous and little-endian (copied only when it is not already).

    Returns:
        ``{"dtype": name, "shape": [...], "data": memoryview}``; the memoryview aliases the array
        (or its contiguous copy) and is packed by msgpack as ``bin`` without another copy.

    Raises:
        TypeError: ``array`` has a dtype the wire does not carry.
    """
    array = np.asarray(array)
    name = dtype_name(array.dtype)
    if name is None:
        raise TypeError(f"dtype {array.dtype} cannot travel on the wire; use one of {sorted(DTYPES)}")
    shape = list(array.shape)  # before ascontiguousarray, which turns a 0-d array into shape [1]
    array = np.ascontiguousarray(array, dtype=DTYPES[name])
    data = array.reshape(-1).view(np.uint8).data  # the same memoryview as memoryview(...) gives
    return {"dtype": name, "shape": shape, "data": data}


def fields_document(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A call's keyword arguments as a wire document: each array a tensor map (no copy of a
    C-contiguous little-endian array), an absent tensor left out (the wire's null tensor).

    Raises:
        TypeError: an array of a dtype the wire does not carry.
    """
    return {
        name: encode_tensor(np.asarray(value)) if name in ("grad_expanded_x", "expanded_row_idx") else value
        for name, value in fields.items()
        if value is not None or name not in ("grad_expanded_x", "expanded_row_idx")
    }


def decode_tensor(obj: Any, field: str, *, max_elements: int | None = None) -> np.ndarray:
    """Decode a wire tensor map into a read-only, zero-copy array.

    Args:
        obj: the decoded msgpack value that should be a tensor map.
        field: the request field it came from (named in every error).
        max_elements: the largest element count accepted, or None for no cap.

    Returns:
        An array of the map's dtype and shape viewing ``obj["data"]`` (``numpy.frombuffer``).

    Raises:
        MalformedRequest: not a map with exactly dtype/shape/data, unknown dtype name, a shape that is
            not a list of at most MAX_RANK non-negative ints, or ``len(data) != prod(shape) * itemsize``.
        PayloadTooLarge: more than ``max_elements`` elements are declared.
    """
    if not isinstance(obj, dict):
        raise MalformedRequest(
            f"{field} must be a tensor map {{dtype, shape, data}}, got {type(obj).__name__}", field=field
        )
    if len(obj) != 3 or not TENSOR_KEYS.issuperset(obj):
        keys = set(obj)
        missing, extra = sorted(TENSOR_KEYS - keys), sorted(map(str, keys - TENSOR_KEYS))
        raise MalformedRequest(
            f"{field} must have exactly the keys dtype, shape, data (missing {missing}, unknown {extra})", field=field
        )
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(name, str) or name not in DTYPES:
        if isinstance(name, str) and name in _UNSUPPORTED_DTYPES:  # a real dtype the operator does not take
            raise InvalidArgument(
                f"{field}.dtype={name} is not supported; the wire dtypes are {sorted(DTYPES)}: "
                f"cast the array (e.g. .astype(numpy.float32) or .astype(numpy.int32))",
                aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
                field=field,
            )
        raise MalformedRequest(f"{field}.dtype={brief(name)} is not one of {sorted(DTYPES)}", field=field)
    if type(shape) is not list or len(shape) > MAX_RANK or not _sizes(shape):
        raise MalformedRequest(
            f"{field}.shape={brief(shape)} must be a list of at most {MAX_RANK} non-negative integers", field=field
        )
    if isinstance(data, Segment):  # a frames body's tensor bytes (decode_frames), viewed in place
        data = data.view
    elif not isinstance(data, bytes):
        raise MalformedRequest(f"{field}.data must be msgpack bin, got {type(data).__name__}", field=field)
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise PayloadTooLarge(
            f"{field}.shape={shape} has {count} elements, over the limit of {max_elements}", field=field
        )
    dtype = DTYPES[name]
    if len(data) != count * dtype.itemsize:
        raise MalformedRequest(
            f"{field}.data has {len(data)} bytes but shape {shape} of {name} needs {count * dtype.itemsize}",
            field=field,
        )
    try:
        return np.ndarray(shape, dtype, data)  # a view of the bytes, as np.frombuffer(...).reshape(shape) gives
    except ValueError:  # an empty array with a dimension NumPy cannot represent, e.g. [0, 2**70]
        raise MalformedRequest(f"{field}.shape={shape} is too large for an array", field=field) from None


def _sizes(shape: list) -> bool:
    """Whether every entry of ``shape`` is a non-negative int (a loop: cheaper than all() at rank <= 8)."""
    for size in shape:
        if type(size) is not int or size < 0:
            return False
    return True


def encode_body(document: Mapping[str, Any]) -> bytes:
    """Pack a request or reply document (string keys; tensors already encoded) as msgpack."""
    return msgpack.packb(document, use_bin_type=True)


def encode_body_view(document: Mapping[str, Any]) -> memoryview:
    """:func:`encode_body`'s bytes as a view of msgpack's own buffer, without copying them out.

    ``packb`` packs into the packer's buffer and then copies the result into a new ``bytes``, so a
    large document is briefly held twice; the view skips that copy (and keeps the buffer alive).
    A server's reply (grad_x of up to GiBs) is the intended use.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(document)
    return packer.getbuffer()


def encode_batch(items: list[Mapping[str, Any]]) -> memoryview:
    """Pack a batch body: a msgpack array of call documents (tensors already encoded), unpadded."""
    return encode_body_view(list(items))  # type: ignore[arg-type]
