"""Tensors and bodies on the wire: NumPy arrays <-> msgpack maps (docs/protocol.md, DESIGN.md section 5).

A tensor travels as the map ``{"dtype": str, "shape": [int, ...], "data": bin}`` where ``data`` is
the C-order, little-endian bytes of the array. bfloat16 travels as raw 2-byte words
(``ml_dtypes.bfloat16``). No msgpack ext types are sent or accepted, and nothing is ever unpickled.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from moegrad._errors import AclnnStatus, InvalidArgument, MalformedRequest, PayloadTooLarge

__all__ = [
    "DTYPES",
    "MAX_RANK",
    "REQUEST_LIMITS",
    "StructureLimits",
    "brief",
    "decode_body",
    "decode_tensor",
    "dtype_name",
    "encode_body",
    "encode_body_view",
    "encode_tensor",
]

#: The wire dtype names and their little-endian NumPy dtypes: the one table every path uses.
DTYPES: Mapping[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
}
_NAMES: Mapping[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})
#: Dtype names that exist (NumPy's, and the Open Inference Protocol's lower-cased) but that the
#: operator does not take: such a tensor is the operator's 161002, not a malformed body.
_UNSUPPORTED_DTYPES = frozenset({"float64", "int64", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
                                 "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"})
#: The highest rank a wire tensor may have (the operator takes ranks 1 to 3).
MAX_RANK = 8
#: The deepest container nesting a body may have (a request is 3 deep: map, tensor map, shape list).
#: msgpack's own stack stops at 1024; this keeps every value far from Python's recursion limit too,
#: which ``repr`` of a ~1000-deep list in an error message would otherwise hit (a 500, not a 400).
MAX_DEPTH = 16


@dataclass(frozen=True)
class StructureLimits:
    """Bounds on a msgpack document's structure that hold whatever its size, so that decoding costs
    at most the body plus a small constant (a 1-byte empty map would otherwise become a 64-byte
    Python dict: a body of them decodes to ~100x its size).

    Attributes:
        max_containers: maps and arrays in the whole document, counted while it is parsed.
        max_map_len: pairs in one map.
        max_array_len: items in one array.
        max_str_len: bytes in one string (keys, dtype and order names).
    """

    max_containers: int
    max_map_len: int
    max_array_len: int
    max_str_len: int


#: A request of one call: the body map (16 keys at most, compare's included), three tensor maps and
#: their shapes (rank <= MAX_RANK), a list of standard names; with room to name what is wrong.
REQUEST_LIMITS = StructureLimits(max_containers=32, max_map_len=32, max_array_len=64, max_str_len=1024)


def dtype_name(dtype: np.dtype | type) -> str | None:
    """The wire name of ``dtype`` (either byte order), or None when the wire has no such dtype."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    return _NAMES.get(dtype)


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
    data = memoryview(array.reshape(-1).view(np.uint8))
    return {"dtype": name, "shape": shape, "data": data}


_BRIEF = reprlib.Repr()
_BRIEF.maxlist, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlevel = 12, 64, 64, 2


