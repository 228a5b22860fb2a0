"""Protocol v1 (msgpack calls, frames, batches, comparisons and explanations): its codec (documents <-> calls and
replies, no HTTP), the grouping of a batch's small calls of one shape, and its routes (read ->
decode -> dataplane -> encode)."""

from moegrad_service.api.v1.routes import BATCH_PATH, COMPARE_PATH, EXPLAIN_PATH, GRAD_PATH, router, routes

__all__ = ["BATCH_PATH", "COMPARE_PATH", "EXPLAIN_PATH", "GRAD_PATH", "router", "routes"]
