"""The steps that carry a request through the preparation stages of one model.

``Preparation`` owns the stage objects (fetch, decode, template, vision encode, grammar; built by
``pipeline.stage_factory``) and one ``StageWorkers`` pool per stage; the ``Pipeline`` owns
admission, lifecycle and the engine.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.answer.call_check import with_calls_check
from pipeline.answer.handle import PreparedInput
from pipeline.config import PipelineConfig
from pipeline.core.grammar_overlap import overlaps, settle
from pipeline.core.image_steps import ImageSteps, RequestImages
from pipeline.core.loop_turns import LoopTurns
from pipeline.core.staged import Job, StageWorkers
from pipeline.engine.factory import check_fits
from pipeline.engine.remote_grammar import RemoteGrammarStage
from pipeline.errors import PipelineError
from pipeline.observability.metrics import Metrics
from pipeline.observability.trace import Tracer
from pipeline.outcome import Outcome
from pipeline.protocol.request import ChatRequest
from pipeline.stage_factory import (
    build_decode_stage,
    build_encoder_cache,
    build_fetch_stage,
    build_reasoning_format,
    build_template_stage,
    build_vision_stage,
)
from sampling.families import family_of
from sampling.inputs import EngineInput
from stages.grammar import CompiledConstraint, GrammarStage
from stages.process_pool import ImagePool
from stages.prompt_content import check_prompt_has_content, special_token_ids
from stages.reasoning import ReasoningFormat
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder, split_deepstack
from vision.image_text import ImageText
from vision.mrope import MRopeIndex, MRopePositions
from vision.preprocess import target_longest_edge

__all__ = ["Preparation", "PreparedRequest"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PreparedRequest:
    """What the stages fill in for one request."""

    request: ChatRequest
    is_large: bool = False  # rendered in the template stage's large lane (admission decides)
    images: RequestImages = field(default_factory=RequestImages)
    prompt_ids: list[int] = field(default_factory=list)
    grammar: Outcome[CompiledConstraint | None] = field(default_factory=Outcome)  # None: unconstrained
    # the compiled grammar for an engine in this process that gets the request before its compile ends
    compiled: Future[Any] | None = None
    mrope: MRopePositions | None = None  # M-RoPE models: the prompt's positions, once it has images


class Preparation:
    """The stage objects, their worker pools, and the steps a request goes through."""

    def __init__(
        self,
        config: PipelineConfig,
        checkpoint: Checkpoint,
        encoder: VisionEncoder | None,
        grammar: GrammarStage | RemoteGrammarStage,
        pool: ImagePool | None,
        *,
        turns: LoopTurns,
        metrics: Metrics,
        tracer: Tracer | None = None,
    ) -> None:
        cfg = self.config = config
        self.metrics = metrics
        self.tracer = tracer
        tokenizer = checkpoint.tokenizer
        self.image_token_id = checkpoint.image_token_id if checkpoint.image_token_id is not None else -1
        self.hidden_size = int(checkpoint.text_config.hidden_size)
        # M-RoPE: positions depend on the image grids, so they are computed here, with the prompt
        family = family_of(checkpoint)
        mrope = family.position_scheme == "mrope" and self.image_token_id >= 0
        # Qwen3-VL: the encoder packs DeepStack features beside each embedding (vision/encoder.py)
        self.has_deepstack = "deepstack_visual_embeds" in family.extra_prefill_inputs
        self.rope_index = MRopeIndex(checkpoint.config, self.image_token_id) if mrope else None
        processor = checkpoint.image_processor
        longest = target_longest_edge(processor)
        self.fetch = build_fetch_stage(cfg)
        self.pool = pool  # the pipeline's: started beside the model's loading, closed after the stages
        self.decode = build_decode_stage(cfg, processor, longest, self.pool)
        image_text = ImageText.from_checkpoint(checkpoint.config, tokenizer) if processor else None
        self.template = build_template_stage(cfg, tokenizer, self.image_token_id, image_text)
        self.special_ids = special_token_ids(tokenizer)
        self.reasoning = build_reasoning_format(cfg, tokenizer)  # None: the model's text is all answer
        self.vision = build_vision_stage(cfg, encoder)
        self.encoder_cache = build_encoder_cache(cfg, checkpoint)
        takes_images = checkpoint.vision_config is not None  # encoded here, or (no encoder) in the engine process
        self.images = ImageSteps(self.fetch, self.decode, self.vision, self.encoder_cache, tracer, takes_images)
        self.grammar = grammar
        metrics.grammar_compiles = lambda: self.grammar.stats.backends
        metrics.grammar = self.grammar.counters
        metrics.register_cache("grammar", self.grammar.cache_counters)
        self.stages = self._build_stages()
        self.turns = turns  # the pipeline's: wrapping an engine input takes one (see ``prepared``)
        self._tg: TaskGroup | None = None

    def admit(self, job: Job[PreparedRequest]) -> None:
        """Put ``job`` into the first stage and start its grammar compile beside the stages.

        :raises anyio.WouldBlock: the first stage's inbox is full (nothing was started).
        """
        assert self._tg is not None, "start() first"
        self.stages[0].offer(job)
        if job.payload.request.grammar is not None:
            # llguidance serves a new spec's first requests (xgrammar compiles in the background, at
            # the lowest priority, from its second use on), whatever the preparation: measured with
            # ``bench compile``, waiting for xgrammar behind a distinct image's preparation cost more
            # (its compile competes with decode and encode for 2 cores) than llguidance's masks
            if not isinstance(self.grammar, RemoteGrammarStage):  # the engine in this process waits on it
                job.payload.compiled = Future()
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
            "template_large": self.template.large_offload.limiter,
            "grammar": self.grammar.limiter,
            "grammar_fast": self.grammar.fast_limiter,  # llguidance compiles and grammar parses
            "loop_turns": self.turns.limiter,
        }
        if self.vision is not None:
            limiters["vision"] = self.vision.limiter
        return limiters

    def side_queues(self) -> dict[str, int]:
        """Items waiting outside the stage inboxes (the vision batcher's queue)."""
        queues = {"vision_batcher": self.vision.queue_depth} if self.vision is not None else {}
        if self.encoder_cache is not None:  # encodes owned for other requests (0 once idle)
            queues["encoder_cache_flights"] = self.encoder_cache.num_flights
        return queues

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
            ("decode", self._decode_step, (cfg.num_prep_workers() if self.pool else cfg.decode_threads) * 2),
            # the large requests waiting for their lane hold at most max_large_requests workers
            ("template", self._template_step, cfg.template_threads * 2 + cfg.max_large_requests),
            ("vision", self._vision_step, cfg.vision_max_batch * 2),
        ]
        # admission's bound is max_pending_requests (config.py): the first inbox must not refuse sooner
        first_queue = max(cfg.stage_queue_size, cfg.max_pending_requests)
        stages = [
            StageWorkers(
                name,
                step,
                num_workers=n,
                queue_size=first_queue if i == 0 else cfg.stage_queue_size,
                metrics=self.metrics.stage(name),
                tracer=self.tracer,
            )
            for i, (name, step, n) in enumerate(steps)
        ]
        for before, after in zip(stages, stages[1:], strict=False):
            before.next = after
        return stages

    # -- the stage steps ------------------------------------------------------------------------
    async def _fetch_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        await self.images.fetch_step(prep.request.images, prep.images, job.request_id)

    async def _decode_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        await self.images.decode_step(prep.request.images, prep.images)

    async def _template_step(self, job: Job[PreparedRequest]) -> None:
        prep = job.payload
        request = prep.request
        plan = request.tools
        tools = plan.tools if plan is not None else ()
        prep.prompt_ids = await self.template.run(
            request.messages,
            prep.images.images,
            tools,
            request.prompt,
            request.prompt_field,
            request.template,
            large=prep.is_large,
        )
        if request.prompt is None:
            check_prompt_has_content(prep.prompt_ids, self.special_ids, request.messages)
        if plan is not None and plan.starts_with_call and plan.format.marker is not None:
            prep.prompt_ids += self.template.marker_ids(plan.format.marker)  # the turn opens with its calls
        sampling, where = request.sampling, "messages" if request.prompt is None else request.prompt_field
        check_fits(self.config, len(prep.prompt_ids), sampling.n, sampling.max_tokens, where)
        grids = [image.grid_thw for image in prep.images.images]
        if self.rope_index is not None and grids:
            prep.mrope = await self.template.offload.run(self.rope_index, prep.prompt_ids, grids)

    async def _vision_step(self, job: Job[PreparedRequest]) -> None:
        await self.images.vision_step(job.payload.images)

    def release(self, job: Job[PreparedRequest]) -> None:
        """What ``job`` still holds once it left the stages (encodes it owned for others)."""
        self.images.release(job.payload.images)

    async def _compile_grammar(self, job: Job[PreparedRequest]) -> None:
        """Runs beside the stages from admission on; a bad grammar fails the request at once."""
        prep = job.payload
        spec = prep.request.grammar
        assert spec is not None
        started = time.perf_counter()
        try:
            constraint = await self.grammar.compile(spec, request_id=job.request_id)
            prep.grammar.set_result(await with_calls_check(constraint, prep.request.tools))
        except PipelineError as exc:
            prep.grammar.fail(exc.bind(stage="grammar", request_id=job.request_id))
        except Exception as exc:  # a bug must fail this request, not the pipeline's task group
            logger.exception("request %s: unexpected error compiling its grammar", job.request_id)
            prep.grammar.fail(
                PipelineError(f"internal error ({type(exc).__name__})", stage="grammar", request_id=job.request_id)
            )
        finally:
            settle(prep.compiled, prep.grammar)
            ended = time.perf_counter()
            job.timings["grammar"] = ended - started
            if self.tracer is not None:
                self.tracer.span("grammar compile", "grammar", job.request_id, started, ended)
            if prep.grammar.error is not None:
                job.fail(prep.grammar.error)  # type: ignore[arg-type]

    def _grammar_trigger(self, request: ChatRequest) -> int | None:
        """``auto`` tool calls: the grammar holds from the marker on."""
        plan = request.tools
        if plan is None or plan.starts_with_call or plan.spans_answer:
            return None
        return self.template.marker_token(plan.format.marker)

    async def engine_input(self, job: Job[PreparedRequest]) -> EngineInput:
        """What ``prepared`` gives, for the engine alone."""
        return (await self.prepared(job, overlap=False)).inp

    async def prepared(self, job: Job[PreparedRequest], *, overlap: bool = True) -> PreparedInput:
        """Wait for ``job`` to leave the last stage, join its grammar (with ``overlap``, not one that
        ``grammar_overlap.overlaps`` lets go on compiling), and wrap it for the engine.

        :raises PipelineError: the error the job ended with. A cancelled caller cancels the job.
        """
        prep = job.payload
        try:
            await job.wait()
            # a request that may go to the engine before its compile ends (pipeline.core.grammar_overlap)
            is_early = overlap and overlaps(prep.request, prep.grammar, self.config.grammar_backend)
            if job.error is None and not is_early:
                await prep.grammar.wait()
            error = job.error or prep.grammar.error
            if error is None and is_early:  # its compile may still be refused while it waits
                error = await self.turns.acquire_unless_failed(prep.grammar)
            elif error is None:
                await self.turns.acquire()
        except BaseException:
            job.cancel()
            raise
        if error is not None:
            raise error  # no turn: raising is not the long step the turns are for
        try:
            return self._wrap(job)
        finally:
            # the caller's step goes on to the engine's submit: the next turn starts in the next iteration
            self.turns.release()

    def _wrap(self, job: Job[PreparedRequest]) -> PreparedInput:
        prep = job.payload
        request = prep.request
        if not prep.grammar.is_done:  # see grammar_overlap
            inp = self._engine_input(job, prep.compiled, ("pending", request.grammar))
            inp.grammar_pending = True
            return PreparedInput(inp, None, prep.grammar, reasoning=self._reasoning_of(inp))
        constraint = prep.grammar.get()
        source = (constraint.backend, request.grammar) if constraint is not None else None
        inp = self._engine_input(job, constraint.grammar if constraint else None, source)
        return PreparedInput(inp, constraint, reasoning=self._reasoning_of(inp))

    def _reasoning_of(self, inp: EngineInput) -> ReasoningFormat | None:
        """The model's reasoning tags where ``inp`` starts with reasoning, to split its answers."""
        return self.reasoning if inp.reasoning_end is not None else None

    def _reasoning_end(self, request: ChatRequest, prompt_ids: list[int]) -> int | None:
        """The token after which the answer of a chat request to a reasoning model starts (None: it
        starts at once: a raw completions prompt, a model that does not reason, or a prompt whose
        template closed the reasoning already, as Qwen3's does for ``enable_thinking: false``)."""
        reasoning = self.reasoning
        if reasoning is None or request.prompt is not None or not reasoning.open_at_start(prompt_ids):
            return None
        return reasoning.end_id

    def _engine_input(self, job: Job[PreparedRequest], grammar: Any, source: tuple[str, Any] | None) -> EngineInput:
        prep = job.payload
        request = prep.request
        embeds, deepstack = prep.images.embeds, None
        if embeds is not None and self.has_deepstack:
            embeds, deepstack = split_deepstack(embeds, self.hidden_size)
        inp = EngineInput(
            request_id=request.request_id,
            prompt_token_ids=prep.prompt_ids,
            image_token_id=self.image_token_id,
            image_embeds=embeds,
            image_pixels=prep.images.pixels,  # the engine process encodes them (then embeds is None)
            sampling=request.sampling,
            grammar=grammar,
            grammar_source=source,
            grammar_trigger=self._grammar_trigger(request),
            reasoning_end=self._reasoning_end(request, prep.prompt_ids),
            # a request sent before its compile ends gets the compile's time when it does (the handle reads it then)
            timings=job.timings if not prep.grammar.is_done else dict(job.timings),
            image_keys=prep.images.keys,
            mrope=prep.mrope,
            extra_prefill={"deepstack_visual_embeds": deepstack} if deepstack is not None else {},
        )
        return inp
