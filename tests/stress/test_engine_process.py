"""The engine in its own process: killed or hung, it fails the requests it held with a 503
``engine_failed``, ``/health`` says so while a new one starts, and the next request is served."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.api.replies import error_reply
from pipeline.core import model_load
from pipeline.core import pipeline as pipeline_module
from pipeline.core.pipeline import Pipeline
from pipeline.engine import link as engine_link
from pipeline.engine.client import ProcessEngine
from pipeline.errors import EngineFailed
from stages import process_pool
from tests.released import assert_released
from tests.stages.test_process_pool import wait_gone

LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "ignore_eos": True}
# sampled without a seed: ignore_eos, or a stop token (about 7e-6 a step) may end an answer before the count
SHORT = {"messages": [{"role": "user", "content": "again"}], "max_tokens": 4, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    """One pipeline for the module; the hang deadline is short (the engine sends at least once a second)."""
    config = PipelineConfig(
        engine_mode="process",
        preparation_mode="thread",
        engine_step_timeout_s=3.0,
        max_running_seqs=4,
        num_kv_blocks=512,
        max_model_len=4096,
    )
    async with Pipeline(config) as p:
        yield p
    assert isinstance(p._engine, ProcessEngine) and p._engine.pid is None  # reaped at close


def _engine(pipe: Pipeline) -> ProcessEngine:
    engine = pipe.engine
    assert isinstance(engine, ProcessEngine)
    return engine


async def _fail_while_decoding(pipe: Pipeline, hurt: signal.Signals) -> EngineFailed:
    """Start two long requests, hurt the engine process once both decode; the first one's error."""
    engine = _engine(pipe)
    pid = engine.pid
    assert pid is not None
    handles = [await pipe.submit(LONG) for _ in range(2)]
    deltas = [aiter(h) for h in handles]  # held, not dropped: dropping the iterator cancels the request
    for d in deltas:
        await anext(d)  # decoding has started
    os.kill(pid, hurt)
    errors = []
    for handle in handles:
        with pytest.raises(EngineFailed) as info:
            await handle.result()
        errors.append(info.value)
    health = pipe.health()
    assert health["status"] == "engine restarting" and health["engine"] == "restarting"
    # submitted while the new engine loads its model: refused the same way, nothing held
    with pytest.raises(EngineFailed):
        await (await pipe.submit(SHORT)).result()
    await wait_gone(pid)
    return errors[0]


