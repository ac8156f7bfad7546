"""A rendered chat prompt must hold some of the conversation: a template that dropped every message's
text leaves the model nothing to answer.

Mistral's templates write a system message only before a user message, so a conversation of only a
system message rendered to ``<s>``, one token, and the model answered that with a 200. OpenAI answers
a system-only conversation from the system message; ChatML templates write it, and it is served.
Where the template wrote none of the text, the request is a 400 naming ``messages`` instead of an
answer to nothing. A conversation with no text at all (an empty user message) is the client's choice
and is served as rendered.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pipeline.errors import InvalidRequest
from pipeline.types import Message, TextPart

__all__ = ["check_prompt_has_content", "special_token_ids"]


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (every added token marked special)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(int(i) for i, token in added.items() if getattr(token, "special", False))


def check_prompt_has_content(ids: list[int], special_ids: Collection[int], messages: tuple[Message, ...]) -> None:
    """:raises InvalidRequest: naming ``messages`` when ``ids`` are all special tokens although some
    message has text (the template wrote none of it)."""
    if any(token not in special_ids for token in ids):  # the first text token ends it: a few steps
        return
    if not any(isinstance(part, TextPart) and part.text.strip() for m in messages for part in m.parts):
        return
    roles = sorted({m.role for m in messages})
    raise InvalidRequest(
        f"the chat template wrote none of the conversation into the prompt (its roles: {', '.join(roles)}); "
        "this model's template needs a user message",
        field="messages",
    )
