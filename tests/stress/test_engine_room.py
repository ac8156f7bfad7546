"""A prepared request waits for room in the engine's command queue instead of being refused: a burst
larger than ``engine_queue_size`` is served whole while the engine is behind, admission counts the
waiters, a waiter that is cancelled holds nothing, and a lost engine process fails its waiters."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.answer.handle import PreparedInput, RequestHandle
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine
from pipeline.errors import EngineFailed, Overloaded, RequestCancelled
from sampling.async_engine import AsyncEngine
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released
from tests.servers import serving
from tests.stages.test_process_pool import wait_gone

QUEUE = 2  # engine_queue_size: a burst of a few requests overflows it
PENDING = 8  # max_pending_requests


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["thread", "process"])
async def pipe(request: pytest.FixtureRequest) -> AsyncIterator[Pipeline]:
    config = PipelineConfig(
        engine_mode=request.param,
        preparation_mode="thread",
        engine_queue_size=QUEUE,
        max_pending_requests=PENDING,
        max_running_seqs=4,
        num_kv_blocks=256,
        max_model_len=1024,
    )
    async with Pipeline(config) as p:
        yield p


def text(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 3, "ignore_eos": True}


@contextlib.asynccontextmanager
async def engine_paused(pipe: Pipeline) -> AsyncIterator[list[RequestHandle]]:
    """The engine reads no command inside the block: an engine process is stopped (SIGSTOP); the
    engine thread is held inside a step of one request of its own (yielded, to be awaited)."""
    engine = pipe.engine
    if isinstance(engine, ProcessEngine):
        pid = engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            yield []
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile
                os.kill(pid, signal.SIGCONT)
        return
    assert isinstance(engine, AsyncEngine)
    llm, entered, release = engine.engine, threading.Event(), threading.Event()
    step = llm.step

    def held_step() -> Any:
        entered.set()
        release.wait()
        return step()

    llm.step = held_step  # type: ignore[method-assign]
    try:
        holder = await pipe.submit(text(-1))
        await anyio.to_thread.run_sync(entered.wait, abandon_on_cancel=True)
        yield [holder]
    finally:
        llm.step = step  # type: ignore[method-assign]
        release.set()


async def settle(pipe: Pipeline) -> None:
    """Every request admitted so far is prepared and has reached the engine or waits for room."""
    # not wait_idle: it asks the engine process (stopped here) about its compiles
    assert pipe._admission is not None
    await pipe._admission.wait_idle()
    await anyio.wait_all_tasks_blocked()


async def test_a_burst_larger_than_the_engine_queue_is_served_whole(pipe: Pipeline) -> None:
    with anyio.fail_after(120):
        async with engine_paused(pipe) as held:
            handles = [await pipe.submit(text(i)) for i in range(6)]
            await settle(pipe)
            # the engine read none of them: two fill its queue, the other four wait (before: 429s)
            assert pipe.engine.room.num_waiting == 4
        for handle in held + handles:
            assert (await handle.result()).completion_tokens == 3
        await assert_released(pipe)
    assert pipe.metrics.requests["refused"] == 0


async def _scraped(pipe: Pipeline, name: str) -> float:
    """``name``'s value as ``GET /metrics`` of a server on ``pipe`` shows it."""
    async with serving(create_app(pipe)) as base, aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(values) == 1, f"{name} in /metrics: {values}"
    return values[0]


async def test_the_requests_waiting_for_room_are_a_gauge_in_metrics(pipe: Pipeline) -> None:
    gauge = "pipeline_requests_waiting_for_engine"
    with anyio.fail_after(120):
        assert await _scraped(pipe, gauge) == 0
        async with engine_paused(pipe) as held:
            handles = [await pipe.submit(text(i)) for i in range(6)]
            await settle(pipe)
            assert pipe.engine.room.num_waiting == 4
            assert await _scraped(pipe, gauge) == 4
        for handle in held + handles:
            assert (await handle.result()).completion_tokens == 3
        assert await _scraped(pipe, gauge) == 0
        await assert_released(pipe)


async def test_admission_counts_the_requests_waiting_for_room(pipe: Pipeline) -> None:
    refused = pipe.metrics.requests["refused"]
    with anyio.fail_after(120):
        async with engine_paused(pipe) as held:
            handles = [await pipe.submit(text(i)) for i in range(6)]
            await settle(pipe)
            handles += [await pipe.submit(text(i)) for i in range(6, 6 + PENDING - 4)]
            await settle(pipe)
            assert pipe.num_pending == 0 and pipe.engine.room.num_waiting == PENDING
            with pytest.raises(Overloaded) as info:
                await pipe.submit(text(99))
            error = info.value
            assert error.status == 429 and error.stage == "admission" and error.retry_after > 0
            assert f"{PENDING} waiting for the engine; the limit is {PENDING}" in error.message
        for handle in held + handles:
            assert (await handle.result()).completion_tokens == 3
        await assert_released(pipe)
    assert pipe.metrics.requests["refused"] == refused + 1


