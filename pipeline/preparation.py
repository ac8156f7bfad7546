"""The preparation stages of one model, and the steps that carry a request through them.

``Preparation`` owns the stage objects (fetch, decode, template, vision encode, grammar) and one
``StageWorkers`` pool per stage; the ``Pipeline`` owns admission, lifecycle and the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from pipeline.config import PipelineConfig
from pipeline.errors import InvalidRequest, PipelineError
from pipeline.metrics import Metrics
from pipeline.request import ChatRequest
from pipeline.staged import Job, StageWorkers, run_each
from pipeline.trace import Tracer
from sampling.inputs import EngineInput
from stages.decode import DecodeStage
from stages.fetch import FetchStage
from stages.grammar import GrammarStage
from stages.template import TemplateStage
from stages.vision_encode import VisionEncodeStage
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.preprocess import ImageTokenIds, PreparedImage, preprocess_image

__all__ = ["Preparation", "PreparedRequest"]


@dataclass(eq=False)
class PreparedRequest:
    """What the stages fill in for one request."""

    request: ChatRequest
    image_bytes: list[bytes] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None
    grammar: Any | None = None
    grammar_done: anyio.Event = field(default_factory=anyio.Event)
    grammar_error: PipelineError | None = None


class Preparation:
    """The stage objects, their worker pools, and the steps a request goes through."""

    def __init__(
        self,
        config: PipelineConfig,
        checkpoint: Checkpoint,
        encoder: VisionEncoder | None,
        *,
        metrics: Metrics,
        tracer: Tracer | None = None,
    ) -> None:
        cfg = self.config = config
        self.metrics = metrics
        self.tracer = tracer
        tokenizer = checkpoint.tokenizer
        self.image_token_id = checkpoint.image_token_id if checkpoint.image_token_id is not None else -1
        processor = checkpoint.image_processor
        longest = (getattr(processor, "size", None) or {}).get("longest_edge") if processor else None
        self.fetch = FetchStage(cfg)
        self.decode = DecodeStage(
            cfg, target_longest_edge=longest, transform=partial(preprocess_image, processor) if processor else None
        )
        self.template = TemplateStage(
            tokenizer,
            ImageTokenIds.from_tokenizer(tokenizer, self.image_token_id),
            max_prompt_tokens=cfg.max_prompt_tokens,
            threads=cfg.template_threads,
            inline=cfg.inline_preparation,
        )
        self.vision = (
            VisionEncodeStage(
                encoder,
                max_batch=cfg.vision_max_batch,
                wait_ms=cfg.vision_batch_wait_ms,
                queue_size=cfg.stage_queue_size * cfg.max_images_per_request,
                threads=cfg.vision_encode_threads,
                inline=cfg.inline_preparation,
            )
            if encoder is not None
            else None
        )
        self.grammar = GrammarStage(cfg, checkpoint.tokenizer_info)
        metrics.grammar_cache_hits = lambda: self.grammar.stats.hits
        metrics.grammar_cache_misses = lambda: self.grammar.stats.misses
        self.stages = self._build_stages()

    def start(self, tg: TaskGroup) -> None:
        self.grammar.attach(tg)
        for stage in self.stages:
            stage.start(tg)
        if self.vision is not None:
            tg.start_soon(self.vision.run_batcher)

    async def aclose(self) -> None:
        for stage in self.stages:
            await stage.aclose()
        if self.vision is not None:
            await self.vision.aclose()
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
        prep: PreparedRequest = job.payload
        images = prep.request.images
        results: list[bytes] = [b""] * len(images)

        async def fetch_one(i: int) -> None:
            results[i] = await self.fetch.run(images[i].url, field=images[i].field)

        await run_each(fetch_one, len(images))
        prep.image_bytes = results

    async def _decode_step(self, job: Job) -> None:
        prep: PreparedRequest = job.payload
        fields = [im.field for im in prep.request.images]
        prepared: list[PreparedImage | None] = [None] * len(fields)

        async def decode_one(i: int) -> None:
            prepared[i] = await self.decode.run(prep.image_bytes[i], field=fields[i])

        await run_each(decode_one, len(fields))
        prep.image_bytes = []  # the encoded bytes are no longer needed: free them early
        prep.images = [p for p in prepared if p is not None]

    async def _template_step(self, job: Job) -> None:
        prep: PreparedRequest = job.payload
        prep.prompt_ids = await self.template.run(prep.request.messages, prep.images)

    async def _vision_step(self, job: Job) -> None:
        prep: PreparedRequest = job.payload
        if prep.images:
            if self.vision is None:
                raise InvalidRequest("this model takes no images", field="messages")
            prep.image_embeds = await self.vision.run(prep.images)
        prep.images = []

    async def compile_grammar(self, job: Job) -> None:
        """Runs beside the stages from admission on; a bad grammar fails the request at once."""
        prep: PreparedRequest = job.payload
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

    async def engine_input(self, job: Job) -> EngineInput:
        """Wait for ``job`` to leave the last stage, join its grammar, and wrap it for the engine.

        :raises PipelineError: the error the job ended with. A cancelled caller cancels the job.
        """
        prep: PreparedRequest = job.payload
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
