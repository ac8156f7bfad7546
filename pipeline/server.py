"""The OpenAI-compatible aiohttp server; errors are mapped to HTTP here and only here."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
from aiohttp import web

from pipeline.cache_metrics import render_cache_metrics
from pipeline.errors import InvalidRequest, Overloaded, PipelineError
from pipeline.handle import RequestHandle, Result
from pipeline.pipeline import Pipeline

__all__ = ["create_app"]

PIPELINE_KEY = web.AppKey("pipeline", Pipeline)
JSON_LIMITER_KEY = web.AppKey("json_limiter", anyio.CapacityLimiter)
MAX_BODY_BYTES = 64 * 1024 * 1024
INLINE_JSON_BYTES = 64 * 1024  # bodies above this are parsed in a worker thread


def error_response(error: PipelineError) -> web.Response:
    """OpenAI's error JSON with the status the error carries (the one place errors meet HTTP)."""
    headers = {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    # a 5xx was logged once, with its traceback and request id, where it happened
    return web.json_response({"error": error.to_dict()}, status=error.status, headers=headers)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", field="body") from None
    except UnicodeDecodeError:
        raise InvalidRequest("the body is not UTF-8", field="body") from None


async def _read_body(request: web.Request) -> Any:
    raw = await request.read()
    if len(raw) < INLINE_JSON_BYTES:
        return _parse_json(raw)
    # A burst of image requests carries megabytes of base64 each: parsed on the loop, 128 of them
    # queue the /health probe behind ~1 ms each (a 140 ms stall, measured by the health bench).
    return await anyio.to_thread.run_sync(_parse_json, raw, limiter=request.app[JSON_LIMITER_KEY])


def _usage(result: Result) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _completion_json(handle: RequestHandle, result: Result, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{handle.request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
            }
            for c in result.choices
        ],
        "usage": _usage(result),
        "timings": result.timings,
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    pipe = request.app[PIPELINE_KEY]
    try:
        body = await _read_body(request)
        handle = await pipe.submit(body)
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
    return web.json_response(_completion_json(handle, result, model, created))


async def _stream(request: web.Request, handle: RequestHandle, model: str, created: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    base = {
        "id": f"chatcmpl-{handle.request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
    }

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    try:
        first = True
        async for delta in handle:
            if first:
                await response.prepare(request)
                for i in range(handle.request.sampling.n):
                    choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    await send({**base, "choices": [choice]})
                first = False
            choice = {"index": delta.index, "delta": {"content": delta.text}, "finish_reason": delta.finish_reason}
            await send({**base, "choices": [choice]})
        if first:
            await response.prepare(request)
        if handle.request.include_usage:
            await send({**base, "choices": [], "usage": _usage(await handle.result())})
        await response.write(b"data: [DONE]\n\n")
    except PipelineError as exc:
        if not response.prepared:
            return error_response(exc)
        await send({"error": exc.to_dict()})  # headers are gone: report in-band, as OpenAI does
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, ConnectionError):
        handle.cancel()  # the client went away mid-stream
    return response


async def list_models(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    model = {"id": pipe.model_name, "object": "model", "created": 0, "owned_by": "local"}
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    status = pipe.health()
    return web.json_response(status, status=200 if status["status"] == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    pipe = request.app[PIPELINE_KEY]
    text = pipe.metrics.render_prometheus() + render_cache_metrics(pipe.cache_stats())
    return web.Response(text=text, content_type="text/plain")


def create_app(pipe: Pipeline) -> web.Application:
    """The aiohttp application over a started ``Pipeline``."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[PIPELINE_KEY] = pipe
    app[JSON_LIMITER_KEY] = anyio.CapacityLimiter(1)  # json.loads holds the GIL: one at a time
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
