"""Faults fail only the requests they touch, with a clear error; the rest complete."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import pytest
from aiohttp import web

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import (
    DeadlineExceeded,
    EngineError,
    GrammarError,
    ImageDecodeError,
    ImageFetchError,
    PayloadTooLarge,
    PipelineError,
    WorkerCrashed,
)
from tests.images import TIFF_FLOAT, data_url, encode, image_request, make_image, tiff_with_strip_offsets
from tests.released import assert_released
from tests.servers import serving

PNG = encode(make_image(32, 32, seed=3))


@dataclass
class Faulty:
    base: str
    release: anyio.Event


@pytest.fixture
async def faulty_images() -> AsyncIterator[Faulty]:
    """An image server with one well-behaved route and one route per fault."""
    release = anyio.Event()

    async def good(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def hang(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(body=PNG, content_type="image/png")

    async def reset(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()  # RST instead of an answer
        await release.wait()
        return web.Response()

    async def html(_: web.Request) -> web.Response:
        return web.Response(text="<html>not an image</html>", content_type="text/html")

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        chunk = b"\0" * 65536
        while True:
            await response.write(chunk)

    app = web.Application()
    for name, handler in (("good", good), ("hang", hang), ("reset", reset), ("html", html), ("endless", endless)):
        app.router.add_get(f"/{name}.png", handler)
    async with serving(app, shutdown_timeout=0.1) as base:
        try:
            yield Faulty(base, release)
        finally:
            release.set()  # let the hanging handlers return before the server stops


def _config(**changes: Any) -> PipelineConfig:
    config = PipelineConfig(
        allow_private_networks=True,
        fetch_total_timeout_s=0.5,
        max_image_bytes=1024 * 1024,
        max_running_seqs=8,
        num_kv_blocks=512,
        max_model_len=4096,
        engine_mode="thread",
    )
    return replace(config, **changes)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    """Preparation in worker processes (the default), each running the real job except that an
    image 48 pixels wide kills its worker, as a codec crash would. One pipeline for the module:
    tests read counters as differences."""
    async with Pipeline(_config(prep_worker_task="tests.stages.pool_tasks:crash_on_width_48")) as p:
        yield p


@pytest.fixture(scope="module")
async def thread_pipe() -> AsyncIterator[Pipeline]:
    """Preparation in this process's threads, where a test can patch the vision encoder."""
    async with Pipeline(_config(preparation_mode="thread")) as p:
        yield p


async def _outcomes(pipe: Pipeline, bodies: list[dict[str, Any]]) -> list[Any]:
    handles = [await pipe.submit(b) for b in bodies]
    results: list[Any] = []
    for handle in handles:
        try:
            results.append(await handle.result())
        except PipelineError as exc:
            results.append(exc)
    return results


async def test_image_server_faults_fail_only_their_requests(pipe: Pipeline, faulty_images: Faulty) -> None:
    base = faulty_images.base
    names = ["hang", "good", "reset", "html", "endless", "good"]
    # sampled without a seed: ignore_eos, or a stop token (about 7e-6 a step) may end an answer before the count
    bodies = [image_request([f"{base}/{n}.png"], max_tokens=3, ignore_eos=True) for n in names]
    with anyio.fail_after(30):
        results = await _outcomes(pipe, bodies)
    expected = [DeadlineExceeded, None, ImageFetchError, ImageFetchError, PayloadTooLarge, None]
    for name, result, kind in zip(names, results, expected, strict=True):
        if kind is None:
            assert result.completion_tokens == 3, name
        else:
            assert isinstance(result, kind), (name, result)
            assert result.field == "messages[0].content[1].image_url.url" and result.stage == "fetch"
            assert "/" + name + ".png" in result.message
    assert [r.status for r in results if isinstance(r, PipelineError)] == [504, 400, 400, 413]
    await assert_released(pipe)


