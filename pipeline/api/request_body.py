"""A request's body as the app takes it: refused from its head when it can be, read, and inflated.

- **From the head alone**, before a byte of the body is read or a ``100 Continue`` sent: a
  ``Content-Encoding`` not decoded here is a 415 naming it (with no word of which package would
  decode it), a ``Content-Length`` over the body limit a 413. ``Expect: 100-continue`` gets its
  ``100 Continue`` only when neither applies (``server.expect_continue``).
- **Read**: on a connection of the server's listener, under a body slot and the body deadline
  (``GuardedHandler.read_body``), as sent. Compressed bodies are then inflated off the loop under
  the inflate budget, held until the request's answer has been written (``pipeline/api/inflate.py``).
  Behind another runner (a plain ``aiohttp`` ``AppRunner``), aiohttp reads and inflates it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from aiohttp import web

from pipeline.api.inflate import ENCODINGS, InflateBudget, inflate
from pipeline.errors import InvalidRequest, PayloadTooLarge, PipelineError

__all__ = ["BODY_LIMIT_KEY", "INFLATE_KEY", "content_encoding", "refusal_before_body", "request_body"]

BODY_LIMIT_KEY = web.AppKey("body_limit", int)
INFLATE_KEY = web.AppKey("inflate_budget", InflateBudget)
_READABLE = ("identity", *ENCODINGS)


def content_encoding(request: web.BaseRequest) -> str:
    return request.headers.get("Content-Encoding", "identity").strip().lower()


def refusal_before_body(request: web.Request) -> PipelineError | None:
    """Why ``request`` is refused from its head alone, or None: an encoding not decoded here (415),
    a ``Content-Length`` over the body limit (413)."""
    encoding = content_encoding(request)
    if encoding not in _READABLE:
        readable = ", ".join(_READABLE)
        error = InvalidRequest(
            f"Content-Encoding {encoding!r} is not supported; this server reads {readable}",
            field="Content-Encoding",
            stage="admission",
        )
        error.status = 415  # an instance attribute: the class keeps its own
        return error
    limit = request.app[BODY_LIMIT_KEY]
    length = request.content_length
    if length is not None and length > limit:
        return PayloadTooLarge(
            f"the request body is {length} bytes, over the limit of {limit} bytes", field="body", stage="admission"
        )
    return None


@asynccontextmanager
async def request_body(request: web.Request) -> AsyncIterator[bytes]:
    """``request``'s body, inflated, for the block (a compressed body's share of the inflate budget
    is held until the block ends).

    :raises PipelineError: over the body limit inflated (413), the budget spent (503), not in its
        stated encoding (400), not whole within the body deadline (408).
    :raises RequestPayloadError: a broken framing (chunked sizes, a body cut short).
    :raises HTTPRequestEntityTooLarge: over the body limit as sent.
    """
    read_body: Callable[[web.BaseRequest], Awaitable[bytes]] | None = getattr(request.protocol, "read_body", None)
    if read_body is None:  # another runner's connection: aiohttp reads and inflates
        yield await request.read()
        return
    raw = await read_body(request)
    encoding = content_encoding(request)
    if encoding == "identity" or not raw:
        yield raw
        return
    budget = request.app[INFLATE_KEY]
    lease = budget.lease()
    try:
        limit = request.app[BODY_LIMIT_KEY]
        body = await anyio.to_thread.run_sync(inflate, raw, encoding, limit, lease, limiter=budget.limiter)
        del raw
        yield body
    finally:
        lease.release()
