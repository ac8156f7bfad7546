"""Admission: a chat-completions body, decoded into ``pipeline.protocol.request_bodies`` types, as a ChatRequest.

The declared types check shapes, types and fixed bounds (``pipeline.protocol.wire`` names the field of any
failure); what is left here is what depends on the configuration (``max_tokens`` against
``max_model_len``, images per request) or on several fields at once, and the fields declared but
not honoured yet. Every error names the offending field (``messages[1].content[0].image_url.url``),
so a client knows what to fix. Runs on the event loop, or in a worker thread for large bodies.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
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
from pipeline.protocol.request_limits import DEFAULT_LIMITS, RequestLimits, check_request_bounds
from pipeline.protocol.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from pipeline.protocol.tool_formats import ToolFormat
from pipeline.protocol.tool_formats import tool_format as format_named
from pipeline.protocol.tools import ToolPlan, plan_tools, template_call_id
from pipeline.protocol.wire import check_depth, decode_body
from pipeline.types import GrammarSpec, ImagePart, Message, TemplateOptions, TextPart
from sampling.params import SamplingParams

__all__ = [
    "ChatRequest",
    "GrammarSpec",
    "ImagePart",
    "Message",
    "SamplingParams",
    "TemplateOptions",
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
    template: TemplateOptions = field(default_factory=TemplateOptions)  # how the conversation is rendered
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    # about how much rendering and tokenizing the prompt is, in characters (request_limits.RequestSize):
    # what the template stage's lane is chosen by
    render_chars: int = 0

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
    parsed = _parts(message, where, images)
    reasoning = _reasoning(message, where)
    return dataclasses.replace(parsed, reasoning=reasoning) if reasoning is not None else parsed


def _reasoning(message: ChatMessage, where: str) -> str | None:
    """An assistant's earlier reasoning, under either of its names."""
    text = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if text is not None and message.role != "assistant":
        name = "reasoning_content" if message.reasoning_content is not None else "reasoning"
        raise _fail("only assistant messages carry reasoning", f"{where}.{name}")
    return text


def _parts(message: ChatMessage, where: str, images: list[ImagePart]) -> Message:
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


def _messages(raw: list[ChatMessage], max_images: int, template: TemplateOptions) -> tuple[Message, ...]:
    images: list[ImagePart] = []
    messages = [_message(m, f"messages[{i}]", images) for i, m in enumerate(raw)]
    if len(images) > max_images:
        raise _fail(f"{len(images)} images in one request; at most {max_images} are allowed", "messages")
    last = f"messages[{len(messages) - 1}].role"
    if template.continue_final_message and messages[-1].role != "assistant":
        raise _fail("'continue_final_message' needs the last message to be the assistant's", last)
    if messages[-1].role == "assistant" and template.add_generation_prompt:
        # a new assistant turn after the assistant's own: a prompt no template writes sensibly
        raise _fail(
            "the last message must not be the assistant's, unless 'continue_final_message' is true "
            "or 'add_generation_prompt' is false",
            last,
        )
    return tuple(messages)


def _template_options(body: ChatCompletionRequest, truncate: int | None, own_template: bool) -> TemplateOptions:
    if body.chat_template is not None and not own_template:
        raise _fail(
            "a request's own 'chat_template' is not allowed by this server (--trust-request-chat-template)",
            "chat_template",
        )
    continue_final = bool(body.continue_final_message)
    add_prompt = not continue_final if body.add_generation_prompt is None else body.add_generation_prompt
    if continue_final and add_prompt:
        raise _fail("'continue_final_message' and 'add_generation_prompt' cannot both be true", "add_generation_prompt")
    return TemplateOptions(
        add_generation_prompt=add_prompt,
        continue_final_message=continue_final,
        chat_template=body.chat_template,
        kwargs=dict(body.chat_template_kwargs or {}),
        truncate_prompt_tokens=truncate,
    )


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


def _token_ids(raw: list[int] | None, vocab_size: int, name: str) -> tuple[int, ...]:
    for j, token in enumerate(raw or ()):
        if token >= vocab_size:
            raise _fail(f"'{name}' holds token ids in [0, {vocab_size}), got {token}", f"{name}[{j}]")
    return tuple(raw or ())


