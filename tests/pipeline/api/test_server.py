"""The server against the real ``openai`` client, on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import anyio
import jsonschema
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.images import data_url, encode, make_image, png_header
from tests.released import assert_released
from tests.servers import serving

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
PNG = encode(make_image(80, 60, seed=11))


@dataclass
class Served:
    pipe: Pipeline
    client: openai.AsyncOpenAI
    base: str
    image_url: str


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    """One server for the module: tests read counters as differences, never as totals."""
    images = web.Application()

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    images.router.add_get("/cat.png", image)
    config = PipelineConfig(
        allow_private_networks=True,
        max_running_seqs=8,
        num_kv_blocks=512,
        max_model_len=4096,
        served_model_names=("m",),
        engine_mode="thread",
    )
    async with (
        serving(images) as image_base,
        Pipeline(config) as pipe,
        serving(create_app(pipe), handler_cancellation=True) as base,
    ):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            yield Served(pipe, client, base, f"{image_base}/cat.png")
        finally:
            await client.close()


def user(*parts: dict[str, object] | str) -> list[dict[str, object]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_plain_completion(served: Served) -> None:
    out = await served.client.chat.completions.create(
        model="m",
        messages=user("hello"),
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.completion_tokens <= 5 and out.usage.prompt_tokens > 0
    models = await served.client.models.list()
    assert [m.id for m in models.data] == [served.pipe.model_name]


async def test_streamed_completion_matches_and_reports_usage(served: Served) -> None:
    kwargs = {"model": "m", "messages": user("hello"), "max_tokens": 12, "temperature": 0}
    whole = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = await served.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


async def test_json_schema_with_images_by_data_and_http_url(served: Served) -> None:
    out = await served.client.chat.completions.create(
        model="m",
        messages=user("Describe both.", image_part(data_url(PNG)), image_part(served.image_url)),  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA, "strict": True}},
        max_tokens=48,
        temperature=0,
        n=2,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"messages": user("x"), "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": user("x"), "n": 0}, 400, "n"),
        ({"messages": user(image_part("data:image/png;base64,%%%"))}, 400, "messages[0].content[0].image_url.url"),
        ({"messages": user(image_part("http://127.0.0.1:1/x.png"))}, 400, "messages[0].content[0].image_url.url"),
        ({"messages": user("x"), "response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({"messages": user("x"), "extra_body": {"regex": "(?=a)b"}}, 400, "regex"),
    ],
)
async def test_bad_requests_arrive_as_typed_client_errors(
    served: Served, kwargs: dict[str, object], status: int, param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        await served.client.chat.completions.create(model="m", **kwargs)  # type: ignore[call-overload]
    assert info.value.status_code == status
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param
    # a request failed by its grammar compile answers at once; its job leaves the stage it is in at
    # the next boundary, so wait for that before asking /health (it reported pending 1 under load)
    with anyio.fail_after(30):
        await served.pipe.wait_idle()
    health = await served.client.get("/../health", cast_to=object)
    assert isinstance(health, dict) and (health["status"], health["pending"]) == ("ok", 0)


async def test_too_large_image_is_413(served: Served) -> None:
    big = png_header(8000, 6000)  # 48 megapixels claimed by the header: refused before decoding
    with pytest.raises(openai.APIStatusError) as info:
        await served.client.chat.completions.create(model="m", messages=user(image_part(data_url(big))))  # type: ignore[arg-type]
    assert info.value.status_code == 413


async def test_abandoned_stream_frees_its_capacity(served: Served) -> None:
    body = {"messages": user("go"), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    cancelled = served.pipe.metrics.requests["cancelled"]
    with anyio.fail_after(30):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{served.base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                resp.close()  # the client goes away mid-stream
        await assert_released(served.pipe)
    assert served.pipe.metrics.requests["cancelled"] == cancelled + 1


async def scrape(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{served.base}/metrics") as resp:
            text = await resp.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_are_prometheus_text(served: Served) -> None:
    templated = ("pipeline_stage_latency_seconds_count", (("stage", "template"),))
    generated = ("pipeline_tokens_generated_total", ())
    before = await scrape(served)
    await served.client.chat.completions.create(
        model="m",
        messages=user("x"),  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    after = await scrape(served)
    assert after[templated] - before.get(templated, 0) == 1
    assert after[generated] - before.get(generated, 0) == 2


# Three distinct items out of two values: the grammar holds the enum and the length, only the answer
# check sees the repeat, so every answer fails it.
IMPOSSIBLE = {
    "type": "array",
    "items": {"type": "integer", "enum": [0, 1]},
    "minItems": 3,
    "maxItems": 3,
    "uniqueItems": True,
}


async def test_an_answer_that_fails_its_check_is_a_422_with_the_path(served: Served) -> None:
    body = {
        "messages": user("numbers"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": IMPOSSIBLE}},
        "max_tokens": 16,
        "temperature": 0,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{served.base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 422
            error = (await resp.json())["error"]
        assert error["type"] == "invalid_answer" and error["reason"] == "uniqueItems" and error["path"] == ""
        assert error["param"] == "response_format.json_schema.schema"  # the constraint the answer failed
        async with session.post(f"{served.base}/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["error"]["type"] == "invalid_answer"  # in-band, as OpenAI reports mid-stream errors
    reasons = [c["finish_reason"] for chunk in chunks[:-1] for c in chunk["choices"]]
    assert "stop" not in reasons  # the failing answer never claims to be complete
    await assert_released(served.pipe)


async def test_vllm_spelling_through_the_openai_client(served: Served) -> None:
    completion = await served.client.chat.completions.create(
        model="m",
        messages=user("pick"),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert completion.choices[0].message.content in ("left", "right")
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.chat.completions.create(
            model="m",
            messages=user("x"),
            max_tokens=2,
            extra_body={"guided_jsn": {}},  # type: ignore[arg-type]
        )
    assert "guided_jsn" in str(info.value)
