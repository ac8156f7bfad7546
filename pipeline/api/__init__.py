"""The OpenAI-compatible HTTP API: every route as a plain call (``routes.Api``: body bytes in, a
``Reply`` or ``StreamReply`` out), the aiohttp server that moves its bytes, API keys and OpenAPI.

It sits above the core; the Ray Serve front end (``pipeline.scaleout``) answers through the same calls.
"""

from __future__ import annotations

from pipeline.api.auth import api_key_refusal, resolve_api_key
from pipeline.api.openapi import openapi_document, openapi_json
from pipeline.api.replies import Reply, StreamReply, error_reply
from pipeline.api.routes import Api
from pipeline.api.server import create_app

__all__ = [
    "Api",
    "Reply",
    "StreamReply",
    "api_key_refusal",
    "create_app",
    "error_reply",
    "openapi_document",
    "openapi_json",
    "resolve_api_key",
]
