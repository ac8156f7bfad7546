"""The preparation stages of one model, and the steps that carry a request through them.

``Preparation`` owns the stage objects (fetch, decode, template, vision encode, grammar) and one
``StageWorkers`` pool per stage; the ``Pipeline`` owns admission, lifecycle and the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

import anyio
import torch
from anyio.abc import TaskGroup

from pipeline.config import PipelineConfig
from pipeline.errors import InvalidRequest, PipelineError
from pipeline.metrics import Metrics
from pipeline.request import ChatRequest
from pipeline.staged import Job, StageWorkers, run_each
from pipeline.trace import Tracer
from pipeline.types import Outcome
from sampling.inputs import EngineInput
from sampling.llguidance_backend import LLGuidanceBackend
from stages.decode import DecodeStage
from stages.fetch import FetchStage
from stages.grammar import CompiledConstraint, GrammarStage
from stages.grammar_backends import LLGuidanceCompiler, XGrammarCompiler
from stages.process_pool import ImagePool
from stages.template import TemplateStage
from stages.vision_encode import VisionEncodeStage
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.image_worker import ImageWorkerSpec
from vision.preprocess import ImageTokenIds, PreparedImage, preprocess_image

__all__ = ["Preparation", "PreparedInput", "PreparedRequest", "build_grammar_stage"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PreparedRequest:
    """What the stages fill in for one request."""

    request: ChatRequest
    image_bytes: list[bytes] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None
    grammar: Outcome[CompiledConstraint | None] = field(default_factory=Outcome)  # None: unconstrained


@dataclass(frozen=True, slots=True)
class PreparedInput:
    """A request ready to decode: the engine's input, and the constraint its answers are checked
    against (None when unconstrained)."""

    inp: EngineInput
    constraint: CompiledConstraint | None


def build_grammar_stage(config: PipelineConfig, checkpoint: Checkpoint) -> GrammarStage:
    """The grammar stage with both backends for ``checkpoint``'s tokenizer (seconds: run it off the loop)."""
    info = checkpoint.tokenizer_info
    llguidance = LLGuidanceBackend(
        checkpoint.tokenizer, vocab_size=info.vocab_size, stop_token_ids=[int(t) for t in info.stop_token_ids]
    )
    return GrammarStage(
        XGrammarCompiler(info, any_whitespace=config.json_any_whitespace),
        LLGuidanceCompiler(llguidance),
        timeout_s=config.grammar_compile_timeout_s,
        cache_bytes=config.grammar_cache_bytes,
        max_concurrent=config.grammar_max_concurrent_compiles,
        xgrammar_budget_s=config.grammar_xgrammar_budget_s,
        backend=config.grammar_backend,
    )


