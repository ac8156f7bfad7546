"""Pipeline: start/stop, ``prepare()`` through the stages and ``submit()`` to the engine.

What start() loads is ``pipeline.core.model_load``'s, the bound on requests in the stages
``pipeline.core.admission``'s; its stages are built by ``pipeline.stage_factory``, and what it
holds is read by ``pipeline.core.snapshot``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from prometheus_client.registry import Collector

from pipeline.answer.handle import RequestHandle
from pipeline.config import PipelineConfig
from pipeline.core.admission import Admission
from pipeline.core.loop_turns import LoopTurns
from pipeline.core.model_load import LoadedModel, OpenedModel, load_model, open_model
from pipeline.core.preparation import Preparation, PreparedRequest
from pipeline.core.run_together import run_together
from pipeline.core.snapshot import Resources, cache_counters, cache_stats, resources
from pipeline.core.staged import Job
from pipeline.engine.factory import Engine
from pipeline.errors import ShuttingDown
from pipeline.observability.metrics import Metrics
from pipeline.observability.prometheus import MetricsExporter
from pipeline.observability.trace import Tracer
from pipeline.protocol.completion_request import parse_completion_request
from pipeline.protocol.request import ChatRequest, parse_chat_request
from pipeline.protocol.request_limits import RequestLimits
from pipeline.protocol.sampling_defaults import SamplingDefaults
from pipeline.stage_factory import build_image_pool
from sampling.inputs import EngineInput
from stages.encoder_cache import CacheStats
from stages.process_pool import ImagePool
from stages.tokens import text_ids
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder

__all__ = ["Pipeline", "PipelineState", "Resources"]


class PipelineState(enum.Enum):
    NEW = "new"  # built, not started
    STARTING = "starting"  # loading the model
    ACCEPTING = "accepting"
    DRAINING = "draining"  # admitted requests go on; new ones get 503
    STOPPED = "stopped"


async def _shielded(close: Callable[[], Awaitable[None]]) -> None:
    with anyio.CancelScope(shield=True):
        await close()


def _in_turn(*steps: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """One step that runs ``steps`` one after the other."""

    async def run() -> None:
        for step in steps:
            await step()

    return run


class Pipeline:
    """The request pipeline and decode engine of one model; use as ``async with Pipeline(cfg) as p``."""

    def __init__(
        self, config: PipelineConfig | None = None, *, with_engine: bool = True, tracer: Tracer | None = None
    ) -> None:
        self.config = config or PipelineConfig()
        self.tracer = tracer
        self.with_engine = with_engine
        self.metrics = Metrics()
        self.metrics.pending = lambda: self.num_pending
        self.metrics.running = lambda: len(self._handles)
        self.metrics.waiting_for_engine = lambda: self._engine.room.num_waiting if self._engine is not None else 0
        self.metrics.engine = self.decoding
        self._exporter = MetricsExporter(self.metrics)
        for cache in ("encoder", "image_pixels", "kv_prefix"):  # read at scrape time; absent while off
            self.metrics.register_cache(cache, functools.partial(self._cache_counters, cache))
        self.state = PipelineState.NEW
        self.loop_turns = LoopTurns()  # taken by admission and replies (pipeline.api) and by ``prepared``
        self._model: LoadedModel | None = None  # checkpoint, encoder, engine, grammar stage: start() loads them
        self._preparation: Preparation | None = None
        self._admission: Admission | None = None
        self._engine: Engine | None = None
        self._stack = AsyncExitStack()
        self._tg: TaskGroup | None = None
        self._handles: set[RequestHandle] = set()

    # -- what start() builds -------------------------------------------------------------------
    @property
    def checkpoint(self) -> Checkpoint:
        if self._model is None:
            raise RuntimeError("the pipeline is not started")
        return self._model.checkpoint

    @property
    def encoder(self) -> VisionEncoder | None:
        return self._model.encoder if self._model is not None else None

    @property
    def preparation(self) -> Preparation:
        if self._preparation is None:
            raise RuntimeError("the pipeline is not started")
        return self._preparation

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the pipeline is not started, or was built with_engine=False")
        return self._engine

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids a request may name (logit_bias, prompt ids): the tokenizer's."""
        return len(self.checkpoint.tokenizer)

    @property
    def token_table(self) -> list[bytes]:
        """Each token id's bytes (log-probability entries show them)."""
        return self.engine.token_table

    def render_metrics(self) -> bytes:
        """The Prometheus text exposition of this pipeline's metrics."""
        return self._exporter.render()

    def add_metrics(self, collector: Collector) -> None:
        """Export ``collector``'s metrics beside the pipeline's (the server adds its connections')."""
        self._exporter.registry.register(collector)

    def remove_metrics(self, collector: Collector) -> None:
        self._exporter.registry.unregister(collector)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may carry; the first is the one responses report."""
        return self.config.served_model_names or (self.checkpoint.model_name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Pipeline:
        if self.state is not PipelineState.NEW:
            raise RuntimeError(f"a pipeline starts once (it is {self.state.value})")
        self.state = PipelineState.STARTING
        stack = self._stack
        try:
            opened = await anyio.to_thread.run_sync(
                functools.partial(open_model, self.config, with_engine=self.with_engine, tracer=self.tracer)
            )
            pool = build_image_pool(self.config, opened.checkpoint, encodes_here=opened.encodes_here)
            # closed in reverse: the task group (stage workers, compiles) first, then the engine,
            # then the stages' resources (HTTP session, inboxes), then the workers
            if pool is not None:
                stack.push_async_callback(_shielded, pool.aclose)
            stack.push_async_callback(_shielded, self._close_preparation)
            if opened.engine_process is not None:  # a thread engine is built by _load
                self._engine = opened.engine_process
                stack.push_async_callback(_shielded, opened.engine_process.aclose)
            await run_together(*self._start_steps(opened, pool))
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._tg.cancel_scope.cancel)
            if self._engine is not None:
                self._engine.attach(self._tg)
            assert self._preparation is not None  # built by _load
            self._preparation.start(self._tg)
        except BaseException:
            await self._close()
            raise
        self.state = PipelineState.ACCEPTING
        return self

    def _start_steps(self, opened: OpenedModel, pool: ImagePool | None) -> list[Callable[[], Awaitable[None]]]:
        """What a start runs at once: this process's loading, the preparation workers' start, an engine
        process's start (each loads its own parts for seconds; the first request waits for none)."""
        load: Callable[[], Awaitable[None]] = functools.partial(self._load, opened, pool)
        process = opened.engine_process
        steps: list[Callable[[], Awaitable[None]]]
        if pool is None:
            steps = [load]
        elif process is None:
            steps = [load, pool.start_all]
        else:
            # the workers start once this process has loaded: started with it, beside the engine
            # process (the longest), they made the whole start slower (11.9-12.0 s against 11.4-11.5)
            steps = [_in_turn(load, pool.start_all)]
        return steps if process is None else [*steps, process.start]

    async def _load(self, opened: OpenedModel, pool: ImagePool | None) -> None:
        """Load the model's parts (in a worker thread), build the stages around ``pool`` and start a
        thread engine."""
        model = self._model = await anyio.to_thread.run_sync(
            functools.partial(load_model, opened, self.config, tracer=self.tracer)
        )
        await anyio.lowlevel.checkpoint_if_cancelled()  # another step failed meanwhile: build nothing more
        self._preparation = Preparation(
            self.config,
            model.checkpoint,
            model.encoder,
            model.grammar,
            pool,
            turns=self.loop_turns,
            metrics=self.metrics,
            tracer=self.tracer,
        )
        engine = self._engine = model.engine
        self._admission = Admission(
            self.config,
            self._preparation,
            self.metrics,
            self.tracer,
            waiting=(lambda: engine.room.num_waiting) if engine is not None else lambda: 0,
        )
        if engine is not None and opened.engine_process is None:
            await engine.start()  # a thread engine: its thread
            self._stack.push_async_callback(_shielded, engine.aclose)

    async def _close_preparation(self) -> None:
        if self._preparation is not None:
            await self._preparation.aclose()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._close()

    async def _close(self) -> None:
        self.state = PipelineState.DRAINING
        await self._stack.aclose()  # the task group must exit in its own scope, so the closers shield themselves
        self.state = PipelineState.STOPPED

    # -- admission ----------------------------------------------------------------------------
    def parse(self, body: Any) -> ChatRequest:
        """:raises InvalidRequest: naming the offending field. :raises ModelNotFound: a model not served."""
        cfg = self.config
        return parse_chat_request(
            body,
            max_images=cfg.max_images_per_request,
            default_max_tokens=cfg.default_max_tokens,
            max_model_len=cfg.max_model_len,
            vocab_size=self.vocab_size,
            model_names=self.model_names,
            tool_format=self._model.tool_format if self._model is not None else None,
            defaults=self.sampling_defaults,
            encode=self._encode_words,
            max_prompt_tokens=cfg.max_prompt_tokens,
            trust_request_chat_template=cfg.trust_request_chat_template,
            limits=self.request_limits,
        )

    @functools.cached_property
    def request_limits(self) -> RequestLimits:
        """What one chat request may hold (the config's bounds, and the text a prompt cannot hold)."""
        cfg = self.config
        return RequestLimits(
            max_messages=cfg.max_messages,
            max_content_parts=cfg.max_content_parts,
            max_tools=cfg.max_tools,
            max_text_chars=self.preparation.template.max_text_chars,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_schema_chars=cfg.grammar_max_bytes,
        )

    def parse_completions(self, body: Any) -> list[ChatRequest]:
        """A completions body, one request per prompt. :raises InvalidRequest: naming the offending field.
        :raises ModelNotFound: a model not served."""
        cfg = self.config
        return parse_completion_request(
            body,
            default_max_tokens=cfg.default_max_tokens,
            max_model_len=cfg.max_model_len,
            vocab_size=self.vocab_size,
            model_names=self.model_names,
            defaults=self.sampling_defaults,
            encode=self._encode_words,
            max_prompt_tokens=cfg.max_prompt_tokens,
        )

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The checkpoint's sampling defaults (``generation_config``), for fields a request leaves unset."""
        return self._model.sampling_defaults if self._model is not None else SamplingDefaults()

    def _encode_words(self, text: str) -> list[int]:
        """``text``'s token ids without special tokens (a request's ``bad_words``: a few short words)."""
        return text_ids(self.checkpoint.tokenizer, text)

    def _admit(self, request: ChatRequest) -> Job[PreparedRequest]:
        if self.state is not PipelineState.ACCEPTING or self._admission is None:
            raise ShuttingDown("the pipeline is not accepting requests", retry_after=self.config.retry_after_s)
        return self._admission.admit(request)

    async def wait_idle(self) -> None:
        """Return once no request is in the stages, no grammar compile is running and no image batch
        is being encoded."""
        if self._admission is not None:
            await self._admission.wait_idle()
        await self.preparation.grammar.wait_idle()
        if self.preparation.vision is not None:
            await self.preparation.vision.wait_idle()

    @property
    def num_pending(self) -> int:
        """Requests admitted whose preparation has not yet left the stages."""
        return self._admission.num_pending if self._admission is not None else 0

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
        engine = self.engine
        if not isinstance(request, ChatRequest):
            request = self.parse(request)
        job = self._admit(request)
        handle = RequestHandle(
            request,
            engine,
            self.metrics,
            tracer=self.tracer,
            resample_attempts=self.config.answer_resample_attempts,
        )
        self._handles.add(handle)
        if self._tg is None:  # admitted above, so started: only a bug gets here
            raise RuntimeError("the pipeline has no task group")
        self._tg.start_soon(self._run_handle, handle, job)
        return handle

    async def _run_handle(self, handle: RequestHandle, job: Job[PreparedRequest]) -> None:
        try:
            await handle.run(self.preparation.prepared(job))
        finally:
            self._handles.discard(handle)

    def stop_accepting(self) -> None:
        """New requests are refused with 503 from now on; those admitted go on."""
        if self.state is PipelineState.ACCEPTING:
            self.state = PipelineState.DRAINING

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every admitted request to end; False if some were still running
        (they end with a 503 ``ShuttingDown`` that says so)."""
        with anyio.move_on_after(timeout_s):
            while self._handles:
                await next(iter(self._handles)).wait_done()
            return True
        for handle in list(self._handles):
            handle.cancel(
                ShuttingDown(
                    f"the server shut down before this request finished (it waited {timeout_s:g} s)",
                    retry_after=self.config.retry_after_s,
                )
            )
        return False

    def _cache_counters(self, cache: str) -> dict[str, float]:
        return cache_counters(self.cache_stats().get(cache)) if self._preparation is not None else {}

    def cache_stats(self) -> dict[str, CacheStats]:
        """Hits, misses, evictions and bytes held of the encoder cache and the KV prefix cache (a
        cache that is off is absent)."""
        return cache_stats(self.preparation, self._engine)

    def decoding(self) -> dict[str, int]:
        """The decode engine now: sequences running and waiting, KV blocks, preemptions so far."""
        return self._engine.stats() if self._engine is not None else {}

    def health(self) -> dict[str, Any]:
        status = "ok" if self.state is PipelineState.ACCEPTING else "stopping"
        engine = self._engine.status if self._engine is not None else "none"
        if status == "ok" and engine not in ("ok", "none"):
            status = f"engine {engine}"  # a new engine process is starting after a failure: a 503 meanwhile
        return {"status": status, "engine": engine, "pending": self.num_pending, "decoding": self.decoding()}

    def resources(self) -> Resources:
        """A snapshot of everything the pipeline holds (see ``Resources.is_released``)."""
        return resources(self.preparation, self.metrics, self._engine, self.num_pending, len(self._handles))
