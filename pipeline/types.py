"""Shared request types: the parts of a chat request the stages read, and the structured-output
constraint (``GrammarSpec``).

Import-free, like ``pipeline.errors`` and ``pipeline.outcome``: these three are the only parts of
``pipeline`` that the lower layers (``stages``, ``vision``, ``sampling``) may import (``make check``
enforces it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GrammarKind", "GrammarSpec", "ImagePart", "Message", "TemplateOptions", "TextPart"]

GrammarKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"]


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    url: str
    field: str  # where the URL sat in the body, for error messages
    index: int  # position of this image among the request's images


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    parts: tuple[TextPart | ImagePart, ...]
    # an assistant's earlier calls: (id, function name, arguments JSON text), ids as the template takes them
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's earlier reasoning (the template's ``reasoning_content``)


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How one chat request's conversation is rendered (vLLM's chat-template request fields)."""

    add_generation_prompt: bool = True  # end the prompt with the assistant's header
    continue_final_message: bool = False  # the last (assistant) message is left open for the answer to continue
    chat_template: str | None = None  # this request's own Jinja template (None: the model's)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # chat_template_kwargs, passed to the template
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A structured-output constraint; ``key`` is canonical, so equal constraints share a cache entry."""

    kind: GrammarKind
    value: Any  # schema dict (json_schema), None (json_object), str (regex/grammar), list[str] (choice)
    strict: bool = True
    field: str = "response_format"
    # the canonical JSON of the whole spec, written on first use and kept (a grammar stage reads it
    # several times per compile, on the event loop, and a spec may be 256 KB)
    _key: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def key(self) -> str:
        if self._key is None:
            body = json.dumps(self.value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            object.__setattr__(self, "_key", f"{self.kind}:{int(self.strict)}:{body}")
        assert self._key is not None
        return self._key
