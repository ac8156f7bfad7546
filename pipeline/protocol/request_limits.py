"""Cheap bounds on a chat request, checked right after its body is decoded and before anything walks,
renders or compiles it: how many messages, content parts and tools it holds, and how much text.

Each is one pass over the decoded body. Past a bound the request is a 400 naming the field, so a
4 MB body of 100,001 two-word messages (738,900 tokens once rendered, 35 s of a template thread
to find out) is refused in milliseconds. OpenAI refuses more than 2,048 messages and more than 128
tools the same way (``array_above_max_length``); vLLM has no such bounds and finds a prompt too long
only once it is rendered and tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import InvalidRequest, PromptTooLong
from pipeline.protocol.request_bodies import ChatCompletionRequest, ChatMessage, TextContent

__all__ = ["DEFAULT_LIMITS", "ITEM_CHARS", "RequestLimits", "RequestSize", "check_request_bounds"]

# What rendering one message or content part costs, in characters of text tokenized in the same
# time: the embedded model's template renders a message in about 80 us, its tokenizer goes through
# a character in about 0.45 us (both measured, on 2,047 messages and on 1-5 M characters).
ITEM_CHARS = 256


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one chat request may hold (``PipelineConfig.max_messages`` and the rest)."""

    max_messages: int = 2048
    max_content_parts: int = 8192  # every message's content parts and earlier tool calls together
    max_tools: int = 128
    # Characters of message text that a prompt of ``max_prompt_tokens`` tokens could not hold
    # whatever the text (the template stage's bound: tokens times the longest vocabulary entry,
    # with room for normalizers); None: no bound before rendering.
    max_text_chars: int | None = None
    max_prompt_tokens: int = 1 << 31  # what the text bound's message quotes
    # The grammar stage's limit on a schema's JSON (``grammar_max_bytes``): the calls' schema holds every
    # tool's parameters, so tools whose parameters alone are larger are refused before it is built.
    max_schema_chars: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_content_parts", "max_tools", "max_prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RequestLimits.{name} must be positive")


DEFAULT_LIMITS = RequestLimits()


@dataclass(frozen=True, slots=True)
class RequestSize:
    """How much a request's conversation holds, as counted by ``check_request_bounds``."""

    num_messages: int = 0
    num_items: int = 0  # content parts and earlier tool calls
    num_chars: int = 0  # every message's text, tool calls' arguments included

    @property
    def render_chars(self) -> int:
        """About how much work rendering and tokenizing the conversation is, in characters."""
        return self.num_chars + ITEM_CHARS * (self.num_messages + self.num_items)


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


def _text_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content or () if isinstance(part, TextContent))


def check_request_bounds(body: ChatCompletionRequest, limits: RequestLimits) -> RequestSize:
    """Count ``body``'s messages, parts, tools and text against ``limits``.

    :raises InvalidRequest: naming ``messages``, the message whose parts cross the bound
        (``messages[i].content``) or ``tools``.
    :raises PromptTooLong: the messages' text alone is more than a prompt can hold (naming ``messages``).
    """
    messages = body.messages
    if len(messages) > limits.max_messages:
        raise _fail(f"{len(messages):,} messages; at most {limits.max_messages:,} are allowed", "messages")
    if body.tools is not None and len(body.tools) > limits.max_tools:
        raise _fail(f"{len(body.tools):,} tools; at most {limits.max_tools:,} are allowed", "tools")
    num_items = num_chars = certain_chars = 0
    for i, message in enumerate(messages):
        calls = message.tool_calls or ()
        parts = message.content if isinstance(message.content, list) else ()
        num_items += len(parts) + len(calls)
        if num_items > limits.max_content_parts:
            where = f"messages[{i}].content" if parts else f"messages[{i}].tool_calls"
            raise _fail(
                f"the messages hold more than {limits.max_content_parts:,} content parts and tool calls together",
                where,
            )
        chars = _text_chars(message)
        reasoning = message.reasoning_content or message.reasoning or ""
        num_chars += chars + len(reasoning) + sum(len(call.function.arguments) for call in calls)
        if message.role != "assistant":
            # the assistant's earlier text is not counted: templates may drop part of it (the
            # reasoning of earlier turns), and this bound must never refuse a prompt that fits
            certain_chars += chars
    if limits.max_text_chars is not None and certain_chars > limits.max_text_chars:
        raise PromptTooLong(
            f"the messages hold {certain_chars:,} characters of text, more than {limits.max_prompt_tokens:,} "
            f"tokens can write; at most {limits.max_prompt_tokens:,} tokens are allowed",
            field="messages",
            stage="admission",
        )
    return RequestSize(len(messages), num_items, num_chars)
