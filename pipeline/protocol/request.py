"""Admission: a chat-completions body, decoded into ``pipeline.protocol.request_bodies`` types, as a ChatRequest.

The declared types check shapes, types and fixed bounds (``pipeline.protocol.wire`` names the field of any
failure); what is left here is what depends on the configuration (``max_tokens`` against
``max_model_len``, images per request) or on several fields at once, and the fields declared but
not honoured yet. Every error names the offending field (``messages[1].content[0].image_url.url``),
so a client knows what to fix. Runs on the event loop, or in a worker thread for large bodies.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.errors import InvalidRequest, ModelNotFound
from pipeline.protocol.constraints import CONSTRAINT_FIELDS, parse_constraint
from pipeline.protocol.request_bodies import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImageContent,
    ImageURL,
)
from pipeline.protocol.tool_formats import ToolFormat
from pipeline.protocol.tool_formats import tool_format as format_named
from pipeline.protocol.tools import ToolPlan, plan_tools, template_call_id
from pipeline.protocol.wire import check_depth, decode_body
from pipeline.types import GrammarSpec, ImagePart, Message, TextPart
from sampling.params import SamplingParams

__all__ = [
    "ChatRequest",
    "GrammarSpec",
    "ImagePart",
    "Message",
    "SamplingParams",
    "TextPart",
    "check_model",
    "parse_chat_request",
    "request_grammar",
    "sampling_params",
]


@dataclass(slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    sampling: SamplingParams
    grammar: GrammarSpec | None = None
    tools: ToolPlan | None = None  # the answer may (auto) or must call these tools
    prompt: str | list[int] | None = None  # a completions request: the raw prompt, no chat template
    prompt_field: str = "prompt"  # what its errors name: ``prompt[i]`` for one of several prompts
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


def _tool_fields(message: ChatMessage, where: str) -> tuple[tuple[tuple[str, str, str], ...], str | None]:
    """An assistant's earlier calls and a tool message's call id, with ids as the template takes them."""
    if message.tool_calls is not None and message.role != "assistant":
        raise _fail("only assistant messages carry tool_calls", f"{where}.tool_calls")
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise _fail("a tool message, and only a tool message, needs 'tool_call_id'", f"{where}.tool_call_id")
    calls = tuple(
        (template_call_id(call.id), call.function.name, call.function.arguments) for call in message.tool_calls or ()
    )
    call_id = template_call_id(message.tool_call_id) if message.tool_call_id is not None else None
    return calls, call_id


def _message(message: ChatMessage, where: str, images: list[ImagePart]) -> Message:
    if message.name is not None:
        raise _fail("'name' is not supported by this server", f"{where}.name")
    calls, call_id = _tool_fields(message, where)
    content = message.content
    if content is None and calls:
        return Message(role=message.role, parts=(), tool_calls=calls)
    if content is None:
        raise _fail("content must be a string or a non-empty list of parts", f"{where}.content")
    if isinstance(content, str):
        return Message(role=message.role, parts=(TextPart(content),), tool_calls=calls, tool_call_id=call_id)
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
    return Message(role=message.role, parts=tuple(parts), tool_calls=calls, tool_call_id=call_id)


def _messages(raw: list[ChatMessage], max_images: int) -> tuple[Message, ...]:
    images: list[ImagePart] = []
    messages = [_message(m, f"messages[{i}]", images) for i, m in enumerate(raw)]
    if len(images) > max_images:
        raise _fail(f"{len(images)} images in one request; at most {max_images} are allowed", "messages")
    if messages[-1].role == "assistant":
        raise _fail("the last message must not be the assistant's", f"messages[{len(messages) - 1}].role")
    return tuple(messages)


# digits of a token id: a longer key is refused before int() (over 4,300 digits it raises ValueError)
_MAX_TOKEN_DIGITS = 12


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = []
    for key, value in (raw or {}).items():
        is_id = key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_DIGITS
        token = int(key) if is_id else -1
        if not 0 <= token < vocab_size:
            shown = key if len(key) <= 32 else f"{key[:29]}..."
            raise _fail(f"logit_bias keys must be token ids in [0, {vocab_size}), got {shown!r}", f"logit_bias.{shown}")
        bias.append((token, value))
    return tuple(bias)


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    default_max_tokens: int,
    max_model_len: int,
    *,
    logprobs: int | None = None,
    vocab_size: int = 1 << 31,
) -> SamplingParams:
    """The sampling fields both endpoints share; ``logprobs``: top log probabilities per token (None: off)."""
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
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
    )


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs and not body.logprobs:
        raise _fail("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def request_grammar(body: ChatCompletionRequest | CompletionRequest, raw: Any) -> GrammarSpec | None:
    """The one structured-output constraint of ``body`` (``raw``: the body as sent, for field order)."""
    given = {name: value for name in CONSTRAINT_FIELDS if (value := getattr(body, name)) is not None}
    if len(given) > 1:
        # two constraints are refused naming the second in body order, which only the raw body keeps
        given = raw if isinstance(raw, dict) else msgspec.json.decode(raw)
    spec = parse_constraint(given)
    if spec is not None and isinstance(spec.value, dict | list):  # the compilers walk it recursively
        check_depth(spec.value, spec.field)
    return spec


def check_model(model: str | None, model_names: tuple[str, ...] | None) -> None:
    """:raises ModelNotFound: (404) ``model`` is set and not among ``model_names`` (None: any)."""
    if model_names is not None and model is not None and model not in model_names:
        raise ModelNotFound(
            f"The model '{model}' does not exist; this server serves {', '.join(model_names)}",
            field="model",
            stage="admission",
        )


def parse_chat_request(
    body: bytes | Any,
    *,
    max_images: int = 8,
    default_max_tokens: int = 256,
    max_model_len: int = 8192,
    vocab_size: int = 1 << 31,
    model_names: tuple[str, ...] | None = None,
    request_id: str | None = None,
    tool_format: str | ToolFormat | None = None,
) -> ChatRequest:
    """Validate an OpenAI chat-completions body (JSON bytes, or the parsed object); ``model_names``:
    the names ``model`` may carry (None: any); ``tool_format``: how the model writes tool calls
    (a ``ToolFormat``, or its name in ``tool_formats.FORMATS``; None: Mistral's).

    :raises InvalidRequest: naming the first offending field. :raises ModelNotFound: (404).
    """
    typed = decode_body(body, ChatCompletionRequest)
    check_model(typed.model, model_names)
    grammar = request_grammar(typed, body)
    fmt = tool_format if isinstance(tool_format, ToolFormat) else format_named(tool_format)
    tools = plan_tools(typed, grammar is not None, fmt)
    sampling = sampling_params(
        typed, default_max_tokens, max_model_len, logprobs=_chat_logprobs(typed), vocab_size=vocab_size
    )
    request = ChatRequest(
        messages=_messages(typed.messages, max_images),
        sampling=sampling,
        grammar=tools.grammar if tools is not None else grammar,
        tools=tools,
        stream=bool(typed.stream),
        include_usage=bool(typed.stream_options and typed.stream_options.include_usage),
        model=typed.model,
    )
    if request_id is not None:
        request.request_id = request_id
    return request
