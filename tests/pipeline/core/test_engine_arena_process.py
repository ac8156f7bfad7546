"""An engine process's adds carry their image embeddings through the engine arena: the answers are
the thread engine's, and every region is freed after requests finish, are cancelled, or are failed
by a killed engine process (whose successor gets a new arena)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine
from pipeline.errors import EngineFailed, RequestCancelled
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released
from tests.stages.test_process_pool import wait_gone

CONFIG = {"max_running_seqs": 4, "num_kv_blocks": 512, "max_model_len": 4096, "preparation_mode": "thread"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    async with Pipeline(PipelineConfig(engine_mode="process", **CONFIG)) as p:
        yield p


def _engine(pipe: Pipeline) -> ProcessEngine:
    engine = pipe.engine
    assert isinstance(engine, ProcessEngine)
    return engine


def image_bodies() -> list[dict[str, object]]:
    """Greedy image requests: one image, two images (the first again), and two choices of one."""
    one = [data_url(encode(make_image(96, 64, seed=11)))]
    two = one + [data_url(encode(make_image(40, 80, seed=12), "JPEG"), "image/jpeg")]
    return [
        image_request(one, max_tokens=24, temperature=0),
        image_request(two, max_tokens=24, temperature=0),
        image_request(one, text="Again.", max_tokens=16, temperature=0.8, seed=3, n=2),
    ]


async def image_answers(pipe: Pipeline) -> list[list[list[int]]]:
    """The token ids of each choice of each of ``image_bodies``' requests."""
    results = [await (await pipe.submit(body)).result() for body in image_bodies()]
    return [[list(choice.token_ids) for choice in result.choices] for result in results]


async def test_image_answers_are_the_thread_engines_and_their_regions_are_freed(pipe: Pipeline) -> None:
    engine = _engine(pipe)
    adds = engine.num_arena_adds
    with anyio.fail_after(240):
        answers = await image_answers(pipe)
        assert (engine.num_arena_adds - adds, engine.num_inline_adds) == (3, 0)
        await assert_released(pipe)  # the engine has read every add: no arena region is held
        async with Pipeline(PipelineConfig(engine_mode="thread", **CONFIG)) as threaded:
            assert await image_answers(threaded) == answers


async def test_a_cancelled_image_request_frees_its_region(pipe: Pipeline) -> None:
    body = image_request([data_url(encode(make_image(seed=13)))], max_tokens=4000, ignore_eos=True)
    with anyio.fail_after(120):
        handle = await pipe.submit(body)
        async for _delta in handle:
            break  # leaving the stream early cancels the request
        with pytest.raises(RequestCancelled):
            await handle.result()
        await assert_released(pipe)


async def test_a_killed_engine_frees_the_regions_of_the_adds_it_never_read(pipe: Pipeline) -> None:
    engine = _engine(pipe)
    pid, arena = engine.pid, engine._arena
    assert pid is not None and arena is not None
    with anyio.fail_after(240):
        inputs = [await pipe.prepare(body) for body in image_bodies()[:2]]
        os.kill(pid, signal.SIGSTOP)  # reads nothing from now on
        streams = [engine.submit(inp) for inp in inputs]
        assert engine.resources()["arena_regions"] == 2
        # the next engine process gets an arena too small for any add: they cross inline
        engine.arena_bytes = 64
        os.kill(pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineFailed):
                async for _output in stream:
                    pass
        assert arena.num_regions == 0 and engine.resources()["arena_regions"] == 0
        await wait_gone(pid)
        await engine.wait_started()
        assert engine._arena is not None and engine._arena is not arena and engine._arena.slab.size == 64
        inline = engine.num_inline_adds
        result = await (await pipe.submit(image_bodies()[0])).result()
        assert result.completion_tokens > 0 and engine.num_inline_adds == inline + 1
        await assert_released(pipe)
