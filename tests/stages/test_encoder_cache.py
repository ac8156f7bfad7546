from __future__ import annotations

import anyio
import torch

from stages.content_hash import INLINE_HASH_BYTES, content_hash, hash_off_loop
from stages.encoder_cache import EncodedImage, EncoderCache, Flight


def encoded(h: str, rows: int = 2, cols: int = 2, hidden: int = 4) -> EncodedImage:
    return EncodedImage(h, torch.full((rows * cols, hidden), float(len(h))), (1, rows, cols))


async def test_hash_is_by_content_inline_or_in_a_thread() -> None:
    small, large = b"a" * 100, bytes(range(256)) * (INLINE_HASH_BYTES // 256 + 1)
    limiter = anyio.CapacityLimiter(1)
    assert await hash_off_loop(small, limiter) == content_hash(bytes(small))
    assert await hash_off_loop(large, limiter) == content_hash(large) != content_hash(large[:-1])


async def test_miss_then_hit_and_namespaces_do_not_mix() -> None:
    cache = EncoderCache(1 << 20, "model-a")
    flight = await cache.claim("h1")
    assert isinstance(flight, Flight)
    cache.fulfil(flight, encoded("h1"))
    hit = await cache.claim("h1")
    assert isinstance(hit, EncodedImage) and hit.content_hash == "h1"
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (1, 1, 1)
    other = EncoderCache(1 << 20, "model-b")
    assert isinstance(await other.claim("h1"), Flight)


async def test_bounded_in_bytes_least_recently_used_out() -> None:
    one = encoded("a").nbytes
    cache = EncoderCache(2 * one, "m")
    for h in ("a", "b"):
        flight = await cache.claim(h)
        assert isinstance(flight, Flight)
        cache.fulfil(flight, encoded(h))
    assert isinstance(await cache.claim("a"), EncodedImage)  # "a" is now the most recent
    flight = await cache.claim("c")
    assert isinstance(flight, Flight)
    cache.fulfil(flight, encoded("c"))
    assert cache.stats.evictions == 1 and cache.stats.bytes_held == 2 * one <= cache.max_bytes
    assert isinstance(await cache.claim("a"), EncodedImage)
    assert isinstance(await cache.claim("b"), Flight)  # evicted


async def test_too_large_to_keep_still_serves_its_waiters() -> None:
    cache = EncoderCache(8, "m")
    owner = await cache.claim("big")
    assert isinstance(owner, Flight)
    got: list[EncodedImage | Flight] = []

    async def wait() -> None:
        got.append(await cache.claim("big"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        cache.fulfil(owner, encoded("big"))
    assert isinstance(got[0], EncodedImage) and cache.stats.bytes_held == 0


async def test_single_flight_a_cancelled_waiter_leaves_alone() -> None:
    cache = EncoderCache(1 << 20, "m")
    owner = await cache.claim("h")
    assert isinstance(owner, Flight)
    got: list[EncodedImage | Flight] = []
    left = anyio.Event()

    async def wait() -> None:
        got.append(await cache.claim("h"))

    async def wait_cancelled(scope: anyio.CancelScope) -> None:
        with scope:
            await cache.claim("h")
        left.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            cancelled = anyio.CancelScope()
            tg.start_soon(wait_cancelled, cancelled)
            for _ in range(3):
                tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            cancelled.cancel()
            await left.wait()
            cache.fulfil(owner, encoded("h"))
    assert len(got) == 3 and all(isinstance(g, EncodedImage) for g in got)
    assert cache.stats.misses == 1 and cache.stats.hits == 3 and cache.num_flights == 0


async def test_an_abandoned_flight_passes_to_one_waiter() -> None:
    cache = EncoderCache(1 << 20, "m")
    owner = await cache.claim("h")
    assert isinstance(owner, Flight)
    got: list[EncodedImage | Flight] = []

    async def wait() -> None:
        claimed = await cache.claim("h")
        got.append(claimed)
        if isinstance(claimed, Flight):
            cache.fulfil(claimed, encoded("h"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            cache.abandon(owner)
    assert sum(isinstance(g, Flight) for g in got) == 1 and cache.stats.misses == 2
    assert cache.num_flights == 0
