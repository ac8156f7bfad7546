"""Admission for ``/v1/completions``: one request per prompt, sharing the sampling parameters.

A prompt is a string (tokenized with the tokenizer's own special tokens, no chat template), a list
of token ids, or a list of either. Each prompt becomes its own ``ChatRequest`` with a raw prompt:
its own sequences, grammar matchers and answer checks, the constraint compiled once (the grammar
cache is keyed by the spec). Choice ``j`` of prompt ``i`` is choice ``i * n + j`` of the response.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pipeline.errors import InvalidRequest
from pipeline.protocol.request import (
    ChatRequest,
    check_model,
    check_stream_options,
    request_grammar,
    sampling_params,
    truncation,
)
from pipeline.protocol.request_bodies import CompletionRequest
from pipeline.protocol.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from pipeline.protocol.wire import decode_body
from pipeline.types import TemplateOptions

__all__ = ["MAX_PROMPTS", "parse_completion_request"]

MAX_PROMPTS = 16  # prompts per request: each is admitted (and bounded) like a request of its own
_KINDS = {str: "string", int: "token id", list: "token-id list"}


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


def _check_ids(ids: list[int], vocab_size: int, where: str) -> list[int]:
    """:raises InvalidRequest: naming the first id out of the vocabulary (``prompt[1][3]``)."""
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise _fail(f"prompt token ids must be in [0, {vocab_size})", f"{where}[{j}]")
    return ids


def _prompts(raw: str | list[str | int | list[int]], vocab_size: int) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if all(isinstance(p, int) for p in raw):
        return [_check_ids([int(p) for p in raw], vocab_size, "prompt")]  # type: ignore[arg-type]  # all ints
    if all(isinstance(p, str) for p in raw):
        prompts: list[str | list[int]] = [p for p in raw if isinstance(p, str)]
    elif all(isinstance(p, list) for p in raw):
        prompts = [p for p in raw if isinstance(p, list)]
    else:  # a mixed list: the first item of another kind than the first is the one named
        kind = type(raw[0])
        i = next(i for i, p in enumerate(raw) if not isinstance(p, kind))
        raise _fail(
            f"'prompt' mixes kinds: item {i} is not a {_KINDS[kind]} as item 0 is (a list holds strings, "
            "token ids or token-id lists, one kind)",
            f"prompt[{i}]",
        )
    if len(prompts) > MAX_PROMPTS:
        raise _fail(f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS} are allowed", "prompt")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not prompt:
            raise _fail("a token-id prompt must not be empty", f"prompt[{i}]")
        if isinstance(prompt, list):
            _check_ids(prompt, vocab_size, f"prompt[{i}]")
    return prompts


def parse_completion_request(
    body: bytes | Any,
    *,
    default_max_tokens: int = 256,
    max_model_len: int = 8192,
    vocab_size: int = 1 << 31,
    model_names: tuple[str, ...] | None = None,
    defaults: SamplingDefaults = NO_DEFAULTS,
    encode: Callable[[str], list[int]] | None = None,
    max_prompt_tokens: int = 1 << 31,
) -> list[ChatRequest]:
    """Validate a completions body: one request per prompt, ids ``cmpl-...-i``; ``model_names``: the
    names ``model`` may carry (None: any); ``defaults``: the checkpoint's sampling defaults;
    ``encode``: the tokenizer, for ``bad_words``.

    :raises InvalidRequest: naming the first offending field. :raises ModelNotFound: (404).
    """
    typed = decode_body(body, CompletionRequest)
    check_model(typed.model, model_names)
    check_stream_options(typed)
    if typed.echo:
        raise _fail("'echo' is not supported by this server", "echo")
    if typed.suffix is not None:
        raise _fail("'suffix' is not supported by this server", "suffix")
    if typed.best_of is not None and typed.best_of != (typed.n or 1):
        raise _fail("'best_of' must equal 'n' when given (no server-side selection)", "best_of")
    prompts = _prompts(typed.prompt, vocab_size)
    grammar = request_grammar(typed, body)
    sampling = sampling_params(
        typed,
        default_max_tokens,
        max_model_len,
        logprobs=typed.logprobs,
        vocab_size=vocab_size,
        defaults=defaults,
        encode=encode,
    )
    template = TemplateOptions(truncate_prompt_tokens=truncation(typed, max_prompt_tokens))
    base = f"cmpl-{uuid.uuid4().hex[:16]}"
    return [
        ChatRequest(
            messages=(),
            sampling=sampling,
            grammar=grammar,
            prompt=prompt,
            prompt_field=f"prompt[{i}]" if len(prompts) > 1 else "prompt",
            stream=bool(typed.stream),
            include_usage=bool(typed.stream_options and typed.stream_options.include_usage),
            model=typed.model,
            template=template,
            request_id=f"{base}-{i}",
            render_chars=len(prompt) if isinstance(prompt, str) else 0,  # token ids are not tokenized
        )
        for i, prompt in enumerate(prompts)
    ]