def brief(value: Any) -> str:
    """A bounded repr for error messages: a client's million-entry shape is not echoed back whole."""
    return _BRIEF.repr(value)


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
        raise MalformedRequest(f"{field} must be a tensor map {{dtype, shape, data}}, got {type(obj).__name__}", field=field)
    keys = set(obj)
    if keys != _TENSOR_KEYS:
        missing, extra = sorted(_TENSOR_KEYS - keys), sorted(map(str, keys - _TENSOR_KEYS))
        raise MalformedRequest(f"{field} must have exactly the keys dtype, shape, data (missing {missing}, unknown {extra})", field=field)
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(name, str) or name not in DTYPES:
        if isinstance(name, str) and name in _UNSUPPORTED_DTYPES:  # a real dtype the operator does not take
            raise InvalidArgument(f"{field}.dtype={name} is not supported; the wire dtypes are {sorted(DTYPES)}: "
                                  f"cast the array (e.g. .astype(numpy.float32) or .astype(numpy.int32))",
                                  aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID, field=field)
        raise MalformedRequest(f"{field}.dtype={brief(name)} is not one of {sorted(DTYPES)}", field=field)
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedRequest(f"{field}.shape={brief(shape)} must be a list of at most {MAX_RANK} non-negative integers", field=field)
    if not isinstance(data, bytes):
        raise MalformedRequest(f"{field}.data must be msgpack bin, got {type(data).__name__}", field=field)
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise PayloadTooLarge(f"{field}.shape={shape} has {count} elements, over the limit of {max_elements}", field=field)
    dtype = DTYPES[name]
    if len(data) != count * dtype.itemsize:
        raise MalformedRequest(
            f"{field}.data has {len(data)} bytes but shape {shape} of {name} needs {count * dtype.itemsize}",
            field=field,
        )
    try:
        return np.frombuffer(data, dtype=dtype, count=count).reshape(shape)
    except ValueError:  # an empty array with a dimension NumPy cannot represent, e.g. [0, 2**70]
        raise MalformedRequest(f"{field}.shape={shape} is too large for an array", field=field) from None


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


def _reject_ext(code: int, data: bytes) -> Any:
    raise MalformedRequest(f"msgpack ext type {code} is not allowed")


def decode_body(body: bytes | bytearray | memoryview, limits: StructureLimits | None = None) -> dict[str, Any]:
    """Unpack a msgpack body into a map with string keys.

    Args:
        body: the msgpack bytes.
        limits: bounds on the document's structure (a server passes :data:`REQUEST_LIMITS`); None
            sizes every container and string limit to the body itself (never msgpack's 100 MiB
            default), for documents from a trusted peer (a client reading its server's reply).

    Ext types (timestamps included) are rejected, and nothing is executed.

    Raises:
        MalformedRequest: not valid msgpack, trailing bytes, an ext type, nesting too deep, a
            structure over ``limits``, or a top-level value that is not a map with string keys.
    """
    size = len(body)
    bounds = {"max_str_len": size, "max_array_len": size, "max_map_len": size // 2}
    hooks: dict[str, Any] = {}
    if limits is not None:
        bounds = {"max_str_len": min(size, limits.max_str_len), "max_array_len": min(size, limits.max_array_len),
                  "max_map_len": min(size // 2, limits.max_map_len)}
        seen = [0]

        def count(container: Any) -> Any:  # called as each map or array is completed
            seen[0] += 1
            if seen[0] > limits.max_containers:
                raise MalformedRequest(f"body has more than {limits.max_containers} maps and arrays; a request "
                                       "holds a handful (docs/protocol.md)")
            return container

        hooks = {"object_hook": count, "list_hook": count}
    try:
        document = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=size,
            max_ext_len=0,
            ext_hook=_reject_ext,
            **bounds,
            **hooks,
        )
    except MalformedRequest:
        raise
    except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, StackError, UnicodeDecodeError ...
        reason = str(exc) or "truncated or invalid data"
        if isinstance(exc, msgpack.ExtraData):
            reason = "trailing bytes after the document"
        elif isinstance(exc, msgpack.StackError):
            reason = "nested too deeply"
        elif "max_ext_len" in reason:  # max_ext_len=0 refuses every ext type before ext_hook runs
            reason = "a msgpack ext type (timestamps included); none is allowed"
        raise MalformedRequest(f"body is not a valid msgpack document ({type(exc).__name__}: {reason})") from None
    if not isinstance(document, dict):
        raise MalformedRequest(f"body must be a msgpack map, got {type(document).__name__}")
    if _deeper_than(document, MAX_DEPTH):
        raise MalformedRequest(f"body is nested more than {MAX_DEPTH} containers deep")
    return document


def _deeper_than(document: dict[str, Any], limit: int) -> bool:
    """True when containers nest more than ``limit`` deep (the top-level map is depth 1); iterative."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
