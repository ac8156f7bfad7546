"""``tool_choice: "auto"`` where no single token opens the calls: Llama 3.1 (its JSON call has no
marker) and a Qwen tokenizer that writes ``<tool_call>`` in several tokens. The grammar then spans
the whole answer: free text, or calls that hold to their schemas, found in the text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.answer.call_check import with_calls_check
from pipeline.api.responses import TokenText, chat_choice
from pipeline.core.pipeline import Pipeline
from tests.models.plain_tags import NEWLINE_MARKER, build_multi_token_qwen
from tests.models.tool_requests import MESSAGES, SCHEMAS, TOOLS, FamilyDir


@pytest.fixture(scope="module")
def plain_tags_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_multi_token_qwen(tmp_path_factory.mktemp("qwen3_plain_tags"))


def _config(folder: Path) -> PipelineConfig:
    return PipelineConfig(
        model=str(folder), device="cpu", max_running_seqs=2, num_kv_blocks=160, max_model_len=1536, engine_mode="thread"
    )


def _bias(tokenizer: Any, pick: Callable[[str], bool], value: int) -> dict[str, int]:
    """``value`` on every token whose text ``pick`` takes."""
    vocab = range(len(tokenizer))
    return {str(t): value for t in vocab if pick(tokenizer.decode([t]))}


async def _answer(pipe: Pipeline, **extra: Any) -> tuple[Any, Any]:
    # room for the one whitespace character a structural tag's JSON allows between its tokens
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "temperature": 0, **extra}
    handle = await pipe.submit(body)
    result = await handle.result()
    plan = handle.request.tools
    assert plan is not None and plan.mode == "auto" and plan.spans_answer
    return result.choices[0], chat_choice(
        result.choices[0], False, TokenText(pipe.token_table), plan.format.arguments_key
    )


def _assert_one_valid_call(choice: Any) -> None:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


async def test_llama3_auto_answers_text_or_one_valid_call(family_dir: FamilyDir) -> None:
    """Llama 3.1 under ``auto``: an answer that opens with ``{`` (pushed there with a logit bias) is a
    call under its schema, parsed into ``tool_calls``; any other answer is text."""
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("llama3.1"))) as pipe:
            tokenizer = pipe.checkpoint.tokenizer
            raw, call = await _answer(pipe, logit_bias=_bias(tokenizer, lambda t: t.startswith("{"), 100))
            plain, text = await _answer(pipe, logit_bias=_bias(tokenizer, lambda t: t.startswith("{"), -100))
            constraint = await pipe.preparation.grammar.compile(
                pipe.parse({"messages": MESSAGES, "tools": TOOLS}).grammar
            )
    assert raw.call_text.startswith("{") and raw.text == ""
    _assert_one_valid_call(call)
    assert call.message.content is None
    assert text.message.tool_calls is None and text.message.content == plain.text and plain.call_text is None
    # the answer check holds calls to their schemas, and lets text through
    good = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert constraint.check.check(good) is None
    assert constraint.check.check("It is sunny {maybe}.") is None
    assert constraint.check.check(good.replace("UTC", "PST")) is not None
    assert constraint.check.check(good.replace("get_time", "get_date")) is not None


async def test_hermes_auto_with_a_marker_of_several_tokens(plain_tags_dir: Path) -> None:
    """Qwen whose tokenizer has no ``<tool_call>`` token: the marker's text opens the calls whichever
    tokens write it (here one token that also holds the newline before it, pushed with a logit bias),
    the call holds to its schema and leaves the content."""
    with anyio.fail_after(240):
        async with Pipeline(_config(plain_tags_dir)) as pipe:
            tokenizer = pipe.checkpoint.tokenizer
            assert tokenizer.convert_tokens_to_ids("<tool_call>") is None
            assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) > 1
            merged = tokenizer.convert_tokens_to_ids(NEWLINE_MARKER)
            raw, call = await _answer(pipe, parallel_tool_calls=False, logit_bias={str(merged): 100})
            constraint = await pipe.preparation.grammar.compile(
                pipe.parse({"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False}).grammar
            )
    assert merged in raw.token_ids
    _assert_one_valid_call(call)
    assert "<tool_call>" not in (call.message.content or "") and "tool_call" not in raw.call_text.split("}")[0]
    # the grammar reads text, not tokens: the marker in any pieces opens a call held to its schema
    good = 'Let me look. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    assert constraint.check.check(good) is None
    assert constraint.check.check("No call here.") is None
    assert constraint.check.check(good.replace("CET", "PST")) is not None
    assert constraint.check.check('Look: <tool_call>{"name": "get_time"}') is not None


async def test_hermes_required_with_a_marker_of_several_tokens(plain_tags_dir: Path) -> None:
    """``required``: the marker's tokens end the prompt and the call follows them."""
    with anyio.fail_after(240):
        async with Pipeline(_config(plain_tags_dir)) as pipe:
            pieces = pipe.checkpoint.tokenizer.encode("<tool_call>", add_special_tokens=False)
            body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 64}
            handle = await pipe.submit({**body, "temperature": 0, "parallel_tool_calls": False})
            result = await handle.result()
            assert handle.request.tools is not None
            choice = chat_choice(result.choices[0], False, TokenText(pipe.token_table))
            prompt = await pipe.preparation.template.run(handle.request.messages, [], handle.request.tools.tools, None)
    assert result.prompt_tokens == len(prompt) + len(pieces)
    _assert_one_valid_call(choice)


NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"],
    "additionalProperties": False,
}


async def test_each_call_is_checked_strictly_beside_the_grammar(family_dir: FamilyDir, plain_tags_dir: Path) -> None:
    """The whole-answer grammar's own check is its engine's acceptor, which lets a raw TAB into a
    string under ``maxLength`` (xgrammar 0.2.8): the answer check parses each call strictly too."""
    tools = [{"type": "function", "function": {"name": "note", "parameters": NOTE}}]
    call = '{"name": "note", "KEY": {"text": "a\tb"}}'
    hermes = "Sure. <tool_call>" + call.replace("KEY", "arguments") + "</tool_call>"
    cases = [(family_dir("llama3.1"), call.replace("KEY", "parameters")), (plain_tags_dir, hermes)]
    for folder, answer in cases:
        with anyio.fail_after(120):
            async with Pipeline(_config(folder), with_engine=False) as pipe:
                request = pipe.parse({"messages": MESSAGES, "tools": tools, "parallel_tool_calls": False})
                assert request.grammar is not None and request.tools is not None and request.tools.spans_answer
                grammar_only = await pipe.preparation.grammar.compile(request.grammar)
                constraint = await with_calls_check(grammar_only, request.tools)
        assert grammar_only.check.check(answer) is None, folder  # the engine's acceptor takes the TAB
        violation = constraint.check.check(answer)
        assert violation is not None and violation.path.startswith("/0"), (folder, violation)
        assert constraint.check.check(answer.replace("\t", " ")) is None
        assert constraint.check.check("Plain text.") is None
