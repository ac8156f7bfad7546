"""Request bodies are read a few at a time (pipeline/api/body_pacing.py): a burst's bodies wait for
their slots in arrival order and all are answered, /health never waits for a slot, a client that
sends its body slowly gives its slot up, and a waiter that goes away holds nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.api import body_pacing
from pipeline.api.body_pacing import BodyPacer
from pipeline.api.connections import ConnectionLimits
from pipeline.api.listener import Listener, listen
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.rawhttp import address, exchange, read_response, request_bytes

ONE_AT_A_TIME = ConnectionLimits(max_reading_bodies=1, log_interval_s=3600)
JSON: dict[str, bytes | str] = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Server:
    pipe: Pipeline
    listener: Listener


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[Server]:
    config = PipelineConfig(
        max_running_seqs=2, num_kv_blocks=64, max_model_len=512, preparation_mode="thread", engine_mode="thread"
    )
    async with Pipeline(config) as pipe, listen(create_app(pipe), limits=ONE_AT_A_TIME) as listener:
        yield Server(pipe, listener)


async def until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds. The server reads in its transports' callbacks on this same
    loop, which no task or event reports: each check gives the loop one iteration (the caller's
    ``fail_after`` bounds the whole)."""
    while not condition():
        await anyio.lowlevel.checkpoint()  # noqa: ASYNC110


def large_invalid_body(i: int) -> bytes:
    """About 600 KB that the server reads whole, then refuses (400, no engine work): ``messages`` is no list."""
    return json.dumps({"messages": "not a list", "padding": f"{i:08d}" + "x" * 600_000}).encode()


async def test_a_burst_of_bodies_is_read_one_at_a_time_and_every_request_is_answered(server: Server) -> None:
    bodies = server.listener.bodies
    before = (bodies.stats.bodies, bodies.stats.waited)
    statuses: list[int] = []

    async def post(i: int) -> None:
        answer = await exchange(
            server.listener.url, request_bytes("POST", "/v1/chat/completions", JSON, large_invalid_body(i))
        )
        statuses.append(answer.status)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(post, i)
    assert statuses == [400] * 12
    assert bodies.stats.bodies - before[0] == 12 and bodies.stats.waited > before[1]
    assert bodies.stats.most_reading == 1 and bodies.num_reading == 0 and bodies.num_waiting == 0


async def test_metrics_show_the_listeners_connections_and_paced_bodies(server: Server) -> None:
    """/metrics of a served pipeline carries the listener's counters, as its guard and pacer hold them."""
    with anyio.fail_after(30):
        await exchange(server.listener.url, request_bytes("POST", "/v1/chat/completions", JSON, large_invalid_body(0)))
        answer = await exchange(server.listener.url, request_bytes("GET", "/metrics", {}))
    assert answer.status == 200
    families = {f.name: f for f in text_string_to_metric_families(answer.body.decode())}
    value = {(s.name, tuple(s.labels.values())): s.value for f in families.values() for s in f.samples}
    stats, guard = server.listener.bodies.stats, server.listener.guard
    assert families["pipeline_http_bodies_paced"].type == "counter"
    assert value[("pipeline_http_bodies_paced_total", ())] == stats.bodies >= 1
    assert value[("pipeline_http_bodies_waited_total", ())] == stats.waited
    assert value[("pipeline_http_body_slots_given_up_total", ())] == stats.slow
    assert value[("pipeline_http_bodies_reading", ())] == 0  # the scrape has no body
    assert value[("pipeline_http_connections_total", ("opened",))] == guard.stats.opened >= 2
    assert value[("pipeline_http_connections_total", ("refused",))] == guard.stats.refused
    assert value[("pipeline_http_connections_open", ())] >= 1  # the scrape's own connection
    assert ("pipeline_requests_total", ("refused",)) in value  # beside the pipeline's own


async def test_health_is_answered_while_a_body_holds_the_only_slot_and_others_wait(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_pacing, "CHECK_S", 3600.0)  # the stalled holder keeps its slot here
    bodies = server.listener.bodies
    host, port = address(server.listener.url)
    body = large_invalid_body(0)
    head = request_bytes("POST", "/v1/chat/completions", JSON, body)[: -len(body)]
    with anyio.fail_after(60):
        async with await anyio.connect_tcp(host, port) as holder, await anyio.connect_tcp(host, port) as waiter:
            await holder.send(head + body[:300_000])  # reads on under the slot, then waits for the rest
            await until(lambda: bodies.num_reading == 1)
            await waiter.send(head + body)
            await until(lambda: bodies.num_waiting == 1)
            health = await exchange(server.listener.url, request_bytes("GET", "/health", {"Connection": "close"}))
            assert health.status == 200
            await holder.send(body[300_000:])
            assert (await read_response(holder)).status == 400
            assert (await read_response(waiter)).status == 400
    assert bodies.num_reading == 0 and bodies.num_waiting == 0


async def test_a_body_sent_slowly_gives_its_slot_up_and_the_next_is_read(server: Server) -> None:
    bodies = server.listener.bodies
    slow_before = bodies.stats.slow
    host, port = address(server.listener.url)
    body = large_invalid_body(1)
    head = request_bytes("POST", "/v1/chat/completions", JSON, body)[: -len(body)]
    with anyio.fail_after(60):
        async with await anyio.connect_tcp(host, port) as slow:
            await slow.send(head + body[:10])  # then nothing: far below the rate that keeps a slot
            await until(lambda: bodies.num_reading == 1)
            fast = await exchange(server.listener.url, request_bytes("POST", "/v1/chat/completions", JSON, body))
            assert fast.status == 400 and bodies.stats.slow > slow_before
            await slow.send(body[10:])
            assert (await read_response(slow)).status == 400
    assert bodies.num_reading == 0 and bodies.num_waiting == 0


class _Transport(asyncio.ReadTransport):
    """A connection's reading switch, as the pacer sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.calls: list[str] = []

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.reading = True
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return False


@dataclass
class _Content:
    total_bytes: int = 0


class _Request:
    """What the pacer reads of a request: its transport, its body stream and ``read()``."""

    def __init__(self, release: asyncio.Event) -> None:
        self.transport = _Transport()
        self.body_exists = True
        self.content = _Content()
        self._release = release

    async def read(self) -> bytes:
        await self._release.wait()
        self.content.total_bytes = 10**9  # as fast as a body can be: the rate check keeps the slot
        return b"body"


async def test_a_waiter_that_goes_away_holds_nothing_and_the_next_one_reads() -> None:
    pacer = BodyPacer(max_reading=1, min_rate=1.0)
    go = asyncio.Event()
    first, gone, last = _Request(go), _Request(go), _Request(go)
    with anyio.fail_after(10):
        reading = asyncio.ensure_future(pacer.read(first))  # type: ignore[arg-type]
        await anyio.wait_all_tasks_blocked()  # it took the slot and waits in its read
        waiting = asyncio.ensure_future(pacer.read(gone))  # type: ignore[arg-type]
        queued = asyncio.ensure_future(pacer.read(last))  # type: ignore[arg-type]
        await anyio.wait_all_tasks_blocked()  # both wait for the slot now
        assert (pacer.num_reading, pacer.num_waiting) == (1, 2)
        assert gone.transport.calls == ["pause"] and last.transport.calls == ["pause"]
        waiting.cancel()
        go.set()
        assert await reading == b"body" and await queued == b"body"
    assert waiting.cancelled() and gone.transport.calls == ["pause", "resume"]
    assert last.transport.calls == ["pause", "resume"] and first.transport.calls == []
    assert (pacer.num_reading, pacer.num_waiting) == (0, 0) and pacer.stats.bodies == 2
