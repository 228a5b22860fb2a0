"""v1 msgpack bodies read in place and replies written in parts: a tensor's bytes are never copied.

A msgpack ``bin`` is a 1-, 2- or 3-byte marker with a 1-, 2- or 4-byte big-endian length, then the
raw bytes (the msgpack specification, "bin format family"). So a request's tensors can be viewed in
the buffer the body was received into, as the frames path views its segments, and a reply's grad_x
can be sent from the buffer it was computed into.

Reading (:func:`decode_call_body`, :func:`decode_batch_body`): a walk over the body's structure
finds the ``data`` bin of each tensor map (a map that is the value of a top-level key, of the call
map or of each call map of a batch) of at least ``min_view_bytes``; the body without those bins'
bytes (each replaced by an empty bin) is then decoded by msgpack itself with the same limits as
always (:func:`moegrad.decode_body`, :func:`moegrad.decode_batch`), and each tensor's ``data``
becomes a read-only view of its bytes in the body (:class:`moegrad.Segment`, which
:func:`moegrad.decode_tensor` takes as it takes a ``bin``). Anything the walk does not expect (not
a map of string keys, a container or string over the limits, an ext type, bytes past the end or
after the document, a reserved byte), or a skeleton msgpack refuses, sends the whole body msgpack's
own way: the same decoder as before, so the same document, or the same error (field, rule, aclnn
code), whatever the body. A view's array is not aligned when the client's header puts its bytes at
an odd offset: NumPy and the kernels read such arrays as they are (unaligned loads cost nothing
measurable on x86-64 or AArch64).

A view keeps the body's buffer alive, and the buffer is kept for another body only once nothing
views it (``ReceiveBuffers.give``): the admission releases it after the reply is sent.

Writing (:func:`encode_parts`): the reply map is packed by msgpack up to each large bin's marker,
then the bin's bytes follow as their own part, then the rest; joined, the parts are exactly
``msgpack.packb(document, use_bin_type=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from moegrad import MAX_BATCH_CALLS, MalformedRequest, StructureLimits, decode_batch, decode_body
from moegrad.wire import Segment  # what decode_tensor takes as it takes a bin
from moegrad_service.api.v1.grouping import GROUP_CALL_BYTES

__all__ = [
    "VIEW_MIN_BYTES",
    "decode_batch_body",
    "decode_call_body",
    "encode_parts",
    "holds_views",
]

#: Bodies, and tensor data bins, of fewer bytes than this are decoded by msgpack whole (copied):
#: the walk costs more than such a copy. A batch's bins are viewed only when over GROUP_CALL_BYTES
#: (a smaller call may join a group, whose members' bytes msgpack gives as ``bytes``).
VIEW_MIN_BYTES = 64 << 10
#: A reply's bins of this many bytes or more are sent as their own part.
PART_MIN_BYTES = 64 << 10

_MAP, _ARRAY, _STR, _BIN, _SCALAR = range(5)
#: Markers of fixed-size values: the whole value's bytes (the marker included).
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}  # fmt: skip
#: Markers with a big-endian length after them: the kind and the length's bytes.
_SIZED = {0xC4: (_BIN, 1), 0xC5: (_BIN, 2), 0xC6: (_BIN, 4), 0xD9: (_STR, 1), 0xDA: (_STR, 2),
          0xDB: (_STR, 4), 0xDC: (_ARRAY, 2), 0xDD: (_ARRAY, 4), 0xDE: (_MAP, 2), 0xDF: (_MAP, 4)}  # fmt: skip
_DATA = b"data"
_EMPTY_BIN = b"\xc4\x00"


class _Unexpected(Exception):
    """The walk met what it does not handle: the body goes msgpack's own way, whole."""


