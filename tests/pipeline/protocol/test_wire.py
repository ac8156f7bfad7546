"""Bodies given as Python objects meet the same rules as JSON bodies: a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.request_bodies import ChatCompletionRequest
from pipeline.protocol.wire import MAX_DEPTH, decode_body


def nested(depth: int) -> Any:
    """``depth`` lists around a string."""
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages[0].content[0].text",
        ),
        (chat(metadata={"k\ud800": "v"}), "metadata.k\ud800"),
        (chat(guided_json={"a": nested(MAX_DEPTH)}), "guided_json.a" + "[0]" * (MAX_DEPTH - 1)),
        (chat(guided_json=nested(3_000)), "guided_json" + "[0]" * MAX_DEPTH),
    ],
)
def test_lone_surrogates_and_deep_nesting_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_body(body, ChatCompletionRequest)
    assert info.type is InvalidRequest and info.value.field == field


def test_a_body_at_the_depth_limit_passes() -> None:
    decoded = decode_body(chat(guided_json=nested(MAX_DEPTH - 2)), ChatCompletionRequest)
    assert decoded.guided_json is not None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"messages": [{"role": "user", "content": "h\xff\xfei"}]}', "messages[0].content"),
        (b'{"model": "\xc3(", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"max_\xfftokens": 1, "messages": [{"role": "user", "content": "hi"}]}', "max_\\xfftokens"),
    ],
)
def test_bytes_that_are_not_utf8_name_their_string(raw: bytes, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_body(raw, ChatCompletionRequest)
    assert (info.value.status, info.value.field) == (400, field)
    assert "not valid UTF-8" in info.value.message