class Preparation:
    """The stage objects, their worker pools, and the steps a request goes through."""

    def __init__(
        self,
        config: PipelineConfig,
        checkpoint: Checkpoint,
        encoder: VisionEncoder | None,
        grammar: GrammarStage,
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
        self.fetch = FetchStage(
            max_bytes=cfg.max_image_bytes,
            concurrency=cfg.fetch_concurrency,
            connect_timeout_s=cfg.fetch_connect_timeout_s,
            total_timeout_s=cfg.fetch_total_timeout_s,
            max_redirects=cfg.max_redirects,
            allow_private=cfg.allow_private_networks,
            media_root=cfg.media_root,
        )
        self.pool = self._build_pool(checkpoint, encoder, longest)
        self.decode = DecodeStage(
            max_pixels=cfg.max_image_pixels,
            threads=cfg.decode_threads,
            inline=cfg.inline_preparation,
            target_longest_edge=longest,
            transform=partial(preprocess_image, processor) if processor else None,
            pool=self.pool,
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
        self.grammar = grammar
        metrics.grammar_cache_hits = lambda: self.grammar.stats.hits
        metrics.grammar_cache_misses = lambda: self.grammar.stats.misses
        metrics.grammar_compiles = lambda: self.grammar.stats.backends
        self.stages = self._build_stages()
        self._tg: TaskGroup | None = None

    def _build_pool(
        self, checkpoint: Checkpoint, encoder: VisionEncoder | None, longest_edge: int | None
    ) -> ImagePool | None:
        """The worker processes of process mode (for a model that takes images)."""
        cfg = self.config
        if cfg.preparation_mode != "process" or cfg.inline_preparation or checkpoint.image_processor is None:
            return None
        # The encoder runs in the workers when it runs on the CPU: there it is GIL-free torch work
        # like the rest, at low priority. On a GPU it stays in this process, on the device, where
        # its micro-batches share the device with the decode engine and need no copy of the weights.
        spec = ImageWorkerSpec(
            checkpoint_path=str(checkpoint.path),
            max_pixels=cfg.max_image_pixels,
            target_longest_edge=longest_edge,
            encode=encoder is not None and encoder.device.type == "cpu",
            nice=cfg.prep_worker_nice,
            task=cfg.prep_worker_task,
        )
        return ImagePool(
            spec,
            size=cfg.num_prep_workers(),
            max_image_bytes=cfg.max_image_bytes,
            job_timeout_s=cfg.prep_worker_timeout_s,
        )

    def warm(self) -> None:
        """Start the preparation workers now (else on the first image), in the background."""
        if self.pool is not None:
            self.pool.warm()

    def admit(self, job: Job[PreparedRequest]) -> None:
        """Put ``job`` into the first stage and start its grammar compile beside the stages.

        :raises anyio.WouldBlock: the first stage's inbox is full (nothing was started).
        """
        assert self._tg is not None, "start() first"
        self.stages[0].offer(job)
        if job.payload.request.grammar is not None:
            self._tg.start_soon(self._compile_grammar, job)
        else:
            job.payload.grammar.set_result(None)

    def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        self.grammar.attach(tg)
        if self.pool is not None:
            self.pool.attach(tg)
        for stage in self.stages:
            stage.start(tg)
        if self.vision is not None:
            tg.start_soon(self.vision.run_batcher)

    def limiters(self) -> dict[str, anyio.CapacityLimiter]:
        """Every stage's limiter by stage name (borrowed tokens: threads or slots in use)."""
        limiters = {
            "fetch": self.fetch.limiter,
            "fetch_base64": self.fetch.base64_limiter,
            "decode": self.decode.limiter,
            "template": self.template.limiter,
            "grammar": self.grammar.limiter,
        }
        if self.vision is not None:
            limiters["vision"] = self.vision.limiter
        return limiters

    def side_queues(self) -> dict[str, int]:
        """Items waiting outside the stage inboxes (the vision batcher's queue)."""
        return {"vision_batcher": self.vision.queue_depth} if self.vision is not None else {}

    async def aclose(self) -> None:
        for stage in self.stages:
            await stage.aclose()
        if self.vision is not None:
            await self.vision.aclose()
        await self.fetch.aclose()
        if self.pool is not None:
            await self.pool.aclose()

    def _build_stages(self) -> list[StageWorkers]:
        cfg = self.config
        steps = [
            ("fetch", self._fetch_step, cfg.fetch_concurrency),
            ("decode", self._decode_step, (cfg.num_prep_workers() if self.pool else cfg.decode_threads) * 2),
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
    async def _fetch_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        images = prep.request.images
        results: list[bytes] = [b""] * len(images)

        async def fetch_one(i: int) -> None:
            results[i] = await self.fetch.run(images[i].url, field=images[i].field)

        await run_each(fetch_one, len(images))
        prep.image_bytes = results

    async def _decode_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        fields = [im.field for im in prep.request.images]
        prepared: list[PreparedImage | None] = [None] * len(fields)

        async def decode_one(i: int) -> None:
            prepared[i] = await self.decode.run(prep.image_bytes[i], field=fields[i])

        await run_each(decode_one, len(fields))
        prep.image_bytes = []  # the encoded bytes are no longer needed: free them early
        prep.images = [p for p in prepared if p is not None]

    async def _template_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        prep.prompt_ids = await self.template.run(prep.request.messages, prep.images)

    async def _vision_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        if prep.images:
            if self.vision is None:
                raise InvalidRequest("this model takes no images", field="messages")
            prep.image_embeds = await self.vision.run(prep.images)
        prep.images = []

    async def _compile_grammar(self, job: Job[PreparedRequest]) -> None:
        """Runs beside the stages from admission on; a bad grammar fails the request at once."""
        prep = job.payload
        spec = prep.request.grammar
        assert spec is not None
        started = time.perf_counter()
        try:
            prep.grammar.set_result(await self.grammar.compile(spec, request_id=job.request_id))
        except PipelineError as exc:
            prep.grammar.fail(exc.bind(stage="grammar", request_id=job.request_id))
        except Exception as exc:  # a bug must fail this request, not the pipeline's task group
            logger.exception("request %s: unexpected error compiling its grammar", job.request_id)
            prep.grammar.fail(
                PipelineError(f"internal error ({type(exc).__name__})", stage="grammar", request_id=job.request_id)
            )
        finally:
            ended = time.perf_counter()
            job.timings["grammar"] = ended - started
            if self.tracer is not None:
                self.tracer.span("grammar compile", "grammar", job.request_id, started, ended)
            if prep.grammar.error is not None:
                job.fail(prep.grammar.error)  # type: ignore[arg-type]

    async def engine_input(self, job: Job[PreparedRequest]) -> EngineInput:
        """What ``prepared`` gives, for the engine alone."""
        return (await self.prepared(job)).inp

    async def prepared(self, job: Job[PreparedRequest]) -> PreparedInput:
        """Wait for ``job`` to leave the last stage, join its grammar, and wrap it for the engine.

        :raises PipelineError: the error the job ended with. A cancelled caller cancels the job.
        """
        prep = job.payload
        try:
            await job.wait()
            if job.error is None:
                await prep.grammar.wait()
        except BaseException:
            job.cancel()
            raise
        if job.error is not None:
            raise job.error
        request = prep.request
        constraint = prep.grammar.get()
        inp = EngineInput(
            request_id=request.request_id,
            prompt_token_ids=prep.prompt_ids,
            image_token_id=self.image_token_id,
            image_embeds=prep.image_embeds,
            sampling=request.sampling,
            grammar=constraint.grammar if constraint is not None else None,
            timings=dict(job.timings),
        )
        return PreparedInput(inp, constraint)
