"""``python -m pipeline serve`` shuts down within ``--shutdown-timeout``, even during a long compile, and
leaves no engine process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import aiohttp
import anyio
from anyio.abc import Process

from tests.pipeline.test_serve_workers import children, cmdline
from tests.stages.test_process_pool import wait_gone

# xgrammar expands bounded strings over the 131k-token vocabulary: 16 of them took 72 s here, so
# 32 cannot finish within the test's guard (the shutdown must not wait for it)
SLOW_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "maxLength": 300 + i} for i in range(32)},
    "required": [f"p{i}" for i in range(32)],
}


async def _serving_url(process: Process) -> str:
    assert process.stdout is not None
    seen = b""
    async for chunk in process.stdout:
        seen += chunk
        for line in seen.decode().splitlines():
            if line.startswith("serving ") and " on http://" in line:
                return line.rsplit(" on ", 1)[1]
    raise AssertionError(f"the server did not start: {seen.decode()}")


async def _compile_started(session: aiohttp.ClientSession, url: str) -> None:
    # the compile starts at admission, before the template stage; the server is another process,
    # so there is no event to wait on: poll its metrics
    while True:
        async with session.get(f"{url}/metrics") as resp:
            if 'pipeline_stage_completed_total{stage="template"} 1' in await resp.text():
                return
        await anyio.sleep(0.05)  # noqa: sleep-ok: polls another process's /metrics (see above)


async def test_a_shutdown_during_a_long_compile_respects_the_timeout() -> None:
    # the default engine mode (its own process), whose engine compiles the schema
    command = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--shutdown-timeout", "1"]
    # text only: no preparation worker would run (their end with the server is test_serve_workers'),
    # and a worker at the lowest priority beside the compile's busy core is slow to stop
    command += ["--grammar-backend", "xgrammar", "--preparation-mode", "thread"]
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}},
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as process:
        try:
            with anyio.fail_after(120):
                url = await _serving_url(process)
            # the engine process has loaded its model before the server says it is serving
            engines = [pid for pid in children(process.pid) if "pipeline.engine.process_main" in cmdline(pid)]
            assert len(engines) == 1
            async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
                answers: list[tuple[int, dict[str, object]]] = []

                async def ask() -> None:
                    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                        answers.append((resp.status, await resp.json()))

                tg.start_soon(ask)
                with anyio.fail_after(60):
                    await _compile_started(session, url)
                process.send_signal(signal.SIGTERM)
                with anyio.fail_after(40):  # 1 s of drain and the clean-up; the compile alone takes minutes
                    assert await process.wait() == 0
                    await wait_gone(engines[0])  # stopped mid-compile, not left behind
        finally:
            if process.returncode is None:
                process.kill()
    [(status, answer)] = answers
    assert status == 503 and answer["error"]["code"] == "shutting_down"  # type: ignore[index]
