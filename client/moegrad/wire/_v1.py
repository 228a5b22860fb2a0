"""Protocol v1's paths and media types (docs/protocol.md): written here once, for the client and the service."""

from __future__ import annotations

from moegrad.wire._frames import FRAMES_MEDIA_TYPE

__all__ = [
    "BATCH_PATH",
    "COMPARE_PATH",
    "EXPLAIN_PATH",
    "FRAMES_ACCEPT",
    "GRAD_PATH",
    "INFO_PATH",
    "JSON_MEDIA_TYPE",
    "MSGPACK_MEDIA_TYPE",
    "MSGPACK_MEDIA_TYPES",
]

#: One call: a msgpack (or frames) body in, grad_x out.
GRAD_PATH = "/v1/moe_init_routing_v2_grad"
#: Many independent calls (and comparisons) in one msgpack array.
BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
#: One call and a candidate grad_x, judged.
COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
#: One call and a candidate grad_x, each differing row explained.
EXPLAIN_PATH = "/v1/moe_init_routing_v2_grad/explain"
#: The service's version, backend, device profile, wire formats and limits, as JSON.
INFO_PATH = "/v1/info"
#: The media type a msgpack body is sent with.
MSGPACK_MEDIA_TYPE = "application/msgpack"
#: Every media type a msgpack body is accepted under.
MSGPACK_MEDIA_TYPES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack"})
#: The media type of ``/v1/info`` and of problem documents' JSON.
JSON_MEDIA_TYPE = "application/json"
#: The Accept of a call that takes a frames reply where the server offers one, msgpack otherwise.
FRAMES_ACCEPT = f"{FRAMES_MEDIA_TYPE}, {MSGPACK_MEDIA_TYPE};q=0.5"
