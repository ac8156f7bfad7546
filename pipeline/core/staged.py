"""The staged queue: bounded inboxes between stages, a worker pool per stage, clean cancellation.

Each stage has an inbox (an anyio memory object stream with a finite buffer) and ``num_workers``
tasks. A worker takes a job, runs the stage's step inside the job's cancel scope, then *sends* the
job to the next inbox, waiting while it is full: a full stage blocks its producer, and so on back to
admission, which refuses instead of waiting. A cancelled job is dropped at the next stage boundary;
work already in a worker thread finishes first (``to_thread.run_sync`` holds its limiter token until
the thread returns), so a cancellation storm cannot pile up thread work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.errors import DeadlineExceeded, Overloaded, PipelineError, RequestCancelled
from pipeline.observability.metrics import StageMetrics
from pipeline.observability.trace import Tracer
from pipeline.outcome import Outcome

logger = logging.getLogger(__name__)
P = TypeVar("P")

__all__ = ["Job", "StageWorkers", "run_each"]


class Job(Generic[P]):
    """One request on its way through the stages; ends in exactly one outcome.

    ``payload`` is what the stage steps read and fill in. The first of ``complete``/``fail``/
    ``cancel`` wins; failing or cancelling also cancels the step working on the job.
    """

    def __init__(self, request_id: str, payload: P, *, on_leave: Callable[[Job[P]], None] | None = None) -> None:
        self.request_id = request_id
        self.payload = payload
        self.outcome: Outcome[None] = Outcome()
        self.timings: dict[str, float] = {}
        self.enqueued_at = time.perf_counter()  # when it entered its current inbox
        self._on_leave = on_leave  # called once, when no stage holds the job any more
        self._scope: anyio.CancelScope | None = None

    @property
    def is_over(self) -> bool:
        return self.outcome.is_done

    @property
    def error(self) -> PipelineError | None:
        error = self.outcome.error
        assert error is None or isinstance(error, PipelineError)
        return error

    async def wait(self) -> None:
        """Return once the job has an outcome (it may still be leaving a stage)."""
        await self.outcome.wait()

    def complete(self) -> None:
        self.outcome.set_result(None)

    def fail(self, error: PipelineError) -> None:
        if self.outcome.fail(error) and self._scope is not None:
            self._scope.cancel()

    def cancel(self) -> None:
        """Called by the requester: the stage working on the job stops at its next await."""
        error = RequestCancelled("the request was cancelled", request_id=self.request_id)
        if self.outcome.cancel(error) and self._scope is not None:
            self._scope.cancel()

    def leave(self) -> None:
        if self._on_leave is not None:
            callback, self._on_leave = self._on_leave, None
            callback(self)


Step = Callable[[Job[Any]], Awaitable[None]]


async def run_each(fn: Callable[[int], Coroutine[Any, Any, None]], count: int) -> None:
    """Run ``fn(0) ... fn(count - 1)`` concurrently; the first to fail cancels the rest and its
    error is raised as itself (not wrapped in an exception group), so it keeps its HTTP status."""
    try:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(fn, i)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        raise next((e for e in leaves if isinstance(e, PipelineError)), leaves[0]) from None


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


class StageWorkers:
    """A stage's inbox and workers; ``next`` is the following stage (None for the last)."""

    def __init__(
        self,
        name: str,
        step: Step,
        *,
        num_workers: int,
        queue_size: int,
        metrics: StageMetrics,
        tracer: Tracer | None = None,
    ) -> None:
        self.name = name
        self.tracer = tracer
        self.step = step
        self.num_workers = num_workers
        self.metrics = metrics
        self.send: MemoryObjectSendStream[Job[Any]]
        self._receive: MemoryObjectReceiveStream[Job[Any]]
        self.send, self._receive = anyio.create_memory_object_stream[Job[Any]](queue_size)
        self.next: StageWorkers | None = None
        metrics.queue_depth = self.queue_depth

    def offer(self, job: Job[Any]) -> None:
        """Put ``job`` in the inbox without waiting. :raises anyio.WouldBlock: the inbox is full."""
        job.enqueued_at = time.perf_counter()
        self.send.send_nowait(job)

    def queue_depth(self) -> int:
        return self.send.statistics().current_buffer_used

    def start(self, tg: TaskGroup) -> None:
        for _ in range(self.num_workers):
            tg.start_soon(self._worker, self._receive.clone())
        self._receive.close()  # the clones keep the stream open

    async def _worker(self, inbox: MemoryObjectReceiveStream[Job[Any]]) -> None:
        async with inbox:
            async for job in inbox:
                await self._process(job)
                # not kept while the worker waits for the next one: the job's payload (a prepared
                # request's image embeddings) belongs to its requester from here on
                del job

    async def _process(self, job: Job[Any]) -> None:
        if job.is_over:  # cancelled or failed while queued: leaves at this boundary
            job.leave()
            return
        started = time.perf_counter()
        if self.tracer is not None:
            self.tracer.span(f"{self.name} queue", "queue", job.request_id, job.enqueued_at, started)
        self.metrics.in_flight += 1
        try:
            with anyio.CancelScope() as scope:
                job._scope = scope
                await self.step(job)
        except PipelineError as exc:
            if isinstance(exc, DeadlineExceeded):  # expected under a slow host or load: one line, no traceback
                logger.warning("request %s failed in stage %s: %s", job.request_id, self.name, exc)
            elif exc.status >= 500 and not isinstance(exc, Overloaded):  # a fault, not bad input: keep its cause
                logger.error("request %s failed in stage %s: %s", job.request_id, self.name, exc, exc_info=True)
            self.metrics.errors[type(exc).__name__] += 1
            job.fail(exc.bind(stage=self.name, request_id=job.request_id))
        except Exception as exc:  # a bug in a stage: a 500 for this request only, logged with its traceback
            logger.exception("request %s: unexpected error in stage %s", job.request_id, self.name)
            self.metrics.errors[type(exc).__name__] += 1
            job.fail(
                PipelineError(f"internal error ({type(exc).__name__})", stage=self.name, request_id=job.request_id)
            )
        finally:
            job._scope = None
            self.metrics.in_flight -= 1
            ended = time.perf_counter()
            elapsed = ended - started
            self.metrics.latency.observe(elapsed)
            if self.tracer is not None:
                self.tracer.span(self.name, "stage", job.request_id, started, ended, outcome=job.outcome.state.value)
            job.timings[self.name] = job.timings.get(self.name, 0.0) + elapsed
        if job.is_over:
            job.leave()
            return
        self.metrics.completed += 1
        if self.next is None:
            job.complete()
            job.leave()
        else:
            job.enqueued_at = time.perf_counter()
            await self.next.send.send(job)  # waits while the next stage is full: backpressure

    async def aclose(self) -> None:
        await self.send.aclose()
        self._receive.close()  # a stage never started (its pipeline's start failed) still holds its own
