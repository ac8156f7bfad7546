"""The vision encoder in the engine process (``vision_encoder_placement="engine"``): the answers are
those of the encoder in preparation; an image the engine process holds crosses once; the serving
process's index and what the engine process holds agree after evictions and after the engine
process is killed (its successor holds nothing, and the pixels cross again); nothing is left behind."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.client import ProcessEngine
from pipeline.engine.images import ImageIndex
from pipeline.errors import EngineFailed
from pipeline.observability.trace import Tracer
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from tests.images import data_url, encode, image_request, make_image
from tests.pipeline.core.test_engine_arena_process import image_answers, image_bodies
from tests.released import assert_released
from tests.stages.test_process_pool import wait_gone

# preparation in threads here (the served families' test prepares in worker processes, which then
# return pixels): one engine process serves the module's tests, in order
CONFIG = {"max_running_seqs": 4, "num_kv_blocks": 512, "max_model_len": 4096, "preparation_mode": "thread"}
TRACER = Tracer()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(engine_mode="process", vision_encoder_placement="engine", **CONFIG)
    async with Pipeline(config, tracer=TRACER) as p:
        yield p


@pytest.fixture(scope="module")
async def expected() -> list[list[list[int]]]:
    """The answers with the encoder in preparation and the engine on a thread."""
    async with Pipeline(PipelineConfig(engine_mode="thread", **CONFIG)) as p:
        return await image_answers(p)


def _engine(pipe: Pipeline) -> tuple[ProcessEngine, ImageIndex]:
    engine = pipe.engine
    assert isinstance(engine, ProcessEngine) and engine.images is not None
    return engine, engine.images


COUNTING = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 300, "ignore_eos": True}


async def _held(engine: ProcessEngine) -> int:
    """Images the engine process holds, as it says after handling everything sent so far."""
    await engine.barrier()
    return engine._held["images_held"]


def test_auto_places_the_encoder_in_the_engine_process_only_on_a_gpu() -> None:
    assert not PipelineConfig(engine_mode="process", device="cpu").encoder_in_engine()
    assert PipelineConfig(engine_mode="process", device="cuda").encoder_in_engine()
    assert not PipelineConfig(engine_mode="thread", device="cuda").encoder_in_engine()
    with pytest.raises(ValueError, match="needs engine_mode"):
        PipelineConfig(engine_mode="thread", vision_encoder_placement="engine")
    with pytest.raises(ValueError, match="vision_encoder_placement"):
        PipelineConfig(vision_encoder_placement="gpu")


async def test_answers_are_the_encoder_in_preparations_and_a_held_image_crosses_once(
    pipe: Pipeline, expected: list[list[list[int]]]
) -> None:
    engine, index = _engine(pipe)
    assert pipe.encoder is None  # no encoder weights in the serving process
    with anyio.fail_after(240):
        sent, adds = index.num_sent, engine.num_arena_adds
        assert await image_answers(pipe) == expected
        assert index.num_sent - sent == 2  # two distinct images: each crosses once
        assert await _held(engine) == len(index) >= 2
        sent = index.num_sent
        assert await image_answers(pipe) == expected  # again: the engine process holds both
        # only adds with pixels take an arena region: those of the first round that sent an image
        assert index.num_sent == sent and engine.num_arena_adds - adds == 2 and engine.num_inline_adds == 0
        stats = pipe.cache_stats()  # the encoder cache is the engine process's; the pixels are kept here
        assert stats["encoder"].entries == len(index) and stats["encoder"].hits >= 4
        assert stats["image_pixels"].entries == 2
        assert b'pipeline_cache_hits_total{cache="image_pixels"}' in pipe.render_metrics()
        await assert_released(pipe)


async def test_a_bound_of_one_image_evicts_and_the_engine_holds_what_the_index_says(
    expected: list[list[list[int]]],
) -> None:
    # the embeddings of either image fit (96x64: 24 rows of 64 float32s, 6 KiB; 40x80: 15 rows), not both
    config = PipelineConfig(
        engine_mode="process", vision_encoder_placement="engine", encoder_cache_bytes=8192, **CONFIG
    )
    with anyio.fail_after(240):
        async with Pipeline(config) as p:
            engine, index = _engine(p)
            assert await image_answers(p) == expected
            assert index.stats.evictions >= 1
            assert await _held(engine) == len(index) == 1
            assert await image_answers(p) == expected
            assert await _held(engine) == len(index) == 1
            await assert_released(p)


async def test_a_killed_engine_process_holds_nothing_and_the_pixels_cross_again(
    pipe: Pipeline, expected: list[list[list[int]]]
) -> None:
    engine, index = _engine(pipe)
    with anyio.fail_after(240):
        await image_answers(pipe)
        assert len(index) >= 2
        pid = engine.pid
        assert pid is not None
        body = image_request([data_url(encode(make_image(seed=13)))], max_tokens=4000, ignore_eos=True)
        handle = await pipe.submit(body)
        killed = False
        with pytest.raises(EngineFailed):  # the request it held fails: the engine process is known lost
            async for _delta in handle:
                if not killed:  # while it decodes
                    os.kill(pid, signal.SIGKILL)
                    killed = True
        await wait_gone(pid)
        await engine.wait_started()
        assert len(index) == 0 and await _held(engine) == 0
        sent = index.num_sent
        assert await image_answers(pipe) == expected
        assert index.num_sent == sent + 2 and await _held(engine) == len(index) == 2
        await assert_released(pipe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_on_a_gpu_auto_encodes_in_the_engine_process_as_the_serving_process_did() -> None:
    """Greedy answers with the encoder beside the engine (auto on a GPU) are those with the encoder
    on the device in the serving process."""
    base = {**CONFIG, "device": "cuda", "engine_mode": "process", "preparation_mode": "thread"}
    greedy = image_bodies()[:2]
    answers = []
    with anyio.fail_after(300):
        for placement in ("auto", "preparation"):
            async with Pipeline(PipelineConfig(**base, vision_encoder_placement=placement)) as p:  # type: ignore[arg-type]
                assert (p.encoder is None) == (placement == "auto")
                results = [await (await p.submit(body)).result() for body in greedy]
                answers.append([list(r.choices[0].token_ids) for r in results])
                await assert_released(p)
    assert answers[0] == answers[1]


async def test_while_sequences_decode_one_adds_images_are_encoded_between_two_steps(
    pipe: Pipeline, tmp_path: Path
) -> None:
    """A burst of image adds reaches the engine process while a request decodes: their encodes are
    spread over its steps (never two adds' encodes back to back), one of them aborted while queued
    is encoded all the same but never added, and the engine holds what the index says."""
    engine, index = _engine(pipe)
    since = TRACER.now()
    with anyio.fail_after(240):
        urls = [data_url(encode(make_image(48, 32, seed=60 + i))) for i in range(4)]
        inputs = [await pipe.prepare(image_request([url], max_tokens=4)) for url in urls]
        long = await pipe.submit(COUNTING)
        stream = long.__aiter__()
        await stream.__anext__()  # it decodes
        held = len(index)
        streams = [engine.submit(inp) for inp in inputs]  # one after the other, no turn of the loop between
        engine.abort(inputs[1].request_id)
        for i, out in enumerate(streams):
            if i != 1:
                async for _output in out:
                    pass
        long.cancel()
        await assert_released(pipe)
        assert await _held(engine) == len(index) == held + 4
    TRACER.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    after = (since - TRACER._t0) * 1e6
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and e["cat"] in ("step", "engine") and e["ts"] >= after),
        key=lambda e: e["ts"],
    )
    names = [e["name"] for e in spans if e["cat"] == "step" or e["name"] == "vision encode"]
    encodes = [i for i, name in enumerate(names) if name == "vision encode"]
    assert len(encodes) == 4  # the aborted add's image too
    assert all(later - earlier > 1 for earlier, later in zip(encodes, encodes[1:], strict=False))


async def test_an_image_that_fails_to_encode_fails_its_request_and_is_not_counted_held(pipe: Pipeline) -> None:
    """An add whose image does not encode (its pixels broken), read by the engine process together
    with later commands while a request decodes: its request fails, the index forgets the image it
    had the engine keep (the failure names the add, not the commands read since), and the next
    request with that image is served."""
    engine, index = _engine(pipe)
    with anyio.fail_after(240):
        body = image_request([data_url(encode(make_image(48, 32, seed=5)))], max_tokens=2, temperature=0)
        good = await pipe.prepare(body)
        digest = good.image_keys[0].content_hash
        broken = dataclasses.replace(good, request_id="broken", image_pixels=[torch.zeros(1, 2, 3)])
        text = [EngineInput(f"t{i}", [1, 2, 3], -1, None, SamplingParams(max_tokens=2)) for i in range(2)]
        long = await pipe.submit(COUNTING)
        stream = long.__aiter__()
        await stream.__anext__()  # it decodes
        streams = [engine.submit(inp) for inp in [broken, *text]]  # one turn of the loop: read together
        errors = [out.error async for out in streams[0]]
        assert errors and all(e is not None and "could not encode" in e for e in errors)
        for out in streams[1:]:
            async for _output in out:
                pass
        long.cancel()
        assert await _held(engine) == len(index) and digest not in index
        result = await (await pipe.submit(body)).result()
        assert result.completion_tokens == 2 and digest in index and await _held(engine) == len(index)
        await assert_released(pipe)


async def test_adds_whose_images_wait_for_the_encoder_count_against_the_engine_queue(pipe: Pipeline) -> None:
    """With room for one unread command, a burst of image requests beside a decode is served whole:
    the count of adds waiting for the encoder reaches the serving process with every change of it,
    so room comes back as they are encoded (a stale count would leave the waiters there for good)."""
    engine, _ = _engine(pipe)
    engine.queue_size = 1
    try:
        with anyio.fail_after(240):
            long = await pipe.submit(COUNTING)
            stream = long.__aiter__()
            await stream.__anext__()  # it decodes
            urls = [data_url(encode(make_image(48, 32, seed=70 + i))) for i in range(5)]
            handles = [await pipe.submit(image_request([url], max_tokens=3, temperature=0)) for url in urls]
            assert [(await h.result()).completion_tokens for h in handles] == [3] * 5
            long.cancel()
            await assert_released(pipe)
    finally:
        engine.queue_size = PipelineConfig().engine_queue_size
