"""Protocol v2, the Open Inference Protocol: its codec (no routes) and its routes (decode -> dataplane -> encode)."""

from moegrad_service.api.v2.codec import MODEL_NAME, MODEL_VERSION
from moegrad_service.api.v2.routes import router, routes

__all__ = ["MODEL_NAME", "MODEL_VERSION", "router", "routes"]
