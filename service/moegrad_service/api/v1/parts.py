"""v1 msgpack replies written in parts: grad_x is sent from the buffer it was computed into.

A msgpack ``bin`` is a marker (0xc4, 0xc5 or 0xc6) and a 1-, 2- or 4-byte big-endian length, then
the raw bytes (the msgpack specification, "bin format family": github.com/msgpack/msgpack, spec.md).
So a reply's map can be packed by msgpack up to each large bin's marker, the bin's bytes sent as their
own part, then the rest: joined, the parts are exactly ``msgpack.packb(document, use_bin_type=True)``.
(Requests are read in place by the client package's one v1 decoder, :func:`moegrad.wire.decode_body`
with ``min_view_bytes``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = ["PART_MIN_BYTES", "encode_parts"]

#: A reply's bins of this many bytes or more are sent as their own part.
PART_MIN_BYTES = 64 << 10


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
