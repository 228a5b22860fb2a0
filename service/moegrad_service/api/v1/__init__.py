"""Protocol v1 (msgpack calls, frames, batches and comparisons): its codec (documents <-> calls and
replies, no HTTP), the grouping of a batch's small calls of one shape, and its routes (read ->
decode -> dataplane -> encode)."""

from moegrad_service.api.v1.routes import BATCH_PATH, COMPARE_PATH, GRAD_PATH, router, routes

__all__ = ["BATCH_PATH", "COMPARE_PATH", "GRAD_PATH", "router", "routes"]
