"""The OpenAI protocol's request bodies as declared types: what clients send to the server.

msgspec structs, decoded straight from the request bytes (``pipeline.protocol.wire``): a 1 MB base64 image
body decodes and validates in 0.28 ms, against 0.60 ms for pydantic 2's ``model_validate_json``
and 1.0 ms for ``json.loads`` alone, and msgspec names a failing field as a path
(``$.messages[0].content[1].image_url.url``), which is the ``param`` a client gets back. The
OpenAPI document (``/openapi.json``) is generated from these types and the response bodies
(``pipeline.protocol.response_bodies``), never written by hand.

Bounds that depend on the configuration (``max_tokens`` against ``max_model_len``, images per
request) are checked where the configuration is known (``pipeline.protocol.request``). A key that no
type here declares is refused (``forbid_unknown_fields``; OpenAI's wording at the top level), and
the few fields declared but not honoured (a message's ``name``, completions' ``echo`` and
``suffix``) are refused by name when set: a field we do not understand is a 400, never silently
dropped.
The structured-output fields keep their raw JSON values: ``pipeline.protocol.constraints`` reads every
spelling of them and names the offending sub-field; their shape is documented in the schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sampling.params import MAX_N as SAMPLING_MAX_N

__all__ = [
    "MAX_N",
    "MAX_STOP_STRINGS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionCall",
    "FunctionDefinition",
    "ImageContent",
    "ImageURL",
    "NamedToolChoice",
    "StreamOptions",
    "TextContent",
    "Tool",
    "ToolCall",
]

MAX_STOP_STRINGS = 8
MAX_N = SAMPLING_MAX_N  # the engine sizes a step's rows by it
MAX_TOKEN_LISTS = 1024  # entries of stop_token_ids, allowed_token_ids; bad_words holds at most MAX_BAD_WORDS
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256

NonEmptyStr = Annotated[str, Meta(min_length=1)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Meta(min_length=1, max_length=MAX_STOP_STRINGS)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_LISTS)]
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_BAD_WORD_CHARS)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A request object: an unknown key is refused, naming it."""


# -- request parts ------------------------------------------------------------------------------------
class TextContent(_Body, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageURL(_Body, kw_only=True):
    url: NonEmptyStr
    # a hint to OpenAI's own resizing; the model's image processor decides the resolution here
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(_Body, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageURL | NonEmptyStr


ContentPart = TextContent | ImageContent


class FunctionCall(_Body, kw_only=True):
    name: str
    arguments: str


class ToolCall(_Body, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(_Body, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Meta(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    # an assistant's earlier reasoning, as a reasoning model's answer returned it (either name): a
    # client that sends the answer's message back as it came is not refused
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Body, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(extra_json_schema={"description": "a JSON schema"})] | None = None
    strict: bool | None = None


class Tool(_Body, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(_Body, kw_only=True):
    name: NonEmptyStr


class NamedToolChoice(_Body, kw_only=True):
    function: FunctionName
    type: Literal["function"] = "function"


class StreamOptions(_Body, kw_only=True):
    include_usage: bool | None = None


# Constraint fields are kept as raw JSON for pipeline.protocol.constraints; the annotations document them.
RawSchema = Annotated[Any, Meta(description="a JSON schema (object or boolean), or a string holding one")]
RawText = Annotated[Any, Meta(description="a regular expression or grammar text", extra_json_schema={"type": "string"})]
_STRINGS = {"type": "array", "items": {"type": "string"}}
RawChoice = Annotated[Any, Meta(description="the answer is one of these strings", extra_json_schema=_STRINGS)]
RawResponseFormat = Annotated[
    Any, Meta(description="OpenAI's response_format: text, json_object, json_schema or structural_tag")
]
RawStructuredOutputs = Annotated[Any, Meta(description="vLLM's structured outputs: json, regex, choice, grammar, ...")]
RawStructuralTag = Annotated[Any, Meta(description="an xgrammar structural tag, or a string holding one")]


# -- requests ------------------------------------------------------------------------------------------
class _Sampling(_Body, kw_only=True):
    """What chat and completions requests share: sampling, streaming and structured outputs."""

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=1 << 20)] | None = None  # 0 or -1 (vLLM's old spelling): off
    seed: Seed | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    # vLLM's sampling fields, with vLLM's meaning (sampling/params.py says what each does)
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: Annotated[list[BadWord], Meta(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=1 << 20)] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # a reasoning model's reasoning ends (its end tag is forced) after this many tokens; its answer follows
    max_reasoning_tokens: Annotated[int, Meta(ge=0)] | None = None
    # -1: as many as the model takes (vLLM's spelling); N: only the prompt's last N tokens
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # declared so that its refusal names it: log probabilities of the prompt's own tokens are not computed
    prompt_logprobs: Annotated[int, Meta(ge=-1)] | None = None
    # structured outputs, every spelling (pipeline/protocol/constraints.py reads and checks them)
    response_format: RawResponseFormat | None = None
    structured_outputs: RawStructuredOutputs | None = None
    guided_json: RawSchema | None = None
    guided_regex: RawText | None = None
    guided_choice: RawChoice | None = None
    guided_grammar: RawText | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: RawText | None = None
    structural_tag: RawStructuralTag | None = None
    json_schema: RawSchema | None = None
    regex: RawText | None = None
    ebnf: RawText | None = None
    grammar: RawText | None = None
    choice: RawChoice | None = None
    # accepted and ignored: none of them can change what the answer must satisfy
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's fields, with vLLM's meaning
    add_generation_prompt: bool | None = None  # default true: the prompt ends with the assistant's header
    continue_final_message: bool | None = None  # the last message is the assistant's, continued
    chat_template: Annotated[str, Meta(min_length=1, max_length=256 * 1024)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking)


class CompletionRequest(_Sampling, kw_only=True):
    # msgspec takes one array-like type per union: a list of prompts, token ids, or lists of them
    # (homogeneous: checked where it is read)
    prompt: str | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
