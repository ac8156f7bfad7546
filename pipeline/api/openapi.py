"""The OpenAPI 3.1 document of the server, generated from the ``pipeline.protocol`` body types.

Nothing here describes a body by hand: request and response schemas are msgspec's JSON schemas of
the declared structs. ``ROUTES`` is the one table of what the server answers; ``create_app``
registers its handlers against it, so a route without its types cannot be served.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.protocol.request_bodies import ChatCompletionRequest, CompletionRequest
from pipeline.protocol.response_bodies import ChatCompletion, ChatCompletionChunk, Completion, ErrorResponse, ModelList
from pipeline.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

__all__ = ["ROUTES", "Route", "openapi_document", "openapi_json"]

_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "bad input; param names the field",
    "401": "missing or wrong API key",
    "404": "unknown model or route",
    "408": "the body did not arrive within the body deadline",
    "413": "body or image over its limit",
    "415": "a Content-Encoding other than gzip, deflate or identity",
    "422": "no answer passed its constraint",
    "429": "full; retry after Retry-After",
    "503": "shutting down, the engine restarting, or compressed bodies over the inflate budget; Retry-After",
    "504": "a deadline passed (fetch, grammar compile)",
}


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    summary: str
    request: type | None = None  # the JSON body's type
    response: type | None = None  # the JSON answer's type; None: plain text
    stream: type | None = None  # each server-sent event's type, when the body asks to stream


ROUTES: tuple[Route, ...] = (
    Route(
        "post",
        "/v1/chat/completions",
        "chat completion, streamed as server-sent events when stream is true",
        ChatCompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
    ),
    Route(
        "post",
        "/v1/completions",
        "completion of raw prompts (text, token ids, or a list), streamed as server-sent events when stream is true",
        CompletionRequest,
        Completion,
        Completion,
    ),
    Route(
        "post",
        "/tokenize",
        "the token ids of a prompt, or of a conversation through the chat template (vLLM's shape)",
        TokenizeRequest,
        TokenizeResponse,
    ),
    Route("post", "/detokenize", "the text of token ids (vLLM's shape)", DetokenizeRequest, DetokenizeResponse),
    Route("get", "/v1/models", "the served model names", response=ModelList),
    Route("get", "/health", "liveness, pending requests and decoding"),
    Route("get", "/metrics", "Prometheus text exposition"),
    Route("get", "/openapi.json", "this document"),
)


def _operation(route: Route, ref: dict[type, dict[str, Any]]) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK"}
    if route.response is not None:
        ok["content"] = {"application/json": {"schema": ref[route.response]}}
    else:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if route.stream is not None:
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": "'data: ' + JSON per event, then 'data: [DONE]'"},
            "x-event-schema": ref[route.stream],
        }
    error = {"content": {"application/json": {"schema": ref[ErrorResponse]}}}
    operation: dict[str, Any] = {
        "summary": route.summary,
        "responses": {"200": ok, **{code: {"description": why, **error} for code, why in _ERRORS.items()}},
    }
    if route.request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[route.request]}}}
    return operation


def openapi_document(title: str = "vlm-pipeline", version: str = "0.1.0") -> dict[str, Any]:
    """The server's OpenAPI document (JSON-serialisable)."""
    types = sorted(
        {t for r in ROUTES for t in (r.request, r.response, r.stream) if t is not None} | {ErrorResponse},
        key=lambda t: t.__name__,
    )
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref = dict(zip(types, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, ref)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


@functools.cache
def openapi_json() -> bytes:
    """The document as served (``GET /openapi.json``), encoded once."""
    return msgspec.json.encode(openapi_document())
