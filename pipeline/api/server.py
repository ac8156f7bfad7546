"""The OpenAI-compatible aiohttp server: aiohttp's routing, body cap and API-key middleware over the
routes of ``pipeline.api.routes`` (shared with the Ray Serve front end)."""

from __future__ import annotations

import logging
import uuid

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestPayloadError

from pipeline.api.auth import api_key_middleware
from pipeline.api.inflate import MAX_INFLATING_BYTES, InflateBudget
from pipeline.api.openapi import ROUTES
from pipeline.api.replies import Reply, StreamReply, error_reply
from pipeline.api.request_body import BODY_LIMIT_KEY, INFLATE_KEY, refusal_before_body, request_body
from pipeline.api.routes import Api
from pipeline.core.pipeline import Pipeline
from pipeline.errors import InvalidRequest, MethodNotAllowed, PayloadTooLarge, PipelineError, RouteNotFound

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

PIPELINE_KEY = web.AppKey("pipeline", Pipeline)
API_KEY = web.AppKey("api", Api)
MAX_BODY_BYTES = 64 * 1024 * 1024


def to_response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


def error_response(error: PipelineError) -> web.Response:
    return to_response(error_reply(error))


def refusal_response(exc: web.HTTPException, request: web.BaseRequest) -> web.Response:
    """An aiohttp refusal (``exc``, a 4xx or 5xx) in OpenAI's JSON shape, its ``Allow`` kept for a 405."""
    response = error_response(http_error(exc, request))
    if isinstance(exc, web.HTTPMethodNotAllowed):
        response.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
    return response


def http_error(exc: web.HTTPException, request: web.BaseRequest) -> PipelineError:
    """aiohttp's own refusals (no route, wrong method, body over the cap) as typed errors."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge) and isinstance(request, web.Request):
        limit = request.app[BODY_LIMIT_KEY]
        return PayloadTooLarge(f"the request body is over the limit of {limit} bytes", field="body")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path} (allowed: {allowed})")
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(f"no route {request.method} {request.path}")
    if isinstance(exc, web.HTTPExpectationFailed):
        return _unmet_expectation(request)
    error = InvalidRequest(exc.reason) if exc.status < 500 else PipelineError(exc.reason)
    error.status = exc.status  # an instance attribute: the class keeps its own
    return error


def _unmet_expectation(request: web.BaseRequest) -> PipelineError:
    expect = request.headers.get("Expect", "")
    error = InvalidRequest(f"the expectation {expect!r} cannot be met; only 100-continue is", field="Expect")
    error.status = 417  # an instance attribute: the class keeps its own
    return error


def _refused_early(error: PipelineError) -> web.Response:
    """An answer before the body is read: the connection closes after it (aiohttp reads what the
    client still sends, for a while, so that the client sees the answer)."""
    response = error_response(error)
    response.force_close()
    return response


def _spent(request: web.Request, error: PipelineError) -> web.Response:
    """An answer on a connection whose body is broken, stalled or not coming: nothing more is read
    from it, and it closes once the answer is written."""
    response = error_response(error)
    response.force_close()
    request.protocol.close()  # its parser is fed no more bytes
    request.content.feed_eof()  # no lingering read waits on it
    return response


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' ``Expect`` handler: ``100 Continue`` only for a body that will be read; a 413 or
    415 from the head alone instead; any other expectation a 417 (RFC 9110). A client that expects
    sends no body before its answer: the connection closes at once after a refusal."""
    if request.version != HttpVersion11:  # HTTP/1.0 knows no expectations: ignored, as aiohttp does
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return _spent(request, _unmet_expectation(request))
    refusal = refusal_before_body(request)
    if refusal is not None:
        return _spent(request, refusal)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer's head is still to come
    return None


def new_request_id() -> str:
    """An id for a request the front end answers itself (the pipeline's ids look the same)."""
    return f"req-{uuid.uuid4().hex[:16]}"


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's JSON shape, aiohttp's own 404/405/413 included; a 500 carries
    an id that its log line carries too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return refusal_response(exc, request)
    except Exception as exc:  # a bug: a 500 in OpenAI's shape, logged once with its traceback
        request_id = new_request_id()
        logger.exception("request %s: %s %s failed", request_id, request.method, request.path)
        return error_response(PipelineError(f"internal error ({type(exc).__name__})", request_id=request_id))


