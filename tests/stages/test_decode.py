from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import anyio
import pytest
from PIL import Image

from pipeline.errors import ImageDecodeError, InvalidRequest, PayloadTooLarge
from stages.decode import DecodeStage
from tests.images import encode, make_image

FIELD = "messages[0].content[1].image_url.url"
TINY = encode(make_image(8, 8), "PNG")


def recording(threads: list[int]) -> Callable[[Image.Image], Image.Image]:
    """A transform that notes the thread it ran in."""

    def transform(image: Image.Image) -> Image.Image:
        threads.append(threading.get_ident())
        return image

    return transform


class Gate:
    """A transform that blocks the decode's worker thread until released; records what happened in order."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.log: list[str] = []
        self._changed = threading.Condition()
        self.running = 0
        self.max_running = 0

    def __call__(self, image: Image.Image) -> str:
        with self._changed:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self._changed.notify_all()
        self.entered.set()
        assert self.release.wait(10)
        with self._changed:
            self.running -= 1
            self.log.append("thread done")
        return "decoded"

    def wait_running(self, count: int) -> None:
        """Block (in a thread, not on the loop) until ``count`` calls are inside at once."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.running >= count, timeout=10)


async def test_decodes_in_a_worker_thread() -> None:
    threads: list[int] = []
    stage = DecodeStage(transform=recording(threads))
    loop_thread = threading.get_ident()
    image = await stage.run(encode(make_image(40, 30, seed=1).convert("RGBA"), "PNG"), field=FIELD)
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (40, 30)
    assert threads and threads[0] != loop_thread
    assert stage.limiter.borrowed_tokens == 0 and stage.offload.calls == 1


async def test_jpeg_draft_target_is_passed_down() -> None:
    stage = DecodeStage(target_longest_edge=512)
    image = await stage.run(encode(make_image(2048, 1024, seed=2), "JPEG"), field=FIELD)
    assert image.size == (512, 256)


async def test_errors_carry_field_and_stage_and_return_the_token() -> None:
    stage = DecodeStage(max_pixels=100)
    with pytest.raises(ImageDecodeError) as bad:
        await stage.run(b"not an image", field=FIELD)
    assert bad.value.field == FIELD and bad.value.stage == "decode"
    with pytest.raises(PayloadTooLarge) as big:
        await stage.run(encode(make_image(20, 20), "PNG"), field=FIELD)
    assert big.value.field == FIELD and big.value.stage == "decode"
    assert stage.limiter.borrowed_tokens == 0


async def test_errors_of_the_transform_are_bound_to_the_stage() -> None:
    def refuse(image: Image.Image) -> Image.Image:
        raise InvalidRequest("image too small for the processor", field=FIELD)

    stage = DecodeStage(transform=refuse)
    with pytest.raises(InvalidRequest) as info:
        await stage.run(encode(make_image(8, 8), "PNG"), field=FIELD)
    assert info.type is InvalidRequest and (info.value.field, info.value.stage) == (FIELD, "decode")
    assert stage.limiter.borrowed_tokens == 0


async def test_at_most_decode_threads_decodes_at_once() -> None:
    gate = Gate()
    stage = DecodeStage(threads=2, transform=gate)
    results: list[str] = []

    async def one() -> None:
        results.append(await stage.run(TINY, field=FIELD))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
            await anyio.to_thread.run_sync(gate.wait_running, 2)
            await anyio.wait_all_tasks_blocked()
            assert stage.limiter.borrowed_tokens == 2 and stage.limiter.statistics().tasks_waiting == 3
            gate.release.set()
    assert results == ["decoded"] * 5 and gate.max_running == 2 and stage.limiter.borrowed_tokens == 0


async def test_cancelled_caller_waits_for_its_thread_then_is_cancelled() -> None:
    gate = Gate()
    stage = DecodeStage(threads=1, transform=gate)
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await stage.run(TINY, field=FIELD)
            gate.log.append("result delivered")  # must not happen: the caller was cancelled
        gate.log.append("caller left")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(gate.entered.wait)
            scope.cancel()  # the caller goes away while the thread works
            await anyio.wait_all_tasks_blocked()
            assert gate.log == [] and stage.limiter.borrowed_tokens == 1  # still held for the thread
            gate.release.set()
    assert gate.log == ["thread done", "caller left"] and scope.cancelled_caught
    assert stage.limiter.borrowed_tokens == 0 and stage.offload.calls == 1


async def test_cancelled_while_waiting_for_a_token_does_no_work() -> None:
    gate = Gate()
    stage = DecodeStage(threads=1, transform=gate)
    waiting = anyio.CancelScope()

    async def queued() -> None:
        with waiting:
            await stage.run(TINY, field=FIELD)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(stage.run, TINY, field=FIELD))
            await anyio.to_thread.run_sync(gate.entered.wait)
            tg.start_soon(queued)
            await anyio.wait_all_tasks_blocked()
            assert stage.limiter.statistics().tasks_waiting == 1
            waiting.cancel()
            await anyio.wait_all_tasks_blocked()
            assert stage.limiter.statistics().tasks_waiting == 0
            gate.release.set()
    assert waiting.cancelled_caught and gate.log == ["thread done"] and stage.offload.calls == 1
    assert stage.limiter.borrowed_tokens == 0


async def test_inline_preparation_decodes_on_the_loop() -> None:
    threads: list[int] = []
    stage = DecodeStage(inline=True, transform=recording(threads))
    await stage.run(encode(make_image(8, 8), "PNG"), field=FIELD)
    assert threads == [threading.get_ident()] and stage.limiter.borrowed_tokens == 0


@pytest.mark.parametrize(
    ("width", "height", "ok"), [(1, 40_000, False), (40_000, 1, False), (3, 3_000, False), (6, 3_000, True)]
)
async def test_an_image_too_thin_for_the_longest_edge_is_refused(width: int, height: int, ok: bool) -> None:
    # scaled to a 512-pixel longest edge, 3x3000 would be 0.5 pixels wide: the processor fails on it
    stage = DecodeStage(target_longest_edge=512)
    data = encode(Image.new("RGB", (width, height)))
    if ok:
        assert (await stage.run(data, field="f")).size == (width, height)
        return
    with pytest.raises(ImageDecodeError) as info:
        await stage.run(data, field="messages[0].content[0].image_url.url")
    assert info.value.field == "messages[0].content[0].image_url.url" and info.value.status == 400