def _bad_words_ids(words: list[str] | None, encode: Callable[[str], list[int]] | None) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM bans them: the word as written, and with one leading
    space (how a word is written after another in most vocabularies) where that is another sequence
    of the same length that does not start with the same token."""
    if not words:
        return ()
    if encode is None:
        raise _fail("'bad_words' needs the model's tokenizer, which this admission has not", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for ids in (plain, spaced):
            if ids and ids not in sequences and (ids is plain or (len(ids) == len(plain) and ids[0] != plain[0])):
                sequences.append(ids)
    return tuple(sequences)


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    default_max_tokens: int,
    max_model_len: int,
    *,
    logprobs: int | None = None,
    vocab_size: int = 1 << 31,
    defaults: SamplingDefaults = NO_DEFAULTS,
    encode: Callable[[str], list[int]] | None = None,
) -> SamplingParams:
    """The sampling fields both endpoints share; ``logprobs``: top log probabilities per token (None: off);
    ``defaults``: the checkpoint's values for fields the body leaves unset; ``encode``: text to token
    ids without special tokens (for ``bad_words``)."""
    if body.prompt_logprobs is not None:
        raise _fail(
            "'prompt_logprobs' is not supported by this server (the prompt's tokens get no logits)", "prompt_logprobs"
        )
    name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        name, max_tokens = "max_tokens", body.max_tokens
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens or default_max_tokens, max_model_len)
    elif max_tokens > max_model_len:
        raise _fail(f"'{name}' must be at most max_model_len ({max_model_len}), got {max_tokens}", name)
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise _fail(f"'min_tokens' must be at most the answer's maximum ({max_tokens}), got {min_tokens}", "min_tokens")
    stop = body.stop
    temperature = _pick(body.temperature, defaults.temperature, 1.0)
    top_p = _pick(body.top_p, defaults.top_p, 1.0)
    allowed = body.allowed_token_ids
    return SamplingParams(
        max_tokens=max_tokens,
        # The sampler works in fp32: logits / 4e-85 divides by zero (found by the fuzzer: NaN
        # probabilities sampled token 0 past the grammar's mask), and a top_p of 1e-300 rounds to 0
        # and filters every token out. Below these bounds the answer is the greedy one anyway.
        temperature=0.0 if temperature < _MIN_TEMPERATURE else temperature,
        top_p=max(top_p, _MIN_TOP_P),
        top_k=max(0, int(_pick(body.top_k, defaults.top_k, 0))),
        seed=body.seed,
        n=body.n or 1,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        repetition_penalty=_pick(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        min_p=_pick(body.min_p, defaults.min_p, 0.0),
        min_tokens=min_tokens,
        stop_token_ids=_token_ids(body.stop_token_ids, vocab_size, "stop_token_ids"),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        bad_words_ids=_bad_words_ids(body.bad_words, encode),
        allowed_token_ids=None if allowed is None else _token_ids(allowed, vocab_size, "allowed_token_ids"),
        skip_special_tokens=body.skip_special_tokens is not False,
        spaces_between_special_tokens=body.spaces_between_special_tokens is not False,
        max_reasoning_tokens=body.max_reasoning_tokens,
    )


def _pick(given: float | None, default: float | None, fallback: float) -> float:
    """The request's value, else the checkpoint's, else OpenAI's."""
    return given if given is not None else default if default is not None else fallback


def truncation(body: ChatCompletionRequest | CompletionRequest, max_prompt_tokens: int) -> int | None:
    """``truncate_prompt_tokens`` as a count of tokens kept (-1: as many as a prompt may hold)."""
    given = body.truncate_prompt_tokens
    if given is None:
        return None
    if given == 0:
        raise _fail("'truncate_prompt_tokens' must be -1 or at least 1", "truncate_prompt_tokens")
    if given > max_prompt_tokens:
        raise _fail(
            f"'truncate_prompt_tokens' must be at most the prompt's limit ({max_prompt_tokens}), got {given}",
            "truncate_prompt_tokens",
        )
    return max_prompt_tokens if given == -1 else given


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


def check_stream_options(body: ChatCompletionRequest | CompletionRequest) -> None:
    """:raises InvalidRequest: ``stream_options`` set without ``stream: true`` (OpenAI refuses it too)."""
    if body.stream_options is not None and not body.stream:
        raise _fail("'stream_options' is only allowed when 'stream' is true", "stream_options")


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
    defaults: SamplingDefaults = NO_DEFAULTS,
    encode: Callable[[str], list[int]] | None = None,
    max_prompt_tokens: int = 1 << 31,
    trust_request_chat_template: bool = True,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> ChatRequest:
    """Validate an OpenAI chat-completions body (JSON bytes, or the parsed object); ``model_names``:
    the names ``model`` may carry (None: any); ``tool_format``: how the model writes tool calls
    (a ``ToolFormat``, or its name in ``tool_formats.FORMATS``; None: Mistral's); ``defaults``: the
    checkpoint's sampling defaults; ``encode``: the tokenizer, for ``bad_words``;
    ``trust_request_chat_template``: whether the body may carry its own template; ``limits``: what
    the request may hold, counted before anything else reads it.

    :raises InvalidRequest: naming the first offending field. :raises ModelNotFound: (404).
    """
    typed = decode_body(body, ChatCompletionRequest)
    size = check_request_bounds(typed, limits)
    check_model(typed.model, model_names)
    check_stream_options(typed)
    grammar = request_grammar(typed, body)
    fmt = tool_format if isinstance(tool_format, ToolFormat) else format_named(tool_format)
    tools = plan_tools(typed, grammar is not None, fmt, max_schema_chars=limits.max_schema_chars)
    sampling = sampling_params(
        typed,
        default_max_tokens,
        max_model_len,
        logprobs=_chat_logprobs(typed),
        vocab_size=vocab_size,
        defaults=defaults,
        encode=encode,
    )
    if tools is not None and sampling.skip_special_tokens:
        # the calls' markers are special tokens in many families (Hermes' <tool_call>, Mistral's
        # [TOOL_CALLS]): the answer's text keeps them, so its calls can be read and checked (as
        # vLLM's tool parsers set it)
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    template = _template_options(typed, truncation(typed, max_prompt_tokens), trust_request_chat_template)
    request = ChatRequest(
        messages=_messages(typed.messages, max_images, template),
        sampling=sampling,
        grammar=tools.grammar if tools is not None else grammar,
        tools=tools,
        stream=bool(typed.stream),
        include_usage=bool(typed.stream_options and typed.stream_options.include_usage),
        model=typed.model,
        template=template,
        render_chars=size.render_chars,
    )
    if request_id is not None:
        request.request_id = request_id
    return request
