"""``python -m pipeline serve`` leaves no preparation worker and no engine process behind, however it ends."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import pytest

from tests.stages.test_process_pool import wait_gone

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


async def _read_line(stream: anyio.abc.ByteReceiveStream, buffer: bytearray, prefix: bytes) -> bytes:
    while True:
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            if line.startswith(prefix):
                return line
        buffer += await stream.receive()


@pytest.mark.parametrize("ending", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "crashed"])
async def test_the_workers_end_with_the_server(ending: signal.Signals) -> None:
    args = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--preparation-mode", "process"]
    args += ["--prep-workers", "2", "--engine-mode", "process"]
    process = await anyio.open_process(args, cwd=ROOT, stderr=None)
    try:
        assert process.stdout is not None
        with anyio.fail_after(180):
            await _read_line(process.stdout, bytearray(), b"serving")
            workers: list[int] = []
            lowest = min(19, os.nice(0) + 19)
            # serve starts its two workers at once; each lowers its priority first thing once running
            while len(workers) < 2 or any(_nice(pid) != lowest for pid in workers):
                await anyio.sleep(0.05)  # noqa: sleep-ok: polls /proc; another process's children give no event
                workers = [pid for pid in children(process.pid) if "vision.image_worker" in cmdline(pid)]
            # the engine process has loaded its model before the server says it is serving
            engines = [pid for pid in children(process.pid) if "pipeline.engine.process_main" in cmdline(pid)]
            assert len(engines) == 1
        process.send_signal(ending)
        with anyio.fail_after(60):
            code = await process.wait()
            for pid in workers + engines:
                await wait_gone(pid)
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()
    assert code == (0 if ending == signal.SIGINT else -signal.SIGKILL)


def cmdline(pid: int) -> str:
    """``pid``'s command line, its arguments joined by spaces ("" once it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: nice
