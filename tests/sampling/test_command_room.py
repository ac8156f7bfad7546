"""CommandRoom: waiters take room first come first served, a cancelled waiter passes its turn on,
and a failure reaches every waiter with an error of its own."""

from __future__ import annotations

import anyio

from pipeline.errors import EngineFailed, PipelineError
from sampling.command_room import CommandRoom


class Queue:
    """A bounded queue's count of commands in flight, as the engine front-ends keep it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.in_flight = 0
        self.room = CommandRoom(lambda: self.in_flight < self.size)

    async def send(self, name: str, sent: list[str]) -> None:
        await self.room.wait()
        self.in_flight += 1  # what submit does, before any await
        sent.append(name)

    def read(self, count: int) -> None:
        """The engine has read ``count`` commands."""
        self.in_flight -= count
        self.room.notify()


async def test_waiters_take_room_in_the_order_they_came() -> None:
    queue, sent = Queue(2), list[str]()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(queue.send, f"r{i}", sent)
                await anyio.wait_all_tasks_blocked()
            assert sent == ["r0", "r1"] and queue.room.num_waiting == 4
            queue.read(1)
            await anyio.wait_all_tasks_blocked()
            assert sent == ["r0", "r1", "r2"] and queue.room.num_waiting == 3
            queue.read(3)  # room for three: the head takes one and wakes the next
            await anyio.wait_all_tasks_blocked()
            assert sent == [f"r{i}" for i in range(6)] and queue.room.num_waiting == 0


async def test_a_newcomer_does_not_overtake_the_waiters() -> None:
    queue, sent = Queue(1), list[str]()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(queue.send, "first", sent)
            tg.start_soon(queue.send, "waiter", sent)
            await anyio.wait_all_tasks_blocked()
            queue.in_flight = 0  # room, but nobody was told yet
            tg.start_soon(queue.send, "newcomer", sent)
            await anyio.wait_all_tasks_blocked()
            assert sent == ["first"] and queue.room.num_waiting == 2
            queue.read(0)
            await anyio.wait_all_tasks_blocked()
            assert sent == ["first", "waiter"]
            queue.read(1)
    assert sent == ["first", "waiter", "newcomer"]


async def test_a_waiter_cancelled_as_the_room_comes_passes_it_on() -> None:
    queue, sent = Queue(1), list[str]()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await queue.send("first", sent)
            scope = anyio.CancelScope()

            async def gives_up() -> None:
                with scope:
                    await queue.send("gives up", sent)

            tg.start_soon(gives_up)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(queue.send, "next", sent)
            await anyio.wait_all_tasks_blocked()
            assert queue.room.num_waiting == 2
            scope.cancel()  # the head of the line leaves, as the room it waited for comes:
            queue.read(1)  # the room goes to the next one
            await anyio.wait_all_tasks_blocked()
    assert sent == ["first", "next"] and queue.room.num_waiting == 0


async def test_a_failure_reaches_every_waiter_and_no_later_caller() -> None:
    queue, sent = Queue(1), list[str]()
    errors: list[PipelineError] = []

    async def send(name: str) -> None:
        try:
            await queue.send(name, sent)
        except EngineFailed as exc:
            errors.append(exc.bind(request_id=name))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await queue.send("first", sent)
            for i in range(3):
                tg.start_soon(send, f"w{i}")
            await anyio.wait_all_tasks_blocked()
            queue.room.fail(EngineFailed("lost", stage="engine"))
            await anyio.wait_all_tasks_blocked()
            assert queue.room.num_waiting == 0
            tg.start_soon(send, "later")  # the queue is still full: it waits, unfailed
            await anyio.wait_all_tasks_blocked()
            assert queue.room.num_waiting == 1
            queue.read(1)
    assert sent == ["first", "later"]
    assert sorted(str(e.request_id) for e in errors) == ["w0", "w1", "w2"]  # each its own error
