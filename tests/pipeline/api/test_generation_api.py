"""Tools, log probabilities, logit_bias and /v1/completions through the real ``openai`` client.

One server for the module (each test asks for a few tokens at temperature 0): the answers of the
tiny random model are gibberish, but the shapes, the constraints and streamed-versus-whole
agreement are exact.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import jsonschema
import openai
import pytest

from pipeline import PipelineConfig
from pipeline.api import completions, routes
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.released import assert_released
from tests.servers import serving

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Paris", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time"}},
]
MARKER = 9  # [TOOL_CALLS] in the Mistral tokenizer
MESSAGES: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": {"type": "object", "maxProperties": 0}}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def api() -> AsyncIterator[tuple[Pipeline, openai.AsyncOpenAI]]:
    # text only: no preparation worker would run, so none is started
    config = PipelineConfig(
        max_running_seqs=8,
        num_kv_blocks=256,
        max_model_len=2048,
        served_model_names=("m",),
        preparation_mode="thread",
        engine_mode="thread",
    )
    async with Pipeline(config) as pipe, serving(create_app(pipe), handler_cancellation=True) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            yield pipe, client
        finally:
            await client.close()


@pytest.fixture
def client(api: tuple[Pipeline, openai.AsyncOpenAI]) -> openai.AsyncOpenAI:
    return api[1]


def table(api: tuple[Pipeline, openai.AsyncOpenAI]) -> list[bytes]:
    return api[0].engine.engine.token_bytes.table


async def test_logprobs_whole_and_streamed_agree(client: openai.AsyncOpenAI) -> None:
    kwargs: Any = {"model": "m", "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True}
    whole = await client.chat.completions.create(**kwargs, top_logprobs=3)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) and entry.logprob <= 0
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token
    streamed = []
    async for chunk in await client.chat.completions.create(**kwargs, top_logprobs=3, stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.content or [] if choice.logprobs else []
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = await client.chat.completions.create(**{**kwargs, "logprobs": False})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(**{**kwargs, "logprobs": False}, top_logprobs=2)


async def test_a_whole_reply_with_logprobs_is_built_off_the_event_loop(
    client: openai.AsyncOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object per token and per top entry: a long answer's would hold the loop (and /health) for
    seconds, so both endpoints build such a reply in a worker thread; a reply without them is not."""
    built_on: list[bool] = []  # True: on the event loop's thread
    loop_thread = threading.get_ident()

    def recording(build: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            built_on.append(threading.get_ident() == loop_thread)
            return build(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(routes, "chat_choice", recording(routes.chat_choice))
    monkeypatch.setattr(completions, "_logprobs", recording(completions._logprobs))
    kwargs: Any = {"model": "m", "max_tokens": 3, "temperature": 0}
    whole = await client.chat.completions.create(**kwargs, messages=MESSAGES, logprobs=True, top_logprobs=2)
    assert whole.choices[0].logprobs is not None
    text = await client.completions.create(**kwargs, prompt=["a", "b"], logprobs=2)
    assert all(c.logprobs is not None for c in text.choices)
    assert built_on == [False, False, False]  # the chat choice, then the two prompts' entries
    await client.chat.completions.create(**kwargs, messages=MESSAGES)
    assert built_on[-1] is True  # no log probabilities: built on the loop, in its turn


async def test_logit_bias_bans_and_forces_tokens(
    client: openai.AsyncOpenAI, api: tuple[Pipeline, openai.AsyncOpenAI]
) -> None:
    kwargs: Any = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    first = await client.chat.completions.create(**kwargs, logprobs=True)
    greedy = table(api).index(bytes(first.choices[0].logprobs.content[0].bytes))  # type: ignore[index, union-attr, arg-type]
    banned = await client.chat.completions.create(**kwargs, logprobs=True, logit_bias={str(greedy): -100})
    assert banned.choices[0].logprobs.content[0].token != first.choices[0].logprobs.content[0].token  # type: ignore[index, union-attr]
    forced = await client.chat.completions.create(**kwargs, logit_bias={"1000": 100}, max_completion_tokens=4)
    assert forced.choices[0].message.content == table(api)[1000].decode() * 4
    assert forced.usage is not None and forced.usage.completion_tokens == 4  # max_completion_tokens wins
    penalised = await client.chat.completions.create(**kwargs, presence_penalty=1.5, frequency_penalty=-0.5)
    assert penalised.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        await client.chat.completions.create(**kwargs, logit_bias={"999999999": 1})


def check_calls(calls: list[tuple[str | None, str | None, str]], names: set[str]) -> None:
    assert calls
    for call_id, name, arguments in calls:
        assert call_id is not None and len(call_id) == 9 and call_id.isalnum()
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def tool_answer(client: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> tuple[Any, str | None, str | None]:
    """(calls as (id, name, arguments), content, finish reason), whole or assembled from the stream."""
    args: Any = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 48, "temperature": 0, **kwargs}
    if not stream:
        out = await client.chat.completions.create(**args)
        message = out.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return calls, message.content, out.choices[0].finish_reason
    parts: dict[int, list[Any]] = {}
    content, finish = "", None
    async for chunk in await client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                if piece.index not in parts:  # the first piece of a call names it
                    assert piece.id is not None and piece.function is not None and piece.function.name
                    parts[piece.index] = [piece.id, piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function is not None and piece.function.name is None
                parts[piece.index][2] += piece.function.arguments or ""
    return [tuple(parts[i]) for i in sorted(parts)], content or None, finish


@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_calls(client: openai.AsyncOpenAI, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, content, finish = await tool_answer(client, stream, tool_choice=named)
    check_calls(calls, {"get_weather"})
    assert len(calls) == 1 and content is None and finish == "tool_calls"
    calls, content, finish = await tool_answer(client, stream, tool_choice="required")
    check_calls(calls, {"get_weather", "get_time"})
    assert content is None and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_answers_in_text_or_calls_after_the_marker(client: openai.AsyncOpenAI, stream: bool) -> None:
    calls, content, finish = await tool_answer(client, stream, max_tokens=6)
    assert calls == [] and content and finish in ("stop", "length")
    # the marker forced first: from there the call is constrained like a required one
    calls, _, finish = await tool_answer(client, stream, logit_bias={str(MARKER): 100})
    check_calls(calls, {"get_weather", "get_time"})
    assert finish == "tool_calls"


async def test_tool_results_go_back_through_the_template(client: openai.AsyncOpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, _, _ = await tool_answer(client, False, tool_choice=named)
    call_id, name, arguments = calls[0]
    for given_id in (call_id, "call_0123456789abcdef"):  # ours, and another server's longer id
        messages: Any = [
            *MESSAGES,
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": given_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": given_id, "content": "sunny, 21 C"},
        ]
        out = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=3, temperature=0
        )
        assert out.usage is not None and out.usage.prompt_tokens > 30
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        bad: Any = [*MESSAGES, {"role": "tool", "content": "x"}]
        await client.chat.completions.create(model="m", messages=bad, max_tokens=2)


async def test_completions_string_ids_and_lists(client: openai.AsyncOpenAI) -> None:
    kwargs: Any = {"model": "m", "max_tokens": 4, "temperature": 0}
    text = await client.completions.create(prompt="Once upon", **kwargs)
    assert text.object == "text_completion" and len(text.choices) == 1 and text.choices[0].text
    ids = await client.completions.create(prompt=[1, 3000, 4000], **kwargs)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    seeded = {**kwargs, "temperature": 0.8, "seed": 3, "n": 2}
    many = await client.completions.create(prompt=[[1, 3000, 4000], [1, 5000]], **seeded)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage is not None and many.usage.prompt_tokens == 5
    prompts = ["Once upon", "a time"]
    greedy = await client.completions.create(prompt=prompts, logprobs=2, **kwargs)
    assert greedy.choices[0].text == text.choices[0].text and len(greedy.choices) == 2
    streamed: dict[int, str] = {}
    finishes: dict[int, str] = {}
    async for chunk in await client.completions.create(prompt=prompts, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index, "")
    assert streamed == {0: greedy.choices[0].text, 1: greedy.choices[1].text}
    assert finishes == {0: greedy.choices[0].finish_reason, 1: greedy.choices[1].finish_reason}
    logprobs = greedy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.token_logprobs or []) == len(logprobs.tokens)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])
    assert "".join(logprobs.tokens) == greedy.choices[0].text


