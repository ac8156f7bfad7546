"""Pipeline: start/stop, admission, ``prepare()`` through the stages and ``submit()`` to the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from pipeline.config import PipelineConfig
from pipeline.errors import InvalidRequest, Overloaded, PipelineError, ShuttingDown
from pipeline.handle import RequestHandle
from pipeline.metrics import Metrics
from pipeline.request import ChatRequest, parse_chat_request
from pipeline.staged import Job, StageWorkers, run_each
from pipeline.trace import Tracer
from sampling.inputs import EngineInput
from stages.decode import DecodeStage
from stages.fetch import FetchStage
from stages.grammar import GrammarStage
from stages.template import TemplateStage
from stages.vision_encode import VisionEncodeStage
from vision.checkpoint import Checkpoint, open_checkpoint
from vision.encoder import VisionEncoder
from vision.preprocess import ImageTokenIds, PreparedImage, preprocess_image

__all__ = ["Pipeline"]


@dataclass(eq=False)
class _Prep:
    """What the stages fill in for one request."""

    request: ChatRequest
    image_bytes: list[bytes] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None
    grammar: Any | None = None
    grammar_done: anyio.Event = field(default_factory=anyio.Event)
    grammar_error: PipelineError | None = None


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
        self.image_token_id = ck.image_token_id if ck.image_token_id is not None else -1
        self.encoder = VisionEncoder(ck, device=self.device) if ck.vision_config is not None else None
        self.tokenizer_info = ck.tokenizer_info
        if self.with_engine:
            from sampling.factory import build_engine

            self.engine = build_engine(ck, self.tokenizer_info, cfg, device=self.device)
            self.engine.engine.tracer = self.tracer

    async def __aenter__(self) -> Pipeline:
        await anyio.to_thread.run_sync(self._load)
        cfg = self.config
        ck = self.checkpoint
        processor = ck.image_processor
        longest = (getattr(processor, "size", None) or {}).get("longest_edge") if processor else None
        self.fetch = FetchStage(cfg)
        self.decode = DecodeStage(
            cfg, target_longest_edge=longest, transform=partial(preprocess_image, processor) if processor else None
        )
        self.template = TemplateStage(
            self.tokenizer,
            ImageTokenIds.from_tokenizer(self.tokenizer, self.image_token_id),
            max_prompt_tokens=cfg.max_prompt_tokens,
            threads=cfg.template_threads,
            inline=cfg.inline_preparation,
        )
        self.vision = (
            VisionEncodeStage(
                self.encoder,
                max_batch=cfg.vision_max_batch,
                wait_ms=cfg.vision_batch_wait_ms,
                queue_size=cfg.stage_queue_size * cfg.max_images_per_request,
                inline=cfg.inline_preparation,
            )
            if self.encoder is not None
            else None
        )
        self.grammar = GrammarStage(cfg, self.tokenizer_info)
        self.metrics.grammar_cache_hits = lambda: self.grammar.stats.hits
        self.metrics.grammar_cache_misses = lambda: self.grammar.stats.misses
        self._stages = self._build_stages()
        self._tg = await anyio.create_task_group().__aenter__()
        self.grammar.attach(self._tg)
        for stage in self._stages:
            stage.start(self._tg)
        if self.vision is not None:
            self._tg.start_soon(self.vision.run_batcher)
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
            for stage in self._stages:
                await stage.aclose()
            if self.vision is not None:
                await self.vision.aclose()
            if self.engine is not None:
                await self.engine.aclose()
            await self.fetch.aclose()

    def _build_stages(self) -> list[StageWorkers]:
        cfg = self.config
        steps = [
            ("fetch", self._fetch_step, cfg.fetch_concurrency),
            ("decode", self._decode_step, cfg.decode_threads * 2),
            ("template", self._template_step, cfg.template_threads * 2),
            ("vision", self._vision_step, cfg.vision_max_batch * 2),
        ]
        stages = [
            StageWorkers(
                name,
                step,
                num_workers=n,
                queue_size=cfg.stage_queue_size,
                metrics=self.metrics.stage(name),
                tracer=self.tracer,
            )
            for name, step, n in steps
        ]
        for before, after in zip(stages, stages[1:], strict=False):
            before.next = after
        return stages

    # -- the stage steps ------------------------------------------------------------------------
    async def _fetch_step(self, job: Job) -> None:
        prep: _Prep = job.payload
        images = prep.request.images
        results: list[bytes] = [b""] * len(images)

        async def fetch_one(i: int) -> None:
            results[i] = await self.fetch.run(images[i].url, field=images[i].field)

        await run_each(fetch_one, len(images))
        prep.image_bytes = results

    async def _decode_step(self, job: Job) -> None:
        prep: _Prep = job.payload
        fields = [im.field for im in prep.request.images]
        prepared: list[PreparedImage | None] = [None] * len(fields)

        async def decode_one(i: int) -> None:
            prepared[i] = await self.decode.run(prep.image_bytes[i], field=fields[i])

        await run_each(decode_one, len(fields))
        prep.image_bytes = []  # the encoded bytes are no longer needed: free them early
        prep.images = [p for p in prepared if p is not None]

    async def _template_step(self, job: Job) -> None:
        prep: _Prep = job.payload
        prep.prompt_ids = await self.template.run(prep.request.messages, prep.images)

    async def _vision_step(self, job: Job) -> None:
        prep: _Prep = job.payload
        if prep.images:
            if self.vision is None:
                raise InvalidRequest("this model takes no images", field="messages")
            prep.image_embeds = await self.vision.run(prep.images)
        prep.images = []

    async def _compile_grammar(self, job: Job) -> None:
        """Runs beside the stages from admission on; a bad grammar fails the request at once."""
        prep: _Prep = job.payload
        started = time.perf_counter()
        try:
            assert prep.request.grammar is not None
            prep.grammar = await self.grammar.compile(prep.request.grammar, request_id=job.request_id)
        except PipelineError as exc:
            prep.grammar_error = exc.bind(stage="grammar", request_id=job.request_id)
            job.fail(prep.grammar_error)
        except Exception as exc:  # a bug must fail this request, not the pipeline's task group
            prep.grammar_error = PipelineError(f"internal error: {exc!r}", stage="grammar", request_id=job.request_id)
            job.fail(prep.grammar_error)
        finally:
            ended = time.perf_counter()
            job.timings["grammar"] = ended - started
            if self.tracer is not None:
                self.tracer.span("grammar compile", "grammar", job.request_id, started, ended)
            prep.grammar_done.set()

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
        job = Job(request.request_id, _Prep(request), on_leave=self._job_left)
        try:
            self._stages[0].send.send_nowait(job)
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
            self._tg.start_soon(self._compile_grammar, job)
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
        return await self._finish_prepare(self._admit(request))

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
            await handle.run(self._finish_prepare(job))
        finally:
            self._handles.discard(handle)

    async def _finish_prepare(self, job: Job) -> EngineInput:
        prep: _Prep = job.payload
        try:
            await job.done.wait()
            if job.error is None:
                await prep.grammar_done.wait()
        except BaseException:
            job.cancel()
            raise
        if job.error is not None:
            raise job.error
        if prep.grammar_error is not None:
            raise prep.grammar_error
        request = prep.request
        return EngineInput(
            request_id=request.request_id,
            prompt_token_ids=prep.prompt_ids,
            image_token_id=self.image_token_id,
            image_embeds=prep.image_embeds,
            sampling=request.sampling,
            grammar=prep.grammar,
            timings=dict(job.timings),
        )

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
