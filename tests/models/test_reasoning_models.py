"""Reasoning models served as their authors ship them: Qwen3's hybrid template (the model opens its own
``<think>``) and DeepSeek-R1's (the generation prompt opens it), on tiny random checkpoints whose
tokenizers hold the tags as the released ones do.

The reasoning comes back as ``reasoning_content`` (and ``reasoning``), the answer as ``content``; a
constraint holds from the token after ``</think>``, so the reasoning is exactly what the model writes
unconstrained (the same tokens as the request without its constraint) and the answer validates.
Where the reasoning ends is set by ``max_reasoning_tokens`` (the tag is forced there) or a logit bias.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from pipeline import PipelineConfig
from pipeline.api.responses import TokenText, chat_choice
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from pipeline.errors import InvalidRequest
from stages.reasoning import detect_reasoning_parser
from tests.models.reasoning_checkpoints import real_template
from tests.models.tool_requests import SCHEMAS, TOOLS, FamilyDir
from tests.servers import serving
from vision.checkpoint import open_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING_TOKENS = 6


def _config(folder: Path, **overrides: Any) -> PipelineConfig:
    return PipelineConfig(
        model=str(folder),
        device="cpu",
        max_running_seqs=4,
        num_kv_blocks=160,
        max_model_len=1536,
        engine_mode="thread",
        **overrides,
    )


def _body(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 96, "temperature": 0, "max_reasoning_tokens": REASONING_TOKENS, **extra}


CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    "regex": {"structured_outputs": {"regex": "(Paris|Oslo) in [1-7] days"}},
    "choice": {"structured_outputs": {"choice": ["sunny", "rainy", "windy"]}},
}


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch("(Paris|Oslo) in [1-7] days", text) is not None
    return text in ("sunny", "rainy", "windy")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen-Qwen3-0.6B", "qwen3"),
        ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek_r1"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_r1"),
        ("Qwen-Qwen2.5-7B-Instruct", None),
        ("HuggingFaceTB-SmolLM2-Instruct", None),
        ("meta-llama-Llama-3.1-8B-Instruct", None),
        ("mistralai-Mistral-Small-3.2-24B-Instruct-2506", None),
    ],
)
def test_the_parser_is_read_from_the_real_template(name: str, expected: str | None, family_dir: FamilyDir) -> None:
    tokenizer = open_checkpoint(str(family_dir("qwen3-thinking")), Path()).tokenizer
    assert detect_reasoning_parser(tokenizer, real_template(name)) == expected


def test_a_tokenizer_without_the_tags_has_no_parser(family_dir: FamilyDir) -> None:
    tokenizer = open_checkpoint(str(family_dir("qwen3")), Path()).tokenizer  # ChatML, no <think> token
    assert detect_reasoning_parser(tokenizer, real_template("Qwen-Qwen3-0.6B")) is None


@pytest.mark.parametrize("family", ["qwen3-thinking", "deepseek-r1"])
async def test_the_answer_after_the_reasoning_follows_each_constraint(family: str, family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir(family))) as pipe:
            reasoning = pipe.preparation.reasoning
            assert reasoning is not None and reasoning.name == (
                "qwen3" if family == "qwen3-thinking" else "deepseek_r1"
            )
            tokenizer = pipe.checkpoint.tokenizer
            free = await (await pipe.submit(_body(ignore_eos=True, max_tokens=REASONING_TOKENS + 1))).result()
            free_ids = free.choices[0].token_ids
            assert free_ids[REASONING_TOKENS] == reasoning.end_id
            for kind, constraint in CONSTRAINTS.items():
                result = await (await pipe.submit(_body(**constraint))).result()
                choice = result.choices[0]
                assert choice.finish_reason == "stop", (kind, choice)
                # the reasoning is the model's own, unconstrained: the same tokens as without the constraint
                assert choice.token_ids[: REASONING_TOKENS + 1] == free_ids
                thought = tokenizer.decode(choice.token_ids[:REASONING_TOKENS]).removeprefix(reasoning.start)
                assert choice.reasoning == thought
                assert _valid(kind, choice.text), (kind, choice.text)
                body = chat_choice(choice, False, TokenText(pipe.token_table))
                assert body.message.content == choice.text and body.message.reasoning_content == thought


async def test_thinking_off_constrains_from_the_first_token(family_dir: FamilyDir) -> None:
    """Qwen3's ``enable_thinking: false`` closes the block in the prompt: no reasoning, the answer at once."""
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"))) as pipe:
            body = _body(chat_template_kwargs={"enable_thinking": False}, **CONSTRAINTS["json_schema"])
            result = await (await pipe.submit(body)).result()
    choice = result.choices[0]
    assert choice.reasoning is None and choice.finish_reason == "stop"
    assert _valid("json_schema", choice.text)


