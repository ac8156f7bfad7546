"""The encoder cache inside the pipeline: hits skip decode and encode, identical images encode once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import ImageDecodeError
from stages.content_hash import content_hash
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def uncached() -> AsyncIterator[Pipeline]:
    """The reference both modes' cached embeddings are compared with (the encoder in this process:
    both modes give the same embeddings, and workers would start for one image)."""
    async with Pipeline(PipelineConfig(encoder_cache_bytes=0, preparation_mode="thread"), with_engine=False) as p:
        yield p


@pytest.fixture(scope="module", params=["process", "thread"])
async def pipe(request: pytest.FixtureRequest, uncached: Pipeline) -> AsyncIterator[Pipeline]:
    """The encoder runs in a preparation worker or in this process: the cache sits in front of both.
    Asks for ``uncached`` so that pipeline starts first and stops last: pipelines are task groups,
    and task groups end in the reverse order they began."""
    async with Pipeline(PipelineConfig(preparation_mode=request.param), with_engine=False) as p:
        yield p


def num_encoded(pipe: Pipeline) -> int:
    """Images the encoder ran on: in the vision stage's batches, or in a preparation worker."""
    pool = pipe.preparation.pool
    assert pipe.preparation.vision is not None
    return sum(pipe.preparation.vision.batch_sizes) + (pool.stats.jobs if pool is not None else 0)


def image(seed: int) -> tuple[str, str]:
    data = encode(make_image(64 + 16 * seed, 48, seed=seed))
    return data_url(data), content_hash(data)


async def test_a_repeated_image_is_a_hit_with_the_same_embeddings(pipe: Pipeline) -> None:
    cache = pipe.preparation.encoder_cache
    assert cache is not None
    url, digest = image(101)
    before = (cache.stats.hits, cache.stats.misses, num_encoded(pipe))
    first = await pipe.prepare(image_request([url]))
    second = await pipe.prepare(image_request([url], text="Another question."))
    assert (cache.stats.hits - before[0], cache.stats.misses - before[1]) == (1, 1)
    assert num_encoded(pipe) - before[2] == 1
    assert first.image_embeds is not None and second.image_embeds is not None
    assert torch.equal(first.image_embeds, second.image_embeds)
    assert [k.content_hash for k in second.image_keys] == [digest]
    assert second.image_keys[0].num_tokens == second.image_embeds.shape[0]
    assert "decode" in second.timings
    await assert_released(pipe)


async def test_concurrent_identical_images_encode_once(pipe: Pipeline) -> None:
    cache = pipe.preparation.encoder_cache
    vision = pipe.preparation.vision
    assert cache is not None and vision is not None
    url, _ = image(102)
    other, _ = image(103)
    misses, encoded = cache.stats.misses, num_encoded(pipe)
    results = []

    async def one(urls: list[str]) -> None:
        results.append(await pipe.prepare(image_request(urls)))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(6):  # also in the other order, and twice in one request
                tg.start_soon(one, [url, other] if i % 3 == 0 else [other, url] if i % 3 == 1 else [url, url])
    assert cache.stats.misses - misses == 2 and num_encoded(pipe) - encoded == 2
    rows = {len(r.image_keys): r for r in results}
    assert set(rows) == {2}
    await assert_released(pipe)


async def test_embeddings_are_those_of_an_uncached_pipeline(pipe: Pipeline, uncached: Pipeline) -> None:
    url, _ = image(104)
    cached = [await pipe.prepare(image_request([url])) for _ in range(2)]
    assert uncached.preparation.encoder_cache is None
    plain = await uncached.prepare(image_request([url]))
    for inp in cached:
        assert inp.prompt_token_ids == plain.prompt_token_ids
        assert inp.image_embeds is not None and plain.image_embeds is not None
        assert torch.equal(inp.image_embeds, plain.image_embeds)
        assert inp.image_keys == plain.image_keys


async def test_a_failed_owner_leaves_no_flight(pipe: Pipeline) -> None:
    cache = pipe.preparation.encoder_cache
    assert cache is not None
    broken = data_url(b"not an image at all")
    with pytest.raises(ImageDecodeError) as info:
        await pipe.prepare(image_request([broken]))
    assert (info.value.field, info.value.stage) == ("messages[0].content[1].image_url.url", "decode")
    assert cache.num_flights == 0
    await assert_released(pipe)


async def test_the_trace_carries_each_image_hash(tmp_path: Path) -> None:
    from pipeline.observability.trace import Tracer

    tracer = Tracer()
    data = encode(make_image(80, 48, seed=105))
    # the hashes are taken in this process whichever the mode: threads start no worker
    async with Pipeline(PipelineConfig(preparation_mode="thread"), with_engine=False, tracer=tracer) as traced:
        await traced.prepare(image_request([data_url(data), data_url(data)]))
    tracer.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    hashed = [e for e in events if e["name"] == "images hashed"]
    assert [e["args"]["hashes"] for e in hashed] == [[content_hash(data)[:16]] * 2]
