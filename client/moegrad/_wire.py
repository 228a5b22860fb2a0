"""Tensors and bodies on the wire: NumPy arrays <-> msgpack maps (docs/protocol.md).

A tensor travels as the map ``{"dtype": str, "shape": [int, ...], "data": bin}`` where ``data`` is
the C-order, little-endian bytes of the array. bfloat16 travels as raw 2-byte words
(``ml_dtypes.bfloat16``). No msgpack ext types are sent or accepted, and nothing is ever unpickled.
"""

from __future__ import annotations

import itertools
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
    "FRAMES_ALIGN",
    "FRAMES_MAGIC",
    "FRAMES_MEDIA_TYPE",
    "MAX_BATCH_CALLS",
    "MAX_RANK",
    "REQUEST_LIMITS",
    "StructureLimits",
    "brief",
    "decode_batch",
    "decode_body",
    "decode_frames",
    "decode_tensor",
    "dtype_name",
    "encode_batch",
    "encode_body",
    "encode_body_view",
    "encode_frames",
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
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None  # the common case, without np.dtype()
    if name is not None:
        return name
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
    data = array.reshape(-1).view(np.uint8).data  # the same memoryview as memoryview(...) gives
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
        raise MalformedRequest(
            f"{field} must be a tensor map {{dtype, shape, data}}, got {type(obj).__name__}", field=field
        )
    if len(obj) != 3 or not _TENSOR_KEYS.issuperset(obj):
        keys = set(obj)
        missing, extra = sorted(_TENSOR_KEYS - keys), sorted(map(str, keys - _TENSOR_KEYS))
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
    if isinstance(data, _Segment):  # a frames body's tensor bytes (decode_frames), viewed in place
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

#: The most calls one batch body may carry.
MAX_BATCH_CALLS = 10_000


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
            item = unpacker.unpack()
            if not isinstance(item, dict):
                items.append(
                    MalformedRequest(f"batch item {index} must be a msgpack map (one call), got {type(item).__name__}")
                )
            elif not all(isinstance(key, str) for key in item):
                items.append(MalformedRequest(f"batch item {index} has a key that is not a string"))
            elif seen[0] > MAX_DEPTH and _deeper_than(item, MAX_DEPTH):  # fewer containers cannot nest deeper
                items.append(MalformedRequest(f"batch item {index} is nested more than {MAX_DEPTH} containers deep"))
            else:
                items.append(item)
        if unpacker.tell() != size:
            raise MalformedRequest("the batch body has trailing bytes after its array")
    except MalformedRequest:
        raise
    except Exception as exc:  # msgpack's OutOfData, FormatError, StackError, ValueError ...
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
        raise MalformedRequest(
            f"batch body is not a valid msgpack array{where} ({type(exc).__name__}: {reason})"
        ) from None
    return items


# --------------------------------------------------------------------------------------------------
# Frames: a msgpack header, then the tensors' bytes unpacked (zero-copy both ways)
# --------------------------------------------------------------------------------------------------

#: The media type of a frames body (docs/protocol.md, "Frames").
FRAMES_MEDIA_TYPE = "application/vnd.moegrad.frames"
#: The first 4 bytes of a frames body; a little-endian uint32 header length follows.
FRAMES_MAGIC = b"MGF1"
#: Every tensor's bytes start at a multiple of this offset from the body's start.
FRAMES_ALIGN = 16
_PREFIX = len(FRAMES_MAGIC) + 4
_SEGMENT_KEYS = frozenset({"dtype", "shape", "offset", "nbytes"})


