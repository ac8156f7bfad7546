"""``python -m pipeline serve`` serves again after its engine process is killed: a new engine starts,
``/health`` returns to 200, the next request is answered, and the killed process is reaped.

Run as the command a user runs, not under this suite's event loop: the engine's loss reaches the
server in an asyncio protocol callback, outside any task, and only a plain ``asyncio.run`` shows what
anyio can and cannot do there (under the test runner the loop's context names the library, and a
restart that failed in production passed here).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import aiohttp
import anyio

from tests.pipeline.test_cli_shutdown import _serving_url
from tests.pipeline.test_serve_workers import children, cmdline
from tests.stages.test_process_pool import wait_gone

BODY = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "ignore_eos": True}


def _engines(pid: int) -> list[int]:
    return [child for child in children(pid) if "pipeline.engine.process_main" in cmdline(child)]


async def _health(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/health") as resp:
        return resp.status


async def test_a_killed_engine_process_is_replaced_and_the_server_serves_again() -> None:
    command = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--preparation-mode", "thread"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as process:
        try:
            with anyio.fail_after(120):
                url = await _serving_url(process)
            (first,) = _engines(process.pid)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/chat/completions", json=BODY) as resp:
                    assert resp.status == 200
                os.kill(first, signal.SIGKILL)
                await wait_gone(first)
                with anyio.fail_after(120):
                    # another process: nothing to wait on but its answers (the new engine loads its model)
                    while await _health(session, url) != 200:  # noqa: ASYNC110 - another process: no event to share
                        await anyio.sleep(0.2)  # noqa: sleep-ok: polls another process's /health
                (second,) = _engines(process.pid)
                assert first not in children(process.pid)  # reaped by the server, not left a zombie
                async with session.post(f"{url}/v1/chat/completions", json=BODY) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["usage"]["completion_tokens"] == 3
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                assert await process.wait() == 0
                await wait_gone(second)
        finally:
            if process.returncode is None:
                process.kill()
