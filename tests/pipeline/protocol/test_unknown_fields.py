"""The unknown-field rule as it runs: the body types forbid undeclared keys, and the decoder names them.

A field a client sends that no body type declares is a 400 in OpenAI's wording, never dropped; every
field the server honours (tools, log probabilities, logit_bias, the penalties, ...) is accepted. Each
case goes through both decode paths: JSON bytes (msgspec's decoder) and an already parsed object.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.completion_request import parse_completion_request
from pipeline.protocol.constraints import CONSTRAINT_FIELDS
from pipeline.protocol.request import parse_chat_request
from pipeline.protocol.request_bodies import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# Every field of a chat body but the constraint spellings (tests/pipeline/protocol/test_constraints.py),
# each set to something other than its default.
CHAT_FIELDS: dict[str, Any] = {
    "messages": MESSAGES,
    "model": "m",
    "max_tokens": 5,
    "max_completion_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "seed": 1,
    "n": 2,
    "stop": ["x"],
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "presence_penalty": -0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "logprobs": True,
    "top_logprobs": 2,
    "tools": [TOOL],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "metadata": {"a": "b"},
    "store": False,
    "service_tier": "auto",
    # vLLM's sampling fields (bad_words needs the tokenizer: tests/pipeline/protocol/test_vllm_fields.py)
    "repetition_penalty": 1.2,
    "min_p": 0.05,
    "min_tokens": 2,
    "stop_token_ids": [7],
    "include_stop_str_in_output": True,
    "bad_words": [],
    "allowed_token_ids": [5, 6, 7],
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "max_reasoning_tokens": 64,
    "truncate_prompt_tokens": 100,
    "prompt_logprobs": None,  # declared to be refused by name when set
    # the chat template's fields
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": "{{ messages[0]['content'] }}",
    "chat_template_kwargs": {"enable_thinking": False},
}
# echo and suffix are declared but not honoured: accepted at their defaults only
COMPLETION_ONLY = {"prompt": "hi", "echo": False, "logprobs": 2, "suffix": None, "best_of": 2}
CHAT_ONLY = {"add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"}


def both_forms(body: dict[str, Any]) -> list[Any]:
    return [body, json.dumps(body).encode()]


def refused(parse: Any, body: dict[str, Any]) -> list[InvalidRequest]:
    errors = []
    for given in both_forms(body):
        with pytest.raises(InvalidRequest) as info:
            parse(given)
        assert info.value.status == 400 and info.value.stage == "admission"
        errors.append(info.value)
    return errors


def test_the_table_covers_every_declared_chat_field() -> None:
    assert set(ChatCompletionRequest.__struct_fields__) - CONSTRAINT_FIELDS == set(CHAT_FIELDS)


@pytest.mark.parametrize("given", both_forms(CHAT_FIELDS), ids=["object", "bytes"])
def test_every_declared_field_is_accepted_and_honoured(given: Any) -> None:
    request = parse_chat_request(given)
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-0.5, 0.5)
    assert sampling.logit_bias == ((5, 1.0),)
    assert sampling.logprobs == 2
    assert request.tools is not None and [t["function"]["name"] for t in request.tools.tools] == ["get_weather"]
    assert (sampling.repetition_penalty, sampling.min_p, sampling.min_tokens) == (1.2, 0.05, 2)
    assert sampling.stop_token_ids == (7,) and sampling.allowed_token_ids == (5, 6, 7)
    assert sampling.include_stop_str_in_output and not sampling.skip_special_tokens
    assert not sampling.spaces_between_special_tokens
    assert sampling.max_reasoning_tokens == 64
    assert request.template.kwargs == {"enable_thinking": False}
    assert request.template.chat_template == "{{ messages[0]['content'] }}"
    assert request.template.truncate_prompt_tokens == 100


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [TOOL]},
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": True},
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 5},
        {"logit_bias": {"7": -100}},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
    ],
    ids=lambda extra: ",".join(extra),
)
def test_fields_other_servers_refuse_are_accepted(extra: dict[str, Any]) -> None:
    for given in both_forms({"messages": MESSAGES, **extra}):
        parse_chat_request(given)


def test_completions_accept_their_own_fields() -> None:
    shared = {k: v for k, v in CHAT_FIELDS.items() if k in CompletionRequest.__struct_fields__}
    assert (
        set(CHAT_FIELDS) - set(shared)
        == {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"} | CHAT_ONLY
    )
    assert set(CompletionRequest.__struct_fields__) - CONSTRAINT_FIELDS == set(shared) | set(COMPLETION_ONLY)
    for given in both_forms({**shared, **COMPLETION_ONLY}):
        (request,) = parse_completion_request(given)
        assert request.prompt == "hi" and request.sampling.n == 2
        assert request.sampling.logit_bias == ((5, 1.0),) and request.sampling.logprobs == 2


@pytest.mark.parametrize(
    "name", ["foo", "documents", "functions", "guided_jsn", "structured_output", "extra_body", "prompt", "echo"]
)
def test_an_undeclared_chat_field_is_refused_in_openai_wording(name: str) -> None:
    for error in refused(parse_chat_request, {"messages": MESSAGES, name: 1}):
        assert error.field == name
        assert error.message == f"Unrecognized request argument supplied: {name}"


@pytest.mark.parametrize(
    "name",
    ["foo", "messages", "tools", "tool_choice", "top_logprobs", "parallel_tool_calls", "chat_template_kwargs"],
)
def test_a_chat_only_field_is_refused_on_completions(name: str) -> None:
    for error in refused(parse_completion_request, {"prompt": "hi", name: 1}):
        assert error.field == name
        assert error.message == f"Unrecognized request argument supplied: {name}"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages[0].foo"),
        ({"messages": MESSAGES, "tools": [{**TOOL, "foo": 1}]}, "tools[0].foo"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
    ],
)
def test_a_nested_unknown_key_is_refused_by_its_path(body: dict[str, Any], field: str) -> None:
    for error in refused(parse_chat_request, body):
        assert error.field == field
        assert error.message == "unknown field 'foo'"


def test_the_first_unknown_field_is_named() -> None:
    for error in refused(parse_chat_request, {"messages": MESSAGES, "user": "u", "zeta": 1, "alpha": 2}):
        assert error.field == "zeta"


def test_an_unknown_field_set_to_null_is_refused_too() -> None:
    for given in both_forms({"messages": MESSAGES, "functions": None, "documents": None}):
        with pytest.raises(InvalidRequest) as info:
            parse_chat_request(given)
        assert info.value.field == "functions"
