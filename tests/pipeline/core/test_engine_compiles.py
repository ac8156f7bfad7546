"""With the engine in its own process, a grammar is compiled once, there: the serving process sends the
spec at admission and waits for the engine's verdict, so a refused spec is the same 400 as in thread
mode before any decode work, and llguidance serves a new schema until the xgrammar compile its second
use started lands."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.remote_grammar import RemoteGrammarStage
from pipeline.errors import GrammarError, PipelineError, RequestCancelled
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler
from stages.grammar.types import FIRST_USE
from tests.images import data_url, encode, image_request, make_image
from tests.pipeline.core.test_grammar_stand_in import TEXT, guided, schema, served_by
from tests.released import assert_released


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def config(mode: str) -> PipelineConfig:
    return PipelineConfig(max_running_seqs=4, num_kv_blocks=256, max_model_len=2048, engine_mode=mode)


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    async with Pipeline(config("process")) as p:
        yield p


@pytest.fixture(scope="module")
async def thread_pipe() -> AsyncIterator[Pipeline]:
    async with Pipeline(config("thread")) as p:
        yield p


@pytest.fixture
def serving_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Compiles by backend in this (the serving) process; the engine process's are its own."""
    counts: Counter[str] = Counter()
    for cls in (XGrammarCompiler, LLGuidanceCompiler):
        real = cls.compile

        def counted(self: Any, spec: Any, _real: Any = real, _name: str = cls.name) -> Any:
            counts[_name] += 1
            return _real(self, spec)

        monkeypatch.setattr(cls, "compile", counted)
    yield counts


@pytest.mark.parametrize("preparation", ["text only", "distinct image"])
async def test_a_new_schema_compiles_once_in_the_engine_process(
    pipe: Pipeline, serving_compiles: Counter[str], preparation: str
) -> None:
    """llguidance serves the first two requests, xgrammar (compiled in the background from the second
    on) the third; each backend compiled the spec once, in the engine process, none in the serving
    process, and xgrammar only once the spec was used again."""
    grammar = pipe.preparation.grammar
    assert isinstance(grammar, RemoteGrammarStage)

    def body(seed: int) -> dict[str, Any]:
        return TEXT if preparation == "text only" else image_request([data_url(encode(make_image(seed=seed)))])

    new = schema(f"once_{preparation.replace(' ', '_')}")
    before = Counter(grammar.stats.backends)

    def compiled() -> Counter[str]:
        counts = Counter(grammar.stats.backends)
        counts.subtract(before)
        return +counts

    with anyio.fail_after(120):
        assert await served_by(pipe, body(31), new) == "llguidance"
        await grammar.wait_idle()
        assert compiled() == Counter({f"llguidance: {FIRST_USE}": 1})  # a one-off schema: no xgrammar
        assert await served_by(pipe, body(32), new) == "llguidance"  # its second use starts xgrammar's
        await grammar.wait_idle()
        assert await served_by(pipe, body(33), new) == "xgrammar"
    assert compiled() == Counter({f"llguidance: {FIRST_USE}": 1, "xgrammar: replaces the llguidance stand-in": 1})
    assert not serving_compiles
    await assert_released(pipe)


async def outcome(pipe: Pipeline, body: dict[str, Any]) -> tuple[Any, ...]:
    try:
        await (await pipe.submit(body)).result()
    except PipelineError as exc:
        return type(exc), exc.message, exc.field, exc.stage
    return ("served",)


