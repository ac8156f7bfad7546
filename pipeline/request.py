"""Admission parsing: an OpenAI chat-completions body into a typed ChatRequest.

Every error names the offending field (``messages[1].content[0].image_url.url``), so a client
knows what to fix; nothing here does I/O or heavy CPU work, so it runs on the event loop.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from pipeline.constraints import check_unknown_fields, parse_constraint
from pipeline.types import GrammarSpec, ImagePart, InvalidRequest, Message, TextPart
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

_ROLES = ("system", "user", "assistant")
_MAX_STOP_STRINGS = 8
_MAX_N = 16


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


def _get_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise _fail(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def _get_int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise _fail(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _parse_parts(content: Any, where: str, images: list[ImagePart]) -> tuple[TextPart | ImagePart, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list) or not content:
        raise _fail("content must be a string or a non-empty list of parts", where)
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        pf = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _fail("a content part must be an object", pf)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _fail("a text part needs a string 'text'", f"{pf}.text")
            parts.append(TextPart(text))
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str) or not url:
                raise _fail("an image_url part needs a string 'url'", f"{pf}.image_url.url")
            image = ImagePart(url=url, field=f"{pf}.image_url.url", index=len(images))
            images.append(image)
            parts.append(image)
        else:
            raise _fail(f"unknown content part type {kind!r} (expected 'text' or 'image_url')", f"{pf}.type")
    return tuple(parts)


def _parse_messages(raw: Any, max_images: int) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise _fail("'messages' must be a non-empty list", "messages")
    images: list[ImagePart] = []
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail("a message must be an object", where)
        role = message.get("role")
        if role not in _ROLES:
            raise _fail(f"role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        parts = _parse_parts(message.get("content"), f"{where}.content", images)
        if role != "user" and any(isinstance(p, ImagePart) for p in parts):
            raise _fail("only user messages may carry images", f"{where}.content")
        messages.append(Message(role=role, parts=parts))
    if len(images) > max_images:
        raise _fail(f"{len(images)} images in one request; at most {max_images} are allowed", "messages")
    if messages[-1].role == "assistant":
        raise _fail("the last message must not be the assistant's", f"messages[{len(messages) - 1}].role")
    return tuple(messages)


def _parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _fail("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > _MAX_STOP_STRINGS:
        raise _fail(f"at most {_MAX_STOP_STRINGS} stop strings", "stop")
    return tuple(stops)


def _parse_sampling(body: dict[str, Any], default_max_tokens: int, max_model_len: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        name = "max_tokens"
    max_tokens = _get_int(body, name, default_max_tokens, 1, max_model_len)
    assert max_tokens is not None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _fail("'ignore_eos' must be a boolean", "ignore_eos")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_get_number(body, "top_p", 1.0, 1e-6, 1.0),
        top_k=_get_int(body, "top_k", 0, 0, 1 << 20) or 0,
        seed=_get_int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        n=_get_int(body, "n", 1, 1, _MAX_N) or 1,
        stop=_parse_stop(body.get("stop")),
        ignore_eos=ignore_eos,
    )


def parse_chat_request(
    body: Any,
    *,
    max_images: int = 8,
    default_max_tokens: int = 256,
    max_model_len: int = 8192,
    request_id: str | None = None,
) -> ChatRequest:
    """Validate an OpenAI chat-completions body.

    :raises InvalidRequest: naming the first offending field.
    """
    if not isinstance(body, dict):
        raise _fail("the request body must be a JSON object", "body")
    check_unknown_fields(body)  # a field we would drop could be a constraint the caller relies on
    grammar = parse_constraint(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _fail("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _fail("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _fail("'model' must be a string", "model")
    request = ChatRequest(
        messages=_parse_messages(body.get("messages"), max_images),
        sampling=_parse_sampling(body, default_max_tokens, max_model_len),
        grammar=grammar,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        model=model,
    )
    if request_id is not None:
        request.request_id = request_id
    return request