async def test_vision_encoder_failure_fails_only_that_image(
    thread_pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = thread_pipe
    assert pipe.encoder is not None
    real = pipe.encoder.encode

    def flaky(images: list[Any]) -> list[Any]:
        if any(im.num_cols == 3 for im in images):  # the 48-pixel-wide image
            raise RuntimeError("simulated encoder fault")
        return real(images)

    monkeypatch.setattr(pipe.encoder, "encode", flaky)
    widths = [32, 48, 64]
    bodies = [
        image_request([data_url(encode(make_image(w, 32, seed=w)))], max_tokens=2, ignore_eos=True) for w in widths
    ]
    with anyio.fail_after(30):
        results = await _outcomes(pipe, bodies)
    assert results[0].completion_tokens == 2 and results[2].completion_tokens == 2
    assert isinstance(results[1], PipelineError) and results[1].status == 500
    assert "simulated encoder fault" in results[1].message and results[1].stage == "vision"
    # logged once, with its traceback, under the request id the client gets back
    logged = [r for r in caplog.records if r.levelname == "ERROR" and results[1].request_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "simulated encoder fault" in logging.Formatter().formatException(logged[0].exc_info)


class SlowForOne:
    """The real xgrammar compiler, but one grammar compiles only when ``gate`` opens."""

    def __init__(self, real: Any, gate: threading.Event) -> None:
        self.real, self.gate, self.name = real, gate, real.name

    def compile(self, spec: Any) -> Any:
        if spec.kind == "grammar" and "slow" in spec.value:
            self.gate.wait(20)
        return self.real.compile(spec)


async def test_grammar_failure_and_deadline(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    grammar = pipe.preparation.grammar
    monkeypatch.setitem(grammar.compilers, "xgrammar", SlowForOne(grammar.compilers["xgrammar"], gate))
    monkeypatch.setattr(grammar, "timeout_s", 0.2)
    text = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    # look-ahead: only xgrammar compiles it, so no fallback
    slow = {**text, "grammar": 'root ::= s [a-z]*\ns ::= "slow" (= [a-z])'}
    bodies = [slow, {**text, "regex": "(?<=a)b"}, {**text, "regex": "[ab]+"}, {**text, "ignore_eos": True}]
    with anyio.fail_after(30):
        results = await _outcomes(pipe, bodies)
        gate.set()
        await pipe.wait_idle()
    assert isinstance(results[0], DeadlineExceeded) and results[0].status == 504 and results[0].field == "grammar"
    assert isinstance(results[1], GrammarError) and results[1].status == 400 and results[1].field == "regex"
    assert results[2].completion_tokens >= 1 and set(results[2].text) <= {"a", "b"}
    assert results[3].completion_tokens == 2
    await assert_released(pipe)


async def test_engine_step_raising_for_one_sequence(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = pipe.engine.engine.runner
    poison = pipe.checkpoint.tokenizer.encode("POISONED", add_special_tokens=False)
    real, real_batch = runner.prefill, runner.prefill_batch

    def poisoned(token_ids: list[int]) -> bool:
        return any(token_ids[i : i + len(poison)] == poison for i in range(len(token_ids)))

    def prefill(token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        if poisoned(token_ids):
            raise RuntimeError("simulated device fault")
        return real(token_ids, *args, **kwargs)

    def prefill_batch(chunks: list[Any]) -> Any:  # batched with its neighbours: they run apart after it
        if any(poisoned(c.token_ids) for c in chunks):
            raise RuntimeError("simulated device fault")
        return real_batch(chunks)

    monkeypatch.setattr(runner, "prefill", prefill)
    monkeypatch.setattr(runner, "prefill_batch", prefill_batch)
    bodies = [
        {"messages": [{"role": "user", "content": t}], "max_tokens": 4, "ignore_eos": True}
        for t in ("fine", "POISONED", "also")
    ]
    with anyio.fail_after(30):
        results = await _outcomes(pipe, bodies)
    assert isinstance(results[1], EngineError) and "simulated device fault" in results[1].message
    logged = [r for r in caplog.records if r.levelname == "ERROR" and results[1].request_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert results[0].completion_tokens == 4 and results[2].completion_tokens == 4
    await assert_released(pipe)


async def test_a_worker_crash_fails_only_that_image_and_the_pool_recovers(
    pipe: Pipeline, caplog: pytest.LogCaptureFixture
) -> None:
    pool = pipe.preparation.pool
    assert pool is not None
    crashes = pool.stats.crashes
    widths = [32, 48, 64]

    def body(width: int, seed: int) -> dict[str, Any]:
        return image_request([data_url(encode(make_image(width, 32, seed=seed)))], max_tokens=2, ignore_eos=True)

    with anyio.fail_after(120):
        results = await _outcomes(pipe, [body(w, w) for w in widths])
        jobs = pool.stats.jobs
        again = await _outcomes(pipe, [body(32, 1), body(64, 1)])  # new images: no encoder cache hit
    assert pool.stats.jobs == jobs + 2
    await assert_released(pipe)
    assert pool.stats.crashes == crashes + 1
    assert [r.completion_tokens for r in (results[0], results[2], *again)] == [2, 2, 2, 2]
    assert isinstance(results[1], WorkerCrashed) and results[1].status == 500
    assert results[1].stage == "decode" and results[1].field == "messages[0].content[1].image_url.url"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    # the process's death once (with its pid), the request's failure once (with its id)
    assert len([m for m in errors if "holding an image" in m]) == 1
    assert len([m for m in errors if results[1].request_id in m]) == 1


@pytest.mark.parametrize("mode", ["process", "thread"])
async def test_a_crafted_tiff_by_http_url_is_a_400_naming_the_image(
    pipe: Pipeline, thread_pipe: Pipeline, mode: str
) -> None:
    # its StripOffsets tag a FLOAT: Pillow's TypeError was a 500 "image preparation failed"
    async def tiff(_: web.Request) -> web.Response:
        return web.Response(body=tiff_with_strip_offsets(TIFF_FLOAT), content_type="image/tiff")

    app = web.Application()
    app.router.add_get("/strip.tiff", tiff)
    served = pipe if mode == "process" else thread_pipe
    async with serving(app) as base:
        with anyio.fail_after(30):
            (result,) = await _outcomes(served, [image_request([f"{base}/strip.tiff"], max_tokens=1)])
    assert isinstance(result, ImageDecodeError) and result.status == 400, result
    assert result.field == "messages[0].content[1].image_url.url" and result.stage == "decode"
    await assert_released(served)
