"""What an API route answers, apart from any web framework: a whole ``Reply`` or a ``StreamReply``.

Errors become HTTP here and only here (``error_reply``); front ends only move these bytes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from pipeline.core.loop_turns import LoopTurns
from pipeline.errors import Overloaded, PipelineError

__all__ = [
    "DONE",
    "SSE_HEADERS",
    "Reply",
    "Send",
    "StreamReply",
    "built_reply",
    "error_reply",
    "event",
    "json_reply",
]

JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"

Send = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer: status, headers (``Content-Type`` among them) and body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": JSON})


@dataclass(frozen=True, slots=True)
class StreamReply:
    """Server-sent events, status 200: ``await write(send)`` sends every event through ``send``.

    The front end sends its headers with the first event. ``write`` raises ``PipelineError`` only
    before its first ``send`` (answer ``error_reply`` then: a plain 4xx/5xx); after that an error is
    sent in-band, as OpenAI does. When ``send`` raises (the client went away) or the caller is
    cancelled, ``write`` cancels the requests it holds before the exception leaves. A front end
    that gets a ``StreamReply`` must call ``write``: the requests are already admitted.
    """

    write: Callable[[Send], Awaitable[None]]
    headers: dict[str, str] = field(default_factory=lambda: dict(SSE_HEADERS))


def json_reply(payload: msgspec.Struct | dict[str, Any], status: int = 200) -> Reply:
    return Reply(status, msgspec.json.encode(payload))


async def built_reply(build: Callable[[], Reply], *, per_token: bool, turns: LoopTurns) -> Reply:
    """``build()``'s whole reply: in a worker thread when it holds an object per token and per top
    entry (log probabilities: 8 choices of 4,000 tokens with 20 each held the loop, and /health, for
    3 s), else on the loop in its turn (0.1-0.4 ms)."""
    if per_token:
        return await anyio.to_thread.run_sync(build)
    async with turns:
        return build()


def error_reply(error: PipelineError) -> Reply:
    """OpenAI's error JSON with the status the error carries (the one place errors meet HTTP).

    The error's frames are let go: a 5xx was logged once, with its traceback and request id, where it
    happened, and an error that crossed a future (a worker thread's, a request handle's) sits in a
    reference cycle with the frame that awaited it. Kept, the cycle kept the request's body and parsed
    messages until the cyclic collector next ran, which an idle server may not do for minutes: 24
    refused 60 MB bodies held 2.9 GB after their answers had left.
    """
    headers = {"Content-Type": JSON}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    reply = Reply(error.status, json.dumps({"error": error.to_dict()}).encode(), headers)
    _drop_frames(error)
    return reply


def _drop_frames(error: BaseException) -> None:
    """Clear the tracebacks of ``error`` and of the errors it was raised from or during."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def event(payload: object) -> bytes:
    """One server-sent event."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