@pytest.mark.parametrize("hurt", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_a_failed_engine_process_fails_its_requests_and_a_new_one_serves(
    pipe: Pipeline, hurt: signal.Signals
) -> None:
    engine = _engine(pipe)
    failures = engine.num_failures
    with anyio.fail_after(240):
        error = await _fail_while_decoding(pipe, hurt)
        assert error.status == 503 and error.code == "engine_failed" and error.stage == "engine"
        assert ("made no progress" in error.message) == (hurt == signal.SIGSTOP)
        reply = error_reply(error)
        assert reply.status == 503 and int(reply.headers["Retry-After"]) >= 1
        await engine.wait_started()
        assert pipe.health()["status"] == "ok" and engine.num_failures == failures + 1
        # a text request, and a guided one: the new engine compiles its grammar again
        assert (await (await pipe.submit(SHORT)).result()).completion_tokens == 4
        guided = dict(SHORT, max_tokens=32, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
        assert (await (await pipe.submit(guided)).result()).finish_reason in ("stop", "length")
        await assert_released(pipe)


@pytest.mark.parametrize("hurt", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_a_failed_engine_process_fails_the_verdicts_awaited(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, hurt: signal.Signals
) -> None:
    """An engine process that dies or freezes while it holds no request, only a grammar's verdict
    awaited, fails that request with ``engine_failed`` (a frozen one at the hang deadline)."""
    engine = _engine(pipe)
    pid, failures = engine.pid, engine.num_failures
    assert pid is not None
    ask = engine.ask

    def hurt_then_ask(*command: object) -> object:
        if command[0] == "grammar":
            os.kill(pid, hurt)  # before it reads the spec: its verdict never comes
        return ask(*command)

    monkeypatch.setattr(engine, "ask", hurt_then_ask)
    new = {"type": "object", "properties": {f"unanswered_{hurt.name}": {"type": "integer"}}}
    guided = dict(SHORT, max_tokens=32, response_format={"type": "json_schema", "json_schema": {"schema": new}})
    with anyio.fail_after(120):
        with pytest.raises(EngineFailed) as info:
            await (await pipe.submit(guided)).result()
        monkeypatch.undo()
        error = info.value
        assert error.status == 503 and error.code == "engine_failed" and error.stage == "engine"
        assert ("made no progress" in error.message) == (hurt == signal.SIGSTOP)
        await wait_gone(pid)
        await engine.wait_started()
        assert engine.num_failures == failures + 1
        # the verdict was not kept: the new engine process compiles the spec
        assert (await (await pipe.submit(guided)).result()).finish_reason in ("stop", "length")
        await assert_released(pipe)


async def test_adds_aborted_at_once_do_not_fill_the_engine_queue(pipe: Pipeline) -> None:
    """Adds the engine reads together with their aborts give it no step to report; it still says it
    read them, so the serving process's bound on unread commands does not fill up for good."""
    engine = _engine(pipe)
    inputs = [await pipe.prepare(dict(SHORT, max_tokens=64)) for _ in range(engine.queue_size // 2)]
    with anyio.fail_after(60):
        for inp in inputs:
            engine.submit(inp)
            engine.abort(inp.request_id)  # written behind its add, read with it
        while True:  # the engine says it read them all: the ack has no event of its own to wait on
            if engine._num_sent == engine._num_acked:
                break
            await anyio.sleep(0.01)  # noqa: sleep-ok: polls the client's count of acked commands
        assert (await (await pipe.submit(SHORT)).result()).completion_tokens == 4
        await assert_released(pipe)


async def test_a_request_dropped_mid_answer_leaves_the_figures_idle(pipe: Pipeline) -> None:
    """A client gone mid-answer: the engine reads the abort and has no step left to report, and
    still sends its figures, so /health and /metrics say it is idle (not the last step's sequence)."""
    engine = _engine(pipe)
    handle = await pipe.submit(LONG)
    deltas = aiter(handle)
    with anyio.fail_after(60):
        await anext(deltas)  # decoding has started: the figures say so
        assert pipe.decoding()["running_seqs"] == 1
        await deltas.aclose()  # the consumer goes away: the request is cancelled, the engine told
        await handle.wait_done()
        while True:  # the engine has read the abort: the ack has no event of its own to wait on
            if engine._num_sent == engine._num_acked:
                break
            await anyio.sleep(0.01)  # noqa: sleep-ok: polls the client's count of acked commands
        decoding = pipe.decoding()
        assert (decoding["running_seqs"], decoding["waiting_seqs"], decoding["kv_blocks_used"]) == (0, 0, 0)
        await assert_released(pipe)


@dataclass
class Started:
    """The engine processes and preparation workers started while a test runs."""

    engines: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def all_reaped(self) -> bool:
        return all(p.returncode is not None for p in self.engines + self.workers)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    record = Started()
    spawn_engine, launch_worker = engine_link._spawn, process_pool._launch

    def engine(fd: int, inherited: tuple[int, ...]) -> subprocess.Popen[bytes]:
        record.engines.append(spawn_engine(fd, inherited))
        return record.engines[-1]

    def worker(fd: int) -> subprocess.Popen[bytes]:
        record.workers.append(launch_worker(fd))
        return record.workers[-1]

    monkeypatch.setattr(engine_link, "_spawn", engine)
    monkeypatch.setattr(process_pool, "_launch", worker)
    return record


async def test_a_grammar_setup_that_fails_is_reported_as_the_start_failure(started: Started) -> None:
    """The engine process builds its grammar stage while it starts (beside the serving process's own
    loading): if that fails, the pipeline's start fails with the reason (its ``Fatal``, not a bare exit
    code nor an exception group), and the preparation workers started meanwhile are stopped."""
    config = PipelineConfig(engine_mode="process", num_kv_blocks=64, max_model_len=1024)
    # past the config's own check (the serving process never builds this stage): only the engine's refuses it
    object.__setattr__(config, "grammar_backend", "neither")
    pipe = Pipeline(config)
    with anyio.fail_after(120), pytest.raises(EngineFailed) as info:
        async with pipe:
            pass
    assert info.value.code == "engine_failed"
    assert "ValueError: backend must be auto, xgrammar or llguidance, got 'neither'" in info.value.message
    assert pipe.state.value == "stopped"
    assert len(started.engines) == 1 and len(started.workers) == config.num_prep_workers()
    assert started.all_reaped()  # the engine process and the preparation workers: stopped and reaped


async def test_a_serving_load_that_fails_kills_the_engine_process_starting_beside_it(
    started: Started, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving process's loading fails while the engine process loads its model: the start raises
    that failure as it is, and the engine process is killed and reaped (no orphan)."""

    def broken_grammar_stage(*args: object) -> None:
        raise RuntimeError("the grammar stage could not be built")

    monkeypatch.setattr(model_load, "build_remote_grammar_stage", broken_grammar_stage)
    pipe = Pipeline(PipelineConfig(engine_mode="process", num_kv_blocks=64, max_model_len=1024))
    with anyio.fail_after(120), pytest.raises(RuntimeError, match="grammar stage could not be built"):
        async with pipe:
            pass
    assert pipe.state.value == "stopped"
    # the engine process had started: the serving side loads in a thread meanwhile
    assert len(started.engines) == 1
    assert started.all_reaped()


async def test_an_engine_process_lost_while_the_pipeline_still_loads_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine process may be ready, and die, before the serving process has loaded: the pipeline
    then starts with a new one loading, not with an engine that stays lost."""
    lost = threading.Event()

    def load_after_a_loss(opened: model_load.OpenedModel, config: PipelineConfig, **kwargs: Any) -> Any:
        engine = opened.engine_process
        assert engine is not None
        noticed = engine._on_lost

        def on_lost(link: engine_link.EngineLink) -> None:
            noticed(link)
            lost.set()

        engine._on_lost = on_lost  # type: ignore[method-assign]
        anyio.from_thread.run(engine.wait_started)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        assert lost.wait(60) and engine.status == "restarting"
        return model_load.load_model(opened, config, **kwargs)

    monkeypatch.setattr(pipeline_module, "load_model", load_after_a_loss)
    config = PipelineConfig(engine_mode="process", preparation_mode="thread", num_kv_blocks=64, max_model_len=1024)
    with anyio.fail_after(120):
        async with Pipeline(config) as pipe:
            assert lost.is_set()
            await _engine(pipe).wait_started()  # a new engine process, started once the pipeline could
            assert (await (await pipe.submit(SHORT)).result()).completion_tokens == 4
            assert _engine(pipe).num_failures == 1
