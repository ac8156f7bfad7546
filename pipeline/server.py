"""The OpenAI-compatible aiohttp server; errors are mapped to HTTP here and only here."""

from __future__ import annotations

import logging
import time

import anyio
import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.completions_api import answer_completions
from pipeline.errors import MethodNotAllowed, Overloaded, PayloadTooLarge, PipelineError, RouteNotFound
from pipeline.handle import RequestHandle, Result
from pipeline.openapi import ROUTES, openapi_document
from pipeline.pipeline import Pipeline
from pipeline.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    Model,
    ModelList,
    Usage,
)
from pipeline.request import ChatRequest
from pipeline.responses import ChatStream, TokenText, chat_choice
from pipeline.server_auth import api_key_middleware

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

PIPELINE_KEY = web.AppKey("pipeline", Pipeline)
JSON_LIMITER_KEY = web.AppKey("json_limiter", anyio.CapacityLimiter)
BODY_LIMIT_KEY = web.AppKey("body_limit", int)
MAX_BODY_BYTES = 64 * 1024 * 1024
# Bodies above this are decoded in a worker thread: msgspec decodes and validates 1 MB of base64
# image body in 0.28 ms, so below it the loop stalls well under a millisecond (rule 1).
INLINE_BODY_BYTES = 1024 * 1024


def error_response(error: PipelineError) -> web.Response:
    """OpenAI's error JSON with the status the error carries (the one place errors meet HTTP)."""
    headers = {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    # a 5xx was logged once, with its traceback and request id, where it happened
    return web.json_response({"error": error.to_dict()}, status=error.status, headers=headers)


def _http_error(exc: web.HTTPException, request: web.Request) -> PipelineError:
    """aiohttp's own refusals (no route, wrong method, body over the cap) as typed errors."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[BODY_LIMIT_KEY]
        return PayloadTooLarge(f"the request body is over the limit of {limit} bytes", field="body")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path} (allowed: {allowed})")
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(f"no route {request.method} {request.path}")
    error = PipelineError(exc.reason)
    error.status = exc.status  # an instance attribute: the class keeps its own
    return error


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's JSON shape, aiohttp's own 404/405/413 included."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(_http_error(exc, request))
        if isinstance(exc, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return response
    except Exception as exc:  # a bug: a 500 in OpenAI's shape, logged once with its traceback
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(PipelineError(f"internal error ({type(exc).__name__})"))


async def _parse_request(request: web.Request) -> ChatRequest:
    pipe = request.app[PIPELINE_KEY]
    raw = await request.read()
    if len(raw) < INLINE_BODY_BYTES:
        return pipe.parse(raw)
    # A burst of image requests carries megabytes of base64 each: decoded on the loop, 128 of them
    # would queue the /health probe behind them (rule 1).
    return await anyio.to_thread.run_sync(pipe.parse, raw, limiter=request.app[JSON_LIMITER_KEY])


def _usage(result: Result) -> Usage:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


def _completion(handle: RequestHandle, result: Result, model: str, created: int, tokens: TokenText) -> ChatCompletion:
    wants_logprobs = handle.request.sampling.logprobs is not None
    return ChatCompletion(
        id=f"chatcmpl-{handle.request_id}",
        created=created,
        model=model,
        choices=[chat_choice(c, wants_logprobs, tokens) for c in result.choices],
        usage=_usage(result),
        timings=result.timings,
    )


def _json(payload: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), content_type="application/json")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    pipe = request.app[PIPELINE_KEY]
    try:
        handle = await pipe.submit(await _parse_request(request))
    except PipelineError as exc:
        return error_response(exc)
    model = handle.request.model or pipe.model_name
    created = int(time.time())
    if handle.request.stream:
        return await _stream(request, handle, model, created)
    try:
        result = await handle.result()  # a disconnect cancels this task, and result() cancels the request
    except PipelineError as exc:
        return error_response(exc)
    return _json(_completion(handle, result, model, created, token_text(pipe)))


async def _stream(request: web.Request, handle: RequestHandle, model: str, created: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    chunk_id = f"chatcmpl-{handle.request_id}"
    chunks = ChatStream(handle.request.sampling.logprobs is not None, token_text(request.app[PIPELINE_KEY]))

    async def send(choices: list[ChunkChoice], usage: Usage | None = None) -> None:
        chunk = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage)
        await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

    try:
        first = True
        async for delta in handle:
            if first:
                await response.prepare(request)
                for i in range(handle.request.sampling.n):
                    await send([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                first = False
            choices = chunks.choices(delta)
            if choices:
                await send(choices)
        if first:
            await response.prepare(request)
        if handle.request.include_usage:
            await send([], _usage(await handle.result()))
        await response.write(b"data: [DONE]\n\n")
    except PipelineError as exc:
        if not response.prepared:
            return error_response(exc)
        # headers are gone: report in-band, as OpenAI does
        await response.write(b"data: " + msgspec.json.encode({"error": exc.to_dict()}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, ConnectionError):
        handle.cancel()  # the client went away mid-stream
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    pipe = request.app[PIPELINE_KEY]
    try:
        raw = await request.read()
        if len(raw) < INLINE_BODY_BYTES:
            requests = pipe.parse_completions(raw)
        else:  # rule 1, as for chat bodies
            requests = await anyio.to_thread.run_sync(
                pipe.parse_completions, raw, limiter=request.app[JSON_LIMITER_KEY]
            )
        return await answer_completions(request, pipe, requests, token_text(pipe))
    except PipelineError as exc:
        return error_response(exc)


async def list_models(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    return _json(ModelList(data=[Model(id=name) for name in pipe.model_names]))


async def health(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    status = pipe.health()
    return web.json_response(status, status=200 if status["status"] == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    body = generate_latest(pipe.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def token_text(pipe: Pipeline) -> TokenText:
    """Each token's bytes, for log-probability entries."""
    return TokenText(pipe.engine.engine.token_bytes.table)


_OPENAPI = msgspec.json.encode(openapi_document())


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


def create_app(
    pipe: Pipeline,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    protect_all: bool = False,
) -> web.Application:
    """The aiohttp application over a started ``Pipeline``; with ``api_key``, ``/v1/*`` requires it
    (and every route with ``protect_all``)."""
    middlewares: list[Middleware] = [openai_errors]
    if api_key:
        middlewares.append(api_key_middleware(api_key, protect_all=protect_all))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[BODY_LIMIT_KEY] = max_body_bytes
    app[PIPELINE_KEY] = pipe
    app[JSON_LIMITER_KEY] = anyio.CapacityLimiter(1)  # decoding holds the GIL: one at a time
    handlers = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/models": list_models,
        "/health": health,
        "/metrics": metrics,
        "/openapi.json": openapi,
    }
    for route in ROUTES:  # the OpenAPI document's table: every route served is documented
        app.router.add_route(route.method.upper(), route.path, handlers[route.path])
    return app