def _unreadable_body(exc: RequestPayloadError, request: web.Request) -> InvalidRequest:
    cause = exc.__cause__
    if isinstance(cause, ContentEncodingError):
        encoding = request.headers.get("Content-Encoding", "")
        message = f"the body is not valid {encoding} data, as its Content-Encoding says it is"
        return InvalidRequest(message, field="Content-Encoding", stage="admission")
    reason = (cause.message if isinstance(cause, HttpProcessingError) else "") or type(cause or exc).__name__
    return InvalidRequest(f"the body could not be read ({reason})", field="body", stage="admission")


async def respond(request: web.Request, reply: Reply | StreamReply) -> web.StreamResponse:
    """Write what an ``Api`` route answered: whole, or as server-sent events."""
    if isinstance(reply, Reply):
        return to_response(reply)
    response = web.StreamResponse(headers=reply.headers)

    async def send(chunk: bytes) -> None:
        if not response.prepared:  # headers leave with the first event: an error before it is a plain 4xx
            await response.prepare(request)
        await response.write(chunk)

    try:
        await reply.write(send)
    except PipelineError as exc:
        return error_response(exc)  # raised only before the first event
    except ConnectionError:
        return response  # the client went away mid-stream; its requests are cancelled
    if not response.prepared:
        await response.prepare(request)
    return response


async def _answer(request: web.Request) -> web.StreamResponse:
    method = "GET" if request.method == "HEAD" else request.method  # aiohttp answers HEAD on every GET route
    call = request.app[API_KEY].route(method, request.path)
    assert call is not None, f"{request.method} {request.path} is routed but not answered"
    refusal = refusal_before_body(request)
    if refusal is not None:
        return _refused_early(refusal)
    taken = False
    try:
        # over the cap as sent: the middleware answers 413
        async with request_body(request) as body:
            taken = True
            return await respond(request, await call(body))
    except RequestPayloadError as exc:  # a broken encoding or framing
        return _spent(request, _unreadable_body(exc, request))
    except PipelineError as exc:
        if taken:  # raised by the call: a bug, for the middleware to log
            raise
        # the body could not be taken: stalled, over the limit inflated, the inflate budget spent
        return _spent(request, exc) if exc.status == 408 else error_response(exc)


def create_app(
    pipe: Pipeline,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_inflating_bytes: int = MAX_INFLATING_BYTES,
    api_key: str | None = None,
    protect_all: bool = False,
) -> web.Application:
    """The aiohttp application over a started ``Pipeline``; with ``api_key``, ``/v1/*`` requires it
    (and every route with ``protect_all``). ``max_inflating_bytes``: compressed bodies' inflated
    bytes held at once, at least ``max_body_bytes`` (``pipeline/api/inflate.py``).

    :raises ValueError: ``max_inflating_bytes`` below ``max_body_bytes``.
    """
    if max_inflating_bytes < max_body_bytes:
        raise ValueError(
            f"max_inflating_bytes ({max_inflating_bytes}) must be at least max_body_bytes ({max_body_bytes})"
        )
    middlewares: list[Middleware] = [openai_errors]
    if api_key:
        middlewares.append(api_key_middleware(api_key, protect_all=protect_all))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[BODY_LIMIT_KEY] = max_body_bytes
    app[INFLATE_KEY] = InflateBudget(max_inflating_bytes)
    app[PIPELINE_KEY] = pipe
    app[API_KEY] = Api(pipe)
    for route in ROUTES:  # the OpenAPI document's table: every route served is documented
        if route.method.upper() == "GET":
            app.router.add_get(route.path, _answer, expect_handler=expect_continue)  # HEAD too: no body
        else:
            app.router.add_route(route.method.upper(), route.path, _answer, expect_handler=expect_continue)
    return app
