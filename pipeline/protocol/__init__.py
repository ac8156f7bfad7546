"""The wire protocol: OpenAI's request and response bodies as declared types (``request_bodies``,
``response_bodies``), bytes into those types (``wire``), and admission of a body into a ``ChatRequest``
with its constraint and tools.

It knows nothing of the pipeline that runs the request (``make check`` holds it below the core).
"""

from __future__ import annotations

from pipeline.protocol.completion_request import parse_completion_request
from pipeline.protocol.constraints import CONSTRAINT_FIELDS, parse_constraint
from pipeline.protocol.request import ChatRequest, parse_chat_request
from pipeline.protocol.tool_calls import CallReader, CallStart
from pipeline.protocol.tools import plan_tools
from pipeline.protocol.wire import decode_body

__all__ = [
    "CONSTRAINT_FIELDS",
    "CallReader",
    "CallStart",
    "ChatRequest",
    "decode_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_constraint",
    "plan_tools",
]
