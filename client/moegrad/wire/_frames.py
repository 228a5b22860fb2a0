"""Frames: a msgpack header, then the tensors' bytes unpacked, zero-copy both ways (docs/protocol.md, "Frames").

A frames body is ``MGF1``, a little-endian uint32 header length, the msgpack header (the document
with each tensor map replaced by ``{"dtype", "shape", "offset", "nbytes"}``), then each tensor's
bytes at a 16-byte aligned offset from the body's start. :func:`encode_frames` sends a document's
tensors from their own buffers; :func:`decode_frames` views them in a received body;
:class:`FramesReader` reads a reply as it arrives, each tensor's bytes copied once, into its own array.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from moegrad._dtypes import DTYPES, brief
from moegrad._errors import MalformedRequest
from moegrad.wire._bodies import decode_body
from moegrad.wire._codec import TENSOR_KEYS, Segment
from moegrad.wire._limits import StructureLimits

__all__ = [
    "FRAMES_ALIGN",
    "FRAMES_MAGIC",
    "FRAMES_MEDIA_TYPE",
    "FramesReader",
    "decode_frames",
    "encode_frames",
]

#: The media type of a frames body (docs/protocol.md, "Frames").
FRAMES_MEDIA_TYPE = "application/vnd.moegrad.frames"
#: The first 4 bytes of a frames body; a little-endian uint32 header length follows.
FRAMES_MAGIC = b"MGF1"
#: Every tensor's bytes start at a multiple of this offset from the body's start.
FRAMES_ALIGN = 16
_PREFIX = len(FRAMES_MAGIC) + 4
_SEGMENT_KEYS = frozenset({"dtype", "shape", "offset", "nbytes"})


def _aligned(n: int) -> int:
    return -(-n // FRAMES_ALIGN) * FRAMES_ALIGN


def encode_frames(document: Mapping[str, Any]) -> tuple[list[memoryview | bytes], int]:
    """A document as a frames body: its parts (to send in order, none copied) and their total length.

    Every top-level value that is a tensor map (:func:`~moegrad.encode_tensor`) travels as a segment: its
    header entry is ``{"dtype", "shape", "offset", "nbytes"}`` and its bytes follow the header,
    each at a 16-byte aligned offset (zero padding between). Other values stay in the header.

    Returns:
        (parts, length): ``parts[0]`` is prefix + header + padding; the rest are the tensors' own
        memoryviews and padding.
    """
    header: dict[str, Any] = {}
    segments: list[memoryview] = []
    for key, value in document.items():
        if isinstance(value, dict) and isinstance(value.get("data"), memoryview) and set(value) == TENSOR_KEYS:
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
        limits: bounds on the header's structure, as :func:`~moegrad.decode_body`'s.

    Returns:
        The header map with each segment entry replaced by ``{"dtype", "shape", "data"}``, ``data``
        a read-only view of the body's bytes that :func:`~moegrad.decode_tensor` takes as it takes a ``bin``.

    Raises:
        MalformedRequest: no magic, a header length past the body, a header that is not a valid
            map (as :func:`~moegrad.decode_body`), a segment entry without exactly dtype/shape/offset/nbytes,
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
        segment = Segment(view[offset : offset + nbytes])
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

    Every segment the header names is checked against the body's length (else ``max_bytes``)
    before any array is allocated, so a header that claims a huge shape costs nothing.

    Args:
        length: the body's length (Content-Length), or None when unknown.
        max_bytes: the most bytes the body may take when its length is unknown (None: no bound).
        limits: bounds on the header's structure, as :func:`~moegrad.decode_body`'s.
    """

    def __init__(
        self, length: int | None = None, *, max_bytes: int | None = None, limits: StructureLimits | None = None
    ) -> None:
        self.length = length
        self.max_bytes = max_bytes
        self._limits = limits
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
        length = int.from_bytes(self._head[len(FRAMES_MAGIC) : _PREFIX], "little")
        size = self.length if self.length is not None else self.max_bytes
        if size is not None and _PREFIX + length > size:
            raise MalformedRequest(f"the frames header of {length} bytes runs past the body of {size} bytes")
        return length

    def _parse_header(self, length: int) -> None:
        header = decode_body(memoryview(self._head)[_PREFIX : _PREFIX + length], self._limits)
        end = _PREFIX + length
        size = self.length if self.length is not None else self.max_bytes
        segments: list[tuple[int, int, str, list[int], np.dtype[Any]]] = []
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
            if size is not None and offset + nbytes > size:
                raise MalformedRequest(
                    f"{key}'s bytes [{offset}, {offset + nbytes}) run past the frames body of {size} bytes", field=key
                )
            segments.append((offset, nbytes, key, shape, dtype))
        segments.sort(key=lambda segment: segment[0])
        for (first, first_size, *_), (second, *_) in itertools.pairwise(segments):
            if second < first + first_size:
                raise MalformedRequest("two segments of the frames body overlap")
        self._segments = []
        for offset, nbytes, key, shape, dtype in segments:  # every segment checked: now allocate
            array = np.empty(shape, dtype=dtype)
            self._segments.append((offset, nbytes, array))
            header[key] = array
        self._header = header

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
