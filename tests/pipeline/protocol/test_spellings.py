"""Every constraint spelling users bring is honoured: the answer it gets back is constrained (the
embedded model writes gibberish, so any answer that satisfies the constraint was forced to)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = "[ab]{3,6}"
CHOICES = ["alpha", "beta", "gamma"]
EBNF = 'root ::= "x" [yz] [yz] [yz]'
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</answer>",
    },
}


def schema_ok(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def regex_ok(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def choice_ok(text: str) -> bool:
    return text in CHOICES


def ebnf_ok(text: str) -> bool:
    return re.fullmatch("x[yz]{3}", text) is not None


def object_ok(text: str) -> bool:
    return isinstance(json.loads(text), dict)


def tag_ok(text: str) -> bool:
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    return schema_ok(text.removeprefix("<answer>").removesuffix("</answer>"))


SPELLINGS = [
    ("openai json_schema", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, schema_ok),
    ("openai json_object", {"response_format": {"type": "json_object"}}, object_ok),
    ("openai structural_tag", {"response_format": TAG}, tag_ok),
    ("vllm structured_outputs.json", {"structured_outputs": {"json": SCHEMA}}, schema_ok),
    ("vllm structured_outputs.json as text", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, schema_ok),
    ("vllm structured_outputs.regex", {"structured_outputs": {"regex": REGEX}}, regex_ok),
    ("vllm structured_outputs.choice", {"structured_outputs": {"choice": CHOICES}}, choice_ok),
    ("vllm structured_outputs.grammar", {"structured_outputs": {"grammar": EBNF}}, ebnf_ok),
    ("vllm structured_outputs.json_object", {"structured_outputs": {"json_object": True}}, object_ok),
    ("vllm structured_outputs.structural_tag", {"structured_outputs": {"structural_tag": json.dumps(TAG)}}, tag_ok),
    ("vllm guided_json", {"guided_json": SCHEMA}, schema_ok),
    ("vllm guided_regex", {"guided_regex": REGEX}, regex_ok),
    ("vllm guided_choice", {"guided_choice": CHOICES}, choice_ok),
    ("vllm guided_grammar", {"guided_grammar": EBNF}, ebnf_ok),
    ("sglang regex", {"regex": REGEX}, regex_ok),
    ("sglang ebnf", {"ebnf": EBNF}, ebnf_ok),
    ("sglang json_schema", {"json_schema": json.dumps(SCHEMA)}, schema_ok),
    ("ours choice", {"choice": CHOICES}, choice_ok),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    # text only: no preparation worker would run, so none is started
    config = PipelineConfig(
        max_running_seqs=8, num_kv_blocks=256, max_model_len=1024, preparation_mode="thread", engine_mode="thread"
    )
    async with Pipeline(config) as p:
        yield p


@pytest.mark.parametrize(("name", "extra", "ok"), SPELLINGS, ids=[s[0] for s in SPELLINGS])
async def test_each_spelling_is_constrained(pipe: Pipeline, name: str, extra: dict[str, Any], ok: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Go."}], "max_tokens": 48, "temperature": 0.0, **extra}
    result = await (await pipe.submit(body)).result()
    assert result.grammar_backend is not None
    if result.finish_reason == "length":  # any JSON object: the model may write one long string
        assert ok is object_ok and result.text.startswith('{"'), (name, result.text)
        return
    assert result.finish_reason == "stop", (name, result.text)
    assert ok(result.text), (name, result.text)