BAD = {
    "a type no schema has": guided(TEXT, {"type": "object", "properties": {"a": {"type": "strin"}}}),
    "a schema without values": guided(TEXT, {"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]}),
    "over the enum bound": guided(TEXT, {"enum": list(range(20_000))}),
    "a malformed grammar": {**TEXT, "guided_grammar": "root ::= ((", "max_tokens": 8},
    "a malformed regex": {**TEXT, "guided_regex": "a((b", "max_tokens": 8},
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_refused_spec_is_the_same_400_in_both_engine_modes(
    pipe: Pipeline, thread_pipe: Pipeline, serving_compiles: Counter[str], case: str
) -> None:
    with anyio.fail_after(120):
        in_process = await outcome(pipe, BAD[case])
        assert not serving_compiles
        in_thread = await outcome(thread_pipe, BAD[case])
        # in thread mode a refused spec's other backend may still compile in this process: let it end
        # here, or the next case's count of this process's compiles would include it
        await thread_pipe.preparation.grammar.wait_idle()
    assert in_process == in_thread
    kind, _, field, stage = in_process
    # refused by the grammar stage, before the engine got the request
    assert issubclass(kind, GrammarError) and field and stage == "grammar"
    await assert_released(pipe)


async def test_a_request_cancelled_while_the_engine_compiles_leaves_nothing_behind() -> None:
    # xgrammar forced, and bounded strings: its compile takes about a second, in the engine process
    bounded = {"type": "object", "properties": {"note": {"type": "string", "minLength": 1, "maxLength": 40}}}
    body = guided(TEXT, bounded)
    async with Pipeline(dataclasses.replace(config("process"), grammar_backend="xgrammar")) as pipe:
        grammar = pipe.preparation.grammar
        assert isinstance(grammar, RemoteGrammarStage)
        with anyio.fail_after(120):
            handle = await pipe.submit(body)
            await anyio.wait_all_tasks_blocked()
            assert grammar.num_compiling == 1  # its verdict is awaited: the engine process compiles
            handle.cancel()
            with pytest.raises(RequestCancelled):
                await handle.result()
            await assert_released(pipe)  # waits for the engine's compile to end; nothing held anywhere
            assert grammar.stats.backends == Counter({"xgrammar: forced by config": 1})
            result = await (await pipe.submit(body)).result()  # compiled meanwhile: a cache hit there
        assert result.grammar_backend == "xgrammar"
        assert grammar.stats.backends == Counter({"xgrammar: forced by config": 1})
        await assert_released(pipe)


async def test_a_small_schema_is_checked_on_the_loop_and_a_large_one_in_a_worker_thread(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small JSON schema's precheck and answer check (under a millisecond) skip the hop to a worker
    thread; a large one's still take it. Both answer alike: served, or the same 400."""
    grammar = pipe.preparation.grammar
    assert isinstance(grammar, RemoteGrammarStage)
    loop_thread = threading.get_ident()
    where: list[bool] = []  # per check: on the loop's thread
    real = RemoteGrammarStage._check

    def recorded(self: RemoteGrammarStage, spec: Any) -> Any:
        where.append(threading.get_ident() == loop_thread)
        return real(self, spec)

    monkeypatch.setattr(RemoteGrammarStage, "_check", recorded)
    small = schema("checked_on_the_loop")
    # the same shape, past the inline bound by its long enum of kinds
    large = {**small, "properties": {**small["properties"], "kind": {"enum": [f"kind {i:05d}" for i in range(400)]}}}
    # no value holds them (a property other tests' refused schemas do not name: never a cached verdict)
    refused = {"type": "object", "properties": {"on_the_loop": {"not": {}}}, "required": ["on_the_loop"]}
    pad = {"enum": [f"p{i:05d}" for i in range(400)]}
    big_refused = {**refused, "properties": {**refused["properties"], "pad": pad}}
    with anyio.fail_after(120):
        assert await served_by(pipe, TEXT, small) in ("llguidance", "xgrammar")
        assert await served_by(pipe, TEXT, large) in ("llguidance", "xgrammar")
        small_refusal = await outcome(pipe, guided(TEXT, refused))
        large_refusal = await outcome(pipe, guided(TEXT, big_refused))
    assert where == [True, False, True, False]
    assert small_refusal[0] is large_refusal[0] and issubclass(small_refusal[0], GrammarError)
    assert small_refusal[2:] == large_refusal[2:] == ("response_format.json_schema.schema", "grammar")
    await assert_released(pipe)
