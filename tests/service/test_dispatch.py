"""One way in: every request reaches its handler through the app's own router, once.

The tensor-carrying POST routes (v1's grad, batch, compare and explain, v2's infer) are Starlette routes of the
app's router, each registered once; nothing in the middleware stack answers a request before the
router except the access log (which only observes) and the token check. The API description
lists them like every other route.
"""

from __future__ import annotations

from collections import Counter

from starlette.routing import Route

from moegrad_service.api.auth import AuthMiddleware
from moegrad_service.api.middleware import RequestLogMiddleware
from moegrad_service.api.routing import EndpointRoute
from moegrad_service.app import create_app
from moegrad_service.settings import Settings

INFERENCE = {
    "/v1/moe_init_routing_v2_grad",
    "/v1/moe_init_routing_v2_grad/batch",
    "/v1/moe_init_routing_v2_grad/compare",
    "/v1/moe_init_routing_v2_grad/explain",
    "/v2/models/{model_name}/infer",
    "/v2/models/{model_name}/versions/{model_version}/infer",
}


def test_each_inference_route_is_registered_once_in_the_apps_router():
    app = create_app(Settings(backend="reference"))
    posts = Counter(route.path for route in app.routes if isinstance(route, Route) and "POST" in (route.methods or ()))
    assert {path for path in INFERENCE if posts[path] == 1} == INFERENCE
    assert {route.path for route in app.routes if isinstance(route, EndpointRoute)} == INFERENCE


def test_the_only_user_middleware_is_the_access_log_and_the_token_check():
    app = create_app(Settings(backend="reference"))
    assert [m.cls for m in app.user_middleware] == [RequestLogMiddleware, AuthMiddleware]


def test_the_api_description_lists_the_inference_routes():
    paths = create_app(Settings(backend="reference")).openapi()["paths"]
    assert all("post" in paths[path] for path in INFERENCE)
