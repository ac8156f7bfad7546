"""Tool calls in each family's own format: Qwen3 writes Hermes ``<tool_call>`` JSON tags, Llama 3.1
one ``{"name": ..., "parameters": ...}`` object. Served through ``Pipeline.submit()``, the calls are
constrained, parsed into OpenAI's ``tool_calls`` and finish with ``tool_calls``; the family's own
chat template renders a conversation with a call and its result."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import anyio
import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.api.responses import TokenText, chat_choice
from pipeline.core.pipeline import Pipeline
from pipeline.protocol.tool_calls import CallReader
from tests.models.tool_requests import MESSAGES, SCHEMAS, TOOLS, FamilyDir

FAMILIES = ["qwen3", "llama3.1", "qwen2.5-vl", "qwen3-vl"]
ARGUMENTS_KEY = {"qwen3": "arguments", "llama3.1": "parameters", "qwen2.5-vl": "arguments", "qwen3-vl": "arguments"}


def _config(folder: Path) -> PipelineConfig:
    return PipelineConfig(
        model=str(folder), device="cpu", max_running_seqs=2, num_kv_blocks=160, max_model_len=1536, engine_mode="thread"
    )


@pytest.mark.parametrize("family", FAMILIES)
async def test_required_and_named_calls_parse_into_openai_tool_calls(family: str, family_dir: FamilyDir) -> None:
    bodies = [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ]
    with anyio.fail_after(180):
        async with Pipeline(_config(family_dir(family))) as pipe:
            tokens = TokenText(pipe.token_table)
            for extra in bodies:
                body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **extra}
                handle = await pipe.submit(body)
                result = await handle.result()
                plan = handle.request.tools
                assert plan is not None
                choice = chat_choice(result.choices[0], False, tokens, plan.format.arguments_key)
                assert choice.finish_reason == "tool_calls", (family, extra, result.choices[0])
                # the family's own syntax: one object, its arguments under the family's key
                assert set(json.loads(result.choices[0].call_text or "")) == {"name", ARGUMENTS_KEY[family]}
                calls = choice.message.tool_calls
                assert calls is not None and len(calls) == 1
                call = calls[0]
                if isinstance(extra["tool_choice"], dict):
                    assert call.function.name == "get_time"
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                assert call.id and call.type == "function"


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (
            "qwen3",
            [
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
                "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>",
            ],
        ),
        (
            "llama3.1",
            [
                '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                '"parameters": {"city": "Paris", "days": 2}}<|eot_id|>',
                "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>",
            ],
        ),
    ],
)
async def test_the_family_template_renders_a_call_and_its_result(
    family: str, expected: list[str], family_dir: FamilyDir
) -> None:
    call = {
        "id": "call_0123456789",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    with anyio.fail_after(120):
        async with Pipeline(_config(family_dir(family)), with_engine=False) as pipe:
            request = pipe.parse({"messages": messages, "tools": TOOLS, "tool_choice": "required"})
            assert request.tools is not None
            template = pipe.preparation.template
            text = pipe.checkpoint.tokenizer.decode(template.render(request.messages, [], request.tools.tools))
            # required: the prompt ends with the family's marker token where it has one
            marker = template.marker_token(request.tools.format.marker)
    assert marker == (pipe.checkpoint.tokenizer.convert_tokens_to_ids("<tool_call>") if family == "qwen3" else None)
    assert '"name": "get_weather"' in text.split(expected[0])[0]  # the tools are described before the call
    for piece in expected:
        assert piece in text
    assert text.index(expected[0]) < text.index(expected[1])


async def test_parallel_hermes_calls_are_constrained_checked_and_read(family_dir: FamilyDir) -> None:
    """Several Qwen calls, each in its tags: the compiled constraint's check accepts them (and
    refuses arguments outside the schema), and the reader finds each call between the tags."""
    text = (
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>\n<tool_call>'
        '{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    )
    with anyio.fail_after(120):
        async with Pipeline(_config(family_dir("qwen3")), with_engine=False) as pipe:
            request = pipe.parse({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
            assert request.tools is not None and request.tools.format.marker == "<tool_call>"
            assert request.grammar is not None
            constraint = await pipe.preparation.grammar.compile(request.grammar)
    assert constraint.check.check(text) is None
    assert constraint.check.check(text.replace('"CET"', '"PST"')) is not None
    assert constraint.check.check(text.replace("</tool_call>\n<tool_call>", ", ")) is not None
    reader = CallReader(request.tools.format.arguments_key)
    for i in range(0, len(text), 5):  # as it streams
        reader.feed(text[i : i + 5])
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}),
        ("get_time", {"zone": "CET"}),
    ]


async def test_auto_calls_open_at_the_hermes_marker_token(family_dir: FamilyDir) -> None:
    """``auto``: free text until the model writes Qwen's ``<tool_call>`` token (pushed here with a
    logit bias, a random model rarely picks it), the call constrained from there on."""
    with anyio.fail_after(180):
        async with Pipeline(_config(family_dir("qwen3"))) as pipe:
            marker = pipe.checkpoint.tokenizer.convert_tokens_to_ids("<tool_call>")
            body = {
                "messages": MESSAGES,
                "tools": TOOLS,
                "parallel_tool_calls": False,
                "max_tokens": 64,
                "temperature": 0,
                "logit_bias": {str(marker): 100},
            }
            handle = await pipe.submit(body)
            result = await handle.result()
            assert handle.request.tools is not None and handle.request.tools.mode == "auto"
            choice = chat_choice(result.choices[0], False, TokenText(pipe.token_table))
    assert marker in result.choices[0].token_ids
    assert choice.finish_reason == "tool_calls", result.choices[0]
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert "<tool_call>" not in (choice.message.content or "")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
async def test_hermes_calls_end_at_the_special_end_token_with_either_backend(
    backend: str, family_dir: FamilyDir
) -> None:
    """Qwen's ``</tool_call>`` is one special token: the grammar takes that token as the end tag
    with either backend (llguidance's matcher once refused the token its mask allowed: a 500).
    A bias on ``<|im_end|>`` ends the answer as soon as the grammar lets it."""
    folder = family_dir("qwen3")
    config = dataclasses.replace(_config(folder), grammar_backend=backend)
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe:
            end = pipe.checkpoint.tokenizer.convert_tokens_to_ids(["</tool_call>", "<|im_end|>"])
            body = {
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": "required",
                "max_tokens": 96,
                "temperature": 0,
                "logit_bias": {str(end[1]): 100},
            }
            handle = await pipe.submit(body)
            result = await handle.result()
            assert handle.request.grammar is not None and handle.request.grammar.kind == "structural_tag"
            choice = chat_choice(result.choices[0], False, TokenText(pipe.token_table))
    assert end[0] in result.choices[0].token_ids
    assert choice.finish_reason == "tool_calls", result.choices[0]
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) >= 1
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