async def test_completions_take_the_same_constraints(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(
        model="m",
        prompt=["pick one", "again"],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert [c.text in ("left", "right") for c in out.choices] == [True, True]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await client.completions.create(model="m", prompt=[[1, 2], "mixed"], max_tokens=2)  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await client.completions.create(model="m", prompt=[1, 10**9], max_tokens=2)


async def test_a_prompt_too_long_among_several_is_named_by_its_index(client: openai.AsyncOpenAI) -> None:
    for prompt, param in ((["a", "word " * 3000], "prompt[1]"), ("word " * 3000, "prompt")):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="m", prompt=prompt, max_tokens=2)
        assert isinstance(info.value.body, dict)
        assert (info.value.body["code"], info.value.body["param"]) == ("context_length_exceeded", param)


async def test_an_abandoned_completions_stream_releases_every_prompt(api: tuple[Pipeline, openai.AsyncOpenAI]) -> None:
    pipe, client = api
    body = {"model": "m", "prompt": ["one", "two", "three"], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    cancelled = pipe.metrics.requests["cancelled"]
    with anyio.fail_after(30):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{client.base_url}completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"data: ")
                resp.close()  # the client goes away mid-stream
        await assert_released(pipe)
    assert pipe.metrics.requests["cancelled"] == cancelled + 3  # each prompt's request ends, cancelled
