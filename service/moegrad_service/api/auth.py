"""Optional bearer-token authentication (off when no token is configured).

Tokens come from ``auth_tokens`` and ``auth_tokens_file`` (one per line; blank lines and ``#``
comments skipped). A presented token is compared with every accepted one through SHA-256 digests
and :func:`hmac.compare_digest`, so the time taken depends on neither the token's content nor its
length. Health, readiness and the OpenAPI document stay open; ``/metrics`` is open only when
``metrics_public`` is set.

Every route of the app's routers is an :class:`AuthenticatedRoute`, which checks the token before
the handler runs (an app-wide FastAPI dependency did the same at a higher cost per request:
see moegrad_service.api.inputs).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from moegrad import Unauthorized
from moegrad_service.settings import Settings

__all__ = ["OPEN_PATHS", "AuthenticatedRoute", "Authenticator", "load_tokens"]

#: Paths that never require a token (probes and the API description).
OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def load_tokens(settings: Settings) -> list[bytes]:
    """The accepted tokens as SHA-256 digests.

    Raises:
        OSError: ``auth_tokens_file`` is set but cannot be read (a startup error).
    """
    tokens = [secret.get_secret_value() for secret in settings.auth_tokens]
    if settings.auth_tokens_file is not None:
        for line in settings.auth_tokens_file.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    return [hashlib.sha256(token.encode()).digest() for token in tokens]


class Authenticator:
    """Admits requests carrying an accepted ``Authorization: Bearer`` token (:meth:`check`)."""

    def __init__(self, settings: Settings) -> None:
        self._digests = load_tokens(settings)
        self._open = OPEN_PATHS | ({"/metrics"} if settings.metrics_public else frozenset())

    @property
    def enabled(self) -> bool:
        """True when at least one token is configured."""
        return bool(self._digests)

    def check(self, request: Request) -> None:
        """Return when ``request`` may proceed: auth is off, its path is open, or its token is accepted.

        Raises:
            Unauthorized: (HTTP 401 with ``WWW-Authenticate: Bearer``) a token is required and missing or wrong.
        """
        if not self._digests or _route_path(request) in self._open:
            return
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthorized("this service requires an Authorization: Bearer <token> header", status_code=401)
        digest = hashlib.sha256(presented.strip().encode()).digest()
        accepted = False
        for known in self._digests:  # no early exit: every token is compared every time
            accepted |= hmac.compare_digest(digest, known)
        if not accepted:
            raise Unauthorized("the bearer token is not accepted", status_code=401)


def _route_path(request: Request) -> str:
    """The path the app routes on: the request's path less the ``root_path`` it is served under
    (behind a proxy that strips a prefix, ``/api/health/live`` is the open ``/health/live``)."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class AuthenticatedRoute(APIRoute):
    """An APIRoute whose handler runs only once the app's :class:`Authenticator` (request state
    ``authenticator``) has admitted the request; its Unauthorized goes to the app's error handlers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def authenticated(request: Request) -> Response:
            request.state.authenticator.check(request)
            return await handle(request)

        return authenticated
