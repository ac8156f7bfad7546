"""Both caches through the whole pipeline: answers identical with them on and off, counters on
/metrics, nothing held after cancellations."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import RequestCancelled
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released

SYSTEM = "You are a careful assistant. Answer in one short sentence, in plain words. " * 8
SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["label", "n"],
    "additionalProperties": False,
}
CONFIG = {"max_running_seqs": 8, "num_kv_blocks": 256, "max_model_len": 2048, "engine_mode": "thread"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def cached() -> AsyncIterator[Pipeline]:
    async with Pipeline(PipelineConfig(**CONFIG)) as p:  # type: ignore[arg-type]
        yield p


def chat(text: str, urls: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    body = image_request(list(urls), text=text, **extra) if urls else {"messages": [{"role": "user", "content": text}]}
    body["messages"] = [{"role": "system", "content": SYSTEM}, *body["messages"]]
    return {"max_tokens": 8, "temperature": 0, **body, **extra}


def requests() -> list[dict[str, Any]]:
    a = data_url(encode(make_image(96, 64, seed=21)))
    b = data_url(encode(make_image(96, 64, seed=22)))
    guided = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    return [
        chat("first question"),
        chat("first question"),
        chat("second question"),
        chat("what is here?", (a,)),
        chat("and now?", (a,)),
        chat("and now?", (b,)),  # another image with the same words: its own answer
        chat("as json", **guided, max_tokens=40),
        chat("as json", **guided, max_tokens=40),
        chat("three ways", n=3, temperature=0.8, seed=9),
        chat("three ways", n=3, temperature=0.8, seed=9),
    ]


async def answers(pipe: Pipeline) -> list[list[list[int]]]:
    out = []
    for body in requests():  # one at a time: later requests find what earlier ones left
        result = await (await pipe.submit(body)).result()
        out.append([list(c.token_ids) for c in result.choices])
    return out


async def test_answers_are_the_same_with_both_caches_on_and_off(cached: Pipeline) -> None:
    on = await answers(cached)
    stats = cached.cache_stats()
    async with Pipeline(PipelineConfig(**CONFIG, encoder_cache_bytes=0, prefix_caching=False)) as plain:  # type: ignore[arg-type]
        assert plain.cache_stats() == {}
        off = await answers(plain)
    assert on == off
    assert on[4] != on[5]
    assert stats["encoder"].hits >= 1 and stats["encoder"].misses >= 2
    kv = stats["kv_prefix"]
    assert kv.hits > 0 and 0 < kv.bytes_held <= kv.bytes_bound
    text = cached.render_metrics().decode()
    assert 'pipeline_cache_hits_total{cache="encoder"}' in text and 'pipeline_cache_bytes{cache="kv_prefix"}' in text
    await assert_released(cached)


async def test_cancelled_requests_sharing_an_image_and_a_prefix_leave_nothing_held(cached: Pipeline) -> None:
    url = data_url(encode(make_image(128, 96, seed=23)))
    handles = [await cached.submit(chat(f"question {i}", (url,), max_tokens=500, ignore_eos=True)) for i in range(6)]
    with anyio.fail_after(60):
        async for _ in handles[0]:
            break  # the first one streams, then leaves
        for handle in handles[1:4]:
            handle.cancel()
    for handle in handles[:4]:
        with pytest.raises(RequestCancelled):
            await handle.result()
    for handle in handles[4:]:
        handle.cancel()
    await assert_released(cached)
    encoder = cached.preparation.encoder_cache
    assert encoder is not None and encoder.num_flights == 0
    allocator = cached.engine.engine.scheduler.allocator
    assert all(allocator.refcount(b) == 0 for b in range(allocator.num_blocks))


async def test_metrics_endpoint_shows_both_caches(cached: Pipeline) -> None:
    import aiohttp

    from pipeline.api.server import create_app
    from tests.servers import serving

    url = data_url(encode(make_image(64, 64, seed=24)))
    for _ in range(2):
        await (await cached.submit(chat("metrics", (url,), max_tokens=1))).result()
    async with serving(create_app(cached)) as base, aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (sample.name, sample.labels.get("cache")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    stats = cached.cache_stats()
    for cache in ("encoder", "kv_prefix"):
        s = stats[cache]
        assert s.hits > 0
        for name, value in (("hits_total", s.hits), ("misses_total", s.misses), ("bytes_bound", s.bytes_bound)):
            assert samples[(f"pipeline_cache_{name}", cache)] == value
    assert 'pipeline_cache_evictions_total{cache="encoder"}' in text
