"""Tensors and bodies on the wire: NumPy arrays <-> msgpack maps (docs/protocol.md).

A tensor travels as the map ``{"dtype": str, "shape": [int, ...], "data": bin}`` where ``data`` is
the C-order, little-endian bytes of the array. bfloat16 travels as raw 2-byte words
(``ml_dtypes.bfloat16``). No msgpack ext types are sent or accepted, and nothing is ever unpickled.
A body is one msgpack map (one call or reply), or an array of them (a batch). The bounds on a
body's structure are :mod:`moegrad.wire._limits`'; the frames form of a body is :mod:`moegrad.wire._frames`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from moegrad._dtypes import DTYPES, brief, dtype_name
from moegrad._errors import AclnnStatus, InvalidArgument, MalformedRequest, PayloadTooLarge
from moegrad.wire._limits import MAX_BATCH_CALLS, MAX_DEPTH, MAX_RANK, StructureLimits

__all__ = [
    "TENSOR_KEYS",
    "Segment",
    "decode_batch",
    "decode_body",
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


def _reject_ext(code: int, data: bytes) -> Any:
    raise MalformedRequest(f"msgpack ext type {code} is not allowed")


def decode_body(body: bytes | bytearray | memoryview, limits: StructureLimits | None = None) -> dict[str, Any]:
    """Unpack a msgpack body into a map with string keys (nested maps are checked where they are
    read: a tensor map's keys by :func:`decode_tensor`).

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
        bounds = {
            "max_str_len": min(size, limits.max_str_len),
            "max_array_len": min(size, limits.max_array_len),
            "max_map_len": min(size // 2, limits.max_map_len),
        }
        seen = [0]

        def count(container: Any) -> Any:  # called as each map or array is completed
            seen[0] += 1
            if seen[0] > limits.max_containers:
                raise MalformedRequest(
                    f"body has more than {limits.max_containers} maps and arrays; a request "
                    "holds a handful (docs/protocol.md)"
                )
            return container

        hooks = {"object_hook": count, "list_hook": count}
    try:
        document = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=False,  # a key that is not a string is refused below, as a batch item's is
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
    if not all(isinstance(key, str) for key in document):
        raise MalformedRequest("body has a key that is not a string")
    if _deeper_than(document, MAX_DEPTH):
        raise MalformedRequest(f"body is nested more than {MAX_DEPTH} containers deep")
    return document


def _deeper_than(document: dict[str, Any], limit: int) -> bool:
    """True when containers nest more than ``limit`` deep (the top-level map is depth 1); iterative,
    one level of containers at a time (msgpack decodes to exactly dict and list)."""
    level: list[Any] = [document]
    depth = 1
    while level:
        if depth > limit:
            return True
        below = []
        for value in level:
            for child in value.values() if type(value) is dict else value:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        level = below
        depth += 1
    return False


# --------------------------------------------------------------------------------------------------
# Batches: one body of many independent calls
# --------------------------------------------------------------------------------------------------


def encode_batch(items: list[Mapping[str, Any]]) -> memoryview:
    """Pack a batch body: a msgpack array of call documents (tensors already encoded), unpadded."""
    return encode_body_view(list(items))  # type: ignore[arg-type]


def decode_batch(
    body: bytes | bytearray | memoryview, limits: StructureLimits | None = None, *, max_calls: int = MAX_BATCH_CALLS
) -> list[dict[str, Any] | MalformedRequest]:
    """Unpack a batch body (a msgpack array of call maps) into its items, in order.

    ``limits`` bound each item as one request's body (a server passes :data:`REQUEST_LIMITS`), so a
    batch of n calls is bounded by n times what one call may hold: the container count restarts at
    every item, and the array itself may hold ``max_calls`` items.

    Args:
        body: the msgpack bytes.
        limits: per-item structure bounds; None sizes them to the body (a trusted peer's reply).
        max_calls: the most items the array may hold.

    Returns:
        One entry per item: its map (string keys), or the MalformedRequest that item alone earns
        (an item that is not a map, or a map with non-string keys).

    Raises:
        MalformedRequest: the body is not one msgpack array, holds more than ``max_calls`` items, is
            truncated or has trailing bytes, an ext type, nesting too deep, or an item over ``limits``
            (the body cannot be read past such an item, so the whole batch is refused).
    """
    size = len(body)
    per = limits or StructureLimits(
        max_containers=size + 1, max_map_len=size // 2 + 1, max_array_len=size + 1, max_str_len=size
    )
    seen = [0]

    def count(container: Any) -> Any:
        seen[0] += 1
        if seen[0] > per.max_containers:
            raise MalformedRequest(
                f"batch item {index} has more than {per.max_containers} maps and arrays; a call "
                "holds a handful (docs/protocol.md)"
            )
        # the unpacker's own array bound must let the batch's array through, so an item's are checked here
        if type(container) is list and len(container) > per.max_array_len:
            raise MalformedRequest(
                f"batch item {index} has an array of {len(container)} items, over the limit of {per.max_array_len} "
                "(docs/protocol.md)"
            )
        return container

    unpacker = msgpack.Unpacker(
        raw=False,
        use_list=True,
        strict_map_key=False,
        max_buffer_size=max(size, 1),
        max_bin_len=size,
        max_str_len=min(size, per.max_str_len),
        max_array_len=max(min(size, per.max_array_len), min(size, max_calls)),
        max_map_len=min(size // 2, per.max_map_len),
        max_ext_len=0,
        ext_hook=_reject_ext,
        object_hook=count,
        list_hook=count,
    )
    index = -1
    try:
        unpacker.feed(body)
        count_items = unpacker.read_array_header()
        if count_items > max_calls:
            raise MalformedRequest(
                f"the batch holds {count_items} calls, over the limit of {max_calls}; split it into several batches"
            )
        items: list[dict[str, Any] | MalformedRequest] = []
        for index in range(count_items):
            seen[0] = 0
            items.append(_batch_item(unpacker.unpack(), index, seen[0]))
        if unpacker.tell() != size:
            raise MalformedRequest("the batch body has trailing bytes after its array")
    except MalformedRequest:
        raise
    except Exception as exc:  # msgpack's OutOfData, FormatError, StackError, ValueError ...
        raise _batch_error(exc, index) from None
    return items


def _batch_item(item: Any, index: int, containers: int) -> dict[str, Any] | MalformedRequest:
    """Batch item ``index`` as decoded (holding ``containers`` maps and arrays): its map, or the
    MalformedRequest that item alone earns."""
    if not isinstance(item, dict):
        return MalformedRequest(f"batch item {index} must be a msgpack map (one call), got {type(item).__name__}")
    if not all(isinstance(key, str) for key in item):
        return MalformedRequest(f"batch item {index} has a key that is not a string")
    if containers > MAX_DEPTH and _deeper_than(item, MAX_DEPTH):  # fewer containers cannot nest deeper
        return MalformedRequest(f"batch item {index} is nested more than {MAX_DEPTH} containers deep")
    return item


def _batch_error(exc: Exception, index: int) -> MalformedRequest:
    """msgpack's error reading a batch body (at item ``index``; -1: before the first) as the client's."""
    reason = str(exc) or "truncated or invalid data"
    if isinstance(exc, msgpack.OutOfData):
        reason = "truncated"
    elif isinstance(exc, msgpack.StackError):
        reason = "nested too deeply"
    elif "max_ext_len" in reason:
        reason = "a msgpack ext type (timestamps included); none is allowed"
    elif isinstance(exc, (ValueError, msgpack.UnpackValueError)) and index < 0:
        reason = f"not a msgpack array of call maps ({reason})"
    where = f" at item {index}" if index >= 0 else ""
    return MalformedRequest(f"batch body is not a valid msgpack array{where} ({type(exc).__name__}: {reason})")
