"""A repeated data URL skips its base64 decode, and the encoder cache stays keyed by content."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch
from aiohttp import web

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import ImageFetchError
from sampling.inputs import EngineInput
from stages.content_hash import content_hash
from stages.data_url_keys import DataUrlKeys
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released
from tests.servers import serving


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(preparation_mode="thread", allow_private_networks=True)
    async with Pipeline(config, with_engine=False) as p:
        yield p


class FetchCount:
    """The URLs the fetch stage was asked for, in order (the stage itself still runs)."""

    def __init__(self, pipe: Pipeline) -> None:
        self.urls: list[str] = []
        fetch = pipe.preparation.fetch
        self._fetch, self._run = fetch, fetch.run

        async def run(url: str, *, field: str, **options: Any) -> bytes:
            self.urls.append(url)
            return await self._run(url, field=field, **options)

        fetch.run = run  # type: ignore[method-assign]

    def __enter__(self) -> FetchCount:
        return self

    def __exit__(self, *exc: object) -> None:
        del self._fetch.run  # the class's method again


def keys_of(pipe: Pipeline) -> DataUrlKeys:
    keys = pipe.preparation.images.url_keys
    assert keys is not None
    return keys


async def prepare(pipe: Pipeline, urls: list[str], text: str = "Describe.") -> EngineInput:
    with anyio.fail_after(60):
        return await pipe.prepare(image_request(urls, text=text))


async def test_a_repeated_data_url_is_not_decoded_again(pipe: Pipeline) -> None:
    data = encode(make_image(64, 48, seed=201))
    url = data_url(data)
    with FetchCount(pipe) as fetched:
        first = await prepare(pipe, [url])
        second = await prepare(pipe, [url], text="Again.")
        third = await prepare(pipe, [url, url], text="Twice.")
    assert fetched.urls == [url]
    assert [k.content_hash for k in third.image_keys] == [content_hash(data)] * 2
    assert first.image_keys == second.image_keys
    assert first.image_embeds is not None and second.image_embeds is not None
    assert torch.equal(first.image_embeds, second.image_embeds)
    await assert_released(pipe)


def bottom_up_pair(seed: int) -> tuple[bytes, bytes]:
    """Two BMPs that differ in their top-left pixel only: BMP stores rows bottom up, so their bytes,
    and their data URLs, differ only at the end."""
    image = make_image(64, 48, seed=seed)
    changed = image.copy()
    r, g, b = image.getpixel((0, 0))  # type: ignore[misc]
    changed.putpixel((0, 0), (255 - r, g, b))
    return encode(image, "BMP"), encode(changed, "BMP")


async def test_a_changed_image_with_the_same_prefix_has_its_own_key(pipe: Pipeline) -> None:
    one, other = bottom_up_pair(202)
    url, changed = data_url(one, "image/bmp"), data_url(other, "image/bmp")
    # the same length, and the same text up to the last row of pixels (64 x 3 bytes, 256 base64 characters)
    assert len(url) == len(changed) and len(url) - len(os.path.commonprefix([url, changed])) <= 256
    with FetchCount(pipe) as fetched:
        first = await prepare(pipe, [url])
        second = await prepare(pipe, [changed])
        again = await prepare(pipe, [changed])
    assert fetched.urls == [url, changed]
    assert [k.content_hash for k in first.image_keys] == [content_hash(one)]
    assert [k.content_hash for k in second.image_keys] == [content_hash(other)]
    assert again.image_keys == second.image_keys
    assert first.image_embeds is not None and second.image_embeds is not None
    assert not torch.equal(first.image_embeds, second.image_embeds)
    await assert_released(pipe)


async def test_two_spellings_and_an_http_url_share_one_encoder_cache_entry(pipe: Pipeline) -> None:
    data = encode(make_image(80, 48, seed=203))
    app = web.Application()

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=data, content_type="image/png")

    app.router.add_get("/image.png", image)
    plain = data_url(data)
    head, payload = plain.split(",", 1)
    wrapped = head + "," + "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))  # MIME lines
    cache = pipe.preparation.encoder_cache
    assert cache is not None
    async with serving(app) as base:
        before = (cache.stats.hits, cache.stats.misses)
        results = [await prepare(pipe, [u]) for u in (plain, wrapped, f"{base}/image.png", plain)]
    assert (cache.stats.hits - before[0], cache.stats.misses - before[1]) == (3, 1)
    assert {k.content_hash for r in results for k in r.image_keys} == {content_hash(data)}
    await assert_released(pipe)


async def test_an_image_evicted_from_the_encoder_cache_is_decoded_from_its_url() -> None:
    urls = [data_url(encode(make_image(64, 48, seed=seed))) for seed in (204, 205)]
    async with Pipeline(PipelineConfig(preparation_mode="thread"), with_engine=False) as reference:
        expected = [await prepare(reference, [u]) for u in urls]
        cache = reference.preparation.encoder_cache
        assert cache is not None
        one_image = cache.stats.bytes_held // 2
    # room for one image's embeddings: each request evicts the other image
    config = PipelineConfig(preparation_mode="thread", encoder_cache_bytes=one_image)
    async with Pipeline(config, with_engine=False) as small:
        with FetchCount(small) as fetched:
            got = [await prepare(small, [u]) for u in (urls[0], urls[1], urls[0])]
        small_cache = small.preparation.encoder_cache
        assert small_cache is not None
        assert (small_cache.stats.hits, small_cache.stats.misses, small_cache.stats.evictions) == (0, 3, 2)
        # the third request knew its hash from the URL's text, and decoded it at the decode step
        assert fetched.urls == [urls[0], urls[1], urls[0]]
        assert keys_of(small).stats.hits == 1
        await assert_released(small)
    for inp, ref in zip(got, [*expected, expected[0]], strict=True):
        assert inp.image_keys == ref.image_keys
        assert inp.image_embeds is not None and ref.image_embeds is not None
        assert torch.equal(inp.image_embeds, ref.image_embeds)


async def test_broken_base64_is_refused_each_time_and_never_remembered(pipe: Pipeline) -> None:
    broken = "data:image/png;base64,@@@@"
    keys = keys_of(pipe)
    entries = keys.stats.entries
    for _ in range(2):
        with pytest.raises(ImageFetchError) as info:
            await prepare(pipe, [broken])
        assert (info.value.field, info.value.stage) == ("messages[0].content[1].image_url.url", "fetch")
    assert keys.stats.entries == entries
    await assert_released(pipe)


async def test_no_memo_without_an_encoder_cache() -> None:
    config = PipelineConfig(preparation_mode="thread", encoder_cache_bytes=0)
    async with Pipeline(config, with_engine=False) as uncached:
        assert uncached.preparation.images.url_keys is None
        url = data_url(encode(make_image(64, 48, seed=206)))
        with FetchCount(uncached) as fetched:
            for _ in range(2):
                await prepare(uncached, [url])
        assert fetched.urls == [url, url]
