"""The aiohttp server's listening side: each connection under ``ConnectionGuard``'s bounds (a
header deadline, then a body deadline), and what aiohttp refuses on its own (malformed HTTP, heads
over its parser's limits) answered in OpenAI's JSON shape.

``GuardedHandler`` is aiohttp's ``RequestHandler`` (one per connection) with the guard's hooks. It
reads three of aiohttp's internals (``_request_count``, ``_handle_request``, ``force_close``),
stable from aiohttp 3.9 to 3.14; ``tests/pipeline/api/test_hostile_http.py`` fails if they move.
Its bodies arrive as sent (aiohttp's inflating off): the app inflates them under a budget
(``pipeline/api/request_body.py``). After answering a head its parser refused, it reads and drops
what the client still sends for a while before it closes, so that the client reads the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import anyio
from aiohttp import web
from aiohttp.web_request import BaseRequest

from pipeline.api.body_deadline import BodyDeadline
from pipeline.api.body_pacing import BodyPacer, read_heads
from pipeline.api.connections import ConnectionGuard, ConnectionLimits, Place, fitted, raise_fd_limit
from pipeline.api.head_errors import MAX_FIELD_BYTES, MAX_HEADERS, MAX_LINE_BYTES, as_json, malformed, raw_reply
from pipeline.api.http_metrics import exported
from pipeline.api.server import PIPELINE_KEY, error_response
from pipeline.errors import InvalidRequest, Overloaded, PipelineError

__all__ = ["Listener", "listen"]

logger = logging.getLogger(__name__)

RESERVED_PATHS = frozenset({"/health"})
# after a refused head, what the client still sends is read and dropped, this long and this much at
# most, before the close: a close with unread bytes resets the connection, and a client still sending
# its head then fails in its send and never reads the answer (seen with a 100 KB Host header)
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024


class GuardedHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, admitted by the guard, under the header and body deadlines."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, bodies: BodyPacer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self.bodies = bodies  # how the request handlers read bodies: a few at a time
        self._place: Place | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._busy = False
        # the request line of the head arriving now: its bytes so far, and whether it is whole
        self._line_bytes = 0
        self._line_whole = False
        self._lingering: asyncio.Future[None] | None = None  # set while dropping bytes before the close
        self._dropped = 0
        self._refused_head = False  # aiohttp's parser refused the head: linger before the close

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
            writer.write(raw_reply(503, "Service Unavailable", error))
            writer.close()
            return
        super().connection_made(transport)
        read_heads(transport)  # a burst's arrival reads heads; bodies wait for their turn
        self._arm_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._place is None:
            return
        self._stop_lingering()
        self._disarm_deadline()
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # the head was refused and answered: drop what follows
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self._stop_lingering()
            return
        heads = self._request_count
        if not self._busy and not self._line_whole:  # which limit a head over them is over: 414 or 431
            end = data.find(b"\n")
            self._line_bytes += len(data) if end < 0 else end
            self._line_whole = end >= 0
        super().data_received(data)
        if self._request_count > heads:
            self._disarm_deadline()
            self._guard.busy(self)
        elif data and not self._busy and self._deadline is None:
            self._arm_deadline()  # the first bytes of a head after a keep-alive pause

    def eof_received(self) -> None:
        self._stop_lingering()  # the client has sent all it will
        super().eof_received()

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
        self.transport.write(raw_reply(408, "Request Timeout", error))
        self.force_close()

    # -- the body deadline --------------------------------------------------------------------
    async def read_body(self, request: BaseRequest) -> bytes:
        """``request``'s body as sent (not inflated), under a body slot and the body deadline, which
        runs from now: a wait for the slot counts, so a body that stalls holds its connection for a
        bounded time however long the queue.

        :raises InvalidRequest: (408) the deadline passed: answer it, and read nothing more here.
        """
        if not request.body_exists:
            return await request.read()
        limits = self._guard.limits
        with anyio.CancelScope() as scope:
            deadline = BodyDeadline(
                request.content, limits.body_timeout_s, limits.body_timeout_rate, scope.cancel, self._loop
            )
            try:
                return await self.bodies.read(request)
            finally:
                deadline.cancel()
        self._guard.body_timed_out()  # here only when the deadline cancelled the read
        error: PipelineError = InvalidRequest(
            f"the request body did not arrive whole within {limits.body_timeout_s:g} s (and a second more "
            f"per {limits.body_timeout_rate:g} bytes received)",
            field="body",
            stage="http",
        )
        error.status = 408
        raise error

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
            answered = await super()._handle_request(request, start_time, partial(as_json, request_handler))
            if self._refused_head:
                await self._linger()
            return answered
        finally:
            self._busy = False
            self._line_bytes, self._line_whole = 0, False
            if self.transport is not None:
                self._guard.waiting(self)  # idle until the next head: evictable, no deadline

    async def _linger(self) -> None:
        """After a refused head's answer: end our side, and read and drop what the client still
        sends until it ends its own, for at most ``LINGER_S`` and ``LINGER_BYTES``; aiohttp closes next."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._guard.waiting(self)  # evictable meanwhile: it holds nothing
        self._lingering = self._loop.create_future()
        if transport.can_write_eof():
            transport.write_eof()  # the answer is whole: the client reads it up to our end
        try:
            await asyncio.wait_for(self._lingering, LINGER_S)
        except TimeoutError:
            pass

    def _stop_lingering(self) -> None:
        if self._lingering is not None and not self._lingering.done():
            self._lingering.set_result(None)

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
            error = malformed(status, exc, message, self._line_bytes)
            self._refused_head = True
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
            manager,
            guard,
            bodies,
            loop=loop,
            keepalive_timeout=limits.keepalive_timeout_s,
            access_log=None,
            auto_decompress=False,  # the app inflates, off the loop and under a budget
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_FIELD_BYTES,
            max_headers=MAX_HEADERS,
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
