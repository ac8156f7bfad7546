"""Admission: a chat-completions body, decoded into ``pipeline.protocol`` types, as a ChatRequest.

The declared types check shapes, types and fixed bounds (``pipeline.wire`` names the field of any
failure); what is left here is what depends on the configuration (``max_tokens`` against
``max_model_len``, images per request) or on several fields at once, and the fields declared but
not honoured yet. Every error names the offending field (``messages[1].content[0].image_url.url``),
so a client knows what to fix. Runs on the event loop, or in a worker thread for large bodies.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.constraints import CONSTRAINT_FIELDS, parse_constraint
from pipeline.protocol import ChatCompletionRequest, ChatMessage, ImageContent, ImageURL
from pipeline.types import GrammarSpec, ImagePart, InvalidRequest, Message, ModelNotFound, TextPart
from pipeline.wire import decode_body
from sampling.params import SamplingParams

__all__ = [
    "ChatRequest",
    "GrammarSpec",
    "ImagePart",
    "Message",
    "SamplingParams",
    "TextPart",
    "parse_chat_request",
]


@dataclass(slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    sampling: SamplingParams
    grammar: GrammarSpec | None = None
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")

    @property
    def images(self) -> list[ImagePart]:
        return [p for m in self.messages for p in m.parts if isinstance(p, ImagePart)]


def _fail(message: str, field_name: str) -> InvalidRequest:
    return InvalidRequest(message, field=field_name, stage="admission")


_MIN_TEMPERATURE = 1e-5
_MIN_TOP_P = 1e-6

# Declared in the protocol, not honoured yet: anything but the default is refused by name (rule 7).
_NOT_YET: dict[str, Callable[[Any], bool]] = {
    "tools": bool,
    "tool_choice": lambda v: v not in (None, "none"),
    "logprobs": bool,
    "top_logprobs": bool,
    "presence_penalty": bool,
    "frequency_penalty": bool,
    "logit_bias": bool,
}


def _check_not_yet(body: ChatCompletionRequest) -> None:
    for name, is_set in _NOT_YET.items():
        if is_set(getattr(body, name)):
            raise _fail(f"'{name}' is not supported by this server yet", name)


def _message(message: ChatMessage, where: str, images: list[ImagePart]) -> Message:
    if message.role == "tool" or message.tool_call_id is not None:
        raise _fail("tool messages are not supported by this server yet", f"{where}.role")
    for name in ("name", "tool_calls"):
        if getattr(message, name) is not None:
            raise _fail(f"'{name}' is not supported by this server yet", f"{where}.{name}")
    content = message.content
    if content is None:
        raise _fail("content must be a string or a non-empty list of parts", f"{where}.content")
    if isinstance(content, str):
        return Message(role=message.role, parts=(TextPart(content),))
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        if isinstance(part, ImageContent):
            url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
            image = ImagePart(url=url, field=f"{where}.content[{j}].image_url.url", index=len(images))
            images.append(image)
            parts.append(image)
        else:
            parts.append(TextPart(part.text))
    if message.role != "user" and any(isinstance(p, ImagePart) for p in parts):
        raise _fail("only user messages may carry images", f"{where}.content")
    return Message(role=message.role, parts=tuple(parts))


def _messages(raw: list[ChatMessage], max_images: int) -> tuple[Message, ...]:
    images: list[ImagePart] = []
    messages = [_message(m, f"messages[{i}]", images) for i, m in enumerate(raw)]
    if len(images) > max_images:
        raise _fail(f"{len(images)} images in one request; at most {max_images} are allowed", "messages")
    if messages[-1].role == "assistant":
        raise _fail("the last message must not be the assistant's", f"messages[{len(messages) - 1}].role")
    return tuple(messages)


def _sampling(body: ChatCompletionRequest, default_max_tokens: int, max_model_len: int) -> SamplingParams:
    name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        name, max_tokens = "max_tokens", body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_model_len)
    elif max_tokens > max_model_len:
        raise _fail(f"'{name}' must be at most max_model_len ({max_model_len}), got {max_tokens}", name)
    stop = body.stop
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return SamplingParams(
        max_tokens=max_tokens,
        # The sampler works in fp32: logits / 4e-85 divides by zero (found by the fuzzer: NaN
        # probabilities sampled token 0 past the grammar's mask), and a top_p of 1e-300 rounds to 0
        # and filters every token out. Below these bounds the answer is the greedy one anyway.
        temperature=0.0 if temperature < _MIN_TEMPERATURE else temperature,
        top_p=max(top_p, _MIN_TOP_P),
        top_k=body.top_k or 0,
        seed=body.seed,
        n=body.n or 1,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        ignore_eos=bool(body.ignore_eos),
    )


def _grammar(body: ChatCompletionRequest, raw: Any) -> GrammarSpec | None:
    given = {name: value for name in CONSTRAINT_FIELDS if (value := getattr(body, name)) is not None}
    if len(given) > 1:
        # two constraints are refused naming the second in body order, which only the raw body keeps
        given = raw if isinstance(raw, dict) else msgspec.json.decode(raw)
    return parse_constraint(given)


def parse_chat_request(
    body: bytes | Any,
    *,
    max_images: int = 8,
    default_max_tokens: int = 256,
    max_model_len: int = 8192,
    model_names: tuple[str, ...] | None = None,
    request_id: str | None = None,
) -> ChatRequest:
    """Validate an OpenAI chat-completions body (JSON bytes, or the parsed object); ``model_names``:
    the names ``model`` may carry (None: any).

    :raises InvalidRequest: naming the first offending field. :raises ModelNotFound: (404).
    """
    typed = decode_body(body, ChatCompletionRequest)
    if model_names is not None and typed.model is not None and typed.model not in model_names:
        raise ModelNotFound(
            f"The model '{typed.model}' does not exist; this server serves {', '.join(model_names)}",
            field="model",
            stage="admission",
        )
    _check_not_yet(typed)
    request = ChatRequest(
        messages=_messages(typed.messages, max_images),
        sampling=_sampling(typed, default_max_tokens, max_model_len),
        grammar=_grammar(typed, body),
        stream=bool(typed.stream),
        include_usage=bool(typed.stream_options and typed.stream_options.include_usage),
        model=typed.model,
    )
    if request_id is not None:
        request.request_id = request_id
    return request
