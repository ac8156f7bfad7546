"""A full stage blocks its producer; a full pipeline refuses admission at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from anyio.abc import TaskStatus

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.core.staged import Job, StageWorkers
from pipeline.errors import Overloaded, PromptTooLong, ShuttingDown
from pipeline.observability.metrics import StageMetrics
from pipeline.outcome import OutcomeState
from tests.images import data_url, encode, image_request, make_image

# the bounds under test are the pipeline's, the same in both preparation modes: threads start no
# worker processes (the images here are a few, and tiny)
THREADS = "thread"


async def test_full_stage_blocks_its_producer() -> None:
    release = anyio.Event()
    seen: list[str] = []

    async def first(job: Job) -> None:
        seen.append(f"first:{job.request_id}")

    async def second(job: Job) -> None:
        await release.wait()
        seen.append(f"second:{job.request_id}")

    a = StageWorkers("a", first, num_workers=1, queue_size=1, metrics=StageMetrics("a"))
    b = StageWorkers("b", second, num_workers=1, queue_size=1, metrics=StageMetrics("b"))
    a.next = b
    jobs = [Job(str(i), None) for i in range(4)]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            a.start(tg)
            b.start(tg)
            await a.send.send(jobs[0])
            await a.send.send(jobs[1])
            await a.send.send(jobs[2])
            await anyio.wait_all_tasks_blocked()
            # b's worker holds job 0, b's inbox holds job 1, a's worker is stuck sending job 2
            assert b.metrics.in_flight == 1 and b.queue_depth() == 1
            assert a.queue_depth() == 0 and a.metrics.completed == 3
            await a.send.send(jobs[3])  # a's inbox had room for exactly one more
            with pytest.raises(anyio.WouldBlock):
                a.offer(Job("overflow", None))
            release.set()
            for job in jobs:
                await job.wait()
            await a.aclose()
            await b.aclose()
    assert [j.outcome.state for j in jobs] == [OutcomeState.COMPLETED] * 4
    assert seen.count("second:0") == 1 and len(seen) == 8


def gate_fetch(pipe: Pipeline) -> anyio.Event:
    """Hold every fetch until the returned event is set (the stages behind it fill up meanwhile)."""
    release = anyio.Event()
    real_run = pipe.preparation.fetch.run

    async def gated_run(url: str, *, field: str, **options: Any) -> bytes:
        await release.wait()
        return await real_run(url, field=field, **options)

    pipe.preparation.fetch.run = gated_run  # type: ignore[method-assign]
    return release


@pytest.fixture
async def blocked_pipe() -> AsyncIterator[tuple[Pipeline, anyio.Event]]:
    config = PipelineConfig(max_pending_requests=4, stage_queue_size=4, fetch_concurrency=1, preparation_mode=THREADS)
    async with Pipeline(config, with_engine=False) as pipe:
        yield pipe, gate_fetch(pipe)


async def test_full_pipeline_refuses_admission_at_once(blocked_pipe: tuple[Pipeline, anyio.Event]) -> None:
    pipe, release = blocked_pipe
    body = image_request([data_url(encode(make_image(seed=1)))])
    results: list[object] = []

    async def prepare_one(*, task_status: TaskStatus[None]) -> None:
        task_status.started()
        results.append(await pipe.prepare(body))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                await tg.start(prepare_one)
            await anyio.wait_all_tasks_blocked()
            assert pipe.num_pending == 4
            with pytest.raises(Overloaded) as info:
                await pipe.prepare(body)
            assert info.value.status == 429 and info.value.retry_after > 0
            release.set()
    assert len(results) == 4 and pipe.num_pending == 0
    assert pipe.metrics.requests["refused"] == 1 and pipe.metrics.jobs["completed"] == 4


async def test_shutting_down_refuses_with_503() -> None:
    config = PipelineConfig(max_pending_requests=2, preparation_mode=THREADS)
    async with Pipeline(config, with_engine=False) as pipe:
        pipe.stop_accepting()
        with pytest.raises(Overloaded) as info:
            await pipe.prepare({"messages": [{"role": "user", "content": "x"}]})
        assert info.value.status == 503


async def test_max_pending_requests_is_the_bound_that_decides() -> None:
    # inboxes of 2 and one fetch worker: before, the first inbox refused the 4th request
    config = PipelineConfig(max_pending_requests=40, stage_queue_size=2, fetch_concurrency=1, preparation_mode=THREADS)
    body = image_request([data_url(encode(make_image(seed=2)))])
    async with Pipeline(config, with_engine=False) as pipe:
        release = gate_fetch(pipe)

        async def prepare_one(*, task_status: TaskStatus[None]) -> None:
            task_status.started()
            await pipe.prepare(body)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(40):
                    await tg.start(prepare_one)
                await anyio.wait_all_tasks_blocked()
                assert pipe.num_pending == 40
                with pytest.raises(Overloaded) as info:
                    await pipe.prepare(body)
                assert "the limit is 40" in info.value.message
                release.set()
        assert pipe.metrics.jobs["completed"] == 40 and pipe.metrics.requests["refused"] == 1


async def test_requests_cut_by_a_shutdown_get_a_503_that_says_so() -> None:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode=THREADS, engine_mode="thread"
    )
    async with Pipeline(config) as pipe:
        handle = await pipe.submit(
            {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True}
        )
        with anyio.fail_after(60):
            deltas = aiter(handle)  # held, not dropped: dropping the iterator cancels the request
            await anext(deltas)  # decoding has started
            pipe.stop_accepting()
            assert not await pipe.drain(0)
            with pytest.raises(ShuttingDown) as info:
                await handle.result()
    assert info.value.status == 503 and "shut down before this request finished" in info.value.message
    assert pipe.metrics.requests["failed"] == 1


async def test_a_sequence_that_may_outgrow_the_whole_kv_cache_is_a_400() -> None:
    # 8 blocks of 16: 128 tokens of cache under a max_model_len of 512
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=8, max_model_len=512, preparation_mode=THREADS, engine_mode="thread"
    )
    async with Pipeline(config) as pipe:
        body = {"messages": [{"role": "user", "content": "go"}], "ignore_eos": True}
        with pytest.raises(PromptTooLong) as info:
            await pipe.prepare({**body, "max_tokens": 200})
        assert info.value.field == "max_tokens" and "holds 128" in info.value.message
        handle = await pipe.submit({**body, "max_tokens": 20})
        with anyio.fail_after(60):
            assert len((await handle.result()).token_ids) == 20