async def test_a_request_cancelled_while_waiting_for_room_holds_nothing(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    embeds: dict[str, weakref.ref[Any]] = {}
    wrap = pipe.preparation._wrap

    def wrap_and_watch(job: Any) -> PreparedInput:
        prepared = wrap(job)
        if prepared.inp.image_embeds is not None:  # not the engine thread's holder (text)
            embeds[prepared.inp.request_id] = weakref.ref(prepared.inp.image_embeds)
        return prepared

    monkeypatch.setattr(pipe.preparation, "_wrap", wrap_and_watch)
    engine = pipe.engine
    # two images each: their embeddings are the request's own (one image's are the encoder cache's entry)
    urls = [[data_url(encode(make_image(seed=40 + 2 * i + k))) for k in range(2)] for i in range(6)]
    # sampled without a seed: ignore_eos, or a stop token (about 7e-6 a step) may end an answer before the count
    bodies = [image_request(pair, max_tokens=3, ignore_eos=True) for pair in urls]
    with anyio.fail_after(120):
        async with engine_paused(pipe) as held:
            handles = [await pipe.submit(body) for body in bodies]
            await settle(pipe)
            waiting = [h for h in handles if h.request_id not in engine._streams]
            assert len(waiting) == 4 and engine.room.num_waiting == 4
            if isinstance(engine, ProcessEngine):
                assert engine.resources()["arena_regions"] == QUEUE  # the adds sent; none for a waiter
            for handle in waiting:
                handle.cancel()
            for handle in waiting:
                with pytest.raises(RequestCancelled):
                    await handle.result()
            assert engine.room.num_waiting == 0
            await anyio.wait_all_tasks_blocked()  # their tasks have returned
            gc.collect()
            assert all(embeds[h.request_id]() is None for h in waiting)  # their embeddings are freed
        for handle in held + [h for h in handles if h not in waiting]:
            assert (await handle.result()).completion_tokens == 3
        await assert_released(pipe)


async def test_a_lost_engine_process_fails_the_requests_waiting_for_room(pipe: Pipeline) -> None:
    engine = pipe.engine
    if not isinstance(engine, ProcessEngine):
        pytest.skip("an engine thread is not lost apart from its process")
    pid = engine.pid
    assert pid is not None
    with anyio.fail_after(240):
        async with engine_paused(pipe):
            handles = [await pipe.submit(text(i)) for i in range(6)]
            await settle(pipe)
            assert engine.room.num_waiting == 4
            os.kill(pid, signal.SIGKILL)
            for handle in handles:  # the two it never read and the four waiting alike
                with pytest.raises(EngineFailed) as info:
                    await handle.result()
                error = info.value
                assert error.status == 503 and error.code == "engine_failed" and error.stage == "engine"
                assert error.request_id == handle.request_id
            assert engine.room.num_waiting == 0
        await wait_gone(pid)
        await engine.wait_started()
        assert (await (await pipe.submit(text(0))).result()).completion_tokens == 3
        await assert_released(pipe)


async def test_an_engine_process_that_hangs_with_only_waiters_owed_is_replaced() -> None:
    """The requests it was sent have gone (aborted), the ones waiting for room remain: they are work
    owed, so the hang deadline kills the stopped process and they get 503 engine_failed."""
    config = PipelineConfig(
        engine_mode="process",
        preparation_mode="thread",
        engine_queue_size=QUEUE,
        engine_step_timeout_s=2.0,
        max_running_seqs=4,
        num_kv_blocks=256,
        max_model_len=1024,
    )
    async with Pipeline(config) as pipe:
        engine = pipe.engine
        assert isinstance(engine, ProcessEngine)
        pid = engine.pid
        assert pid is not None
        with anyio.fail_after(240):
            async with engine_paused(pipe):
                handles = [await pipe.submit(text(i)) for i in range(6)]
                await settle(pipe)
                sent = [h for h in handles if h.request_id in engine._streams]
                assert len(sent) == QUEUE and engine.room.num_waiting == 4
                for handle in sent:
                    handle.cancel()
                    with pytest.raises(RequestCancelled):
                        await handle.result()
                assert not engine._streams
                for handle in handles:
                    if handle not in sent:
                        with pytest.raises(EngineFailed) as info:
                            await handle.result()
                        assert "made no progress" in info.value.message and info.value.status == 503
            await wait_gone(pid)
            await engine.wait_started()
            assert (await (await pipe.submit(text(0))).result()).completion_tokens == 3
            await assert_released(pipe)
