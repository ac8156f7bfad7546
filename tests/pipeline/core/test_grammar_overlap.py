"""A request whose preparation ends before its grammar compile goes to the engine at once: its prefill
runs beside the compile and its first token waits for it. A refused spec is still the 400 naming its
field, no token leaves before the verdict, and a refused or cancelled request leaves nothing behind
(no sequence, no KV block, no compile), in both engine modes."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.remote_grammar import RemoteGrammarStage
from pipeline.errors import GrammarError, RequestCancelled
from stages.grammar import GrammarStage
from tests.grammars import GatedCompiler
from tests.pipeline.core.test_grammar_stand_in import TEXT, guided, schema
from tests.released import assert_released

# refused by the compile itself (no value has 3 items and at most 1), not by a check before it
IMPOSSIBLE = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def config(mode: str) -> PipelineConfig:
    return PipelineConfig(max_running_seqs=4, num_kv_blocks=256, max_model_len=2048, engine_mode=mode)


@pytest.fixture(scope="module", params=["thread", "process"])
async def pipe(request: pytest.FixtureRequest) -> AsyncIterator[Pipeline]:
    async with Pipeline(config(request.param)) as p:
        yield p


@dataclass
class Submitted:
    """``event`` is set once a request reaches the engine; ``pending``: whether each went before its verdict."""

    event: anyio.Event = field(default_factory=anyio.Event)
    pending: list[bool] = field(default_factory=list)

    async def wait(self) -> None:
        await self.event.wait()


@pytest.fixture
def submitted(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Submitted:
    event = Submitted()
    real = pipe.engine.submit

    def submit(inp: Any) -> Any:
        stream = real(inp)
        event.pending.append(inp.grammar_pending)
        event.event.set()
        return stream

    monkeypatch.setattr(pipe.engine, "submit", submit)
    return event


@pytest.fixture
def verdict_gate(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Closed: no compile's verdict reaches the request until the test opens it (thread mode: both
    compilers wait for it; process mode: the engine process compiles, its verdict waits here)."""
    gate = threading.Event()
    grammar = pipe.preparation.grammar
    if isinstance(grammar, GrammarStage):
        real = dict(grammar.compilers)
        for name, compiler in real.items():
            grammar.compilers[name] = GatedCompiler(compiler, gate)
    else:
        assert isinstance(grammar, RemoteGrammarStage)
        compile_remote = grammar.compile

        async def gated(spec: Any, **kwargs: Any) -> Any:
            try:
                return await compile_remote(spec, **kwargs)
            finally:
                await anyio.to_thread.run_sync(gate.wait, 20)

        monkeypatch.setattr(grammar, "compile", gated)
    yield gate
    gate.set()
    if isinstance(grammar, GrammarStage):
        grammar.compilers.update(real)


async def test_a_refused_spec_whose_request_went_to_the_engine_is_a_400_with_nothing_left(
    pipe: Pipeline, submitted: Submitted, verdict_gate: threading.Event
) -> None:
    with anyio.fail_after(120):
        handle = await pipe.submit(guided(TEXT, IMPOSSIBLE))
        await submitted.wait()  # in the engine while its compile (or its verdict) is held back
        assert submitted.pending == [True]
        verdict_gate.set()
        deltas = []
        with pytest.raises(GrammarError) as info:
            async for delta in handle:
                deltas.append(delta)
    assert not deltas  # not a token left before the verdict
    assert info.type is GrammarError and info.value.status == 400
    assert info.value.field == "response_format.json_schema.schema" and info.value.stage == "grammar"
    await assert_released(pipe)


async def test_a_request_cancelled_while_its_grammar_compiles_in_the_engine_leaves_nothing(
    pipe: Pipeline, submitted: Submitted, verdict_gate: threading.Event
) -> None:
    with anyio.fail_after(120):
        handle = await pipe.submit(guided(TEXT, schema(f"cancelled_{pipe.config.engine_mode}")))
        await submitted.wait()
        assert submitted.pending == [True]
        handle.cancel()
        with pytest.raises(RequestCancelled):
            await handle.result()
        verdict_gate.set()
        await assert_released(pipe)


async def test_a_request_sent_before_its_verdict_is_served_under_its_constraint(
    pipe: Pipeline, submitted: Submitted, verdict_gate: threading.Event
) -> None:
    body = {**guided(TEXT, schema(f"served_{pipe.config.engine_mode}")), "n": 2}
    with anyio.fail_after(120):
        handle = await pipe.submit(body)
        await submitted.wait()
        assert submitted.pending == [True]
        verdict_gate.set()
        result = await handle.result()
    assert [c.finish_reason for c in result.choices] == ["stop", "stop"] and result.grammar_backend == "llguidance"
    await assert_released(pipe)
