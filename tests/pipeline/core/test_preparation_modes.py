"""Preparation in worker processes and in threads gives the same requests the same answers; the
workers of process mode are up once the pipeline has started."""

from __future__ import annotations

import os

import anyio

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from tests.images import data_url, encode, image_request, make_image


async def _answers(mode: str) -> tuple[list[list[int]], list[int]]:
    config = PipelineConfig(
        max_running_seqs=4, num_kv_blocks=256, max_model_len=2048, preparation_mode=mode, engine_mode="thread"
    )
    images = [data_url(encode(make_image(w, h, seed=w))) for w, h in ((64, 48), (200, 120))]
    bodies = [
        image_request([images[0]], max_tokens=6, temperature=0),
        image_request(images, max_tokens=6, temperature=0),
        image_request([images[1]], max_tokens=6, temperature=0.9, seed=7),
    ]
    async with Pipeline(config) as pipe:
        pool = pipe.preparation.pool
        if mode == "process":  # the workers are up once the pipeline is: no request waits for one
            assert pool is not None and (pool.stats.starts, pool.stats.jobs) == (config.num_prep_workers(), 0)
            assert len(pool.pids()) == config.num_prep_workers()
            for pid in pool.pids():
                os.kill(pid, 0)  # a running process: raises ProcessLookupError otherwise
        else:
            assert pool is None
        with anyio.fail_after(120):
            results = [await (await pipe.submit(b)).result() for b in bodies]
        prompt_lengths = [r.prompt_tokens for r in results]
        return [r.choices[0].token_ids for r in results], prompt_lengths


async def test_both_modes_give_the_same_answers() -> None:
    assert await _answers("process") == await _answers("thread")