async def test_running_out_of_tokens_while_reasoning_gives_length_and_no_content(family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("deepseek-r1"))) as pipe:
            body = _body(max_tokens=4, max_reasoning_tokens=None, **CONSTRAINTS["json_schema"])
            body["logit_bias"] = {str(pipe.preparation.reasoning.end_id): -100}  # type: ignore[union-attr]
            result = await (await pipe.submit(body)).result()
            choice = result.choices[0]
            message = chat_choice(choice, False, TokenText(pipe.token_table)).message
    assert choice.finish_reason == "length" and choice.text == "" and message.content is None
    assert message.reasoning_content and len(choice.token_ids) == 4


async def test_tool_calls_are_read_from_the_answer_only(family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"))) as pipe:
            tokens = TokenText(pipe.token_table)
            for choice_field in ("required", "auto"):
                body = _body(tools=TOOLS, tool_choice=choice_field, max_tokens=160)
                if choice_field == "auto":  # after the reasoning, the random model is pushed into a call
                    call_id = pipe.checkpoint.tokenizer.convert_tokens_to_ids("<tool_call>")
                    body["logit_bias"] = {str(call_id): 100}
                handle = await pipe.submit(body)
                result = await handle.result()
                choice = result.choices[0]
                assert choice.reasoning is not None
                # pushed into a call from the first token, the model writes the tag while it reasons
                # too: there it opens nothing (no grammar before the reasoning ends)
                assert "<tool_call>" in choice.reasoning or choice_field == "required"
                message = chat_choice(choice, False, tokens).message
                assert message.tool_calls, (choice_field, choice)
                for call in message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_n_sampled_choices_each_reason_then_answer(family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"))) as pipe:
            body = _body(n=3, temperature=1.0, seed=7, **CONSTRAINTS["json_schema"])
            result = await (await pipe.submit(body)).result()
    for choice in result.choices:
        assert choice.finish_reason == "stop" and choice.reasoning is not None
        assert _valid("json_schema", choice.text)


async def test_parser_none_leaves_the_whole_text_to_the_answer(family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"), reasoning_parser="none")) as pipe:
            assert pipe.preparation.reasoning is None
            result = await (await pipe.submit(_body(**CONSTRAINTS["choice"]))).result()
    assert result.choices[0].reasoning is None and _valid("choice", result.choices[0].text)


async def test_streamed_reasoning_comes_first_and_assembles_to_the_whole_answer(family_dir: FamilyDir) -> None:
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"))) as pipe, serving(create_app(pipe)) as base:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            body = {"model": pipe.model_name, **_body(**CONSTRAINTS["json_schema"])}
            body["extra_body"] = {"max_reasoning_tokens": body.pop("max_reasoning_tokens")}
            try:
                whole = await client.chat.completions.create(**body)
                stream = await client.chat.completions.create(**body, stream=True)
                parts: list[tuple[str, str]] = []
                async for chunk in stream:
                    for c in chunk.choices:
                        extra = c.delta.model_extra or {}
                        if extra.get("reasoning_content"):
                            assert extra["reasoning"] == extra["reasoning_content"]
                            parts.append(("reasoning", extra["reasoning_content"]))
                        if c.delta.content:
                            parts.append(("content", c.delta.content))
            finally:
                await client.close()
    message = whole.choices[0].message
    extra = message.model_extra or {}
    kinds = [k for k, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # every reasoning delta before the answer's
    assert "".join(t for k, t in parts if k == "reasoning") == extra["reasoning_content"] == extra["reasoning"]
    assert "".join(t for k, t in parts if k == "content") == message.content
    assert _valid("json_schema", message.content or "")


async def test_an_answer_sent_back_with_its_reasoning_renders_as_the_template_writes_it(family_dir: FamilyDir) -> None:
    """A client appends the returned message as it came (``reasoning_content`` and all): Qwen3's template
    renders that reasoning in the turn it continues, and the answer goes on past the closed block."""
    turn = {"role": "assistant", "content": "It is", "reasoning_content": "The user asks about Paris."}
    with anyio.fail_after(240):
        async with Pipeline(_config(family_dir("qwen3-thinking"))) as pipe:
            body = {
                "messages": [*MESSAGES, turn],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 4,
            }
            inp = await pipe.prepare(body)
            tokenizer = pipe.checkpoint.tokenizer
            expected = tokenizer.apply_chat_template(
                [*MESSAGES, turn], tokenize=False, continue_final_message=True, add_generation_prompt=False
            )
            assert "<think>\nThe user asks about Paris.\n</think>" in expected
            assert inp.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
            assert inp.reasoning_end is None  # the block is closed: the answer continues
            with pytest.raises(InvalidRequest) as refused:
                pipe.parse({"messages": [{"role": "user", "content": "hi", "reasoning": "no"}]})
    assert refused.value.field == "messages[0].reasoning"
