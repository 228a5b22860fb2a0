"""Optional bearer-token authentication (off when no token is configured): one check, before routing.

Tokens come from ``auth_tokens`` and ``auth_tokens_file`` (one per line; blank lines and ``#``
comments skipped). A presented token is compared with every accepted one through SHA-256 digests
and :func:`hmac.compare_digest`, so the time taken depends on neither the token's content nor its
length. Health, readiness and the OpenAPI document stay open; ``/metrics`` is open only when
``metrics_public`` is set.

Each accepted token is a *tenant*: the service shares its queues out fairly between tenants
(moegrad_service.engine.fair). A request's tenant is the token's identity, ``token-<n>`` (its place
among the accepted tokens, from 1), kept in the request's state under :data:`TENANT`; the token
itself is never kept, logged or counted.

:class:`AuthMiddleware` checks every HTTP request before the router sees it, so every route of
every protocol has the same one hook, and a request without a token learns nothing about the
routes (an unknown path, a wrong method or a trailing-slash redirect is a 401 like any other).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from moegrad import Unauthorized
from moegrad_service.api.errors import error_response
from moegrad_service.settings import Settings

__all__ = ["OPEN_PATHS", "TENANT", "AuthMiddleware", "Authenticator", "load_tokens", "tenant_of"]

#: The request state's key of the caller's tenant: its token's identity (``token-<n>``), never the token.
TENANT = "tenant"

#: Paths that never require a token (probes and the API description).
OPEN_PATHS = frozenset(
    {
        "/health/live",
        "/health/ready",
        "/v2/health/live",
        "/v2/health/ready",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)


def load_tokens(settings: Settings) -> list[bytes]:
    """The accepted tokens as SHA-256 digests.

    Raises:
        OSError: ``auth_tokens_file`` is set but cannot be read (a startup error).
        ValueError: ``auth_tokens_file`` is set but holds no token: authentication was asked for,
            so the service refuses to start rather than run open (fail closed).
    """
    tokens = [secret.get_secret_value() for secret in settings.auth_tokens]
    if settings.auth_tokens_file is not None:
        from_file = [
            line.strip()
            for line in settings.auth_tokens_file.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        if not from_file:
            raise ValueError(
                f"auth_tokens_file {settings.auth_tokens_file} holds no token (blank lines and # "
                "comments only); add one token per line, or unset it to run without authentication"
            )
        tokens.extend(from_file)
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

    def check(self, path: str, authorization: str) -> str | None:
        """Return when a request may proceed: auth is off, its path is open, or its token is accepted.

        Args:
            path: the path the app routes on (less any ``root_path``).
            authorization: the request's ``Authorization`` header ("" when absent).

        Returns:
            The caller's tenant: ``token-<n>`` for the n-th accepted token (from 1: ``auth_tokens`` in
            order, then the file's lines); None when auth is off or the path is open.

        Raises:
            Unauthorized: (HTTP 401 with ``WWW-Authenticate: Bearer``) a token is required and missing or wrong.
        """
        if not self._digests or path in self._open:
            return None
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthorized("this service requires an Authorization: Bearer <token> header", status_code=401)
        digest = hashlib.sha256(presented.strip().encode()).digest()
        matched = 0
        for place, known in enumerate(self._digests, 1):  # no early exit: every token is compared every time
            same = hmac.compare_digest(digest, known)
            matched = place if same and not matched else matched
        if not matched:
            raise Unauthorized("the bearer token is not accepted", status_code=401)
        return f"token-{matched}"


def tenant_of(scope: Scope) -> str | None:
    """The request's tenant (:data:`TENANT`, set by :class:`AuthMiddleware`), or None: no token."""
    return scope.get("state", {}).get(TENANT)


def _route_path(scope: Scope) -> str:
    """The path the app routes on: the request's path less the ``root_path`` it is served under
    (behind a proxy that strips a prefix, ``/api/health/live`` is the open ``/health/live``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class AuthMiddleware:
    """Pure ASGI: an HTTP request goes on only once ``authenticator`` has admitted it; a refusal is
    answered in the request's protocol by the one error renderer (api/errors.py)."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.authenticator.enabled:
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            try:
                tenant = self.authenticator.check(_route_path(scope), authorization)
            except Unauthorized as exc:
                await error_response(Request(scope, receive), exc)(scope, receive, send)
                return
            if tenant is not None:
                scope.setdefault("state", {})[TENANT] = tenant
        await self.app(scope, receive, send)
