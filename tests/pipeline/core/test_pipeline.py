from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import GrammarError, ImageDecodeError, RequestCancelled
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["label", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["thread", "process"])
async def pipe(request: pytest.FixtureRequest) -> AsyncIterator[Pipeline]:
    """One pipeline per engine mode for the module: tests read counters as differences, never as totals
    (and step timelines from a time on)."""
    config = PipelineConfig(
        max_running_seqs=8, num_kv_blocks=512, max_model_len=4096, engine_mode=request.param, record_step_timeline=True
    )
    async with Pipeline(config) as p:
        yield p


def schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


async def test_prepare_places_one_embedding_row_per_image_token(pipe: Pipeline) -> None:
    urls = [
        data_url(encode(make_image(96, 64, seed=1))),
        data_url(encode(make_image(40, 80, seed=2), "JPEG"), "image/jpeg"),
    ]
    inp = await pipe.prepare(image_request(urls))
    num_image_tokens = inp.prompt_token_ids.count(inp.image_token_id)
    assert inp.image_embeds is not None and inp.image_embeds.shape[0] == num_image_tokens
    # 96x64 -> 6x4 patches, 40x80 -> 3x5 patches (rounded up to whole patches by the processor)
    assert num_image_tokens == 6 * 4 + 3 * 5
    assert {"fetch", "decode", "template", "vision"} <= set(inp.timings)


async def test_guided_image_request_validates_and_streams(pipe: Pipeline) -> None:
    body = image_request(
        [data_url(encode(make_image(seed=3)))], response_format=schema_format(SCHEMA), max_tokens=64, temperature=0
    )
    handle = await pipe.submit(body)
    streamed = "".join([d.text async for d in handle])
    result = await handle.result()
    assert streamed == result.text
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.prompt_tokens > 0 and result.completion_tokens == len(result.token_ids)
    assert "grammar" in result.timings and "first_token" in result.timings


async def test_n_choices_are_each_valid(pipe: Pipeline) -> None:
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "n": 3,
        "temperature": 0.9,
        "seed": 5,
        "response_format": schema_format(SCHEMA),
        "max_tokens": 64,
    }
    result = await (await pipe.submit(body)).result()
    assert [c.index for c in result.choices] == [0, 1, 2]
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)


async def test_bad_schema_fails_before_decode_with_400(pipe: Pipeline) -> None:
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "response_format": schema_format({"type": "array", "minItems": 3, "maxItems": 1}),
    }
    generated = pipe.metrics.tokens_generated
    handle = await pipe.submit(body)
    with pytest.raises(GrammarError) as info:
        await handle.result()
    assert info.value.status == 400 and info.value.field == "response_format.json_schema.schema"
    assert pipe.metrics.tokens_generated == generated


async def test_bad_image_fails_only_its_request(pipe: Pipeline) -> None:
    bad = await pipe.submit(image_request([data_url(b"this is text, not a png")]))
    # sampled without a seed: ignore_eos, or a stop token (about 7e-6 a step) may end an answer before the count
    good = await pipe.submit(image_request([data_url(encode(make_image(seed=4)))], max_tokens=4, ignore_eos=True))
    with pytest.raises(ImageDecodeError) as info:
        await bad.result()
    assert info.value.field == "messages[0].content[1].image_url.url" and info.value.stage == "decode"
    assert (await good.result()).completion_tokens == 4
    assert pipe.num_pending == 0


async def test_text_that_mimics_the_image_token_is_text(pipe: Pipeline) -> None:
    prepared = await pipe.prepare({"messages": [{"role": "user", "content": "look: [IMG]"}]})
    assert pipe.checkpoint.tokenizer.convert_tokens_to_ids("[IMG]") not in prepared.prompt_token_ids


async def test_cancel_frees_the_engine(pipe: Pipeline) -> None:
    handle = await pipe.submit(
        {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "ignore_eos": True}
    )
    async for _delta in handle:
        break  # leaving the stream early cancels the request
    with pytest.raises(RequestCancelled):
        await handle.result()
    await assert_released(pipe)


async def test_logprobs_come_with_every_token(pipe: Pipeline) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    body |= {"logprobs": True, "top_logprobs": 2}
    result = await (await pipe.submit(body)).result()
    choice = result.choices[0]
    assert [e.token_id for e in choice.logprobs] == choice.token_ids and len(choice.token_ids) == 6
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in choice.logprobs)
    assert pipe.token_table[choice.token_ids[0]]  # the bytes entries show, from the engine in either mode


async def test_the_steps_since_a_time_are_those_of_the_requests_after_it(pipe: Pipeline) -> None:
    """The engine's step timeline as the benchmarks fetch it, from the engine thread or the engine process."""
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    await (await pipe.submit(body)).result()
    since = time.perf_counter()  # the engine process's clock is the same one
    result = await (await pipe.submit(body | {"max_tokens": 4})).result()
    steps = await pipe.engine.step_timeline(since)
    num_prompt = result.prompt_tokens
    # the prompt in one chunk (sampling the first token), then a decode of one for each other token
    assert [(t.kind, t.batch) for t in steps] == [("prefill", 1)] + [("decode", 1)] * 3
    assert steps[0].tokens <= num_prompt and all(t.tokens == 1 for t in steps[1:])
    assert all(since <= t.start and t.total > 0 for t in steps)