class _Walk:
    """A walk over one body's structure (a view of bytes), bounded by ``limits`` like msgpack's own
    decoding: every container and string within them, at most ``max_containers`` containers per
    document (per call map of a batch)."""

    def __init__(self, view: memoryview, limits: StructureLimits) -> None:
        self.view, self.limits, self.end = view, limits, len(view)
        self.containers = 0

    def head(self, pos: int) -> tuple[int, int, int]:
        """The value at ``pos``: its kind, its length (bytes of a str or bin, items of an array,
        pairs of a map; 0 for a scalar) and the bytes of its marker and length (of a scalar: all)."""
        if pos >= self.end:
            raise _Unexpected
        marker = self.view[pos]
        if marker <= 0x7F or marker >= 0xE0:
            return _SCALAR, 0, 1
        if marker <= 0x8F:
            return self._container(_MAP, marker & 0x0F, 1)
        if marker <= 0x9F:
            return self._container(_ARRAY, marker & 0x0F, 1)
        if marker <= 0xBF:
            return self._string(marker & 0x1F, 1)
        fixed = _FIXED.get(marker)
        if fixed is not None:
            return _SCALAR, 0, fixed
        sized = _SIZED.get(marker)
        if sized is None:  # 0xc1 (never used) and the ext family
            raise _Unexpected
        kind, width = sized
        if pos + 1 + width > self.end:
            raise _Unexpected
        length = int.from_bytes(self.view[pos + 1 : pos + 1 + width], "big")
        if kind == _STR:
            return self._string(length, 1 + width)
        if kind == _BIN:
            return _BIN, length, 1 + width
        return self._container(kind, length, 1 + width)

    def _container(self, kind: int, count: int, width: int) -> tuple[int, int, int]:
        self.containers += 1
        bound = self.limits.max_map_len if kind == _MAP else self.limits.max_array_len
        if count > bound or self.containers > self.limits.max_containers:
            raise _Unexpected
        return kind, count, width

    def _string(self, length: int, width: int) -> tuple[int, int, int]:
        if length > self.limits.max_str_len:
            raise _Unexpected
        return _STR, length, width

    def head_is_map(self, pos: int) -> bool:
        """Whether a map begins at ``pos`` (nothing counted)."""
        if pos >= self.end:
            raise _Unexpected
        marker = self.view[pos]
        return 0x80 <= marker <= 0x8F or marker in (0xDE, 0xDF)

    def skip(self, pos: int) -> int:
        """The position after the value at ``pos``."""
        left = 1
        while left:
            left -= 1
            kind, length, width = self.head(pos)
            pos += width
            if kind == _STR or kind == _BIN:
                pos += length
            elif kind == _ARRAY:
                left += length
            elif kind == _MAP:
                left += 2 * length
        if pos > self.end:
            raise _Unexpected
        return pos

    def key(self, pos: int) -> tuple[memoryview | None, int]:
        """The raw bytes of the str key at ``pos`` (None: the key is no str) and the position after it."""
        kind, length, width = self.head(pos)
        if kind != _STR:
            return None, self.skip(pos)
        start = pos + width
        if start + length > self.end:
            raise _Unexpected
        return self.view[start : start + length], start + length

    def call_map(self, pos: int, min_view_bytes: int) -> tuple[int, dict[bytes, tuple[int, int, int] | None]]:
        """Walk the call map at ``pos``: the position after it, and for each of its keys (raw str
        bytes) the ``data`` bin to view of the tensor map it names, as (marker, start, end)
        positions, or None. A repeated key, in either map, counts as msgpack counts it: the last."""
        kind, count, width = self.head(pos)
        if kind != _MAP:
            raise _Unexpected
        pos += width
        found: dict[bytes, tuple[int, int, int] | None] = {}
        for _ in range(count):
            name, pos = self.key(pos)
            if name is None:
                raise _Unexpected  # a key that is no str: msgpack's own way says so
            kind, pairs, width = self.head(pos)
            if kind != _MAP:
                found[bytes(name)] = None
                pos = self.skip(pos)
                continue
            pos += width
            data = None
            for _ in range(pairs):
                inner, pos = self.key(pos)
                if inner is None or inner != _DATA:
                    pos = self.skip(pos)
                    continue
                kind, length, width = self.head(pos)
                if kind == _BIN and length >= min_view_bytes:
                    data = (pos, pos + width, pos + width + length)
                    pos += width + length
                    if pos > self.end:
                        raise _Unexpected
                else:
                    data = None
                    pos = self.skip(pos)
            found[bytes(name)] = data
        return pos, found


