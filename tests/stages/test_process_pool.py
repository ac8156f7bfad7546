"""The preparation worker pool: same results as in-process preparation, faults contained, nothing left behind."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from pipeline.errors import DeadlineExceeded, ImageDecodeError, WorkerCrashed
from stages.process_pool import ImagePool
from tests.images import encode, make_image
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.image_io import decode_image
from vision.image_worker import ImageWorkerSpec
from vision.preprocess import preprocess_image

SCRIPTED = "tests.stages.pool_tasks:scripted"
ROOT = Path(__file__).resolve().parents[2]


def _spec(
    checkpoint: Checkpoint, *, encode: bool = True, task: str = "vision.image_worker:ImageTask"
) -> ImageWorkerSpec:
    return ImageWorkerSpec(str(checkpoint.path), 40_000_000, None, encode, task=task)


async def wait_gone(pid: int) -> None:
    """Return once process ``pid`` has exited (a pidfd turns readable then: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def _open_slabs() -> list[str]:
    """This process's open shared-memory slabs (memfds named prep-*)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if "memfd:prep-" in link]


@pytest.fixture
async def pool_factory() -> AsyncIterator[Any]:
    pools: list[ImagePool] = []
    async with anyio.create_task_group() as tg:

        def make(spec: ImageWorkerSpec, **kwargs: Any) -> ImagePool:
            pool = ImagePool(spec, max_image_bytes=1 << 20, **kwargs)
            pool.attach(tg)
            pools.append(pool)
            return pool

        yield make
        for pool in pools:
            await pool.aclose()


async def test_the_pool_prepares_as_the_serving_process_would(checkpoint: Checkpoint, pool_factory: Any) -> None:
    data = png_bytes(300, 200, seed=3)
    decoded = decode_image(data, max_pixels=10**8, target_longest_edge=None, field="f")
    image = preprocess_image(checkpoint.image_processor, decoded)
    expected = VisionEncoder(checkpoint).encode([image])[0]
    with anyio.fail_after(120):
        encoded = await pool_factory(_spec(checkpoint), size=1).run(data, field="f")
        pixels = await pool_factory(_spec(checkpoint, encode=False), size=1).run(data, field="f")
    assert encoded.grid_thw == image.grid_thw
    assert encoded.pixel_values is None and encoded.embeds is not None
    torch.testing.assert_close(encoded.embeds, expected)  # one thread in the worker: sums may round differently
    assert pixels.embeds is None and pixels.pixel_values is not None
    assert torch.equal(pixels.pixel_values, image.pixel_values)


async def test_a_bad_image_is_the_clients_error_and_the_worker_stays(checkpoint: Checkpoint, pool_factory: Any) -> None:
    pool = pool_factory(_spec(checkpoint), size=1)
    with anyio.fail_after(120):
        with pytest.raises(ImageDecodeError) as caught:
            await pool.run(b"hello, I am a text file called cat.png", field="messages[0].content[1]")
        (pid,) = pool.pids()
        await pool.run(png_bytes(32, 32, seed=1), field="f")
    assert caught.value.field == "messages[0].content[1]" and caught.value.stage == "decode"
    assert pool.pids() == [pid] and pool.stats.crashes == 0


async def test_a_crashed_worker_fails_only_its_job_and_is_replaced(checkpoint: Checkpoint, pool_factory: Any) -> None:
    pool = pool_factory(_spec(checkpoint, task=SCRIPTED), size=2)
    results: dict[str, Any] = {}

    async def run(name: str, data: bytes) -> None:
        try:
            results[name] = await pool.run(data, field=name)
        except Exception as exc:
            results[name] = exc

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "crash", b"crash")
            tg.start_soon(run, "echo", b"echo")
        survivors = set(pool.pids())
        after = [await pool.run(b"again", field="f") for _ in range(3)]
    assert isinstance(results["crash"], WorkerCrashed)
    assert results["crash"].stage == "decode" and results["crash"].field == "crash" and results["crash"].status == 500
    assert results["echo"].embeds.tolist() == [[4.0] * 3] * 2
    assert [r.embeds[0, 0].item() for r in after] == [5.0] * 3
    assert pool.stats.crashes == 1 and pool.stats.starts == 3  # two, and the replacement
    assert len(survivors | set(pool.pids())) == 2


async def test_a_stuck_worker_is_killed_at_the_deadline(checkpoint: Checkpoint, pool_factory: Any) -> None:
    pool = pool_factory(_spec(checkpoint, task=SCRIPTED), size=1, job_timeout_s=2.0)
    with anyio.fail_after(60):
        await pool.run(b"warm", field="f")
        (stuck,) = pool.pids()
        with pytest.raises(DeadlineExceeded) as caught:
            await pool.run(b"hang", field="messages[0]")
        await wait_gone(stuck)
        done = await pool.run(b"after", field="f")
    assert caught.value.stage == "decode" and caught.value.status == 504
    assert done.embeds is not None and pool.pids() != [stuck] and pool.stats.timeouts == 1


async def test_a_cancelled_job_keeps_its_worker_until_done(
    checkpoint: Checkpoint, pool_factory: Any, tmp_path: Path
) -> None:
    pool = pool_factory(_spec(checkpoint, task=SCRIPTED), size=1)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    returned: list[Any] = []
    with anyio.fail_after(60):
        await pool.run(b"warm", field="f")
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def caller() -> None:
                with scope:
                    returned.append(await pool.run(f"gate:{gate}".encode(), field="f"))

            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()  # the caller waits for the worker's reply
            assert pool.stats.jobs == 2
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            held_while_running = pool.limiter.borrowed_tokens
            await anyio.to_thread.run_sync(gate.write_bytes, b"go")  # the worker finishes the job
        after = await pool.run(b"next", field="f")
    assert held_while_running == 1 and returned == [] and scope.cancelled_caught
    assert pool.limiter.borrowed_tokens == 0 and after.embeds is not None and pool.stats.crashes == 0


async def test_nothing_is_left_behind(checkpoint: Checkpoint) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            pool = ImagePool(_spec(checkpoint, task=SCRIPTED), size=2, max_image_bytes=1 << 20)
            pool.attach(tg)
            big = await pool.run(b"big", field="f")  # 16 MB back: the worker grows its output slab
            crashed = await _raises(pool.run(b"crash", field="f"))
            await pool.run(b"echo", field="f")
            pids = pool.pids()
            await pool.aclose()
        for pid in pids:
            await wait_gone(pid)
    assert big.embeds is not None and big.embeds.shape == (4096, 1024) and big.embeds[-1, -1] == 4 * 1024 * 1024 - 1
    assert isinstance(crashed, WorkerCrashed)
    assert _open_slabs() == [] and set(os.listdir("/dev/shm")) == shm_before


async def _raises(awaitable: Any) -> BaseException | None:
    try:
        await awaitable
    except Exception as exc:
        return exc
    return None


async def test_workers_die_with_the_serving_process(checkpoint: Checkpoint) -> None:
    script = textwrap.dedent(
        f"""
        import functools

        import anyio
        from stages.process_pool import ImagePool
        from vision.image_worker import ImageWorkerSpec

        async def main():
            spec = ImageWorkerSpec({str(checkpoint.path)!r}, 1000, None, True, task={SCRIPTED!r})
            async with anyio.create_task_group() as tg:
                pool = ImagePool(spec, size=2, max_image_bytes=1024)
                pool.attach(tg)
                async with anyio.create_task_group() as jobs:
                    jobs.start_soon(functools.partial(pool.run, b"a", field="f"))
                    jobs.start_soon(functools.partial(pool.run, b"b", field="f"))
                print(*pool.pids(), flush=True)
                await anyio.sleep_forever()

        if __name__ == "__main__":
            anyio.run(main)
        """
    )
    process = await anyio.open_process([sys.executable, "-c", script], cwd=ROOT, stderr=None)
    try:
        assert process.stdout is not None
        with anyio.fail_after(120):
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2
        process.send_signal(signal.SIGKILL)
        with anyio.fail_after(30):
            for pid in pids:
                await wait_gone(pid)
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()


def png_bytes(width: int, height: int, *, seed: int) -> bytes:
    return encode(make_image(width, height, seed=seed))


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
async def test_the_pool_runs_on_uvloop(checkpoint: Checkpoint, pool_factory: Any) -> None:
    """uvloop (Ray Serve's replicas run on it) makes every fd it polls non-blocking: a descriptor
    read right after the message that announced it would find nothing yet (EAGAIN) unless the
    pool waits for it. Starting workers and a bigger output slab are the two such reads."""
    pools = [pool_factory(_spec(checkpoint, task=SCRIPTED), size=2) for _ in range(3)]
    with anyio.fail_after(120):
        for pool in pools:
            async with anyio.create_task_group() as tg:
                for _ in range(2):  # both workers start
                    tg.start_soon(partial(pool.run, b"echo", field="f"))
            big = await pool.run(b"big", field="f")
            assert big.embeds is not None and big.embeds.numel() == 4 * 1024 * 1024
    assert [pool.stats.crashes for pool in pools] == [0, 0, 0]


async def test_a_script_without_a_main_guard_can_start_workers(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """A user's script run as a file, with no ``if __name__ == "__main__":``: a worker started the
    way multiprocessing's spawn starts one would run the whole script again, then die trying to
    start workers of its own while it bootstraps. Ours run only their own code."""
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import anyio
            from stages.process_pool import ImagePool
            from vision.image_worker import ImageWorkerSpec

            print("the script ran", flush=True)  # once: in this process, never in a worker

            async def main():
                spec = ImageWorkerSpec({str(checkpoint.path)!r}, 1000, None, True, task={SCRIPTED!r})
                async with anyio.create_task_group() as tg:
                    pool = ImagePool(spec, size=1, max_image_bytes=1024)
                    pool.attach(tg)
                    await pool.start_all()
                    result = await pool.run(b"abc", field="f")
                    print("result", result.embeds.tolist(), flush=True)
                    await pool.aclose()

            anyio.run(main)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with anyio.fail_after(120):
        done = await anyio.run_process([sys.executable, str(script)], cwd=tmp_path, env=env, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, (out, done.stderr.decode()[-3000:])
    assert out.splitlines() == ["the script ran", f"result {[[3.0] * 3] * 2}"], out


async def test_closing_waits_for_the_workers_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both workers' exits are awaited at once: a reap that waits for the other's start would never
    return if the pool reaped one worker after the other."""
    import threading

    from stages import process_pool

    both_reaping = threading.Barrier(2, timeout=10)
    reaped: list[float] = []

    def reap(worker: Any, timeout_s: float) -> None:
        both_reaping.wait()  # BrokenBarrierError after 10 s when the reaps run one after another
        reaped.append(timeout_s)

    monkeypatch.setattr(process_pool._Worker, "reap", reap)
    spec = ImageWorkerSpec(str(tmp_path), max_pixels=1 << 20, target_longest_edge=None, encode=False)
    pool = ImagePool(spec, size=2, max_image_bytes=1 << 20)
    with anyio.fail_after(60):
        await pool.aclose()
    assert reaped == [5.0, 5.0]
