"""The OpenAI protocol's response bodies as declared types: what the server answers.

msgspec structs that the HTTP API (``pipeline.api``) encodes; the OpenAPI document is generated from
them and the request bodies (``pipeline.protocol.request_bodies``). Fields marked "ours" are this
server's additions to OpenAI's shapes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pipeline.protocol.request_bodies import ToolCall

__all__ = [
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "Delta",
    "ErrorObject",
    "ErrorResponse",
    "FunctionCallDelta",
    "Model",
    "ModelList",
    "TokenLogprob",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
]


class _Out(msgspec.Struct, kw_only=True):
    """A response object."""


# -- responses ------------------------------------------------------------------------------------------
class Usage(_Out, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Out, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Out, kw_only=True):
    """A sampled token's log probability (after the grammar mask, before the temperature), and the
    ``top_logprobs`` most likely tokens of its step."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out, kw_only=True):
    content: list[TokenLogprob] | None


class AssistantMessage(_Out, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # a reasoning model's reasoning, apart from its answer: vLLM's and SGLang's name, and vLLM's newer one
    reasoning_content: str | None = None
    reasoning: str | None = None


class Choice(_Out, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Out, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    timings: dict[str, float] | None = None  # ours: seconds per preparation stage


class FunctionCallDelta(_Out, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: the first carries its id, type and name, the rest argument text."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: Literal["function"] | None = None


class Delta(_Out, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a piece of the reasoning (and under vLLM's newer name)
    reasoning: str | None = None


class ChunkChoice(_Out, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Out, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out, kw_only=True):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(_Out, kw_only=True):
    index: int  # prompt i's choice j is index i * n + j
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Out, kw_only=True):
    """A completions response, and each chunk of a streamed one (``usage`` only on the last, if asked)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ErrorObject(_Out, kw_only=True):
    """OpenAI's error object; ``param`` names the offending field of a 4xx."""

    message: str
    type: str
    param: str | None
    code: str | None
    stage: str | None = None  # ours: where it failed
    request_id: str | None = None  # ours: the id the server logged it under
    path: str | None = None  # ours, 422 only: JSON pointer into the answer where it broke
    reason: str | None = None  # ours, 422 only: the keyword that failed


class ErrorResponse(_Out, kw_only=True):
    error: ErrorObject


class Model(_Out, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "local"


class ModelList(_Out, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Model]
