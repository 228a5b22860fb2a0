"""The wire: the v1 msgpack codec (tensors; bodies read in place or copied), the frames body, the
bounds on a body's structure, and protocol v1's paths and media types (docs/protocol.md).

The public face of :mod:`moegrad.wire`; the service and the benchmarks import these names from here.
"""

from moegrad.wire._bodies import VIEW_MIN_BYTES, decode_batch, decode_body, holds_views
from moegrad.wire._codec import (
    TENSOR_KEYS,
    Segment,
    decode_tensor,
    encode_batch,
    encode_body,
    encode_body_view,
    encode_tensor,
    fields_document,
)
from moegrad.wire._frames import (
    FRAMES_ALIGN,
    FRAMES_MAGIC,
    FRAMES_MEDIA_TYPE,
    FramesReader,
    decode_frames,
    encode_frames,
)
from moegrad.wire._limits import MAX_BATCH_CALLS, MAX_DEPTH, MAX_RANK, REQUEST_LIMITS, StructureLimits
from moegrad.wire._v1 import (
    BATCH_PATH,
    COMPARE_PATH,
    EXPLAIN_PATH,
    FRAMES_ACCEPT,
    GRAD_PATH,
    INFO_PATH,
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPES,
)

__all__ = [
    "BATCH_PATH",
    "COMPARE_PATH",
    "EXPLAIN_PATH",
    "FRAMES_ACCEPT",
    "FRAMES_ALIGN",
    "FRAMES_MAGIC",
    "FRAMES_MEDIA_TYPE",
    "GRAD_PATH",
    "INFO_PATH",
    "JSON_MEDIA_TYPE",
    "MAX_BATCH_CALLS",
    "MAX_DEPTH",
    "MAX_RANK",
    "MSGPACK_MEDIA_TYPE",
    "MSGPACK_MEDIA_TYPES",
    "REQUEST_LIMITS",
    "TENSOR_KEYS",
    "VIEW_MIN_BYTES",
    "FramesReader",
    "Segment",
    "StructureLimits",
    "decode_batch",
    "decode_body",
    "decode_frames",
    "decode_tensor",
    "encode_batch",
    "encode_body",
    "encode_body_view",
    "encode_frames",
    "encode_tensor",
    "fields_document",
    "holds_views",
]
