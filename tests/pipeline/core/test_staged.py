"""A stage's failures are logged as what they are: an expected deadline in one line, a fault with its cause."""

from __future__ import annotations

import logging

import anyio
import pytest

from pipeline.core.staged import Job, StageWorkers
from pipeline.errors import DeadlineExceeded, PipelineError, WorkerCrashed
from pipeline.observability.metrics import StageMetrics


async def fail_one_job(error: PipelineError) -> Job[None]:
    async def step(job: Job[None]) -> None:
        raise error

    stage = StageWorkers("fetch", step, num_workers=1, queue_size=1, metrics=StageMetrics("fetch"))
    job: Job[None] = Job("req-1", None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            stage.start(tg)
            await stage.send.send(job)
            await job.wait()
            await stage.aclose()
    return job


async def test_a_deadline_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.core.staged"):
        job = await fail_one_job(DeadlineExceeded("image http://x/a.png did not arrive within 20 s"))
    assert isinstance(job.error, DeadlineExceeded) and job.error.request_id == "req-1"
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "req-1" in record.getMessage() and "did not arrive" in record.getMessage()


async def test_a_fault_is_logged_with_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.core.staged"):
        await fail_one_job(WorkerCrashed("a preparation worker died"))
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
