"""API keys: ``/v1/*`` requires ``Authorization: Bearer KEY`` when the server has a key.

The key is compared in constant time (``hmac.compare_digest``: only a length mismatch returns
early). ``/health``, ``/metrics`` and ``/openapi.json`` stay open unless ``protect_all`` is set, so
a load balancer's probe and a Prometheus scraper need no secret.
"""

from __future__ import annotations

import hmac
import os

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pipeline.errors import AuthenticationFailed

__all__ = ["API_KEY_ENV", "api_key_middleware", "resolve_api_key"]

API_KEY_ENV = "PIPELINE_API_KEY"
_OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def resolve_api_key(given: str | None) -> str | None:
    """The key from the command line, else from ``$PIPELINE_API_KEY``; None (or empty): no key."""
    return given or os.environ.get(API_KEY_ENV) or None


def _refusal(message: str) -> web.Response:
    error = AuthenticationFailed(message, field="Authorization")
    response = web.json_response({"error": error.to_dict()}, status=error.status)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def api_key_middleware(api_key: str, *, protect_all: bool = False) -> Middleware:
    """A middleware that refuses (401, OpenAI's shape) requests without ``Bearer api_key``."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not protect_all and request.path in _OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization")
        if given is None:
            return _refusal("no API key: send 'Authorization: Bearer KEY'")
        if not hmac.compare_digest(given.encode(), expected):
            return _refusal("Incorrect API key provided")
        return await handler(request)

    return require_api_key
