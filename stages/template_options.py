"""A chat request's own template options, checked as vLLM checks them: extra template variables
(``chat_template_kwargs``) and prompt truncation (``truncate_prompt_tokens``)."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

from pipeline.errors import InvalidRequest

__all__ = ["reserved_template_names", "template_kwargs", "truncate_prompt"]

# what the template call sets itself: a request's variable of one of these names would replace the
# conversation, the tools or the call's own switches (transformers lets kwargs override them)
_CALL_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


def reserved_template_names(tokenizer: Any) -> frozenset[str]:
    """The names a request's template variables may not take: the template call's own arguments
    (those of ``tokenizer.apply_chat_template`` included, whatever its transformers version)."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return _CALL_NAMES | named


def template_kwargs(kwargs: dict[str, Any], reserved: Collection[str]) -> dict[str, Any]:
    """``kwargs`` (a request's ``chat_template_kwargs``) as extra template variables.

    :raises InvalidRequest: naming ``chat_template_kwargs.<name>`` for a name the call sets itself.
    """
    for name in kwargs:
        if name in reserved:
            raise InvalidRequest(
                f"'{name}' is an argument of the template call itself, not a template variable a request may set",
                field=f"chat_template_kwargs.{name}",
            )
    return kwargs


def truncate_prompt(
    ids: list[int], keep: int | None, max_prompt_tokens: int, image_token: int | None, span_tokens: Collection[int]
) -> list[int]:
    """The last ``keep`` of ``ids`` (vLLM's ``truncate_prompt_tokens``; -1: as many as a prompt may
    hold; None: all of them). ``span_tokens``: the ids an image's span is written with (its image
    tokens and their markers, ``<|vision_start|>``, ``[IMG_BREAK]``, ...).

    :raises InvalidRequest: naming ``truncate_prompt_tokens`` when ``keep`` is neither -1 nor positive, or
        when the cut would drop an image token (its embedding would find no place) or split a span.
    """
    if keep is None:
        return ids
    if keep == -1:
        keep = max_prompt_tokens
    if keep < 1:
        raise InvalidRequest(
            "truncate_prompt_tokens must be -1 or a positive number of tokens", field="truncate_prompt_tokens"
        )
    cut = len(ids) - keep
    if cut <= 0:
        return ids
    spans = set(span_tokens)
    if image_token is not None and (image_token in ids[:cut] or {ids[cut - 1], ids[cut]} <= spans):
        start = ids.index(image_token)
        while start > 0 and ids[start - 1] in spans:  # its opening markers
            start -= 1
        raise InvalidRequest(
            f"keeping the last {keep} of the prompt's {len(ids)} tokens would cut through an image's tokens; "
            f"the first image's span starts {len(ids) - start} tokens from the end",
            field="truncate_prompt_tokens",
        )
    return ids[cut:]
