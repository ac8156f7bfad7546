"""ProcessEngine: the decode engine in its own process, seen from the serving process as ``AsyncEngine`` is.

The pipeline uses either through the same calls (``submit``, ``abort``, ``barrier``, ``stats``,
``resources``, ``start``, ``aclose``), so nothing above the engine knows which runs. Commands go
through the engine process's link (``pipeline.core.engine_link``: the event loop's own transport,
never blocking); each engine step's outputs arrive in one message and are handed to their streams
there, as ``AsyncEngine`` hands them over once per step.

Faults: an engine process that dies (kill -9, out of memory, a native crash), or that makes no progress
for ``step_timeout_s`` while it holds requests (it is then killed), fails the requests it held with
``EngineFailed`` (503, retryable); requests submitted while a new one starts get the same; a new
process (the model loaded again) is started in the background and serves what comes after.
``status`` says which (``/health`` reports it).

An add's tensors cross in the engine process's arena (``pipeline.core.engine_arena``): a region is
taken at ``submit`` and freed when the engine acknowledges having read the add (it copies the tensors
out then); a fault frees them all, and the new process gets a new arena.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.core.engine_arena import EngineArena
from pipeline.core.engine_link import EngineLink
from pipeline.core.engine_process import EngineProcessSpec
from pipeline.core.engine_wire import Alive, BarrierReached, Step, StepTimeline, encode_input
from pipeline.errors import EngineFailed
from pipeline.observability.trace import Tracer
from sampling.async_engine import Add, EngineQueueFull, OutputStream, deliver
from sampling.inputs import EngineInput, SeqOutput
from sampling.timeline import StepTiming

__all__ = ["ProcessEngine"]

logger = logging.getLogger(__name__)

_RESTART_PAUSE_S = 1.0  # between attempts when a new engine process fails to start
# an add's region lives until the engine has read it (milliseconds): room for a burst of adds of
# ~10 MB of embeddings each; pages are only allocated where written. Adds that do not fit cross inline.
ARENA_BYTES = 256 << 20


class ProcessEngine:
    """The client of one engine process (started again after a failure)."""

    def __init__(
        self,
        spec: EngineProcessSpec,
        *,
        queue_size: int,
        step_timeout_s: float,
        start_timeout_s: float,
        retry_after_s: float,
        token_table: Callable[[], list[bytes]],
        arena_bytes: int = ARENA_BYTES,
        tracer: Tracer | None = None,
    ) -> None:
        self.spec = spec
        self.tracer = tracer  # records the engine's step spans (the spec asks the process to trace)
        self.arena_bytes = arena_bytes  # 0: no arena, every add's tensors inline
        self.queue_size = queue_size
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.retry_after_s = retry_after_s
        self._token_table = token_table
        self.status = "starting"  # "ok", "restarting", "stopped"
        self._started = anyio.Event()  # set while status is "ok"
        self.num_failures = 0
        self._link: EngineLink | None = None
        self._streams: dict[str, OutputStream] = {}
        self._barriers: dict[int, anyio.Event] = {}
        self._timelines: dict[int, list[StepTiming]] = {}  # answers to step_timeline(), by barrier token
        self._num_barriers = 0
        self._num_sent = 0
        self._num_acked = 0
        self._arena: EngineArena | None = None
        # adds with tensors: through the arena, and inline (they did not fit it, or it is off)
        self.num_arena_adds = self.num_inline_adds = 0
        self._progress_at = time.monotonic()
        self._hung = False
        self._closing = False
        self._tg: TaskGroup | None = None
        self._stats: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._prefix: dict[str, int] | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while none runs)."""
        return self._link.pid if self._link is not None else None

    @property
    def token_table(self) -> list[bytes]:
        """Each token id's bytes (built here once: log-probability entries show them)."""
        return self._token_table()

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded. :raises EngineFailed: it could not."""
        await self._launch()
        self._set_ok()

    def _set_ok(self) -> None:
        self.status = "ok"
        self._started.set()

    async def wait_started(self) -> None:
        """Return once an engine process serves (at once unless one is starting after a failure)."""
        await self._started.wait()

    def attach(self, tg: TaskGroup) -> None:
        """Where the hang watchdog runs and new engine processes are started after a failure."""
        self._tg = tg
        tg.start_soon(self._watch)

    async def aclose(self) -> None:
        """Stop the engine process (a stop message, then SIGKILL after a grace period) and wait for it."""
        self._closing = True
        was_serving, self.status = self.status == "ok", "stopped"
        link, self._link = self._link, None
        if link is not None:
            await link.close(kill=not was_serving)  # one still loading its model would read the stop late
            self._drop_arena(link)
        self._release_barriers()

    async def _launch(self) -> None:
        arena = EngineArena.create(self.arena_bytes) if self.arena_bytes else None
        link = EngineLink(
            self.spec,
            on_message=lambda m: self._on_message(link, m),
            on_lost=lambda: self._on_lost(link),
            arena=arena,
        )
        self._link, self._arena = link, arena
        self._num_sent = self._num_acked = 0
        try:
            await link.open(self.start_timeout_s, self.retry_after_s)
        except BaseException:
            self._drop_arena(link)
            raise
        logger.info("engine process %s ready", link.pid)

    def _drop_arena(self, link: EngineLink) -> None:
        """Close ``link``'s arena (its process is gone: the memory is freed when both ends are closed)."""
        if link.arena is not None:
            if link.arena is self._arena:
                self._arena = None
            link.arena.close()
            link.arena = None

    # -- the pipeline's calls ---------------------------------------------------------------------
    def submit(self, inp: EngineInput) -> OutputStream:
        """Send ``inp`` to the engine; its outputs arrive on the returned stream.

        :raises EngineQueueFull: the engine has not read ``queue_size`` commands yet.
        :raises EngineFailed: the engine process is being started again after a failure.
        """
        link = self._link
        if self.status != "ok" or link is None or not link.is_open:
            raise EngineFailed(
                "the decode engine is restarting after a failure; retry", retry_after=self.retry_after_s, stage="engine"
            )
        if self._num_sent - self._num_acked >= self.queue_size:
            raise EngineQueueFull("the decode engine's queue is full")
        add = encode_input(inp, self._arena)
        if add.shared is not None and self._arena is not None:
            self._arena.hold_until(self._num_sent + 1)  # freed once the engine has read this add
            self.num_arena_adds += 1
        elif inp.image_embeds is not None:
            self.num_inline_adds += 1
        command = ("add", add)
        if not self._streams:
            self._progress_at = time.monotonic()  # the hang deadline counts from the first work
        link.write(command)
        self._num_sent += 1
        stream = OutputStream(Add(inp), inp.sampling.n)
        self._streams[inp.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Free the request's sequences before the engine's next step (never blocks)."""
        if self._streams.pop(request_id, None) is None:
            return
        if self._link is not None and self._link.is_open:
            self._link.write(("abort", request_id))
            self._num_sent += 1

    async def barrier(self) -> None:
        """Return once the engine process has handled every command sent before this call (at once
        while no engine process runs: it holds nothing)."""
        link = self._link
        if link is None or not link.is_open or self.status != "ok":
            return
        self._num_barriers += 1
        token = self._num_barriers
        reached = self._barriers[token] = anyio.Event()
        link.write(("barrier", token))
        self._num_sent += 1
        await reached.wait()

    async def step_timeline(self, since: float = 0.0) -> list[StepTiming]:
        """The engine's steps that began at ``since`` (``time.perf_counter()``) or later, with
        ``record_step_timeline`` (empty without it, or while no engine process runs)."""
        link = self._link
        if link is None or not link.is_open or self.status != "ok":
            return []
        self._num_barriers += 1
        token = self._num_barriers
        reached = self._barriers[token] = anyio.Event()
        link.write(("timeline", token, since))
        self._num_sent += 1
        await reached.wait()
        return self._timelines.pop(token, [])

    @property
    def num_running(self) -> int:
        return len(self._streams)

    def resources(self) -> dict[str, int]:
        """What the engine holds, as of its last message (after a ``barrier``: now)."""
        return {
            "engine_requests": self._held.get("engine_requests", 0),
            "engine_streams": len(self._streams),
            "kv_blocks_used": self._held.get("kv_blocks_used", 0),
            "arena_regions": self._arena.num_regions if self._arena is not None else 0,
        }

    def stats(self) -> dict[str, int]:
        """Decoding as of the engine's last message, for /health and /metrics."""
        return dict(self._stats)

    def prefix_cache_figures(self) -> dict[str, int] | None:
        """The KV prefix cache's counters as of the engine's last message (None: off)."""
        return self._prefix

    # -- from the engine process --------------------------------------------------------------
    def _on_message(self, link: EngineLink, message: Any) -> None:
        if link is not self._link:
            return  # a process we have given up on
        self._progress_at = time.monotonic()
        if isinstance(message, Step):
            self._figures(message)
            self._deliver(message.outputs)
            if self.tracer is not None:
                for span in message.spans:
                    self.tracer.span(span.name, span.cat, None, span.start, span.end, **span.args)
        elif isinstance(message, BarrierReached):
            self._figures(message)
            reached = self._barriers.pop(message.token, None)
            if reached is not None:
                reached.set()
        elif isinstance(message, StepTimeline):
            reached = self._barriers.pop(message.token, None)
            if reached is not None:
                self._timelines[message.token] = message.steps
                reached.set()
        elif isinstance(message, Alive):
            self._acked(message.acked)

    def _acked(self, acked: int) -> None:
        """The engine has read ``acked`` commands: the adds among them have their tensors copied out."""
        self._num_acked = acked
        if self._arena is not None:
            self._arena.acked(acked)

    def _figures(self, message: Step | BarrierReached) -> None:
        self._acked(message.acked)
        self._stats, self._held, self._prefix = message.stats, message.held, message.prefix

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        deliver(self._streams, outputs)

    def _on_lost(self, link: EngineLink) -> None:
        if link is not self._link:
            return
        self._release_barriers()
        if self._closing or self.status != "ok":
            return
        self.status = "restarting"
        self._started = anyio.Event()
        self.num_failures += 1
        why = f"made no progress for {self.step_timeout_s:g} s" if self._hung else "died"
        logger.error("engine process %s %s holding %d requests; starting another", link.pid, why, len(self._streams))
        error = EngineFailed(
            f"the decode engine process {why} while it held this request; retry",
            retry_after=self.retry_after_s,
            stage="engine",
        )
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        if self._arena is not None:  # nobody reads the regions any more; _restart closes the arena
            self._arena.reset()
        self._held, self._stats, self._hung = {}, {}, False
        if self._tg is not None:
            self._tg.start_soon(self._restart, link)

    def _release_barriers(self) -> None:
        barriers, self._barriers = self._barriers, {}
        for reached in barriers.values():
            reached.set()

    # -- in the background ----------------------------------------------------------------------
    async def _restart(self, failed: EngineLink) -> None:
        await failed.close(kill=True)
        self._drop_arena(failed)
        while not self._closing:
            try:
                await self._launch()
            except Exception:
                logger.exception("a new engine process could not start; trying again")
                await anyio.sleep(_RESTART_PAUSE_S)
                continue
            if self._closing:
                return
            link = self._link
            if link is not None and link.is_open:
                self._set_ok()
                return
            if link is not None:  # it died between its Ready and here: reap it and start another
                await link.close(kill=True)
                self._drop_arena(link)

    async def _watch(self) -> None:
        """Kill an engine process that holds requests and has sent nothing for ``step_timeout_s``."""
        while True:
            await anyio.sleep(min(1.0, self.step_timeout_s / 4))
            link = self._link
            stalled = time.monotonic() - self._progress_at > self.step_timeout_s
            if self.status == "ok" and self._streams and stalled and link is not None and not self._hung:
                logger.error("engine process %s made no progress for %.0f s: killed", link.pid, self.step_timeout_s)
                self._hung = True
                link.kill()
