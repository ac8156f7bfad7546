"""What aiohttp refuses on its own, before the app sees a request, in OpenAI's JSON shape and our words.

- A head over the parser's limits: a URL over ``MAX_LINE_BYTES`` is a 414 naming the request line;
  more than ``MAX_HEADERS`` headers, or a header line over ``MAX_FIELD_BYTES``, a 431 naming the
  headers. Neither quotes the client's bytes back.
- Any other malformed head: a 400 quoting aiohttp's reason, clipped, naming the header it is about.
- A refusal aiohttp raises outside the app's middlewares (the ``Expect`` handler of a path without a
  route): the app's own mapping (``server.http_error``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, InvalidURLError, LineTooLong
from aiohttp.web_request import BaseRequest

from pipeline.api.replies import error_reply
from pipeline.api.server import refusal_response
from pipeline.errors import InvalidRequest, PipelineError

__all__ = ["MAX_FIELD_BYTES", "MAX_HEADERS", "MAX_LINE_BYTES", "as_json", "malformed", "raw_reply"]

# aiohttp's parser limits (its own defaults), set on every connection
MAX_LINE_BYTES = 8190  # the request line
MAX_FIELD_BYTES = 8190  # one header line
MAX_HEADERS = 128
_MESSAGE_LIMIT = 200  # characters of aiohttp's parse error quoted back (it may quote the request)
_FRAMING_HEADERS = ("Content-Length", "Transfer-Encoding", "Content-Encoding", "Host", "Expect")


def raw_reply(status: int, reason: str, error: PipelineError) -> bytes:
    """A whole response with ``Connection: close``, written before (or instead of) aiohttp's own."""
    reply = error_reply(error)
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(reply.body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in reply.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + reply.body


def _over_limits(exc: BaseException | None, line_bytes: int) -> PipelineError | None:
    if isinstance(exc, LineTooLong) and line_bytes > MAX_LINE_BYTES:
        error: PipelineError = InvalidRequest(
            f"the request line is over {MAX_LINE_BYTES} bytes (its URL is too long)", field="request line", stage="http"
        )
        error.status = 414
    elif isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()):
        error = InvalidRequest(
            f"the request headers are over the server's limits: at most {MAX_HEADERS} headers, each line at "
            f"most {MAX_FIELD_BYTES} bytes",
            field="headers",
            stage="http",
        )
        error.status = 431
    else:
        return None
    return error


def malformed(status: int, exc: BaseException | None, message: str | None, line_bytes: int) -> PipelineError:
    """aiohttp's refusal of a head (``status``, its exception and message) as a typed error;
    ``line_bytes``: the bytes of the head's request line received (whole or not), which tells a URL
    over the limit (414) from headers over theirs (431)."""
    over = _over_limits(exc, line_bytes)
    if over is not None:
        return over
    text = (message or (str(exc) if exc is not None else "") or "malformed request").strip()
    text = text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 3] + "..."
    field = next((name for name in _FRAMING_HEADERS if name.lower() in text.lower()), "headers")
    if isinstance(exc, BadStatusLine | InvalidURLError):
        field = "request line"
    error: PipelineError = InvalidRequest(f"malformed HTTP request: {text}", field=field, stage="http")
    error.status = status  # an instance attribute: aiohttp's status (400 for a parse error)
    return error


async def as_json(
    handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]], request: BaseRequest
) -> web.StreamResponse:
    """``handler``'s answer, with an aiohttp refusal raised outside the app's middlewares in
    OpenAI's JSON shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = refusal_response(exc, request)
        response.force_close()
        return response
