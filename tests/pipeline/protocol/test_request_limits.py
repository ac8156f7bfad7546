"""Cheap bounds at admission: messages, content parts, tools and text counted before anything renders
or compiles them, each refusal a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.errors import InvalidRequest, PromptTooLong
from pipeline.protocol.request import parse_chat_request
from pipeline.protocol.request_limits import ITEM_CHARS, RequestLimits

SMALL = RequestLimits(max_messages=4, max_content_parts=5, max_tools=2, max_text_chars=100, max_prompt_tokens=10)


def turns(count: int, text: str = "hello there") -> list[dict[str, Any]]:
    """``count`` messages, user and assistant in turn, ending with the user's."""
    roles = ["user", "assistant"] * count
    return [{"role": role, "content": text} for role in roles[:count][::-1]]


def refused(body: dict[str, Any], limits: RequestLimits = SMALL) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body, limits=limits)
    assert info.value.status == 400 and info.value.stage == "admission"
    return info.value


def test_openai_bounds_by_default() -> None:
    # the 4 MB body: 100,001 short messages were rendered and tokenized for 35 s before a 400
    body = json.dumps({"messages": turns(100_001)}).encode()
    assert len(body) > 3_000_000
    error = refused(body, RequestLimits())
    assert error.field == "messages" and "100,001 messages; at most 2,048" in error.message
    parse_chat_request({"messages": turns(2047)})  # an odd count ends with the user's turn
    parts = [{"type": "text", "text": "hi"}] * 200_000
    assert refused({"messages": [{"role": "user", "content": parts}]}, RequestLimits()).field == "messages[0].content"
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(34_000)]
    error = refused({"messages": turns(1), "tools": tools}, RequestLimits())
    assert error.field == "tools" and "34,000 tools; at most 128" in error.message


def test_messages_parts_and_tools_are_counted() -> None:
    assert refused({"messages": turns(5)}).field == "messages"
    parse_chat_request({"messages": turns(3)}, limits=SMALL)
    three = [{"type": "text", "text": "a"}] * 3
    body = {"messages": [{"role": "user", "content": three}, {"role": "assistant", "content": "b"}] * 2}
    body["messages"] = body["messages"][:3]  # 3 + 3 parts: the second list crosses 5
    assert refused(body).field == "messages[2].content"
    calls = [{"id": f"call{i:05d}", "function": {"name": "f", "arguments": "{}"}} for i in range(6)]
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls}]}
    assert refused(body).field == "messages[1].tool_calls"
    tool = {"type": "function", "function": {"name": "f"}}
    assert refused({"messages": turns(1), "tools": [tool] * 3}).field == "tools"


def test_text_that_no_prompt_can_hold_is_refused_before_rendering() -> None:
    with pytest.raises(PromptTooLong) as info:
        parse_chat_request({"messages": [{"role": "system", "content": "s" * 60}, *turns(1, "u" * 41)]}, limits=SMALL)
    assert info.value.field == "messages" and info.value.code == "context_length_exceeded"
    assert "101 characters" in info.value.message and "10 tokens" in info.value.message
    # the assistant's earlier text is not counted: templates may drop some of it (earlier reasoning)
    request = parse_chat_request({"messages": turns(3, "x" * 40)}, limits=SMALL)
    assert request.render_chars == 120 + ITEM_CHARS * 3


def test_render_size_counts_every_message_part_and_call() -> None:
    calls = [{"id": "call00001", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]
    body = {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call00001", "content": "ok"},
            {"role": "user", "content": "next"},
        ]
    }
    request = parse_chat_request(body)
    assert request.render_chars == (5 + 8 + 2 + 4) + ITEM_CHARS * (4 + 2 + 1)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tools"):
        RequestLimits(max_tools=0)
