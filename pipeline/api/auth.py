"""API keys: ``/v1/*`` requires ``Authorization: Bearer KEY`` when the server has a key.

The key is compared in constant time (``hmac.compare_digest``: only a length mismatch returns
early); the scheme is case-insensitive, and any bytes after it are a key (a wrong one is a 401).
``/health``, ``/metrics`` and ``/openapi.json`` stay open unless ``protect_all`` is set, so a load
balancer's probe and a Prometheus scraper need no secret.
"""

from __future__ import annotations

import hmac
import os

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pipeline.api.replies import Reply, error_reply
from pipeline.errors import AuthenticationFailed

__all__ = ["API_KEY_ENV", "api_key_middleware", "api_key_refusal", "resolve_api_key"]

API_KEY_ENV = "PIPELINE_API_KEY"
_OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def resolve_api_key(given: str | None) -> str | None:
    """The key from the command line, else from ``$PIPELINE_API_KEY``; None (or empty): no key."""
    return given or os.environ.get(API_KEY_ENV) or None


def _is_key(authorization: str, api_key: str) -> bool:
    scheme, _, credentials = authorization.partition(" ")
    # aiohttp reads header bytes that are not UTF-8 as escaped surrogates: encode them back as they came
    given = credentials.strip(" ").encode("utf-8", "surrogateescape")
    matches = hmac.compare_digest(given, api_key.encode())
    return matches and scheme.lower() == "bearer"  # schemes are case-insensitive (RFC 9110, 11.1)


def api_key_refusal(api_key: str, path: str, authorization: str | None, *, protect_all: bool = False) -> Reply | None:
    """The 401 (OpenAI's shape) for a request to ``path`` without ``Bearer api_key``; None: let it in."""
    if not protect_all and path in _OPEN_PATHS:
        return None
    if authorization is None:
        message = "no API key: send 'Authorization: Bearer KEY'"
    elif not _is_key(authorization, api_key):
        message = "Incorrect API key provided"
    else:
        return None
    reply = error_reply(AuthenticationFailed(message, field="Authorization"))
    reply.headers["WWW-Authenticate"] = "Bearer"
    return reply


def api_key_middleware(api_key: str, *, protect_all: bool = False) -> Middleware:
    """An aiohttp middleware that refuses (401) requests without ``Bearer api_key``."""

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = api_key_refusal(api_key, request.path, request.headers.get("Authorization"), protect_all=protect_all)
        if refusal is not None:
            return web.Response(status=refusal.status, body=refusal.body, headers=refusal.headers)
        return await handler(request)

    return require_api_key
