"""The listener on uvloop's event loop (as a library user may run the app): its transports are not
asyncio's classes, and a connection refused at the cap is still answered with a 503 and closed."""

from __future__ import annotations

import anyio
import pytest
from aiohttp import web

from pipeline.api.connections import ConnectionLimits
from pipeline.api.listener import listen
from tests.rawhttp import address, read_response, request_bytes

pytest.importorskip("uvloop")

LIMITS = ConnectionLimits(max_connections=2, reserved_connections=1, log_interval_s=3600)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return "asyncio", {"use_uvloop": True}


async def test_a_connection_past_the_cap_is_refused_with_a_503_on_uvloop() -> None:
    arrived, release = anyio.Event(), anyio.Event()
    entered = 0

    async def held(request: web.Request) -> web.Response:
        nonlocal entered
        entered += 1
        if entered == 2:
            arrived.set()
        await release.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", held)  # the reserve slot serves /health only
    with anyio.fail_after(30):
        async with listen(app, limits=LIMITS) as listener:
            host, port = address(listener.url)
            held_streams = [await anyio.connect_tcp(host, port) for _ in range(2)]
            for stream in held_streams:  # each connection has a request: none can be made room of
                await stream.send(request_bytes("GET", "/health", {}))
            await arrived.wait()
            async with await anyio.connect_tcp(host, port) as refused:
                answer = await read_response(refused)
            assert answer.status == 503
            assert answer.json()["error"]["code"] == "overloaded"
            assert listener.guard.stats.refused == 1
            release.set()
            for stream in held_streams:
                assert (await read_response(stream)).status == 200
                await stream.aclose()
