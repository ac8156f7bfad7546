"""The aiohttp server's listening side: each connection under ``ConnectionGuard``'s bounds, and what
aiohttp refuses on its own (malformed HTTP) answered in OpenAI's JSON shape.

``GuardedHandler`` is aiohttp's ``RequestHandler`` (one per connection) with the guard's hooks. It
reads three of aiohttp's internals (``_request_count``, ``_handle_request``, ``force_close``),
stable from aiohttp 3.9 to 3.14; ``tests/pipeline/api/test_hostile_http.py`` fails if they move.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, InvalidURLError
from aiohttp.web_request import BaseRequest

from pipeline.api.body_pacing import BodyPacer, read_heads
from pipeline.api.connections import ConnectionGuard, ConnectionLimits, Place, fitted, raise_fd_limit
from pipeline.api.http_metrics import exported
from pipeline.api.replies import error_reply
from pipeline.api.server import PIPELINE_KEY, error_response
from pipeline.errors import InvalidRequest, Overloaded, PipelineError

__all__ = ["Listener", "listen"]

logger = logging.getLogger(__name__)

RESERVED_PATHS = frozenset({"/health"})
_MESSAGE_LIMIT = 200  # characters of aiohttp's parse error quoted back (it may quote the request)
_FRAMING_HEADERS = ("Content-Length", "Transfer-Encoding", "Content-Encoding", "Host", "Expect")


def _raw_reply(status: int, reason: str, error: PipelineError) -> bytes:
    """A whole response with ``Connection: close``, written before (or instead of) aiohttp's own."""
    reply = error_reply(error)
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(reply.body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in reply.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + reply.body


def _malformed(status: int, exc: BaseException | None, message: str | None) -> PipelineError:
    text = (message or (str(exc) if exc is not None else "") or "malformed request").strip()
    text = text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 3] + "..."
    field = next((name for name in _FRAMING_HEADERS if name.lower() in text.lower()), "headers")
    if isinstance(exc, BadStatusLine | InvalidURLError):
        field = "request line"
    error: PipelineError = InvalidRequest(f"malformed HTTP request: {text}", field=field, stage="http")
    error.status = status  # an instance attribute: aiohttp's status (400 for a parse error)
    return error


class GuardedHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, admitted by the guard, under the header deadline."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, bodies: BodyPacer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self.bodies = bodies  # how the request handlers read bodies: a few at a time
        self._place: Place | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._busy = False

    @property
    def is_reserve(self) -> bool:
        """Whether this connection holds a reserve slot (``/health`` only)."""
        return self._place == "reserve"

    # -- the connection's life ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._place = self._guard.admit(self)
        if self._place is None:  # refused: aiohttp never sees it
            limits = self._guard.limits
            error = Overloaded(f"the server holds its limit of {limits.max_connections} connections; retry later")
            # a cast, not an isinstance check: another event loop's transports (uvloop's) are not
            # registered with asyncio's transport classes
            writer = cast(asyncio.WriteTransport, transport)
            writer.write(_raw_reply(503, "Service Unavailable", error))
            writer.close()
            return
        super().connection_made(transport)
        read_heads(transport)  # a burst's arrival reads heads; bodies wait for their turn
        self._arm_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._place is None:
            return
        self._disarm_deadline()
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count > heads:
            self._disarm_deadline()
            self._guard.busy(self)
        elif data and not self._busy and self._deadline is None:
            self._arm_deadline()  # the first bytes of a head after a keep-alive pause

    def evict(self) -> None:
        self._disarm_deadline()
        self.force_close()

    # -- the header deadline ------------------------------------------------------------------
    def _arm_deadline(self) -> None:
        self._deadline = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_too_slow)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_too_slow(self) -> None:
        self._deadline = None
        if self._busy or self.transport is None:
            return
        self._guard.timed_out()
        timeout = self._guard.limits.header_timeout_s
        error: PipelineError = InvalidRequest(
            f"the request head did not arrive whole within {timeout:g} s", field="headers", stage="http"
        )
        error.status = 408
        self.transport.write(_raw_reply(408, "Request Timeout", error))
        self.force_close()

    # -- requests -----------------------------------------------------------------------------
    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        self._busy = True
        self._disarm_deadline()
        self._guard.busy(self)
        if self.is_reserve and request.path not in RESERVED_PATHS:
            request_handler = self._refuse_on_reserve
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._busy = False
            if self.transport is not None:
                self._guard.waiting(self)  # idle until the next head: evictable, no deadline

    async def _refuse_on_reserve(self, request: BaseRequest) -> web.StreamResponse:
        self._guard.refused_request()
        limits = self._guard.limits
        error = Overloaded(
            f"the server is at its connection limit ({limits.max_connections}); this connection may "
            "only ask for /health",
            request_id=None,
        )
        response = error_response(error)
        response.force_close()
        return response

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's refusals of malformed HTTP (and any error that escapes the app) as JSON."""
        if status >= 500:
            logger.error("%s %s failed before the app answered", request.method, request.path, exc_info=exc)
            error = PipelineError(f"internal error ({type(exc).__name__ if exc else status})")
            error.status = status
        else:  # a client's garbage: no traceback, or every port scan would fill the log
            logger.debug("malformed request from %s: %s", request.remote, message or exc)
            error = _malformed(status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has begun: no error response can follow")
        response = error_response(error)
        response.force_close()
        return response


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening server: its URL, its guard (limits and counts) and its body pacer."""

    url: str
    port: int
    guard: ConnectionGuard
    bodies: BodyPacer


@asynccontextmanager
async def listen(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ConnectionLimits | None = None,
    *,
    handler_cancellation: bool = True,
    backlog: int = 512,
) -> AsyncIterator[Listener]:
    """Serve ``app`` on ``host:port`` under ``limits`` for the block (the open-file limit raised first,
    and the cap lowered to fit it); yields the listener."""
    limits = fitted(limits or ConnectionLimits(), raise_fd_limit())
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    guard = ConnectionGuard(limits, loop.time, loop.call_later)
    bodies = BodyPacer(limits.max_reading_bodies, limits.min_body_rate)
    manager = runner.server
    assert manager is not None

    def connection() -> GuardedHandler:
        return GuardedHandler(
            manager, guard, bodies, loop=loop, keepalive_timeout=limits.keepalive_timeout_s, access_log=None
        )

    server = await loop.create_server(connection, host, port, backlog=backlog)
    bound = server.sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    pipe = app.get(PIPELINE_KEY)
    # /metrics shows the listener's connections and bodies beside the pipeline's
    metrics = exported(pipe, guard, bodies) if pipe is not None else nullcontext()
    with metrics:  # around the close too: connections drained at the end are counted
        try:
            yield Listener(f"http://{shown}:{bound}", bound, guard, bodies)
        finally:
            server.close()
            await runner.cleanup()
