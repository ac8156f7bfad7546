"""A small request never waits behind large ones in the template stage: large prompts are rendered in
a lane of their own, and only so many of them are admitted at once.

The large requests' rendering is held on an event (a 4.95 M-character message, under the prompt's
text bound, held a template thread for 3.2-3.7 s), so the test says what waits for what without timings.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import Overloaded, PipelineError
from pipeline.types import Message, TextPart
from tests.released import assert_released

HUGE = "HUGE " + "word " * 60_000  # 300 KB: past template_large_request_chars (256 KiB)
SMALL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pipe() -> AsyncIterator[Pipeline]:
    config = PipelineConfig(preparation_mode="thread", max_large_requests=2, max_model_len=2048)
    async with Pipeline(config, with_engine=False) as p:
        yield p


class HeldRenders:
    """The template's render, held for huge conversations until ``release`` is set."""

    def __init__(self, render: Any) -> None:
        self.render = render
        self.release = threading.Event()
        self.entered = anyio.Event()  # a huge conversation is being rendered

    def __call__(self, messages: tuple[Message, ...], *args: Any) -> list[int]:
        first = messages[0].parts[0] if messages and messages[0].parts else None
        if isinstance(first, TextPart) and first.text.startswith("HUGE"):
            anyio.from_thread.run_sync(self.entered.set)
            self.release.wait(60)
        return self.render(messages, *args)


@pytest.fixture
def held(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRenders]:
    template = pipe.preparation.template
    renders = HeldRenders(template.render)
    monkeypatch.setattr(template, "render", renders)
    try:
        yield renders
    finally:
        renders.release.set()


async def _prepare_failing(pipe: Pipeline, body: dict[str, Any]) -> None:
    with pytest.raises(PipelineError) as info:  # 60,000 words: more tokens than a prompt may hold
        await pipe.prepare(body)
    assert info.value.field == "messages" and info.value.code == "context_length_exceeded"


async def test_a_small_request_is_prepared_beside_large_ones(pipe: Pipeline, held: HeldRenders) -> None:
    huge = {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}
    async with anyio.create_task_group() as tg:
        for _ in range(2):  # one renders in the large lane, the other waits for it (holding a worker)
            tg.start_soon(_prepare_failing, pipe, huge)
        with anyio.fail_after(10):
            await held.entered.wait()
            await anyio.wait_all_tasks_blocked()
            assert pipe.num_pending == 2
            limiters = pipe.preparation.limiters()
            assert limiters["template_large"].borrowed_tokens == 1 and limiters["template"].borrowed_tokens == 0
            # before the lanes: it waited for the one template thread, held by the large prompt
            prepared = await pipe.prepare(SMALL)
        assert prepared.prompt_token_ids
        held.release.set()
    await assert_released(pipe)


async def test_large_requests_past_their_bound_are_refused_at_admission(pipe: Pipeline, held: HeldRenders) -> None:
    huge = {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(_prepare_failing, pipe, huge)
        with anyio.fail_after(10):
            await held.entered.wait()
        await anyio.wait_all_tasks_blocked()
        assert pipe.num_pending == 2
        with pytest.raises(Overloaded) as info:
            await pipe.prepare(huge)
        assert info.value.status == 429 and "large prompts" in info.value.message
        with anyio.fail_after(10):
            await pipe.prepare(SMALL)  # small requests are not counted against it
        held.release.set()
    await assert_released(pipe)
