"""``tool_choice: "auto"`` where no single token opens the calls: Llama 3.1 (its JSON call has no
marker). The grammar then spans the whole answer: free text, or calls that hold to their schemas,
found in the text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema

from pipeline import PipelineConfig
from pipeline.api.responses import TokenText, chat_choice
from pipeline.core.pipeline import Pipeline

FamilyDir = Callable[[str], Path]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _config(folder: Path) -> PipelineConfig:
    return PipelineConfig(model=str(folder), device="cpu", max_running_seqs=2, num_kv_blocks=160, max_model_len=1536)


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
