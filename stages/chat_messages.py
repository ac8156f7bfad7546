"""A conversation as a chat template reads it: each message's content in the template's format.

A string-format template gets each message's text as one string, its text parts joined with "\\n"
(as vLLM joins them) and each image written as the model's image placeholder; an openai-format
template gets the list of parts. Tool results are one string either way, and an assistant's calls
carry their arguments as an object, which templates expect (``arguments | tojson``). Every string the
request wrote goes through a ``mark`` (``stages/control_tokens.py``); the image placeholders this
module writes do not, so they stay the model's own tokens.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.errors import InvalidRequest
from pipeline.types import ImagePart, Message
from stages.chat_format import ContentFormat
from stages.control_tokens import Marker, no_marking
from stages.tokens import single_token_id
from vision.image_text import ImageText
from vision.preprocess import ImageTokenIds

__all__ = ["image_placeholder_of", "to_template_messages"]

# Qwen-VL's templates wrap each image's pad token in these (one token each in its tokenizer)
_VISION_WRAP = ("<|vision_start|>", "<|vision_end|>")


def _token_text(tokenizer: Any, token_id: int) -> str | None:
    text = tokenizer.convert_ids_to_tokens(token_id)
    return text if isinstance(text, str) and text else None


def image_placeholder_of(tokenizer: Any, image_ids: ImageTokenIds | None, image_text: ImageText | None) -> str | None:
    """What the model's own template writes for one image: Gemma 3's ``<start_of_image>``, Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, else the image token (``[IMG]``, ``<image>``);
    None for a model that takes no images or whose image token has no text."""
    if image_text is not None:
        return image_text.placeholder
    if image_ids is None:
        return None
    token = _token_text(tokenizer, image_ids.image)
    if token is not None and all(single_token_id(tokenizer, wrap) is not None for wrap in _VISION_WRAP):
        return f"{_VISION_WRAP[0]}{token}{_VISION_WRAP[1]}"
    return token


def _arguments(text: str) -> Any:
    """A call's arguments as templates take them: an object where the JSON text is one (Llama 3.1's
    template writes ``arguments | tojson``, which would quote a string), else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _text(message: Message, index: int, image_placeholder: str | None, mark: Marker) -> str:
    pieces: list[str] = []
    for part in message.parts:
        if not isinstance(part, ImagePart):
            pieces.append(mark(part.text))
        elif image_placeholder is None:
            raise InvalidRequest(
                "this chat template takes text content only, and the model names no image placeholder to write "
                "an image as",
                field=f"messages[{index}].content",
            )
        else:
            pieces.append(image_placeholder)
    return "\n".join(pieces)


def _content(
    message: Message, index: int, content_format: ContentFormat, image_placeholder: str | None, mark: Marker
) -> Any:
    if not message.parts:
        return None  # an assistant turn of calls only; transformers drops a None content
    if message.role == "tool":  # templates read a tool result as one string
        return mark("".join(part.text for part in message.parts if not isinstance(part, ImagePart)))
    if content_format == "string":
        return _text(message, index, image_placeholder, mark)
    return [
        {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": mark(part.text)}
        for part in message.parts
    ]


def to_template_messages(
    messages: tuple[Message, ...],
    content_format: ContentFormat,
    image_placeholder: str | None = None,
    mark: Marker = no_marking,
) -> list[dict[str, Any]]:
    """``messages`` as the template's ``messages`` variable, content in ``content_format``; ``mark``:
    what each string the request wrote goes through (its text, results, calls and call ids).

    :raises InvalidRequest: (string format) an image in a message when there is no ``image_placeholder``.
    """
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        hf: dict[str, Any] = {
            "role": message.role,
            "content": _content(message, index, content_format, image_placeholder, mark),
        }
        if message.tool_calls:
            hf["tool_calls"] = [
                {
                    "id": mark(call_id),
                    "type": "function",
                    "function": {"name": mark(name), "arguments": mark(_arguments(arguments))},
                }
                for call_id, name, arguments in message.tool_calls
            ]
        if message.tool_call_id is not None:
            hf["tool_call_id"] = mark(message.tool_call_id)
        if message.reasoning is not None:  # Qwen3's template reads it (and keeps the last turn's)
            hf["reasoning_content"] = mark(message.reasoning)
        out.append(hf)
    return out
