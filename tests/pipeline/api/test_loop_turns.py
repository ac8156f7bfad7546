"""The serving process's longer synchronous steps take turns on the event loop: admission, the
engine input's wrapping and the reply each wait for ``Pipeline.loop_turns``, in arrival order,
a request cancelled while it waits holds nothing, and one that already failed takes no turn."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from pipeline import PipelineConfig
from pipeline.answer.handle import RequestHandle
from pipeline.api.replies import Reply, StreamReply
from pipeline.api.routes import Api
from pipeline.core.pipeline import Pipeline
from pipeline.errors import GrammarError, ImageDecodeError
from pipeline.protocol.request import ChatRequest
from stages.grammar import GrammarStage
from tests.grammars import GatedCompiler
from tests.images import data_url, image_request
from tests.released import assert_released


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(
        max_running_seqs=4, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    async with Pipeline(config) as pipe:
        yield pipe


def body(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()


class Submitted:
    """The first message of each request ``pipe.submit`` admitted, in order (the pipeline still runs)."""

    def __init__(self, pipe: Pipeline) -> None:
        self.texts: list[str] = []
        self.any = anyio.Event()
        self._pipe, submit = pipe, pipe.submit

        async def spy(request: ChatRequest | dict[str, Any]) -> RequestHandle:
            assert isinstance(request, ChatRequest)
            self.texts.append(request.messages[0].parts[0].text)  # type: ignore[union-attr]
            self.any.set()
            return await submit(request)

        pipe.submit = spy  # type: ignore[method-assign]

    def __enter__(self) -> Submitted:
        return self

    def __exit__(self, *exc: object) -> None:
        del self._pipe.submit  # the class's method again


def status(reply: Reply | StreamReply) -> int:
    assert isinstance(reply, Reply)
    return reply.status


async def test_admissions_wait_for_the_turn_and_take_it_in_arrival_order(pipe: Pipeline) -> None:
    api, turns = Api(pipe), pipe.loop_turns
    statuses: list[int] = []

    async def post(text: str) -> None:
        statuses.append(status(await api.chat_completions(body(text))))

    with Submitted(pipe) as submitted, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await turns.acquire()
            for text in ("first", "second", "third"):
                tg.start_soon(post, text)
            await anyio.wait_all_tasks_blocked()
            assert submitted.texts == [] and turns.limiter.statistics().tasks_waiting == 3
            turns.release()
    assert submitted.texts == ["first", "second", "third"]
    assert statuses == [200] * 3
    await assert_released(pipe)


async def test_a_request_cancelled_while_it_waits_for_the_turn_holds_nothing(pipe: Pipeline) -> None:
    api, turns = Api(pipe), pipe.loop_turns
    with Submitted(pipe) as submitted, anyio.fail_after(60):
        await turns.acquire()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(api.chat_completions, body("cancelled"))
                await anyio.wait_all_tasks_blocked()
                assert turns.limiter.statistics().tasks_waiting == 1
                tg.cancel_scope.cancel()
        finally:
            turns.release()
        assert (turns.limiter.borrowed_tokens, turns.limiter.statistics().tasks_waiting) == (0, 0)
        assert status(await api.chat_completions(body("after"))) == 200
    assert submitted.texts == ["after"]
    await assert_released(pipe)


async def test_a_prepared_request_waits_for_the_turn_before_the_engine(pipe: Pipeline) -> None:
    api, turns = Api(pipe), pipe.loop_turns
    replies: list[Reply | StreamReply] = []

    async def post() -> None:
        replies.append(await api.chat_completions(body("prepared")))

    with Submitted(pipe) as submitted, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(post)
            await submitted.any.wait()
            await turns.acquire()  # once admission gave it back
            try:
                await pipe.wait_idle()  # out of the stages: the request waits for the turn to wrap its input
                await anyio.wait_all_tasks_blocked()
                assert turns.limiter.statistics().tasks_waiting == 1
                assert not any(pipe.resources().engine.values()) and replies == []
            finally:
                turns.release()
    assert [status(r) for r in replies] == [200]
    await assert_released(pipe)


async def test_a_request_cancelled_while_its_input_waits_for_the_turn_holds_nothing(pipe: Pipeline) -> None:
    api, turns = Api(pipe), pipe.loop_turns
    with Submitted(pipe) as submitted, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(api.chat_completions, body("cancelled after admission"))
            await submitted.any.wait()
            await turns.acquire()
            try:
                await pipe.wait_idle()
                await anyio.wait_all_tasks_blocked()
                assert turns.limiter.statistics().tasks_waiting == 1
                tg.cancel_scope.cancel()
                await checkpoint()
            finally:
                turns.release()
    assert (turns.limiter.borrowed_tokens, turns.limiter.statistics().tasks_waiting) == (0, 0)
    await assert_released(pipe)


async def test_a_request_that_failed_in_preparation_ends_without_waiting_for_the_turn(pipe: Pipeline) -> None:
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 3, "maxItems": 1}},
    }
    bodies = [
        {"messages": [{"role": "user", "content": "go"}], "response_format": bad_schema},  # fails its grammar
        image_request([data_url(b"this is text, not a png")]),  # fails its decode stage
    ]
    turns = pipe.loop_turns
    with anyio.fail_after(60):
        await turns.acquire()
        try:
            handles = [await pipe.submit(b) for b in bodies]
            await pipe.wait_idle()
            await anyio.wait_all_tasks_blocked()
            assert turns.limiter.statistics().tasks_waiting == 0
            assert all(handle.is_done for handle in handles)
        finally:
            turns.release()
    for handle, error in zip(handles, (GrammarError, ImageDecodeError), strict=True):
        with pytest.raises(error):
            await handle.result()
    await assert_released(pipe)


async def test_a_request_whose_compile_is_refused_while_it_waits_for_the_turn_leaves_at_once(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text-only request goes for its turn before its compile ends (grammar_overlap); a refusal
    that comes while it waits ends it there, holding no turn and sending nothing to the engine."""
    gate = threading.Event()
    grammar = pipe.preparation.grammar
    assert isinstance(grammar, GrammarStage)  # thread mode: the compile runs here
    compilers = grammar.compilers
    monkeypatch.setitem(compilers, "llguidance", GatedCompiler(compilers["llguidance"], gate))
    unsatisfiable = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 4, "maxItems": 2}},
    }
    submitted: list[str] = []
    submit = pipe.engine.submit

    def spy(inp: Any) -> Any:
        submitted.append(inp.request_id)
        return submit(inp)

    monkeypatch.setattr(pipe.engine, "submit", spy)
    turns = pipe.loop_turns
    with anyio.fail_after(60):
        await turns.acquire()
        try:
            handle = await pipe.submit(
                {"messages": [{"role": "user", "content": "go"}], "response_format": unsatisfiable}
            )
            while turns.limiter.statistics().tasks_waiting == 0:
                await anyio.wait_all_tasks_blocked()  # its preparation ends; it waits for the turn
            gate.set()  # the compile goes on, and is refused
            with pytest.raises(GrammarError):
                await handle.result()
            assert turns.limiter.statistics().tasks_waiting == 0
        finally:
            gate.set()
            turns.release()
    assert submitted == []
    await assert_released(pipe)
