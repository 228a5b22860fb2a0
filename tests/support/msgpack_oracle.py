"""msgpack itself as the oracle of the v1 body decoder's in-place reading and of the reply writer.

The service decodes a v1 msgpack body with :func:`moegrad.wire.decode_body` (a batch with
``decode_batch``) and ``min_view_bytes``, so that large tensors view the body, and packs a reply in
parts (:func:`moegrad_service.api.v1.parts.encode_parts`). The oracle is msgpack's own decoding of the
same body, every bin copied (the same functions without ``min_view_bytes``: msgpack alone), and
``msgpack.packb``. :func:`checking` wraps the names the v1 routes call so that every body a test sends
is decoded three ways -- msgpack alone, the service's own way, and with every ``data`` bin viewed
(``min_view_bytes=0``, so that the walk runs on small bodies too) -- and each way must give the same
document (a view equal, byte for byte, to the bin it replaces) or the same error (type, message,
field, aclnn code: so the same status and problem document); and every reply's parts, joined, must be
msgpack's own bytes. The service's own result is what the route gets.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from moegrad import MoegradError
from moegrad.wire import Segment, decode_batch, decode_body

__all__ = ["checking", "outcome"]


def _plain(value: Any) -> Any:
    """``value`` with every view as the bytes it views, every float as its bits (a NaN equals no
    other NaN, and -0.0 equals 0.0) and every error as what its answer is made of."""
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, Segment):
        return ("view", bytes(value.view))
    if isinstance(value, bytes):
        return ("view", value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, MoegradError):
        return _error(value)
    if isinstance(value, float):  # by its bits: NaN equals NaN, and -0.0 differs from 0.0
        return ("float", struct.pack("<d", value))
    return value


def _error(exc: MoegradError) -> tuple:
    return ("error", type(exc).__name__, str(exc), getattr(exc, "field", None), getattr(exc, "aclnn_status", None))


def outcome(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What ``function(*args, **kwargs)`` gives, comparable: its result with views as bytes, or its error."""
    try:
        return _plain(function(*args, **kwargs))
    except MoegradError as exc:
        return _error(exc)


def checking(module: Any, monkeypatch: Any) -> list[int]:
    """Wrap ``module``'s decode_body, decode_batch and encode_parts (the names the v1 routes call)
    with the oracle's checks; the list returned counts the bodies and replies checked."""
    from moegrad_service.api.v1.parts import encode_parts

    checked = [0, 0]

    def call_body(body, limits, **kwargs):
        expected = outcome(decode_body, bytes(body), limits)
        assert outcome(decode_body, body, limits, min_view_bytes=0) == expected
        assert outcome(decode_body, body, limits, **kwargs) == expected
        checked[0] += 1
        return decode_body(body, limits, **kwargs)  # what the route gets (or raises)

    def batch_body(body, limits, **kwargs):
        calls = kwargs.get("max_calls")
        limit = {} if calls is None else {"max_calls": calls}
        expected = outcome(decode_batch, bytes(body), limits, **limit)
        assert outcome(decode_batch, body, limits, min_view_bytes=0, **limit) == expected
        assert outcome(decode_batch, body, limits, **kwargs) == expected
        checked[0] += 1
        return decode_batch(body, limits, **kwargs)

    def parts(document):
        parts, length = encode_parts(document)
        joined = b"".join(bytes(part) for part in parts)
        assert joined == msgpack.packb(document, use_bin_type=True) and len(joined) == length
        checked[1] += 1
        return parts, length

    monkeypatch.setattr(module, "decode_body", call_body)
    monkeypatch.setattr(module, "decode_batch", batch_body)
    monkeypatch.setattr(module, "encode_parts", parts)
    return checked
