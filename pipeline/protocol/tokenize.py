"""``POST /tokenize`` and ``/detokenize`` in vLLM's shape: what a prompt or a conversation is in token ids.

Clients use them to count a prompt against the context before sending it, and to see what the chat
template made of a conversation. A conversation is read exactly as ``/v1/chat/completions`` reads
it (the same checks, template options and tools), so the count is the one a chat request would
get; images are refused by name, since their token count depends on the decoded image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pipeline.errors import InvalidRequest
from pipeline.protocol.request import ChatRequest, check_model
from pipeline.protocol.request_bodies import ChatCompletionRequest, ChatMessage, Tool
from pipeline.protocol.wire import decode_body

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeJob",
    "TokenizeRequest",
    "TokenizeResponse",
    "parse_detokenize",
    "parse_tokenize",
]

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Either ``prompt`` (a completions prompt) or ``messages`` (a conversation, with the chat fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # a prompt: the tokenizer's own special tokens (BOS) as /v1/completions adds them; a conversation:
    # none besides the template's (vLLM's defaults)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Annotated[str, Meta(min_length=1, max_length=256 * 1024)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None  # also each token's text, as the vocabulary writes it


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_DETOKENIZE_IDS)]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


@dataclass(frozen=True, slots=True)
class TokenizeJob:
    """What to tokenize: a raw ``prompt``, or ``chat`` (a conversation admitted as a chat request)."""

    prompt: str | None
    chat: ChatRequest | None
    add_special_tokens: bool
    return_token_strs: bool


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


# the chat fields a conversation carries on to the chat request it is read as
_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def parse_tokenize(body: bytes | Any, *, model_names: tuple[str, ...] | None, parse_chat: Any) -> TokenizeJob:
    """``body`` as a job; ``parse_chat``: the pipeline's chat admission (a chat body in, a ChatRequest out).

    :raises InvalidRequest: naming the offending field. :raises ModelNotFound: (404).
    """
    typed = decode_body(body, TokenizeRequest)
    check_model(typed.model, model_names)
    if (typed.prompt is None) == (typed.messages is None):
        raise _fail("give exactly one of 'prompt' and 'messages'", "messages" if typed.messages else "prompt")
    strs = bool(typed.return_token_strs)
    if typed.prompt is not None:
        for name in _CHAT_FIELDS[1:]:
            if getattr(typed, name) is not None:
                raise _fail(f"'{name}' goes with 'messages', not 'prompt'", name)
        special = typed.add_special_tokens is not False
        return TokenizeJob(typed.prompt, None, special, strs)
    # already decoded: handed to the chat admission as its body type, not written back to JSON first
    chat: ChatRequest = parse_chat(ChatCompletionRequest(**{name: getattr(typed, name) for name in _CHAT_FIELDS}))
    if chat.images:
        raise _fail(
            "images are not tokenized here: their token count depends on the decoded image", chat.images[0].field
        )
    return TokenizeJob(None, chat, bool(typed.add_special_tokens), strs)


def parse_detokenize(body: bytes | Any, *, model_names: tuple[str, ...] | None, vocab_size: int) -> list[int]:
    """The token ids of a detokenize body. :raises InvalidRequest: an id out of the vocabulary."""
    typed = decode_body(body, DetokenizeRequest)
    check_model(typed.model, model_names)
    for j, token in enumerate(typed.tokens):
        if token >= vocab_size:
            raise _fail(f"token ids must be in [0, {vocab_size})", f"tokens[{j}]")
    return typed.tokens
