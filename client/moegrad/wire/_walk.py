"""Where a v1 body's large tensor bytes lie: a walk over a msgpack body's structure that finds each
tensor map's ``data`` bin without decoding anything, so :mod:`moegrad.wire._bodies` can view those bytes
in place instead of copying them.

A msgpack ``bin`` is a 1-byte marker (0xc4, 0xc5, 0xc6) then a 1-, 2- or 4-byte big-endian length,
then the raw bytes; a str, an array and a map have their own markers and lengths, and a fixed-size
scalar's marker tells its size (the msgpack specification, "Formats": github.com/msgpack/msgpack,
spec.md). The walk is bounded like msgpack's own decoding (the same structure limits), and anything it
does not expect raises :class:`Unexpected`: the caller then decodes the body msgpack's own way, whole.
"""

from __future__ import annotations

from moegrad.wire._limits import StructureLimits

__all__ = ["Unexpected", "Walk", "array_header", "bytes_of", "skeleton"]

_MAP, _ARRAY, _STR, _BIN, _SCALAR = range(5)
#: Markers of fixed-size values: the whole value's bytes (the marker included).
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}  # fmt: skip
#: Markers with a big-endian length after them: the kind and the length's bytes.
_SIZED = {0xC4: (_BIN, 1), 0xC5: (_BIN, 2), 0xC6: (_BIN, 4), 0xD9: (_STR, 1), 0xDA: (_STR, 2),
          0xDB: (_STR, 4), 0xDC: (_ARRAY, 2), 0xDD: (_ARRAY, 4), 0xDE: (_MAP, 2), 0xDF: (_MAP, 4)}  # fmt: skip
_DATA = b"data"
_EMPTY_BIN = b"\xc4\x00"


class Unexpected(Exception):
    """The walk met what it does not handle: the body goes msgpack's own way, whole."""


class Walk:
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
            raise Unexpected
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
            raise Unexpected
        kind, width = sized
        if pos + 1 + width > self.end:
            raise Unexpected
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
            raise Unexpected
        return kind, count, width

    def _string(self, length: int, width: int) -> tuple[int, int, int]:
        if length > self.limits.max_str_len:
            raise Unexpected
        return _STR, length, width

    def head_is_map(self, pos: int) -> bool:
        """Whether a map begins at ``pos`` (nothing counted)."""
        if pos >= self.end:
            raise Unexpected
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
            raise Unexpected
        return pos

    def key(self, pos: int) -> tuple[memoryview | None, int]:
        """The raw bytes of the str key at ``pos`` (None: the key is no str) and the position after it."""
        kind, length, width = self.head(pos)
        if kind != _STR:
            return None, self.skip(pos)
        start = pos + width
        if start + length > self.end:
            raise Unexpected
        return self.view[start : start + length], start + length

    def call_map(self, pos: int, min_view_bytes: int) -> tuple[int, dict[bytes, tuple[int, int, int] | None]]:
        """Walk the call map at ``pos``: the position after it, and for each of its keys (raw str
        bytes) the ``data`` bin to view of the tensor map it names, as (marker, start, end)
        positions, or None. A repeated key, in either map, counts as msgpack counts it: the last."""
        kind, count, width = self.head(pos)
        if kind != _MAP:
            raise Unexpected
        pos += width
        found: dict[bytes, tuple[int, int, int] | None] = {}
        for _ in range(count):
            name, pos = self.key(pos)
            if name is None:
                raise Unexpected  # a key that is no str: msgpack's own way says so
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
                        raise Unexpected
                else:
                    data = None
                    pos = self.skip(pos)
            found[bytes(name)] = data
        return pos, found


def bytes_of(body: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view.toreadonly()


def skeleton(view: memoryview, bins: list[tuple[int, int, int]]) -> bytearray:
    """The body with each of ``bins`` (marker, start, end) replaced by an empty bin."""
    skeleton = bytearray()
    done = 0
    for marker, _, end in sorted(bins):
        skeleton += view[done:marker]
        skeleton += _EMPTY_BIN
        done = end
    skeleton += view[done:]
    return skeleton


def array_header(view: memoryview) -> tuple[int, int]:
    """The item count of the array at the body's start and the position of its first item (the
    batch's own array: bounded by ``max_calls``, not by the per-call limits)."""
    marker = view[0] if len(view) else 0xC1
    if 0x90 <= marker <= 0x9F:
        return marker & 0x0F, 1
    width = {0xDC: 2, 0xDD: 4}.get(marker)
    if width is None or len(view) < 1 + width:
        raise Unexpected
    return int.from_bytes(view[1 : 1 + width], "big"), 1 + width
