"""Tool calls of the Hermes and Llama 3 formats streamed through the server with the ``openai``
client: the ``tool_calls`` chunks assemble to the calls (names and arguments) and content of the
same greedy request answered whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.models.plain_tags import NEWLINE_MARKER, build_multi_token_qwen
from tests.models.tool_requests import MESSAGES, TOOLS, FamilyDir
from tests.servers import serving

Answer = tuple[str | None, list[tuple[str, str]], str | None]  # content, (name, arguments) per call, finish


def _bias_to(tokenizer: Any, case: str) -> dict[str, int]:
    """What pushes the random model into a call under ``auto``: its marker token, or ``{`` for Llama."""
    if case == "llama3.1-auto":
        return {str(t): 100 for t in range(len(tokenizer)) if tokenizer.decode([t]).startswith("{")}
    marker = NEWLINE_MARKER if case == "plain-tags-auto" else "<tool_call>"
    return {str(tokenizer.convert_tokens_to_ids(marker)): 100}


CASES: dict[str, dict[str, Any]] = {
    # Hermes, <tool_call> one token: the grammar from that token on; several calls may follow
    "qwen3-auto": {"family": "qwen3"},
    "qwen3-required": {"family": "qwen3", "tool_choice": "required"},
    # Hermes, <tool_call> in several tokens: the grammar over the whole answer
    "plain-tags-auto": {"family": "plain-tags", "parallel_tool_calls": False},
    # Llama 3 JSON: no marker
    "llama3.1-auto": {"family": "llama3.1"},
    "llama3.1-named": {"family": "llama3.1", "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
}


@pytest.fixture(scope="module")
def plain_tags_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_multi_token_qwen(tmp_path_factory.mktemp("qwen3_plain_tags"))


async def _whole(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Answer:
    reply = await client.chat.completions.create(**body)
    choice = reply.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    return choice.message.content, calls, choice.finish_reason


async def _streamed(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[Answer, list[str]]:
    """The answer assembled from the chunks, and the ids of the calls (one per call, on its first chunk)."""
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    ids: list[str] = []
    finish = None
    stream = await client.chat.completions.create(**body, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    ids.append(piece.id)
                    assert piece.index not in names and piece.function is not None and piece.function.name
                    names[piece.index] = piece.function.name
                if piece.function is not None and piece.function.arguments:
                    arguments[piece.index] = arguments.get(piece.index, "") + piece.function.arguments
            finish = choice.finish_reason or finish
    calls = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    return ("".join(content) or None, calls, finish), ids


@pytest.mark.parametrize("case", list(CASES))
async def test_streamed_tool_calls_assemble_to_the_whole_answer(
    case: str, family_dir: FamilyDir, plain_tags_dir: Path
) -> None:
    extra = dict(CASES[case])
    family = extra.pop("family")
    folder = plain_tags_dir if family == "plain-tags" else family_dir(family)
    config = PipelineConfig(
        model=str(folder), device="cpu", max_running_seqs=2, num_kv_blocks=160, max_model_len=1536, engine_mode="thread"
    )
    with anyio.fail_after(240):
        async with Pipeline(config) as pipe, serving(create_app(pipe)) as base:
            body = {"model": pipe.model_name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
            body.update(extra)
            if "tool_choice" not in extra:
                body["logit_bias"] = _bias_to(pipe.checkpoint.tokenizer, case)
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            try:
                whole = await _whole(client, body)
                streamed, ids = await _streamed(client, body)
            finally:
                await client.close()
    content, calls, finish = whole
    assert finish == "tool_calls" and calls, whole
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        json.loads(arguments)
    assert streamed == whole
    assert len(ids) == len(calls) and all(len(i) == 9 for i in ids)
