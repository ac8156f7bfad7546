"""Fetch slots are shared between requests: a few requests whose image URLs hang cannot take every
slot, so another request's good URL is fetched at once (servers on 127.0.0.1, events, no sleeps)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import pytest
from aiohttp import web

from pipeline.core.image_steps import ImageSteps, RequestImages
from pipeline.types import ImagePart
from stages.decode import DecodeStage
from stages.fetch import FetchStage
from stages.fetch_policy import AddressPolicy
from tests.images import encode, make_image
from tests.servers import serving

PNG = encode(make_image(8, 8, seed=1))
TOTAL, PER_REQUEST, IMAGES = 32, 4, 8  # the defaults: four requests of eight images filled every slot


@dataclass
class SlowImages:
    base: str
    release: anyio.Event
    arrived: list[str] = field(default_factory=list)
    all_arrived: anyio.Event = field(default_factory=anyio.Event)
    expected: int = 0


@pytest.fixture
async def slow_images() -> AsyncIterator[SlowImages]:
    """``/slow/N.png`` answers once released; ``/good.png`` at once."""
    state = SlowImages("", anyio.Event())

    async def slow(request: web.Request) -> web.Response:
        state.arrived.append(request.path)
        if len(state.arrived) == state.expected:
            state.all_arrived.set()
        await state.release.wait()
        return web.Response(body=PNG, content_type="image/png")

    async def good(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    app = web.Application()
    app.add_routes([web.get("/slow/{n}.png", slow), web.get("/good.png", good)])
    async with serving(app, shutdown_timeout=0.1) as base:
        state.base = base
        try:
            yield state
        finally:
            state.release.set()


def refs(urls: list[str]) -> list[ImagePart]:
    return [ImagePart(url=url, field=f"messages[0].content[{i}].image_url.url", index=i) for i, url in enumerate(urls)]


async def test_slow_requests_leave_slots_for_another_request(slow_images: SlowImages) -> None:
    policy = AddressPolicy(allow_private=True)
    async with FetchStage(concurrency=TOTAL, per_request=PER_REQUEST, policy=policy, total_timeout_s=60) as fetch:
        steps = ImageSteps(fetch, DecodeStage(), None, None, None, takes_images=True)
        num_slow = 4
        slow_images.expected = num_slow * PER_REQUEST  # what may arrive while the rest wait for their share
        async with anyio.create_task_group() as tg:
            for r in range(num_slow):
                urls = [f"{slow_images.base}/slow/{r * IMAGES + k}.png" for k in range(IMAGES)]
                tg.start_soon(steps.fetch_step, refs(urls), RequestImages(), f"slow-{r}")
            with anyio.fail_after(10):
                await slow_images.all_arrived.wait()
            await anyio.wait_all_tasks_blocked()  # every other slow fetch is parked on its request's share
            assert len(slow_images.arrived) == num_slow * PER_REQUEST
            assert fetch.limiter.borrowed_tokens == num_slow * PER_REQUEST < TOTAL
            good = RequestImages()
            with anyio.fail_after(10):  # without the shares: waits until the slow ones are released
                await steps.fetch_step(refs([f"{slow_images.base}/good.png"]), good, "good")
            assert good.data == [PNG]
            slow_images.release.set()
        assert len(slow_images.arrived) == num_slow * IMAGES  # every slow image was fetched in the end
        assert fetch.limiter.borrowed_tokens == 0


async def test_one_requests_images_wait_for_its_own_share(slow_images: SlowImages) -> None:
    policy = AddressPolicy(allow_private=True)
    async with FetchStage(concurrency=TOTAL, per_request=2, policy=policy, total_timeout_s=60) as fetch:
        steps = ImageSteps(fetch, DecodeStage(), None, None, None, takes_images=True)
        slow_images.expected = 2
        async with anyio.create_task_group() as tg:
            urls = [f"{slow_images.base}/slow/{k}.png" for k in range(5)]
            tg.start_soon(steps.fetch_step, refs(urls), RequestImages(), "one")
            with anyio.fail_after(10):
                await slow_images.all_arrived.wait()
            await anyio.wait_all_tasks_blocked()
            assert len(slow_images.arrived) == 2 and fetch.limiter.borrowed_tokens == 2
            slow_images.release.set()
        assert len(slow_images.arrived) == 5


async def test_many_requests_to_one_slow_host_leave_slots_for_other_hosts(slow_images: SlowImages) -> None:
    """Eight requests whose images all hang on one host hold that host's 3 slots, not all 8: an image
    on another host (another port of 127.0.0.1) is fetched at once, and the host table empties after."""
    other = web.Application()
    other.add_routes([web.get("/good.png", _png)])
    policy = AddressPolicy(allow_private=True)
    async with (
        serving(other, shutdown_timeout=0.1) as other_base,
        FetchStage(concurrency=8, per_request=8, per_host=3, policy=policy, total_timeout_s=60) as fetch,
    ):
        steps = ImageSteps(fetch, DecodeStage(), None, None, None, takes_images=True)
        slow_images.expected = 3
        async with anyio.create_task_group() as tg:
            for r in range(8):
                tg.start_soon(steps.fetch_step, refs([f"{slow_images.base}/slow/{r}.png"]), RequestImages(), f"r{r}")
            with anyio.fail_after(10):
                await slow_images.all_arrived.wait()
            await anyio.wait_all_tasks_blocked()  # the other five wait for the host's slots
            assert len(slow_images.arrived) == 3 and fetch.limiter.borrowed_tokens == 3
            assert fetch.hosts_in_use() == 1
            good = RequestImages()
            with anyio.fail_after(10):  # one shared limit alone: all 8 slots held, and this waits
                await steps.fetch_step(refs([f"{other_base}/good.png"]), good, "good")
            assert good.data == [PNG]
            slow_images.release.set()
        assert len(slow_images.arrived) == 8
        assert fetch.hosts_in_use() == 0 and fetch.limiter.borrowed_tokens == 0


async def _png(_: web.Request) -> web.Response:
    return web.Response(body=PNG, content_type="image/png")
