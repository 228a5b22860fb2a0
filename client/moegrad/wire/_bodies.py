"""v1 msgpack bodies read: one call's map, or a batch's array of them (docs/protocol.md).

Decoding is msgpack's own (msgpack-python's ``unpackb`` / ``Unpacker``), bounded by a
:class:`~moegrad.wire.StructureLimits` and refusing every ext type, so nothing is ever executed. With
``min_view_bytes`` a large tensor's ``data`` is not copied: :mod:`moegrad.wire._walk` finds each
tensor map's ``data`` bin of at least that many bytes, msgpack decodes the body with those bins
emptied, and each ``data`` becomes a read-only view of its bytes in the body (a
:class:`~moegrad.wire.Segment`, which :func:`~moegrad.wire.decode_tensor` takes as it takes a bin).
Whatever the walk does not expect (a key that is no str, an ext type, bytes past the end, a
container over the limits ...) sends the whole body msgpack's own way, so the in-place reading gives
the same document, or raises the same error (message, field, aclnn code), as the copying one for
every body. A view keeps the body's buffer alive: the body must stay unchanged while it is used.

A view's array is not aligned when the sender put its bytes at an odd offset; NumPy and the kernels
read such arrays as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from moegrad._errors import MalformedRequest
from moegrad.wire._codec import Segment
from moegrad.wire._limits import MAX_BATCH_CALLS, MAX_DEPTH, StructureLimits
from moegrad.wire._walk import Unexpected, Walk, array_header, bytes_of, skeleton

__all__ = ["VIEW_MIN_BYTES", "decode_batch", "decode_body", "holds_views"]

#: The smallest ``data`` bin a server views in place (``min_view_bytes``): below it, the walk over a
#: body costs more than msgpack's copy of the bin.
VIEW_MIN_BYTES = 64 << 10

_Bins = dict[bytes, "tuple[int, int, int] | None"]


def decode_body(
    body: bytes | bytearray | memoryview,
    limits: StructureLimits | None = None,
    *,
    min_view_bytes: int | None = None,
) -> dict[str, Any]:
    """Unpack a msgpack body into a map with string keys (nested maps are checked where they are
    read: a tensor map's keys by :func:`~moegrad.wire.decode_tensor`).

    Args:
        body: the msgpack bytes.
        limits: bounds on the document's structure (a server passes :data:`REQUEST_LIMITS`); None
            sizes every container and string limit to the body itself (never msgpack's 100 MiB
            default), for documents from a trusted peer (a client reading its server's reply).
        min_view_bytes: None copies every bin out of ``body``; a number views each tensor map's
            ``data`` bin of that many bytes or more in ``body`` (:class:`Segment`), for a body of at
            least that many bytes (``body`` must then stay unchanged while the document is used).

    Ext types (timestamps included) are rejected, and nothing is executed.

    Raises:
        MalformedRequest: not valid msgpack, trailing bytes, an ext type, nesting too deep, a
            structure over ``limits``, or a top-level value that is not a map with string keys;
            the same error whatever ``min_view_bytes``.
    """
    if min_view_bytes is None or len(body) < min_view_bytes:
        return _unpack_body(body, limits)
    view = bytes_of(body)
    try:
        end, found = Walk(view, limits or _sized(len(view))).call_map(0, min_view_bytes)
        if end != len(view):
            raise Unexpected  # trailing bytes: msgpack names them
    except Unexpected:
        return _unpack_body(body, limits)
    bins = [data for data in found.values() if data is not None]
    if not bins:
        return _unpack_body(body, limits)
    try:
        document = _unpack_body(skeleton(view, bins), limits)
    except MalformedRequest:
        return _unpack_body(body, limits)  # the error msgpack finds in the body itself
    _place(document, found, view)
    return document


def decode_batch(
    body: bytes | bytearray | memoryview,
    limits: StructureLimits | None = None,
    *,
    max_calls: int = MAX_BATCH_CALLS,
    min_view_bytes: int | None = None,
) -> list[dict[str, Any] | MalformedRequest]:
    """Unpack a batch body (a msgpack array of call maps) into its items, in order.

    ``limits`` bound each item as one request's body (a server passes :data:`REQUEST_LIMITS`), so a
    batch of n calls is bounded by n times what one call may hold: the container count restarts at
    every item, and the array itself may hold ``max_calls`` items.

    Args:
        body: the msgpack bytes.
        limits: per-item structure bounds; None sizes them to the body (a trusted peer's reply).
        max_calls: the most items the array may hold.
        min_view_bytes: None copies every bin; a number views each call's tensor ``data`` bins of
            that many bytes or more in ``body``, when the calls average at least that many bytes
            (the walk over thousands of small calls costs more than msgpack's copy of them).

    Returns:
        One entry per item: its map (string keys), or the MalformedRequest that item alone earns
        (an item that is not a map, or a map with non-string keys).

    Raises:
        MalformedRequest: the body is not one msgpack array, holds more than ``max_calls`` items, is
            truncated or has trailing bytes, an ext type, nesting too deep, or an item over ``limits``
            (the body cannot be read past such an item, so the whole batch is refused); the same
            error whatever ``min_view_bytes``.
    """
    if min_view_bytes is None:
        return _unpack_batch(body, limits, max_calls)
    view = bytes_of(body)
    try:
        items = _batch_bins(view, limits or _sized(len(view)), max_calls, min_view_bytes)
    except Unexpected:
        return _unpack_batch(body, limits, max_calls)
    bins = [data for found in items for data in found.values() if data is not None]
    if not bins:
        return _unpack_batch(body, limits, max_calls)
    try:
        decoded = _unpack_batch(skeleton(view, bins), limits, max_calls)
    except MalformedRequest:
        return _unpack_batch(body, limits, max_calls)
    for item, found in zip(decoded, items, strict=True):
        if isinstance(item, dict):
            _place(item, found, view)
    return decoded


def _batch_bins(view: memoryview, limits: StructureLimits, max_calls: int, min_view_bytes: int) -> list[_Bins]:
    """For each item of the batch in ``view``, the ``data`` bins to view (:meth:`Walk.call_map`).

    Raises:
        Unexpected: the body is not walked (too many or too small calls, or what the walk refuses).
    """
    walk = Walk(view, limits)
    count, pos = array_header(view)
    if count > max_calls or count == 0 or len(view) // count < min_view_bytes:
        raise Unexpected
    items: list[_Bins] = []
    for _ in range(count):
        walk.containers = 0  # msgpack's count restarts at every item
        if walk.head_is_map(pos):
            pos, found = walk.call_map(pos, min_view_bytes)
        else:
            pos, found = walk.skip(pos), {}
        items.append(found)
    if pos != len(view):
        raise Unexpected
    return items


def _sized(size: int) -> StructureLimits:
    """Structure limits sized to a body of ``size`` bytes (a trusted peer's document)."""
    return StructureLimits(max_containers=size + 1, max_map_len=size // 2 + 1, max_array_len=size + 1, max_str_len=size)


def _place(document: dict[str, Any], found: _Bins, view: memoryview) -> None:
    """Set each found tensor's ``data`` to a view of its bin's bytes in ``view``."""
    for name, data in found.items():
        if data is not None:
            document[name.decode()]["data"] = Segment(view[data[1] : data[2]])


def holds_views(document: Mapping[str, Any]) -> bool:
    """Whether a decoded document's tensors view its body (:func:`decode_body` viewed one)."""
    return any(isinstance(value, dict) and isinstance(value.get("data"), Segment) for value in document.values())


def _reject_ext(code: int, data: bytes) -> Any:
    raise MalformedRequest(f"msgpack ext type {code} is not allowed")


def _unpack_body(body: bytes | bytearray | memoryview, limits: StructureLimits | None) -> dict[str, Any]:
    """:func:`decode_body` by msgpack alone: every bin copied out of ``body``."""
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


def _unpack_batch(
    body: bytes | bytearray | memoryview, limits: StructureLimits | None, max_calls: int
) -> list[dict[str, Any] | MalformedRequest]:
    """:func:`decode_batch` by msgpack alone: every bin copied out of ``body``."""
    size = len(body)
    per = limits or _sized(size)
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
