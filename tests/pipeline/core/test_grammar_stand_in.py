"""A request does not wait for an xgrammar compile, whatever its preparation: llguidance serves a new
spec's first use and starts no xgrammar compile; its second use starts one in the background, for the
requests after it."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import RequestCancelled
from pipeline.types import GrammarSpec
from stages.grammar import CompiledConstraint
from stages.grammar.types import FIRST_USE
from tests.grammars import GatedCompiler
from tests.images import data_url, encode, image_request, make_image
from tests.released import assert_released


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(max_running_seqs=4, num_kv_blocks=256, max_model_len=2048, engine_mode="thread")
    async with Pipeline(config) as p:
        yield p


@pytest.fixture
def gate(pipe: Pipeline) -> AsyncIterator[threading.Event]:
    """Closed: every xgrammar compile of ``pipe`` waits (at most 20 s) until the test opens it."""
    grammar = pipe.preparation.grammar
    real = grammar.compilers["xgrammar"]
    gate = threading.Event()
    grammar.compilers["xgrammar"] = GatedCompiler(real, gate)
    yield gate
    gate.set()
    grammar.compilers["xgrammar"] = real


def schema(name: str) -> dict[str, Any]:
    """A schema new to the pipeline (the dispatch table gives it to xgrammar)."""
    return {
        "type": "object",
        "properties": {name: {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["a", "b"]}},
        "required": [name, "kind"],
        "additionalProperties": False,
    }


def guided(body: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    return {**body, "response_format": fmt, "max_tokens": 48, "temperature": 0}


TEXT = {"messages": [{"role": "user", "content": "A number."}]}


async def served_by(pipe: Pipeline, body: dict[str, Any], schema: dict[str, Any]) -> str | None:
    result = await (await pipe.submit(guided(body, schema))).result()
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)  # the answer holds, whichever backend served
    return result.grammar_backend


def spec_of(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", schema, strict=True, field="response_format.json_schema.schema")


def cached(pipe: Pipeline, schema: dict[str, Any]) -> CompiledConstraint:
    entry = pipe.preparation.grammar.lookup(spec_of(schema))
    assert isinstance(entry, CompiledConstraint)
    return entry


def image_body(seed: int) -> dict[str, Any]:
    return image_request([data_url(encode(make_image(seed=seed)))])


@pytest.mark.parametrize("preparation", ["text only", "cached image", "distinct image"])
async def test_a_new_schema_is_served_by_llguidance_until_its_second_use_compiled_xgrammar(
    pipe: Pipeline, gate: threading.Event, preparation: str
) -> None:
    """The first use starts no xgrammar compile; the second, still served by llguidance, starts it (it
    waits for the gate); the requests after it get xgrammar's grammar. Whatever the preparation,
    nobody waits for that compile: it runs at the lowest CPU priority."""
    grammar = pipe.preparation.grammar
    xgrammar = grammar.compilers["xgrammar"]
    assert isinstance(xgrammar, GatedCompiler)
    new = schema(preparation.replace(" ", "_"))
    key = spec_of(new).key

    def body(seed: int) -> dict[str, Any]:
        return TEXT if preparation == "text only" else image_body(21 if preparation == "cached image" else seed)

    with anyio.fail_after(60):
        if preparation == "cached image":
            await (await pipe.submit({**body(0), "max_tokens": 1})).result()  # its embeddings now cached
        assert await served_by(pipe, body(22), new) == "llguidance"
        stand_in = cached(pipe, new)
        assert stand_in.is_stand_in and stand_in.reason == FIRST_USE
        await anyio.wait_all_tasks_blocked()
        assert grammar.num_compiling == 0 and xgrammar.calls[key] == 0  # a one-off schema: nothing more
        assert await served_by(pipe, body(23), new) == "llguidance"  # the second use: the stand-in serves
        assert cached(pipe, new) is stand_in and grammar.num_compiling == 1  # and xgrammar compiles
        gate.set()
        await grammar.wait_idle()
        assert await served_by(pipe, body(24), new) == "xgrammar"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert xgrammar.calls[key] == 1 and xgrammar.nice[key] == min(19, base + 19)
    await assert_released(pipe)


async def test_a_request_cancelled_while_its_grammar_compiles_leaves_nothing_behind(
    pipe: Pipeline, gate: threading.Event
) -> None:
    grammar = pipe.preparation.grammar
    l_gate = threading.Event()
    real_llguidance = grammar.compilers["llguidance"]
    grammar.compilers["llguidance"] = GatedCompiler(real_llguidance, l_gate)
    new = schema("cancelled")
    try:
        with anyio.fail_after(60):
            handle = await pipe.submit(guided(TEXT, new))
            while grammar.num_compiling < 1:  # llguidance's compile started (the first use's only one)
                await anyio.wait_all_tasks_blocked()
            handle.cancel()
            with pytest.raises(RequestCancelled):
                await handle.result()
            assert grammar.num_compiling == 1  # the compile outlives the request that started it
            l_gate.set()
            await assert_released(pipe)  # every limiter token, compile, job and engine slot returned
    finally:
        grammar.compilers["llguidance"] = real_llguidance
    resources = pipe.resources()
    assert resources.grammar_compiles == 0
    assert resources.limiter_tokens["grammar"] == 0 and resources.limiter_tokens["grammar_fast"] == 0
    assert cached(pipe, new).is_stand_in  # the compile filled the cache, for the schema's next use
    xgrammar = grammar.compilers["xgrammar"]
    assert isinstance(xgrammar, GatedCompiler) and xgrammar.calls[spec_of(new).key] == 0
