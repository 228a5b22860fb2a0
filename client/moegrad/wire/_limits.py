"""The structure limits of a wire document: what bounds decoding's cost whatever a body's size (docs/protocol.md).

A server passes :data:`REQUEST_LIMITS` to :func:`moegrad.decode_body` (and per item to
:func:`moegrad.decode_batch`); a client decodes a reply with :data:`REPLY_LIMITS` (a batch's with
:func:`batch_reply_limits`), so that no reply costs more to decode than its bytes and a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_BATCH_CALLS",
    "MAX_DEPTH",
    "MAX_RANK",
    "REPLY_LIMITS",
    "REQUEST_LIMITS",
    "StructureLimits",
    "batch_reply_limits",
    "explain_reply_limits",
]

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

#: The most calls one batch body may carry.
MAX_BATCH_CALLS = 10_000

#: A reply of one call or comparison: the reply map, grad_x's tensor map and shape, timings_ms and
#: a comparison's report (about 45 maps and lists, the longest 34 items, with every standard); with
#: room to spare, and a server's messages (a problem's ``detail``) up to 4 KiB.
REPLY_LIMITS = StructureLimits(max_containers=256, max_map_len=64, max_array_len=256, max_str_len=4096)


def batch_reply_limits(count: int) -> StructureLimits:
    """The structure limits of a batch reply of ``count`` items: REPLY_LIMITS per item, and a
    ``results`` list of ``count``."""
    return StructureLimits(
        max_containers=count * REPLY_LIMITS.max_containers + 4,
        max_map_len=REPLY_LIMITS.max_map_len,
        max_array_len=max(count, REPLY_LIMITS.max_array_len),
        max_str_len=REPLY_LIMITS.max_str_len,
    )


#: The most maps and arrays one row of an explanation holds: the row, its evidence (its schedules,
#: NaN/Inf columns, candidates and up to 16 of them), its slots (6 lists) and elements (10 lists).
EXPLAIN_ROW_CONTAINERS = 40


def explain_reply_limits(rows: int, top_k: int) -> StructureLimits:
    """The structure limits of an explanation's reply for a call of ``rows`` tokens and ``top_k``:
    REPLY_LIMITS' per reply, and per row of the explanation (every row may differ) its maps and
    lists, a ``rows`` list of ``rows`` and slot lists of ``top_k``."""
    return StructureLimits(
        max_containers=REPLY_LIMITS.max_containers + rows * EXPLAIN_ROW_CONTAINERS,
        max_map_len=REPLY_LIMITS.max_map_len,
        max_array_len=max(rows, top_k, REPLY_LIMITS.max_array_len),
        max_str_len=REPLY_LIMITS.max_str_len,
    )
