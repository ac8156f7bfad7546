"""Pipeline: start/stop, admission, ``prepare()`` through the stages and ``submit()`` to the engine."""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.config import PipelineConfig
from pipeline.errors import Overloaded, ShuttingDown
from pipeline.handle import RequestHandle
from pipeline.metrics import Metrics
from pipeline.preparation import Preparation, PreparedRequest
from pipeline.request import ChatRequest, parse_chat_request
from pipeline.staged import Job
from pipeline.trace import Tracer
from sampling.inputs import EngineInput
from vision.checkpoint import Checkpoint, open_checkpoint
from vision.encoder import VisionEncoder

__all__ = ["Pipeline"]


class Pipeline:
    """The request pipeline and decode engine of one model; use as ``async with Pipeline(cfg) as p``."""

    def __init__(
        self, config: PipelineConfig | None = None, *, with_engine: bool = True, tracer: Tracer | None = None
    ) -> None:
        self.config = config or PipelineConfig()
        self.tracer = tracer
        self.with_engine = with_engine
        self.metrics = Metrics()
        self._pending = 0
        self._accepting = False
        self._tg: TaskGroup | None = None
        self.engine: Any = None
        self._handles: set[RequestHandle] = set()
        self._idle = anyio.Event()

    # -- lifecycle ----------------------------------------------------------------------------
    def _load(self) -> None:
        """Heavy, synchronous model loading (run in a worker thread)."""
        cfg = self.config
        self.device = cfg.resolved_device()
        self.checkpoint: Checkpoint = open_checkpoint(cfg.model, cfg.cache_dir)
        ck = self.checkpoint
        self.tokenizer = ck.tokenizer
        self.encoder = VisionEncoder(ck, device=self.device) if ck.vision_config is not None else None
        self.tokenizer_info = ck.tokenizer_info
        if self.with_engine:
            from sampling.factory import build_engine

            self.engine = build_engine(ck, self.tokenizer_info, cfg, device=self.device)
            self.engine.engine.tracer = self.tracer

    async def __aenter__(self) -> Pipeline:
        await anyio.to_thread.run_sync(self._load)
        self.preparation = Preparation(
            self.config, self.checkpoint, self.encoder, metrics=self.metrics, tracer=self.tracer
        )
        prep = self.preparation
        # the stages, by name, for callers and tests that look inside
        self.fetch, self.decode, self.template = prep.fetch, prep.decode, prep.template
        self.vision, self.grammar = prep.vision, prep.grammar
        self._tg = await anyio.create_task_group().__aenter__()
        prep.start(self._tg)
        if self.engine is not None:
            await self.engine.start()
        self._accepting = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._accepting = False
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            await self.preparation.aclose()
            if self.engine is not None:
                await self.engine.aclose()

    # -- admission ----------------------------------------------------------------------------
    def parse(self, body: Any) -> ChatRequest:
        """:raises InvalidRequest: naming the offending field."""
        cfg = self.config
        return parse_chat_request(
            body,
            max_images=cfg.max_images_per_request,
            default_max_tokens=cfg.default_max_tokens,
            max_model_len=cfg.max_model_len,
        )

    def _admit(self, request: ChatRequest) -> Job:
        if not self._accepting:
            raise ShuttingDown("the pipeline is not accepting requests", retry_after=self.config.retry_after_s)
        if self._pending >= self.config.max_pending_requests:
            self.metrics.outcomes["refused"] += 1
            raise Overloaded(
                f"{self._pending} requests in preparation; the limit is {self.config.max_pending_requests}",
                retry_after=self.config.retry_after_s,
                stage="admission",
                request_id=request.request_id,
            )
        job = Job(request.request_id, PreparedRequest(request), on_leave=self._job_left)
        try:
            self.preparation.stages[0].send.send_nowait(job)
        except anyio.WouldBlock:
            self.metrics.outcomes["refused"] += 1
            raise Overloaded(
                "the first stage's inbox is full", retry_after=self.config.retry_after_s, stage="admission"
            ) from None
        self._pending += 1
        if self.tracer is not None:
            self.tracer.instant("admitted", request.request_id, images=len(request.images))
        assert self._tg is not None
        if request.grammar is not None:
            self._tg.start_soon(self.preparation.compile_grammar, job)
        else:
            job.payload.grammar_done.set()
        return job

    def _job_left(self, job: Job) -> None:
        self._pending -= 1
        self.metrics.outcomes[job.outcome or "unknown"] += 1
        if self._pending == 0:
            self._idle.set()
            self._idle = anyio.Event()

    async def wait_idle(self) -> None:
        """Return once no request is in the stages and no grammar compile is running."""
        if self._pending:
            await self._idle.wait()
        await self.grammar.wait_idle()

    @property
    def num_pending(self) -> int:
        """Requests admitted whose preparation has not yet left the stages."""
        return self._pending

    async def prepare(self, request: ChatRequest | dict[str, Any]) -> EngineInput:
        """Run one request through every preparation stage and join its grammar.

        :raises PipelineError: the typed error of the stage that failed (Overloaded at admission).
        """
        if not isinstance(request, ChatRequest):
            request = self.parse(request)
        return await self.preparation.engine_input(self._admit(request))

    async def submit(self, request: ChatRequest | dict[str, Any]) -> RequestHandle:
        """Admit ``request`` (refusing at once when full) and start it; stream or await the handle.

        :raises InvalidRequest: for a malformed body. :raises Overloaded: when the pipeline is full.
        """
        if self.engine is None:
            raise RuntimeError("this Pipeline was built with_engine=False")
        if not isinstance(request, ChatRequest):
            request = self.parse(request)
        job = self._admit(request)
        handle = RequestHandle(request, self.engine, self.metrics, tracer=self.tracer)
        self._handles.add(handle)
        assert self._tg is not None
        self._tg.start_soon(self._run_handle, handle, job)
        return handle

    async def _run_handle(self, handle: RequestHandle, job: Job) -> None:
        try:
            await handle.run(self.preparation.engine_input(job))
        finally:
            self._handles.discard(handle)

    def stop_accepting(self) -> None:
        """New requests are refused with 503 from now on; those admitted go on."""
        self._accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every admitted request to end; False if some were still running."""
        with anyio.move_on_after(timeout_s):
            while self._handles:
                await next(iter(self._handles)).wait_done()
            return True
        for handle in list(self._handles):
            handle.cancel()
        return False

    def health(self) -> dict[str, Any]:
        return {"status": "ok" if self._accepting else "stopping", "pending": self._pending}

    @property
    def model_name(self) -> str:
        return self.checkpoint.model_name