def _bytes_of(body: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view.toreadonly()


def _skeleton(view: memoryview, bins: list[tuple[int, int, int]]) -> bytearray:
    """The body with each of ``bins`` (marker, start, end) replaced by an empty bin."""
    skeleton = bytearray()
    done = 0
    for marker, _, end in sorted(bins):
        skeleton += view[done:marker]
        skeleton += _EMPTY_BIN
        done = end
    skeleton += view[done:]
    return skeleton


def _place(document: dict[str, Any], found: dict[bytes, tuple[int, int, int] | None], view: memoryview) -> None:
    for name, data in found.items():
        if data is not None:
            document[name.decode()]["data"] = Segment(view[data[1] : data[2]])


def decode_call_body(
    body: bytes | bytearray | memoryview, limits: StructureLimits, *, min_view_bytes: int = VIEW_MIN_BYTES
) -> dict[str, Any]:
    """A call's (or a comparison's) msgpack body as :func:`moegrad.decode_body` decodes it, each
    tensor map's ``data`` bin of ``min_view_bytes`` or more a read-only view of the body
    (:class:`moegrad.Segment`) instead of a copy.

    Args:
        body: the msgpack bytes (the server's receive buffer); it must stay unchanged while the
            document's views are alive.
        limits: the structure limits (:data:`moegrad.REQUEST_LIMITS`).
        min_view_bytes: the smallest bin viewed, and the smallest body walked.

    Raises:
        MalformedRequest: exactly as :func:`moegrad.decode_body` raises it for the same body.
    """
    view = _bytes_of(body)
    if len(view) < min_view_bytes:
        return decode_body(body, limits)
    walk = _Walk(view, limits)
    try:
        end, found = walk.call_map(0, min_view_bytes)
        if end != len(view):
            raise _Unexpected  # trailing bytes: msgpack names them
    except _Unexpected:
        return decode_body(body, limits)
    bins = [data for data in found.values() if data is not None]
    if not bins:
        return decode_body(body, limits)
    try:
        document = decode_body(_skeleton(view, bins), limits)
    except MalformedRequest:
        return decode_body(body, limits)  # the error msgpack finds in the body itself
    _place(document, found, view)
    return document


def decode_batch_body(
    body: bytes | bytearray | memoryview,
    limits: StructureLimits,
    *,
    max_calls: int = MAX_BATCH_CALLS,
    min_view_bytes: int = GROUP_CALL_BYTES + 1,
) -> list[dict[str, Any] | MalformedRequest]:
    """A batch body as :func:`moegrad.decode_batch` decodes it, each call map's tensor ``data`` bins
    of ``min_view_bytes`` or more read-only views of the body (by default only those over
    GROUP_CALL_BYTES: a call that may join a group has its bytes as ``bytes``, as the grouping
    needs them).

    Only a batch whose calls average ``min_view_bytes`` or more is walked (the walk of thousands of
    small calls would cost more than msgpack's copy of them); any other goes msgpack's way whole.

    Raises:
        MalformedRequest: exactly as :func:`moegrad.decode_batch` raises it for the same body.
    """
    view = _bytes_of(body)
    walk = _Walk(view, limits)
    try:
        count, pos = _array_header(view)
        if count > max_calls or count == 0 or len(view) // count < min_view_bytes:
            raise _Unexpected
        items: list[dict[bytes, tuple[int, int, int] | None]] = []
        for _ in range(count):
            walk.containers = 0  # msgpack's count restarts at every item
            if walk.head_is_map(pos):
                pos, found = walk.call_map(pos, min_view_bytes)
            else:
                pos, found = walk.skip(pos), {}
            items.append(found)
        if pos != len(view):
            raise _Unexpected
    except _Unexpected:
        return decode_batch(body, limits, max_calls=max_calls)
    bins = [data for found in items for data in found.values() if data is not None]
    if not bins:
        return decode_batch(body, limits, max_calls=max_calls)
    try:
        decoded = decode_batch(_skeleton(view, bins), limits, max_calls=max_calls)
    except MalformedRequest:
        return decode_batch(body, limits, max_calls=max_calls)
    for item, found in zip(decoded, items, strict=True):
        if isinstance(item, dict):
            _place(item, found, view)
    return decoded


def _array_header(view: memoryview) -> tuple[int, int]:
    """The item count of the array at the body's start and the position of its first item (the
    batch's own array: bounded by ``max_calls``, not by the per-call limits)."""
    marker = view[0] if len(view) else 0xC1
    if 0x90 <= marker <= 0x9F:
        return marker & 0x0F, 1
    width = {0xDC: 2, 0xDD: 4}.get(marker)
    if width is None or len(view) < 1 + width:
        raise _Unexpected
    return int.from_bytes(view[1 : 1 + width], "big"), 1 + width


def holds_views(document: Mapping[str, Any]) -> bool:
    """Whether a decoded document's tensors view the body (:func:`decode_call_body` viewed one)."""
    return any(isinstance(value, dict) and isinstance(value.get("data"), Segment) for value in document.values())


# --- the reply ------------------------------------------------------------------------------------


def _bin_marker(nbytes: int) -> bytes:
    """The marker and length msgpack writes before ``nbytes`` of bin (its smallest that fits)."""
    if nbytes < 1 << 8:
        return b"\xc4" + nbytes.to_bytes(1, "big")
    if nbytes < 1 << 16:
        return b"\xc5" + nbytes.to_bytes(2, "big")
    return b"\xc6" + nbytes.to_bytes(4, "big")


def _large(value: Any) -> bool:
    """Whether ``value`` is, or holds, a bin of PART_MIN_BYTES or more (a reply's containers are few)."""
    if isinstance(value, memoryview):
        return value.nbytes >= PART_MIN_BYTES
    if type(value) is dict:
        return any(_large(item) for item in value.values())
    if type(value) is list:
        return any(_large(item) for item in value)
    return False


def encode_parts(document: Mapping[str, Any]) -> tuple[list[bytes | memoryview], int]:
    """A reply document as msgpack in parts (to send in order): packed by msgpack, except that each
    ``memoryview`` of PART_MIN_BYTES or more is its own part, after its bin marker; the parts
    joined are ``msgpack.packb(document, use_bin_type=True)``.

    Returns:
        (parts, length): the parts (bytes, and the large memoryviews themselves, cast to bytes) and
        their total length in bytes.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    parts: list[bytes | memoryview] = []
    _emit(packer, parts, dict(document))
    tail = packer.bytes()
    if tail:
        parts.append(tail)
    return parts, sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)


def _emit(packer: msgpack.Packer, parts: list[bytes | memoryview], value: Any) -> None:
    # A function of the module, not a closure: a recursive closure is a reference cycle, which would
    # hold the parts (grad_x's buffer) until the garbage collector next ran.
    if isinstance(value, memoryview) and value.nbytes >= PART_MIN_BYTES:
        parts.append(packer.bytes() + _bin_marker(value.nbytes))
        packer.reset()
        parts.append(value.cast("B") if value.format != "B" or value.ndim != 1 else value)
    elif type(value) is dict and _large(value):
        packer.pack_map_header(len(value))
        for key, item in value.items():
            packer.pack(key)
            _emit(packer, parts, item)
    elif type(value) is list and _large(value):
        packer.pack_array_header(len(value))
        for item in value:
            _emit(packer, parts, item)
    else:
        packer.pack(value)