class _Segment:
    """A tensor's bytes inside a frames body: a read-only memoryview that :func:`decode_tensor` takes
    as it takes a msgpack ``bin`` (a bare memoryview is refused there: msgpack never decodes one)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


def _aligned(n: int) -> int:
    return -(-n // FRAMES_ALIGN) * FRAMES_ALIGN


def encode_frames(document: Mapping[str, Any]) -> tuple[list[memoryview | bytes], int]:
    """A document as a frames body: its parts (to send in order, none copied) and their total length.

    Every top-level value that is a tensor map (:func:`encode_tensor`) travels as a segment: its
    header entry is ``{"dtype", "shape", "offset", "nbytes"}`` and its bytes follow the header,
    each at a 16-byte aligned offset (zero padding between). Other values stay in the header.

    Returns:
        (parts, length): ``parts[0]`` is prefix + header + padding; the rest are the tensors' own
        memoryviews and padding.
    """
    header: dict[str, Any] = {}
    segments: list[memoryview] = []
    for key, value in document.items():
        if isinstance(value, dict) and isinstance(value.get("data"), memoryview) and set(value) == _TENSOR_KEYS:
            header[key] = {
                "dtype": value["dtype"],
                "shape": value["shape"],
                "offset": 0,
                "nbytes": value["data"].nbytes,
            }
            segments.append(value["data"])
        else:
            header[key] = value
    # Offsets depend on the header's length, which depends on the offsets' encoded widths: pack with
    # 64-bit-wide placeholders first (msgpack's widest int), then with the real offsets, padded to the same end.
    tensor_keys = [k for k, v in header.items() if isinstance(v, dict) and set(v) == _SEGMENT_KEYS]
    for key in tensor_keys:
        header[key]["offset"] = 1 << 40
    packed = msgpack.packb(header, use_bin_type=True)
    start = _aligned(_PREFIX + len(packed))
    offset = start
    for key, data in zip(tensor_keys, segments, strict=True):
        header[key]["offset"] = offset
        offset = _aligned(offset + data.nbytes)
    packed = msgpack.packb(header, use_bin_type=True)
    assert _PREFIX + len(packed) <= start
    head = bytearray(start)
    head[:_PREFIX] = FRAMES_MAGIC + len(packed).to_bytes(4, "little")
    head[_PREFIX : _PREFIX + len(packed)] = packed
    parts: list[memoryview | bytes] = [memoryview(head)]
    position = start
    for key, data in zip(tensor_keys, segments, strict=True):
        parts.append(data.cast("B") if data.format != "B" else data)
        position += data.nbytes
        pad = _aligned(position) - position
        if pad and key != tensor_keys[-1]:
            parts.append(bytes(pad))
            position += pad
    return parts, position


def decode_frames(body: bytes | bytearray | memoryview, limits: StructureLimits | None = None) -> dict[str, Any]:
    """Unpack a frames body into a document whose tensor maps view the body (no copy).

    Args:
        body: the whole body (its start 16-byte aligned for the arrays to be aligned).
        limits: bounds on the header's structure, as :func:`decode_body`'s.

    Returns:
        The header map with each segment entry replaced by ``{"dtype", "shape", "data"}``, ``data``
        a read-only view of the body's bytes that :func:`decode_tensor` takes as it takes a ``bin``.

    Raises:
        MalformedRequest: no magic, a header length past the body, a header that is not a valid
            map (as :func:`decode_body`), a segment entry without exactly dtype/shape/offset/nbytes,
            an offset that is not a multiple of 16, before the end of the header or past the body,
            segments that overlap, or bytes after the last segment.
    """
    view = memoryview(body).cast("B") if not isinstance(body, memoryview) or body.format != "B" else body
    view = view.toreadonly()
    if len(view) < _PREFIX or bytes(view[: len(FRAMES_MAGIC)]) != FRAMES_MAGIC:
        raise MalformedRequest(
            f"a frames body starts with {FRAMES_MAGIC!r} and a 4-byte header length (docs/protocol.md, Frames)"
        )
    length = int.from_bytes(view[len(FRAMES_MAGIC) : _PREFIX], "little")
    if _PREFIX + length > len(view):
        raise MalformedRequest(f"the frames header of {length} bytes runs past the body of {len(view)} bytes")
    document = decode_body(view[_PREFIX : _PREFIX + length], limits)
    end = _PREFIX + length
    spans: list[tuple[int, int, str]] = []
    for key, value in document.items():
        if not (isinstance(value, dict) and "offset" in value):
            continue
        if set(value) != _SEGMENT_KEYS:
            raise MalformedRequest(
                f"{key} must have exactly the keys dtype, shape, offset, nbytes in a frames "
                f"header, got {brief(sorted(map(str, value)))}",
                field=key,
            )
        offset, nbytes = value["offset"], value["nbytes"]
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise MalformedRequest(f"{key}.offset and {key}.nbytes must be non-negative integers", field=key)
        if offset % FRAMES_ALIGN:
            raise MalformedRequest(f"{key}.offset={offset} must be a multiple of {FRAMES_ALIGN}", field=key)
        if offset < end or offset + nbytes > len(view):
            raise MalformedRequest(
                f"{key}'s bytes [{offset}, {offset + nbytes}) must lie after the header "
                f"(ends at {end}) and inside the body of {len(view)} bytes",
                field=key,
            )
        spans.append((offset, offset + nbytes, key))
        segment = _Segment(view[offset : offset + nbytes])
        document[key] = {"dtype": value["dtype"], "shape": value["shape"], "data": segment}
    spans.sort()
    for (_, first_end, first), (second_start, _, second) in itertools.pairwise(spans):
        if second_start < first_end:
            raise MalformedRequest(f"the bytes of {first} and {second} overlap", field=second)
    last = max([end] + [stop for _, stop, _ in spans])
    if last != len(view):
        raise MalformedRequest(f"the frames body has {len(view) - last} bytes after its last segment")
    return document


class FramesReader:
    """Reads a frames body as it arrives, each tensor's bytes copied once, into an array of its own.

    For a client reading its server's reply: feed the chunks in order, then :meth:`document`. The
    header is parsed as soon as it is complete; each segment's bytes then go straight into a fresh
    ``numpy.empty`` array of the segment's dtype and shape (padding is skipped), so a result is an
    owned, writable, C-contiguous array with no further copy.

    Args:
        length: the body's length (Content-Length), or None when unknown.
    """

    def __init__(self, length: int | None = None) -> None:
        self.length = length
        #: The error the body earned, set by whoever feeds it (it stops feeding then); raised by the reader's user.
        self.error: MalformedRequest | None = None
        self._head = bytearray()
        self._header: dict[str, Any] | None = None
        self._segments: list[tuple[int, int, np.ndarray]] = []  # (offset, nbytes, array) sorted by offset
        self._position = 0
        self._segment = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the body.

        Raises:
            MalformedRequest: the bytes so far are not a valid frames body (see :func:`decode_frames`).
        """
        view = memoryview(chunk).cast("B") if not isinstance(chunk, bytes) else memoryview(chunk)
        while self._header is None:  # only the header's own bytes are gathered; the rest is read in place
            need = _PREFIX if len(self._head) < _PREFIX else _PREFIX + self._frame_header_length()
            take = min(need - len(self._head), len(view))
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < need:
                return
            if need > _PREFIX:
                self._parse_header(need - _PREFIX)
                self._position = need
                self._head = bytearray()
        while len(view):
            if self._segment < len(self._segments):
                offset, nbytes, array = self._segments[self._segment]
                end = offset + nbytes
            else:
                offset = end = self._position + len(view)  # the body's end: nothing should follow
                if self.length is not None and end > self.length:
                    raise MalformedRequest("the frames body is longer than its Content-Length")
                self._position = end
                return
            if self._position < offset:  # padding before the segment
                skip = min(offset - self._position, len(view))  # padding is not checked
                view = view[skip:]
                self._position += skip
                continue
            take = min(end - self._position, len(view))
            target = array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")
            start = self._position - offset
            target[start : start + take] = view[:take]
            view = view[take:]
            self._position += take
            if self._position == end:
                self._segment += 1

    @property
    def received(self) -> int:
        """The bytes of the body taken so far (fed or advanced over)."""
        return self._position if self._header is not None else len(self._head)

    def room(self) -> memoryview | None:
        """Where the body's next bytes go when they are a tensor's: a writable view of the rest of
        that tensor's bytes, to receive into (then :meth:`advance`); None while the header, padding
        or the body's end comes next (:meth:`feed` those bytes)."""
        if self._header is None or self._segment >= len(self._segments):
            return None
        offset, nbytes, array = self._segments[self._segment]
        if self._position < offset:
            return None
        return array.reshape(-1).view(np.uint8).data[self._position - offset : nbytes]

    def advance(self, count: int) -> None:
        """Take ``count`` bytes written into :meth:`room` as the body's next bytes.

        Raises:
            ValueError: there is no room, or less than ``count`` bytes of it.
        """
        room = self.room()
        if room is None or not 0 <= count <= len(room):
            raise ValueError(f"advance({count}) past the room of {0 if room is None else len(room)} bytes")
        self._position += count
        offset, nbytes, _ = self._segments[self._segment]
        if self._position == offset + nbytes:
            self._segment += 1

    def _frame_header_length(self) -> int:
        if bytes(self._head[: len(FRAMES_MAGIC)]) != FRAMES_MAGIC:
            raise MalformedRequest(f"a frames body starts with {FRAMES_MAGIC!r}")
        return int.from_bytes(self._head[len(FRAMES_MAGIC) : _PREFIX], "little")

    def _parse_header(self, length: int) -> None:
        header = decode_body(memoryview(self._head)[_PREFIX : _PREFIX + length])
        end = _PREFIX + length
        segments = []
        for key, value in header.items():
            if not (isinstance(value, dict) and "offset" in value):
                continue
            if set(value) != _SEGMENT_KEYS:
                raise MalformedRequest(f"{key} must have exactly the keys dtype, shape, offset, nbytes", field=key)
            name, shape, offset, nbytes = value["dtype"], value["shape"], value["offset"], value["nbytes"]
            if name not in DTYPES or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise MalformedRequest(f"{key} has dtype {brief(name)} and shape {brief(shape)}", field=key)
            if type(offset) is not int or type(nbytes) is not int or offset < end or offset % FRAMES_ALIGN:
                raise MalformedRequest(
                    f"{key}.offset={brief(offset)} is not a 16-byte aligned offset after the header", field=key
                )
            dtype = DTYPES[name]
            if nbytes != math.prod(shape) * dtype.itemsize:
                raise MalformedRequest(f"{key}.nbytes={nbytes} does not match shape {shape} of {name}", field=key)
            array = np.empty(shape, dtype=dtype)
            segments.append((offset, nbytes, array))
            header[key] = array
        segments.sort(key=lambda segment: segment[0])
        for (first, size, _), (second, _, _) in itertools.pairwise(segments):
            if second < first + size:
                raise MalformedRequest("two segments of the frames body overlap")
        self._header, self._segments = header, segments

    def document(self) -> dict[str, Any]:
        """The body's header map, each tensor entry replaced by its filled array.

        Raises:
            MalformedRequest: the body ended before its header or a segment was complete, or its
                length differs from the Content-Length.
        """
        if self._header is None:
            raise MalformedRequest("the frames body ended inside its header")
        if self._segment < len(self._segments):
            raise MalformedRequest("the frames body ended inside a tensor's bytes")
        if self.length is not None and self._position != self.length:
            raise MalformedRequest(f"the frames body has {self._position} of its {self.length} bytes")
        return self._header
