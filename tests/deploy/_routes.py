"""Which paths the real app answers: the probes, the healthcheck and the scrape config must point there."""

from __future__ import annotations

from functools import cache

from starlette.routing import Match

__all__ = ["serves_get"]


@cache
def _app():
    from moegrad_service.app import create_app
    from moegrad_service.settings import Settings

    return create_app(Settings(backend="reference"))  # building the app opens nothing: no lifespan runs


def serves_get(path: str) -> bool:
    """Whether ``GET path`` reaches a route of ``create_app(...)`` (asked of the router itself)."""
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [], "query_string": b""}
    return any(route.matches(scope)[0] is Match.FULL for route in _app().router.routes)
