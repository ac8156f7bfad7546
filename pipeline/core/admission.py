"""Admission: a parsed request enters the preparation stages as a job, or is refused at once when full.

The ``Pipeline`` says whether it accepts at all (its state); this counts the requests in the stages
(admitted, not yet out), with the prepared requests waiting for room in the engine's command queue,
against ``max_pending_requests`` and wakes ``wait_idle`` when none are left in the stages. Large
requests (``template_large_request_chars``) count against ``max_large_requests`` too: the template
stage has that many workers more than its small lane needs, so however many large requests wait for
the large lane, small ones always find a worker.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from pipeline.config import PipelineConfig
from pipeline.core.preparation import Preparation, PreparedRequest
from pipeline.core.staged import Job
from pipeline.errors import Overloaded
from pipeline.observability.metrics import Metrics
from pipeline.observability.trace import Tracer
from pipeline.protocol.request import ChatRequest

__all__ = ["Admission"]


class Admission:
    """Jobs into ``preparation``'s first stage, at most ``config.max_pending_requests`` in the stages
    and waiting for the engine together."""

    def __init__(
        self,
        config: PipelineConfig,
        preparation: Preparation,
        metrics: Metrics,
        tracer: Tracer | None = None,
        *,
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config = config
        # prepared requests waiting for room in the engine's command queue: they count, so a slow
        # engine's backpressure reaches admission, the one place that refuses
        self.waiting = waiting
        self.preparation = preparation
        self.metrics = metrics
        self.tracer = tracer
        self.num_pending = 0  # jobs admitted and not yet out of the stages
        self.num_large = 0  # of those, the large ones (see is_large)
        self._idle = anyio.Event()

    def admit(self, request: ChatRequest) -> Job[PreparedRequest]:
        """The job of ``request``, in the first stage and its grammar compile started.

        :raises Overloaded: the stages and the engine's waiters hold ``max_pending_requests``, or the
            first inbox is full.
        """
        waiting = self.waiting()
        if self.num_pending + waiting >= self.config.max_pending_requests:
            self.metrics.requests["refused"] += 1
            where = f" and {waiting} waiting for the engine" if waiting else ""
            raise Overloaded(
                f"{self.num_pending} requests in preparation{where}; the limit is {self.config.max_pending_requests}",
                retry_after=self.config.retry_after_s,
                stage="admission",
                request_id=request.request_id,
            )
        is_large = self.is_large(request)
        if is_large and self.num_large >= self.config.max_large_requests:
            self.metrics.requests["refused"] += 1
            raise Overloaded(
                f"{self.num_large} large prompts in preparation; the limit is {self.config.max_large_requests}",
                retry_after=self.config.retry_after_s,
                stage="admission",
                request_id=request.request_id,
            )
        job = Job(request.request_id, PreparedRequest(request, is_large=is_large), on_leave=self._job_left)
        try:
            self.preparation.admit(job)
        except anyio.WouldBlock:
            self.metrics.requests["refused"] += 1
            raise Overloaded(
                "the first stage's inbox is full", retry_after=self.config.retry_after_s, stage="admission"
            ) from None
        self.num_pending += 1
        self.num_large += is_large
        if self.tracer is not None:
            self.tracer.instant("admitted", request.request_id, images=len(request.images))
        return job

    def is_large(self, request: ChatRequest) -> bool:
        """Whether ``request`` is prepared in the template stage's large lane."""
        return self.preparation.template.is_large(request.render_chars)

    def _job_left(self, job: Job[PreparedRequest]) -> None:
        self.preparation.release(job)
        self.num_pending -= 1
        self.num_large -= job.payload.is_large
        self.metrics.jobs[job.outcome.state.value] += 1
        if self.num_pending == 0:
            self._idle.set()
            self._idle = anyio.Event()

    async def wait_idle(self) -> None:
        """Return once no admitted request is in the stages."""
        if self.num_pending:
            await self._idle.wait()
