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
    """OpenAI's error JSON with the status the error carries (the one place errors meet HTTP)."""
    headers = {"Content-Type": JSON}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    # a 5xx was logged once, with its traceback and request id, where it happened
    return Reply(error.status, json.dumps({"error": error.to_dict()}).encode(), headers)


def event(payload: object) -> bytes:
    """One server-sent event."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
